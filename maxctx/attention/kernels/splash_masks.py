"""Splash masks over original token indices, and whether a query chunk sees any key.

Splash masks are index-based and static, while maxctx masks come from positions and segment ids. Within one
document the original sequence index orders tokens exactly as positions do, so "causal on the original index
AND same segment id" equals the position mask. The token *storage* order is static (natural, or zig-zag with
load balance), so each splash call gets a static mask over original indices:

    mask[i, j] = kv_orig[j] <= q_orig[i]       (and q_orig[i] - kv_orig[j] < W with a sliding window W > 0)

Splash builds its block tables on the host by asking the mask for every block. At long context nearly every block
is all visible or all hidden, so the mask answers those from the block's cached index range and a shared constant
block instead of comparing elementwise (benchmarks/splash_masks.md measures both).

Blocks that are partly visible are computed in the kernel (computed_mask) when the keys form at most COMPUTED_RUNS
runs (every p2p ring hop, and any call in natural order) or a gathered zig-zag order (all_gather, a2a, usp's ring
blocks): splash then gets a value per query as its `q_sequence` and a mask function (`KeyRuns`, `ZigZagKeys`)
that maps a key's place in the call to its value, instead of a stored boolean block per partial block. A stored
block is an s32[block_q, block_kv] window in VMEM, double-buffered: 32 MiB at blocks of 2048, half the VMEM of a
v5p (docs/long_context.md, "Splash's blocks and VMEM"). Other key orders keep stored blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from maxctx.attention.kernels.index_runs import runs

# The most runs of key indices a mask computes in the kernel (one select per run past the first, per score).
COMPUTED_RUNS = 4


def _mask_lib():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    return mask_lib


@dataclasses.dataclass(frozen=True)
class KeyRuns:
    """Splash's in-kernel mask function: mask(q, k) for a query's value q (its q_sequence entry) and a key's place
    k in the call, the key's value being k plus its run's offset, `runs` ((start, length) of the keys' values in
    the call's order). Hashable by value, as splash's kernels are compared by their settings."""
    runs: tuple[tuple[int, int], ...]
    window: int = 0

    def __call__(self, q, k):
        import jax.numpy as jnp

        first_start, first_length = self.runs[0]
        value, place = k + first_start, first_length
        for start, length in self.runs[1:]:
            value = jnp.where(k >= place, k + (start - place), value)
            place += length
        return _visible(q, value, self.window)


@dataclasses.dataclass(frozen=True)
class ZigZagKeys:
    """Splash's in-kernel mask function for keys in a gathered zig-zag order: 2m runs of n keys, run 2h starting at
    value low + h n and run 2h + 1 at high - h n (each device's two chunks, in device order: all_gather's and a2a's
    whole sequence, usp's ring blocks). The run of key place k is found in fp32, k + 1/2 over n (exact while
    places stay below 2^22; _zigzag checks every place), so the cost per score does not grow with m."""
    n: int
    low: int
    high: int
    window: int = 0

    def run(self, k, xp):
        """The run of key places k, in fp32 as the kernel finds it; `xp`: jax.numpy in the kernel, numpy on the host."""
        return xp.floor((k.astype(xp.float32) + 0.5) * (1.0 / self.n)).astype(xp.int32)

    def values(self, k, xp):
        """The keys' values at places k (`xp` as for run)."""
        run = self.run(k, xp)
        half = xp.right_shift(run, 1)
        return k - run * self.n + xp.where(xp.bitwise_and(run, 1) == 1, self.high - half * self.n,
                                           self.low + half * self.n)

    def __call__(self, q, k):
        import jax.numpy as jnp

        return _visible(q, self.values(k, jnp), self.window)


def _visible(q, value, window: int):
    """A key of `value` is visible to a query of value q: causal, and within `window` when it is > 0."""
    visible = value <= q
    return visible & (q - value < window) if window else visible


def _zigzag(keys: np.ndarray, window: int):
    """ZigZagKeys whose values are `keys` (the middle device's two chunks may be one run), else None. Checked on
    every place, the fp32 run index included, with the kernel's own arithmetic (ZigZagKeys.values on numpy)."""
    n, size = runs(keys)[0][1], len(keys)
    if size % (2 * n) or size >= 2 ** 22 or size == n:
        return None
    function = ZigZagKeys(n, int(keys[0]), int(keys[n]), window)
    place = np.arange(size, dtype=np.int32)
    if not np.array_equal(function.run(place, np), place // n):
        return None
    return function if np.array_equal(function.values(place, np), keys) else None


def computed_mask(q_orig: np.ndarray, kv_orig: np.ndarray, window: int = 0):
    """(q_sequence, mask function) computing mask[i, j] in the kernel: KeyRuns for keys in at most COMPUTED_RUNS
    runs, ZigZagKeys for a gathered zig-zag order; None otherwise (splash then loads its partial blocks). Causal:
    values are ranks among the keys (a query's is the rank of the last key it sees),
    so a zig-zag ring hop's two key runs are one; windowed: indices from the keys' first. Either way the function
    depends on the keys alone, so the row chunks of one call (splash.RowLoop) share it."""
    kv_orig, q_orig = np.asarray(kv_orig), np.asarray(q_orig)
    if window:
        keys, queries = kv_orig - kv_orig.min(), q_orig - kv_orig.min()
    else:
        ordered = np.sort(kv_orig)
        keys, queries = np.searchsorted(ordered, kv_orig), np.searchsorted(ordered, q_orig, side="right") - 1
    key_runs = runs(keys)
    function = KeyRuns(key_runs, window) if len(key_runs) <= COMPUTED_RUNS else _zigzag(keys, window)
    return None if function is None else (queries.astype(np.int32), function)


def ordered_causal_mask(q_orig: np.ndarray, kv_orig: np.ndarray, window: int = 0, computed: bool = True):
    """A splash Mask: mask[i, j] = kv_orig[j] <= q_orig[i] (causal on original indices), and within `window`
    tokens (q_orig[i] - kv_orig[j] < window) when it is > 0. With `computed`, and where computed_mask allows, the
    mask also has splash's `q_sequence` and `mask_function`: the kernel computes its partial blocks instead of
    loading them."""
    mask_lib = _mask_lib()
    in_kernel = computed_mask(q_orig, kv_orig, window) if computed and len(kv_orig) else None

    class OrderedCausalMask(mask_lib.Mask):
        def __init__(self):
            self.q_orig, self.kv_orig = np.asarray(q_orig), np.asarray(kv_orig)
            self._key = (self.q_orig.tobytes(), self.kv_orig.tobytes(), window, computed)
            self._ranges = ({}, {})  # per axis: slice -> (min, max, length) of the original indices it selects
            if in_kernel is not None:  # what splash's _process_mask looks for: then no partial block is stored
                self.q_sequence, self.mask_function = in_kernel

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
