"""GPU attention through cuDNN flash (jax.nn.dot_product_attention, implementation='cudnn').

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, D head dim.

The API takes no segment ids, so the position/segment mask is passed as a boolean mask[B, 1, S, T]: 1 byte per
(query, key) pair of the local call (cuDNN still never materialises fp32 scores). cuDNN needs bf16 or fp16 inputs;
`auto` picks it on GPU only for those dtypes and uses flash otherwise. Rows with no visible key give out 0 and
lse -inf, as the other kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx.attention.dot_product import mask_from_positions


def cudnn_attention(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, return_lse: bool = False,
                    window: int = 0):
    """Returns (out[B, S, H, D], lse[B, H, S] fp32 or None). A sliding window (> 0) is part of the boolean mask."""
    mask_BST = mask_from_positions(q_pos, q_seg, kv_pos, kv_seg, window)
    result = jax.nn.dot_product_attention(q_BSHD, k_BTKD, v_BTKD, mask=mask_BST[:, None], implementation="cudnn",
                                          return_residual=return_lse)
    out, lse = result if return_lse else (result, None)
    seen_BS = mask_BST.any(-1)
    out = jnp.where(seen_BS[:, :, None, None], out, 0)
    if lse is not None:
        lse_BHS = lse.astype(jnp.float32).transpose(0, 2, 1)  # the residual is laid out [B, S, H]
        lse = jnp.where(seen_BS[:, None, :], lse_BHS, -jnp.inf)
    return out, lse
