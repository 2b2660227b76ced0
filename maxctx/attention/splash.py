"""TPU splash attention (Pallas, jax.experimental.pallas.ops.tpu.splash_attention) behind the position masks.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim.

Splash masks are index-based and static, while maxctx masks come from positions and segment ids. Within one
document the original sequence index orders tokens exactly as positions do, so "causal on the original index
AND same segment id" equals the position mask. The token *storage* order is static (natural, or zig-zag with
load balance), so each call gets a static mask over original indices:

    mask[i, j] = kv_orig[row_shard(i), j] <= q_orig[i]

`q_orig` maps every global query row to its original index; `kv_orig[r]` gives the original indices of the
key/value block that query shard r sees at this call (a ring hop, or the gathered sequence). The kernel is built
for the global query axis with `q_seq_shards` shards, and its mask info is sharded over the strategy's query
axes through `manual_sharding_spec`, so each device gets its own rows: no device index is traced into the mask.
Blocks the mask hides are skipped by the kernel's block sparsity (ring hops under zig-zag do equal work).

Segment ids go through `SegmentIds` (document separation); queries are pre-scaled by D**-0.5. GQA: an MQA kernel
over the G query heads of each kv head, vmapped over K and B.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.flash import block_size


def _lib():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )
    return kernel_lib, mask_lib


def ordered_causal_mask(q_orig: np.ndarray, kv_orig_rows: np.ndarray):
    """A splash Mask: causal on original indices, for stored orders `q_orig[S]`, `kv_orig_rows[shards, T]`."""
    _, mask_lib = _lib()

    class OrderedCausalMask(mask_lib.Mask):
        def __init__(self):
            self.q_orig = np.asarray(q_orig)
            self.kv_rows = np.asarray(kv_orig_rows)
            self.rows_per_shard = len(self.q_orig) // self.kv_rows.shape[0]
            self._key = (self.q_orig.tobytes(), self.kv_rows.tobytes(), self.kv_rows.shape)

        @property
        def shape(self) -> tuple[int, int]:
            return len(self.q_orig), self.kv_rows.shape[1]

        def __getitem__(self, idx) -> np.ndarray:
            qi, ki = idx
            rows, cols = np.arange(self.shape[0])[qi], np.arange(self.shape[1])[ki]
            r, c = np.atleast_1d(rows), np.atleast_1d(cols)
            m = self.kv_rows[r // self.rows_per_shard][:, c] <= self.q_orig[r][:, None]
            if np.ndim(cols) == 0:
                m = m[:, 0]
            return m[0] if np.ndim(rows) == 0 else m

        def __eq__(self, other) -> bool:
            return isinstance(other, OrderedCausalMask) and self._key == other._key

        def __hash__(self) -> int:
            return hash(self._key)

    return OrderedCausalMask()


def make_kernel(q_orig: np.ndarray, kv_orig_rows: np.ndarray, group: int, block_q: int, block_kv: int,
                save_residuals: bool, interpret: bool = False):
    """An MQA splash kernel over `group` query heads for the global query axis split into len(kv_orig_rows)."""
    kernel_lib, mask_lib = _lib()
    shards = kv_orig_rows.shape[0]
    mask = mask_lib.MultiHeadMask([ordered_causal_mask(q_orig, kv_orig_rows)] * group)
    bq = block_size(len(q_orig) // shards, block_q)
    bkv = block_size(kv_orig_rows.shape[1], block_kv)
    sizes = kernel_lib.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                                  block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return kernel_lib.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=shards,
                                      save_residuals=save_residuals, interpret=interpret)


def kernel_spec(kernel, mesh, q_axes):
    """shard_map spec of a kernel's mask info: query blocks split over `q_axes` (None: replicated)."""
    return kernel.manual_sharding_spec(NamedSharding(mesh, P(None, q_axes)))


def splash_call(kernel, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool):
    """Runs a (local) splash kernel; returns (out[B, S, H, D], lse[B, H, S] fp32 or None)."""
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
        lse = jnp.where(lse > -1e30, lse, -jnp.inf)  # rows the kernel never visited
    return out, lse
