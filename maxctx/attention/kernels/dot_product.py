"""Reference attention: materialises the [S, T] scores. For tests and short sequences only.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim (of q and k;
v's may differ: MLA's 192 and 128, and out has v's).
Masks come from token positions and segment ids, never from array indices, so any token order (zig-zag load
balancing) and packed documents work: query i sees key j iff seg[i] == seg[j] and pos[j] <= pos[i], and with a
sliding window W > 0 also pos[i] - pos[j] < W (the last W tokens of the document, itself included). A logit
soft-cap c > 0 (Gemma 2's attn_logits_soft_cap) turns the scaled scores into c tanh(s / c) before the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_from_positions(q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window: int = 0):
    """[B, S, T] boolean: causal within a document (and within `window` tokens when > 0), nothing across
    documents."""
    same_doc = q_seg_BS[:, :, None] == kv_seg_BT[:, None, :]
    behind = q_pos_BS[:, :, None] - kv_pos_BT[:, None, :]
    if window > 0:
        return same_doc & (behind >= 0) & (behind < window)
    return same_doc & (behind >= 0)


def soft_cap(scores, cap: float):
    """cap * tanh(scores / cap), or the scores as they are for cap 0 (no soft-cap)."""
    return cap * jnp.tanh(scores / cap) if cap else scores


def dot_product_attention(q_BSHD, k_BTKD, v_BTKD, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window: int = 0,
                          softcap: float = 0.0):
    """Returns (out[B, S, H, Dv] in q's dtype, lse[B, H, S] fp32). Rows with no visible key give out 0, lse -inf."""
    b, s, h, d = q_BSHD.shape
    k = k_BTKD.shape[2]
    q_BSKGD = q_BSHD.reshape(b, s, k, h // k, d)
    scores = jnp.einsum("BSKGD,BTKD->BKGST", q_BSKGD, k_BTKD, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * (d ** -0.5), softcap)
    mask = mask_from_positions(q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("BKGST,BTKD->BSKGD", probs.astype(v_BTKD.dtype), v_BTKD, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, v_BTKD.shape[-1]).astype(q_BSHD.dtype), lse.reshape(b, h, s)


def dot_product_block_backward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, out_BSHD, lse_BHS, dout_BSHD,
                               window: int = 0, softcap: float = 0.0):
    """(dq, dk, dv) fp32 of one key/value block given the rows' final out and lse (a ring's merged result).

    With lse held fixed, o(q, k, v) = sum_j exp(s_ij - lse_i) v_j and z(q, k) = sum_j exp(s_ij - lse_i); the true
    gradient is the VJP of (o, z) with cotangents (dout, -rowsum(dout * out)), the second term standing for lse's
    own dependence on the scores.
    """
    b, s, h, d = q_BSHD.shape
    kh = k_BTKD.shape[2]
    mask = mask_from_positions(q_pos, q_seg, kv_pos, kv_seg, window)[:, None, None]
    lse = jnp.where(jnp.isfinite(lse_BHS), lse_BHS, jnp.inf).reshape(b, kh, h // kh, s)
    delta = jnp.einsum("BSHD,BSHD->BHS", dout_BSHD.astype(jnp.float32), out_BSHD.astype(jnp.float32))

    def partial_rows(q, k, v):
        scores = soft_cap(jnp.einsum("BSKGD,BTKD->BKGST", q.reshape(b, s, kh, h // kh, d), k) * (d ** -0.5), softcap)
        p = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
        o = jnp.einsum("BKGST,BTKD->BSKGD", p, v).reshape(b, s, h, v.shape[-1])
        return o, p.sum(-1).reshape(b, h, s)

    f32 = [x.astype(jnp.float32) for x in (q_BSHD, k_BTKD, v_BTKD)]
    _, vjp = jax.vjp(partial_rows, *f32)
    return vjp((dout_BSHD.astype(jnp.float32), -delta))
