"""The kernels every strategy can run, behind one local interface.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, D head dim.

A `LocalKernel` is built outside shard_map for one strategy's token layout and used inside it:
  attend(hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg)           -> (out, lse|None), differentiable in out
  block_forward(hop, ...)                                      -> (out fp32, lse fp32), for ring hops
  block_backward(hop, ..., out, lse, dout)                     -> (dq, dk, dv) fp32 given the merged out/lse
`hop` picks the ring hop's splash kernels; only splash needs it (its masks are index-based, see splash.py), the
others mask from positions. cuDNN and splash rings run their backward hops with the flash backward (exact, pure
JAX): neither exposes a backward that takes the ring's merged lse.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention import cudnn, flash, splash
from maxctx.attention.dot_product import dot_product_attention, dot_product_block_backward
from maxctx.attention.load_balance import zigzag_permutation

KERNELS = ("dot_product", "flash", "splash", "cudnn")


def stored_order(seq_len: int, cp: int, load_balance: bool) -> np.ndarray:
    """Original index of every stored token (the zig-zag permutation, or the identity)."""
    return zigzag_permutation(seq_len, cp) if load_balance and cp > 1 else np.arange(seq_len)


@dataclasses.dataclass(frozen=True)
class LocalKernel:
    name: str
    block_q: int = 512
    block_kv: int = 512
    q_axes: Any = None
    # splash only: per hop, the distinct kernels and, per query shard, which of them it runs.
    splash_kernels: tuple = ()
    splash_table: tuple = ()

    def _splash(self, hop, save_residuals, q, k, v, q_seg, kv_seg):
        kernels, table = self.splash_kernels[hop], self.splash_table[hop]
        branches = [functools.partial(splash.splash_call, kern, save_residuals=save_residuals) for kern in kernels]
        if len(branches) == 1:
            return branches[0](q, k, v, q_seg, kv_seg)
        which = jnp.asarray(table, jnp.int32)[jax.lax.axis_index(self.q_axes)]
        return jax.lax.switch(which, branches, q, k, v, q_seg, kv_seg)

    def attend(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            return dot_product_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        if self.name == "flash":
            return flash.flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv)
        if self.name == "cudnn":
            return cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        return self._splash(hop, False, q, k, v, q_seg, kv_seg)

    def block_forward(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            return dot_product_attention(*f32, q_pos, q_seg, kv_pos, kv_seg)
        if self.name == "flash":
            return flash.flash_forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv)
        if self.name == "cudnn":
            out, lse = cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, return_lse=True)
        else:
            out, lse = self._splash(hop, True, q, k, v, q_seg, kv_seg)
        return out.astype(jnp.float32), lse

    def block_backward(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout):
        if self.name == "dot_product":
            return dot_product_block_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout)
        return flash.flash_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout, None,
                                    self.block_q, self.block_kv)


def _dense_ranks(q_orig: np.ndarray, kv_orig: np.ndarray) -> bytes:
    """A key that is equal for two (q, kv) index sets iff their causal masks are equal: the masks only compare
    indices, so replacing them by their ranks in the union keeps the mask."""
    union = np.unique(np.concatenate([q_orig, kv_orig]))
    return np.searchsorted(union, q_orig).tobytes() + b"|" + np.searchsorted(union, kv_orig).tobytes()


def make_local(name: str, block_q: int, block_kv: int, *, mesh=None, order: np.ndarray | None = None,
               q_shards: int = 1, kv_blocks: int = 1, q_axes=None, group: int = 1, ring: bool = False) -> LocalKernel:
    """Builds the kernel for a layout. Splash only: `order` is the stored order of the whole sequence, split into
    `q_shards` query shards (the linear index over mesh axes `q_axes`); the keys a call sees are either the whole
    sequence (kv_blocks=1) or, at ring hop t, block (r - t) mod kv_blocks for query shard r; `group` = query heads
    per kv head; `ring` builds lse-returning kernels, one set per hop. Shards whose masks are equal share a
    kernel (under zig-zag a hop has at most 2 distinct masks), and a device picks its own with `lax.switch`.
    Off TPU (the mesh's devices, else the default backend) splash runs in Pallas interpret mode: slow, for tests."""
    if name != "splash":
        return LocalKernel(name, block_q, block_kv)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    kernels, tables = _splash_kernels(np.asarray(order, np.int64).tobytes(), q_shards, kv_blocks, group, block_q,
                                      block_kv, ring, platform != "tpu", splash.MAX_TABLE_ENTRIES)
    return LocalKernel(name, block_q, block_kv, q_axes, kernels, tables)


@functools.lru_cache(maxsize=32)
def _splash_kernels(order_bytes: bytes, q_shards: int, kv_blocks: int, group: int, block_q: int, block_kv: int,
                    ring: bool, interpret: bool, max_table_entries: int) -> tuple[tuple, tuple]:
    """Per hop, the distinct kernels and each query shard's index into them. Cached: building the mask info walks
    every block on the host, and the train step, the eval step and rematerialisation trace attention again."""
    order = np.frombuffer(order_bytes, np.int64)
    n, rows = len(order) // kv_blocks, len(order) // q_shards
    hop_kernels, hop_tables = [], []
    for hop in range(kv_blocks if ring else 1):
        kernels, table, seen = [], [], {}
        for r in range(q_shards):
            q_orig = order[r * rows:(r + 1) * rows]
            b = (r * kv_blocks // q_shards - hop) % kv_blocks
            kv_orig = order[b * n:(b + 1) * n]
            key = _dense_ranks(q_orig, kv_orig)
            if key not in seen:  # a hop that sees no key gets make_kernel's empty chunk (splash refuses its mask)
                seen[key] = len(kernels)
                kernels.append(splash.make_kernel(q_orig, kv_orig, group, block_q, block_kv, save_residuals=ring,
                                                  interpret=interpret, max_table_entries=max_table_entries))
            table.append(seen[key])
        hop_kernels.append(tuple(kernels))
        hop_tables.append(tuple(table))
    return tuple(hop_kernels), tuple(hop_tables)
