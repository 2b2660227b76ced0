"""Reference attention: materialises the [S, T] scores. For tests and short sequences only.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim.
Masks come from token positions and segment ids, never from array indices, so any token order (zig-zag load
balancing) and packed documents work: query i sees key j iff seg[i] == seg[j] and pos[j] <= pos[i].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_from_positions(q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT):
    """[B, S, T] boolean: causal within a document, nothing across documents."""
    same_doc = q_seg_BS[:, :, None] == kv_seg_BT[:, None, :]
    causal = kv_pos_BT[:, None, :] <= q_pos_BS[:, :, None]
    return same_doc & causal


def dot_product_attention(q_BSHD, k_BTKD, v_BTKD, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT):
    """Returns (out[B, S, H, D] in q's dtype, lse[B, H, S] fp32). Rows with no visible key give out 0, lse -inf."""
    b, s, h, d = q_BSHD.shape
    k = k_BTKD.shape[2]
    q_BSKGD = q_BSHD.reshape(b, s, k, h // k, d)
    scores = jnp.einsum("BSKGD,BTKD->BKGST", q_BSKGD, k_BTKD, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    mask = mask_from_positions(q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("BKGST,BTKD->BSKGD", probs.astype(v_BTKD.dtype), v_BTKD, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q_BSHD.dtype), lse.reshape(b, h, s)
