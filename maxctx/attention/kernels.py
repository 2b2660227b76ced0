"""The kernels every strategy can run, behind one local interface.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, D head dim.

A `LocalKernel` is built outside shard_map for one strategy's token layout and used inside it:
  attend(args, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg)         -> (out, lse|None), differentiable in out
  block_forward(args, hop, ...)                                      -> (out fp32, lse fp32), for ring hops
  block_backward(args, hop, ..., out, lse, dout)                     -> (dq, dk, dv) fp32 given the merged out/lse
`args` are the kernel's device arrays (splash mask info), passed through shard_map with `arg_specs`; `hop` picks
the ring hop's kernel. Only splash needs either (its masks are index-based, see splash.py); the others mask from
positions. cuDNN and splash rings run their backward hops with the flash backward (exact, pure JAX): neither
exposes a backward that takes the ring's merged lse.
"""

from __future__ import annotations

import dataclasses

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
    args: tuple = ()
    arg_specs: tuple = ()

    def attend(self, args, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            return dot_product_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        if self.name == "flash":
            return flash.flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv)
        if self.name == "cudnn":
            return cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        return splash.splash_call(args[hop], q, k, v, q_seg, kv_seg, save_residuals=False)

    def block_forward(self, args, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            return dot_product_attention(*f32, q_pos, q_seg, kv_pos, kv_seg)
        if self.name == "flash":
            return flash.flash_forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv)
        if self.name == "cudnn":
            out, lse = cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, return_lse=True)
            return out.astype(jnp.float32), lse
        out, lse = splash.splash_call(args[hop], q, k, v, q_seg, kv_seg, save_residuals=True)
        return out.astype(jnp.float32), lse

    def block_backward(self, args, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout):
        if self.name == "dot_product":
            return dot_product_block_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout)
        return flash.flash_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout, None,
                                    self.block_q, self.block_kv)


def make_local(name: str, block_q: int, block_kv: int, *, mesh=None, order: np.ndarray | None = None,
               q_shards: int = 1, kv_blocks: int = 1, q_axes=None, group: int = 1, ring: bool = False
               ) -> LocalKernel:
    """Builds the kernel for a layout. Splash only: `order` is the stored order of the whole sequence, split into
    `q_shards` query shards (over mesh axes `q_axes`); the keys a call sees are either the whole sequence
    (kv_blocks=1) or, at ring hop t, block (r - t) mod kv_blocks for query shard r; `group` = query heads per kv
    head; `ring` builds one lse-returning kernel per hop."""
    if name != "splash":
        return LocalKernel(name, block_q, block_kv)
    n = len(order) // kv_blocks
    kernels = []
    for hop in range(kv_blocks if ring else 1):
        blocks = [((r * kv_blocks // q_shards) - hop) % kv_blocks for r in range(q_shards)]
        kv_rows = np.stack([order[b * n:(b + 1) * n] for b in blocks])
        kernels.append(splash.make_kernel(order, kv_rows, group, block_q, block_kv, save_residuals=ring))
    specs = tuple(splash.kernel_spec(kern, mesh, q_axes) for kern in kernels) if mesh is not None else ()
    return LocalKernel(name, block_q, block_kv, tuple(kernels), specs)
