"""A ring hop's backward through splash's own dQ and dK/dV kernels (maxctx.attention.ring calls it through
kernels.LocalKernel.block_backward), for hops whose tables fit one splash call (splash.make_kernel built them);
hops in row chunks (splash.RowLoop) take the blockwise backward. The kernels are private functions of JAX's
splash module: splash.backward_kernels_available checks their signatures.

Legend: B batch, S query rows, T keys, H query heads, K kv heads, G = H // K, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxctx.attention import splash


def has_backward(kernels) -> bool:
    """Whether make_kernel's result for a ring hop can run hop_backward: one chunk (not a RowLoop) whose kernel
    has dQ and dK/dV tables, or no kernel (the hop sees no key)."""
    return (splash.backward_kernels_available() and not isinstance(kernels, splash.RowLoop) and len(kernels) == 1
            and (kernels[0][2] is None or kernels[0][2].dkv_mask_info is not None))


def hop_backward(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, out_BSHD, lse_BHS, dout_BSHD):
    """A ring hop's (dq, dk, dv) through splash's own dQ and dK/dV kernels, from the *merged* out and lse of all
    hops (the same residuals the blockwise backward takes): P = exp(s - lse) is then the hop's share of the row's
    softmax, so the hops' gradients add up to the whole attention's. Returned as fp32 for the ring's fp32
    accumulators, but computed in the inputs' dtype (splash's kernels output it: bf16 in training, each hop's
    gradient rounded to bf16 before the sum). For kernels with has_backward."""
    kernel_lib, _ = splash._lib()
    (_, _, kernel), = kernels
    if kernel is None:  # the hop sees no key
        return (jnp.zeros(q_BSHD.shape, jnp.float32), jnp.zeros(k_BTKD.shape, jnp.float32),
                jnp.zeros(v_BTKD.shape, jnp.float32))
    b, s, h, d = q_BSHD.shape
    kv_heads = k_BTKD.shape[2]

    def heads(x):  # [B, S, H, D] -> [B, K, G, S, D], as _call_one lays out q
        return x.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)

    q_BKGSD, do_BKGSD = heads(q_BSHD * d ** -0.5), heads(dout_BSHD.astype(q_BSHD.dtype))
    # A row no hop lets see a key has lse -inf; +inf instead makes its P 0 rather than 0 * inf.
    lse_BKGS = jnp.where(jnp.isfinite(lse_BHS), lse_BHS, jnp.inf).reshape(b, kv_heads, h // kv_heads, s)
    # di = rowsum(out * dout), from out in its own layout (no head-major copy of the fp32 out).
    di_BKGS = jnp.einsum("bshd,bshd->bhs", out_BSHD.astype(jnp.float32),
                         dout_BSHD.astype(jnp.float32)).reshape(b, kv_heads, h // kv_heads, s)
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    segments = kernel_lib.SegmentIds(q=q_seg_BS.astype(jnp.int32), kv=kv_seg_BT.astype(jnp.int32))
    sizes, kw = kernel.kwargs["block_sizes"], kernel.kwargs
    common = dict(is_mqa=True, mask_value=kw["mask_value"], attn_logits_soft_cap=kw.get("attn_logits_soft_cap"),
                  q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                  mask_function=kw.get("mask_function"), interpret=kw["interpret"])

    def one(q, k, v, seg, di, lse, do):
        args = dict(q=q, k=k, v=v, segment_ids=seg, logsumexp=lse, do=do, di=di, **common)
        dkv_fn, dq_fn = kernel_lib._splash_attention_bwd_dkv, kernel_lib._splash_attention_bwd_dq
        dq, dk, dv = dkv_fn(**args, **_sinks(dkv_fn), bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
                            bkv_compute=sizes.block_kv_dkv_compute, mask_info=kernel.dkv_mask_info,
                            use_fused_bwd_kernel=sizes.use_fused_bwd_kernel)
        if not sizes.use_fused_bwd_kernel:
            dq = dq_fn(**args, **_sinks(dq_fn), bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
                       mask_info=kernel.dq_mask_info)
        return dq, dk, dv

    dq, dk, dv = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, 0, 0, 0)))(
        q_BKGSD, k_BKTD, v_BKTD, segments, di_BKGS, lse_BKGS, do_BKGSD)
    dq = dq.astype(jnp.float32).transpose(0, 3, 1, 2, 4).reshape(b, s, h, d) * d ** -0.5
    return dq, dk.astype(jnp.float32).transpose(0, 2, 1, 3), dv.astype(jnp.float32).transpose(0, 2, 1, 3)


@functools.cache
def _sinks(fn) -> dict:
    """sinks=None where this JAX's splash kernel function takes attention sinks (newer releases)."""
    import inspect

    return {"sinks": None} if "sinks" in inspect.signature(fn).parameters else {}
