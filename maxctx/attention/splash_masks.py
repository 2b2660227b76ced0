"""Splash masks over original token indices, and whether a query chunk sees any key.

Splash masks are index-based and static, while maxctx masks come from positions and segment ids. Within one
document the original sequence index orders tokens exactly as positions do, so "causal on the original index
AND same segment id" equals the position mask. The token *storage* order is static (natural, or zig-zag with
load balance), so each splash call gets a static mask over original indices:

    mask[i, j] = kv_orig[j] <= q_orig[i]       (and q_orig[i] - kv_orig[j] < W with a sliding window W > 0)

Splash builds its block tables on the host by asking the mask for every block. At long context nearly every block
is all visible or all hidden, so the mask answers those from the block's cached index range and a shared constant
block instead of comparing elementwise (benchmarks/splash_masks.md measures both).
"""

from __future__ import annotations

import functools

import numpy as np


def _mask_lib():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    return mask_lib


def ordered_causal_mask(q_orig: np.ndarray, kv_orig: np.ndarray, window: int = 0):
    """A splash Mask: mask[i, j] = kv_orig[j] <= q_orig[i] (causal on original indices), and within `window`
    tokens (q_orig[i] - kv_orig[j] < window) when it is > 0."""
    mask_lib = _mask_lib()

    class OrderedCausalMask(mask_lib.Mask):
        def __init__(self):
            self.q_orig, self.kv_orig = np.asarray(q_orig), np.asarray(kv_orig)
            self._key = (self.q_orig.tobytes(), self.kv_orig.tobytes(), window)
            self._ranges = ({}, {})  # per axis: slice -> (min, max, length) of the original indices it selects

        def _range(self, axis: int, where: slice) -> tuple[int, int, int]:
            key = (where.start, where.stop, where.step)
            found = self._ranges[axis].get(key)
            if found is None:
                picked = (self.q_orig, self.kv_orig)[axis][where]
                found = (int(picked.min()), int(picked.max()), picked.size) if picked.size else (0, 0, 0)
                self._ranges[axis][key] = found
            return found

        @property
        def shape(self) -> tuple[int, int]:
            return len(self.q_orig), len(self.kv_orig)

        def __getitem__(self, idx) -> np.ndarray:
            if isinstance(idx[0], slice) and isinstance(idx[1], slice):
                # Splash asks block by block, and at long context nearly every block is all visible or all
                # hidden: answer those from the blocks' (cached) index ranges and a shared constant block.
                (r_lo, r_hi, n_rows), (c_lo, c_hi, n_cols) = self._range(0, idx[0]), self._range(1, idx[1])
                if n_rows and n_cols and c_hi <= r_lo and (not window or r_hi - c_lo < window):
                    return _constant_block(True, n_rows, n_cols)
                if n_rows and n_cols and (c_lo > r_hi or (window and r_lo - c_hi >= window)):
                    return _constant_block(False, n_rows, n_cols)
            rows, cols = self.q_orig[idx[0]], self.kv_orig[idx[1]]
            behind = np.atleast_1d(rows)[:, None] - np.atleast_1d(cols)[None, :]
            mask = (behind >= 0) & (behind < window) if window else behind >= 0
            return mask[0 if np.ndim(rows) == 0 else slice(None), 0 if np.ndim(cols) == 0 else slice(None)]

        def __eq__(self, other) -> bool:  # by content: each call defines the class anew (lazy Pallas import)
            return isinstance(other, mask_lib.Mask) and getattr(other, "_key", None) == self._key

        def __hash__(self) -> int:
            return hash(self._key)

    return OrderedCausalMask()


class _ConstantBlock(np.ndarray):
    """A block that is all True or all False. Splash asks `any()` and then `all()` of every block it builds the
    tables from; reading the elements makes that O(rows x cols) per block, the whole mask per call (hours on the host
    for ring hops of millions of rows), so these two answer from the known value, in O(1)."""

    def any(self, *args, **kwargs):
        value = getattr(self, "constant", None)
        return value if value is not None and not args and not kwargs else np.asarray(self).any(*args, **kwargs)

    def all(self, *args, **kwargs):
        value = getattr(self, "constant", None)
        return value if value is not None and not args and not kwargs else np.asarray(self).all(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _constant_block(value: bool, rows: int, cols: int) -> np.ndarray:
    block = np.full((rows, cols), value).view(_ConstantBlock)
    block.constant = np.bool_(value)
    block.setflags(write=False)  # shared by every caller
    return block


def sees_a_key(q_runs, kv_runs, window: int) -> bool:
    """Whether any query of `q_runs` sees any key of `kv_runs` (runs of original indices, index_runs.runs): a key
    j <= q, and q - j < window when window > 0. Per pair of runs, so a chunk between two key runs and farther than
    the window from the lower one counts as hidden (splash refuses an all-hidden mask)."""
    for q_start, q_len in q_runs:
        for kv_start, kv_len in kv_runs:
            q = max(q_start, kv_start)  # the earliest query at or after the run's first key
            if q < q_start + q_len and (not window or q - (kv_start + kv_len - 1) < window):
                return True
    return False
