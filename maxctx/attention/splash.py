"""TPU splash attention (Pallas, jax.experimental.pallas.ops.tpu.splash_attention) behind the position masks.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim.

Splash masks are index-based and static, while maxctx masks come from positions and segment ids. Within one
document the original sequence index orders tokens exactly as positions do, so "causal on the original index
AND same segment id" equals the position mask. The token *storage* order is static (natural, or zig-zag with
load balance), so each call gets a static mask over original indices:

    mask[i, j] = kv_orig[j] <= q_orig[i]       (and q_orig[i] - kv_orig[j] < W with a sliding window W > 0)

`q_orig` and `kv_orig` map a device's local query rows and the key/value block it sees at this call (a ring hop,
or the gathered sequence) to original indices. Devices with equal masks share a kernel; kernels.make_local builds
the distinct ones and a device picks its own by its mesh index (under zig-zag a hop has at most two distinct
masks). Blocks the mask hides are skipped by the kernel's block sparsity (ring hops under zig-zag do equal work).
Splash builds its block tables on the host by asking the mask for every block; the mask answers blocks that are
all visible or all hidden (nearly all of them at long context) from the block's cached index range, 15.6x faster
than comparing elementwise (benchmarks/splash_masks.py: 0.79 s vs 12.3 s per all_gather kernel at 256K tokens).
The tables (query blocks x key blocks per call) live in on-chip SMEM, which 2**18 entries overflow on v5p (an
all_gather call at 1M tokens with 512-token blocks); a call past MAX_TABLE_ENTRIES runs as several kernels over
chunks of its query rows (make_kernel). Key blocks are computed 512 keys at a time whatever the block size, so
larger blocks (flash_block_q/flash_block_kv set both kernels' blocks) do not overflow VMEM.
(Sharding one kernel's mask info over devices with q_seq_shards fails in jax 0.10 for hops whose mask has no
partial block, as zig-zag ring hops do.)

Segment ids go through `SegmentIds` (document separation); queries are pre-scaled by D**-0.5. GQA: an MQA kernel
over the G query heads of each kv head, vmapped over K and B.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.flash import block_size

COMPUTE_BLOCK = 512
# Block-table entries (query blocks x key blocks) one kernel call may have. llama3-8b all_gather at 1M tokens on
# v5p-128: 2**18 entries in one kernel overflowed SMEM, 2**17 (two chunks) and 2**16 compiled; 2**16 also compiled on
# v6e (benchmarks/splash_masks.md, fit_table.md). The default stays at the size measured on both.
MAX_TABLE_ENTRIES = 2 ** 16


def _lib():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )
    return kernel_lib, mask_lib


def ordered_causal_mask(q_orig: np.ndarray, kv_orig: np.ndarray, window: int = 0):
    """A splash Mask: mask[i, j] = kv_orig[j] <= q_orig[i] (causal on original indices), and within `window`
    tokens (q_orig[i] - kv_orig[j] < window) when it is > 0."""
    _, mask_lib = _lib()

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
    tables from; reading the elements makes that O(rows x cols) per call (usp's ring hops at 2**24 tokens: 2M x 2M,
    hours on the host), so these two answer from the known value, in O(1)."""

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


def make_kernel(q_orig: np.ndarray, kv_orig: np.ndarray, group: int, block_q: int, block_kv: int,
                save_residuals: bool, interpret: bool = False, max_table_entries: int | None = None,
                window: int = 0):
    """Splash kernels over `group` query heads for one device's query rows and key/value block: a tuple of
    (first row, last row + 1, kernel or None) chunks of the rows. One chunk unless the call's block table (query
    blocks x key blocks, in on-chip SMEM) would pass `max_table_entries`: then the rows are split into the fewest
    equal chunks of whole blocks that keep each chunk's table within it, one kernel each (a2a at 1M tokens).
    (Growing the blocks instead does not work at long context: llama3-8b at 2**24 tokens on v5p-128 overflowed VMEM
    with 1024- and 2048-token blocks under p2p and usp.) None: a chunk that sees no key (splash refuses an
    all-hidden mask)."""
    max_table_entries = MAX_TABLE_ENTRIES if max_table_entries is None else max_table_entries
    bq, bkv = block_size(len(q_orig), block_q), block_size(len(kv_orig), block_kv)
    q_blocks, kv_blocks = len(q_orig) // bq, len(kv_orig) // bkv
    chunks = next((n for n in range(1, q_blocks + 1) if q_blocks % n == 0 and q_blocks // n * kv_blocks
                   <= max_table_entries), q_blocks)
    rows = len(q_orig) // chunks
    out = []
    for start in range(0, len(q_orig), rows):
        q_part = q_orig[start:start + rows]
        hidden = kv_orig.min() > q_part.max() or (window and q_part.min() - kv_orig.max() >= window)
        out.append((start, start + rows, None if hidden else _make_one(q_part, kv_orig, group, bq, bkv,
                                                                         save_residuals, interpret, window)))
    return tuple(out)


def _make_one(q_orig, kv_orig, group: int, bq: int, bkv: int, save_residuals: bool, interpret: bool, window: int):
    kernel_lib, mask_lib = _lib()
    mask = mask_lib.MultiHeadMask([ordered_causal_mask(q_orig, kv_orig, window)] * group)
    # The blocks set the block tables (SMEM); the kernels step through a key block COMPUTE_BLOCK keys at a time, so
    # blocks larger than that (long context) do not grow the working set in VMEM (MaxText's default compute blocks).
    compute = math.gcd(bkv, COMPUTE_BLOCK) if bkv > COMPUTE_BLOCK else bkv
    sizes = kernel_lib.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=compute, block_q_dkv=bq,
                                  block_kv_dkv=bkv, block_kv_dkv_compute=compute, block_q_dq=bq, block_kv_dq=bkv)
    return kernel_lib.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      save_residuals=save_residuals, interpret=interpret)


def splash_call(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool):
    """Runs the (local) splash kernels of `make_kernel` on their row chunks; returns (out[B, S, H, D], lse[B, H, S]
    fp32 or None). Chunks share the keys, so autodiff sums their dK/dV."""
    parts = []
    for start, stop, kernel in kernels:
        q, seg = q_BSHD[:, start:stop], q_seg_BS[:, start:stop]
        if kernel is None:
            b, s, h, _ = q.shape
            parts.append((jnp.zeros_like(q), jnp.full((b, h, s), -jnp.inf, jnp.float32) if save_residuals else None))
        else:
            parts.append(_call_one(kernel, q, k_BTKD, v_BTKD, seg, kv_seg_BT, save_residuals))
    if len(parts) == 1:
        return parts[0]
    out = jnp.concatenate([o for o, _ in parts], axis=1)
    return out, (jnp.concatenate([lse for _, lse in parts], axis=-1) if save_residuals else None)


def _call_one(kernel, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool):
    kernel_lib, _ = _lib()
    b, s, h, d = q_BSHD.shape
    kv_heads = k_BTKD.shape[2]
    q_BKGSD = (q_BSHD * d ** -0.5).reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    segments = kernel_lib.SegmentIds(q=q_seg_BS.astype(jnp.int32), kv=kv_seg_BT.astype(jnp.int32))

    def one(q_GSD, k_TD, v_TD, seg):
        return kernel(q_GSD, k_TD, v_TD, segment_ids=seg)

    result = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(q_BKGSD, k_BKTD, v_BKTD, segments)
    out, lse = (result[0], result[1][0]) if save_residuals else (result, None)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
    if lse is not None:
        lse = lse.reshape(b, h, s).astype(jnp.float32)
        # Rows with no visible key (a ring hop's hidden chunk): splash leaves lse at -inf (or near its mask value)
        # and out at 0/0; make them the empty result the merge expects.
        seen = lse > -1e30
        lse = jnp.where(seen, lse, -jnp.inf)
        out = jnp.where(seen.transpose(0, 2, 1)[..., None], out, 0)
    return out, lse
