"""A ring hop's backward through splash's own dQ and dK/dV kernels (maxctx.attention.cp.ring calls it through
kernels.LocalKernel.block_backward), for the kernels splash.make_kernel built with their tables: one call, or row
chunks looped as one kernel per pass (splash.RowLoop: dQ per chunk, dK/dV summed over the chunks). The kernels are
private functions of JAX's splash module: splash.backward_kernels_available checks their signatures; without
them a hop takes the blockwise backward.

Legend: B batch, S query rows, T keys, H query heads, K kv heads, G = H // K, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxctx.attention.kernels import document_blocks, splash


def has_backward(kernels) -> bool:
    """Whether make_kernel's result for a ring hop can run hop_backward: a RowLoop or one call whose kernel has dQ
    and dK/dV tables, or no kernel at all (the hop sees no key)."""
    if not splash.backward_kernels_available():
        return False
    if isinstance(kernels, splash.RowLoop):
        return "dkv_mask_info" in kernels.infos
    return all(kernel is None for _, _, kernel in kernels) or (
        len(kernels) == 1 and kernels[0][2].dkv_mask_info is not None)


def hop_backward(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, out_BSHD, lse_BHS, dout_BSHD, ids=None):
    """A ring hop's (dq, dk, dv) through splash's own dQ and dK/dV kernels, from the *merged* out and lse of all
    hops (the same residuals the blockwise backward takes): P = exp(s - lse) is then the hop's share of the row's
    softmax, so the hops' gradients add up to the whole attention's. Returned as fp32 for the ring's fp32
    accumulators, but computed in the inputs' dtype (splash's kernels output it: bf16 in training, each hop's
    (and row chunk's) gradient rounded to bf16 before the sum). For kernels with has_backward. A RowLoop runs its
    chunks in a scan: each chunk's dq comes out as its rows (in the kernel's dtype: no fp32 carry of every row,
    a large array at long context, docs/long_context.md), its dk and dv add up in fp32 carries. `ids`: (query
    positions, key positions, window, query values or None: splash.splash_call) to narrow the dQ and dK/dV tables
    to the rows' documents (document_blocks)."""
    if not isinstance(kernels, splash.RowLoop):
        if kernels[0][2] is None:  # the hop sees no key
            return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q_BSHD, k_BTKD, v_BTKD))
        kernel = kernels[0][2]
        b, s, h, d = q_BSHD.shape
        infos = {"dq_mask_info": kernel.dq_mask_info, "dkv_mask_info": kernel.dkv_mask_info}
        if ids is not None:
            infos = document_blocks.call_infos(kernel, infos, ids[0], q_seg_BS, ids[1], kv_seg_BT, ids[2], ids[3])
        with splash.pallas_scope(splash.visited_macs(kernel.fwd_mask_info.block_mask, s, kernel, d) * b * h):
            dq, dk, dv = _backward(kernel, infos["dq_mask_info"], infos["dkv_mask_info"], q_BSHD, k_BTKD, v_BTKD,
                                   q_seg_BS, kv_seg_BT, out_BSHD, lse_BHS, dout_BSHD)
        return _scaled(dq), dk, dv
    loop = kernels
    infos = {name: loop.device_info(name) for name in ("dq_mask_info", "dkv_mask_info") if name in loop.infos}

    def chunk(grads, xs):  # slices in the loop rather than chunk-major copies of q, out and dout
        i, which = xs
        q, seg, out, lse, dout = (jax.lax.dynamic_slice_in_dim(x, i * loop.rows, loop.rows, axis) for x, axis in
                                  ((q_BSHD, 1), (q_seg_BS, 1), (out_BSHD, 1), (lse_BHS, 2), (dout_BSHD, 1)))
        picked = {name: None if name not in infos else loop.pick(infos[name], which)
                  for name in ("dq_mask_info", "dkv_mask_info")}
        if ids is not None:
            pos, values = (None if x is None else jax.lax.dynamic_slice_in_dim(x, i * loop.rows, loop.rows, 1)
                           for x in (ids[0], ids[3]))
            picked = document_blocks.call_infos(loop.kernel, picked, pos, seg, ids[1], kv_seg_BT, ids[2], values)
        dq_info, dkv_info = picked["dq_mask_info"], picked["dkv_mask_info"]
        with splash.pallas_scope(loop.macs(q_BSHD.shape[0] * q_BSHD.shape[2], q_BSHD.shape[3])):
            dq, dk, dv = _backward(loop.kernel, dq_info, dkv_info, q, k_BTKD, v_BTKD, seg, kv_seg_BT, out, lse, dout)
        return (grads[0] + dk, grads[1] + dv), dq

    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (k_BTKD, v_BTKD))
    (dk, dv), dq_chunks = jax.lax.scan(chunk, zeros, (jnp.arange(loop.chunks), jnp.asarray(loop.index)))
    return _scaled(jnp.moveaxis(dq_chunks, 0, 1).reshape(q_BSHD.shape)), dk, dv


def _scaled(dq_BSHD):
    """dq in fp32 for the ring's accumulator, times the D**-0.5 splash's queries were pre-scaled by."""
    return dq_BSHD.astype(jnp.float32) * dq_BSHD.shape[-1] ** -0.5


def _backward(kernel, dq_info, dkv_info, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, out_BSHD, lse_BHS, dout_BSHD):
    """hop_backward of one splash call: `kernel`'s block sizes and settings with the dQ and dK/dV tables given
    (dq_info None under the fused backward). dq in the kernel's dtype without the query scale (_scaled), dk and dv
    in fp32."""
    kernel_lib, _ = splash._lib()
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
                            bkv_compute=sizes.block_kv_dkv_compute, mask_info=dkv_info,
                            use_fused_bwd_kernel=sizes.use_fused_bwd_kernel)
        if not sizes.use_fused_bwd_kernel:
            dq = dq_fn(**args, **_sinks(dq_fn), bq=sizes.block_q_dq, bkv=sizes.block_kv_dq, mask_info=dq_info)
        return dq, dk, dv

    dq, dk, dv = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, 0, 0, 0)))(
        q_BKGSD, k_BKTD, v_BKTD, segments, di_BKGS, lse_BKGS, do_BKGSD)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)  # unscaled, in the kernel's dtype (_scaled)
    return dq, dk.astype(jnp.float32).transpose(0, 2, 1, 3), dv.astype(jnp.float32).transpose(0, 2, 1, 3)


@functools.cache
def _sinks(fn) -> dict:
    """sinks=None where this JAX's splash kernel function takes attention sinks (newer releases)."""
    import inspect

    return {"sinks": None} if "sinks" in inspect.signature(fn).parameters else {}
