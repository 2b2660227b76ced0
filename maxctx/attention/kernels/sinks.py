"""Attention sinks (GPT-OSS's `sinks`): one learned logit s_h per query head that joins every row's softmax
denominator and carries no value, so a row may attend to "nothing".

Legend: B batch, S query rows, H query heads, D head dim.

Given attention over the keys as (out, lse), the sink is one more log-add-exp merge, of a block whose output is 0:
    lse' = logaddexp(lse, s_h)        out' = out e^(lse - lse') = out sigmoid(lse - s_h)
It is applied once, to the (out, lse) of all keys: after a ring's hops are merged (maxctx.attention.cp.ring), or
after one kernel call (`attend` here); merged per hop it would count s_h once per hop.

Backward: (out', lse') are the residuals of attention over keys and sink together, so the kernels' block backward
(flash's dS = P (dP - rowsum(dout out))), given them in place of (out, lse), is exact for q, k and v: P is taken
against lse', and rowsum(dout out') is the full row's. The sink's own gradient, with p_sink = e^(s_h - lse'):
    d s_h = -sum over (b, s) of p_sink rowsum(dout out')
Every kernel with a block forward and backward (dot_product, blockwise, splash, tokamax_splash, cuDNN's forward with
the blockwise backward) runs sinks this way; their kernels are built with residuals (`ring=True` in make_local).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def merge(out_BSHD, lse_BHS, sinks_H):
    """(out, lse) over the keys -> over the keys and the sink; fp32 lse' and out' in out's dtype."""
    sink = sinks_H.astype(jnp.float32)[None, :, None]
    new = jnp.logaddexp(lse_BHS, sink)
    kept = jnp.exp(lse_BHS - new).transpose(0, 2, 1)[..., None]  # 0 for a row that sees no key
    return (out_BSHD * kept).astype(out_BSHD.dtype), new


def sink_grad(out_BSHD, lse_BHS, dout_BSHD, sinks_H):
    """d s_h of attention whose merged (out', lse') include the sink (module doc), in the sinks' dtype."""
    row = jnp.einsum("bshd,bshd->bhs", dout_BSHD.astype(jnp.float32), out_BSHD.astype(jnp.float32))
    p_sink = jnp.exp(sinks_H.astype(jnp.float32)[None, :, None] - lse_BHS)
    return -(p_sink * row).sum((0, 2)).astype(sinks_H.dtype)


def attend(local, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H=None):
    """local.attend's out, with the sinks merged when given (None: the kernel's own call, unchanged)."""
    if sinks_H is None:
        return local.attend(hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg)[0]
    # Outside the custom VJP, so that autodiff puts dK/dV back in the order the keys came in.
    k, v, kv_pos, kv_seg = local.gathered(k, v, kv_pos, kv_seg)
    return _sink_attention(local, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sink_attention(local, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H):
    return _forward(local, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H)[0]


def _forward(local, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H):
    out, lse = local.block_forward(hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg)  # out fp32: merged before rounding
    out, lse = merge(out, lse, sinks_H)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H, out, lse)


def _backward(local, hop, res, dout):
    q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks_H, out, lse = res
    dq, dk, dv = local.block_backward(hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None,
            sink_grad(out, lse, dout, sinks_H))


_sink_attention.defvjp(_forward, _backward)
