"""The Qwen layer kind (`qwen` in maxctx.model.stacks): Llama's pre-norm block whose attention adds biases to q, k
and v (attention_bias) and an RMSNorm over each head's head_dim of q and k before RoPE (use_qk_norm), as
transformers' Qwen2Attention and Qwen3Attention do.

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from maxctx.model.layers import Attention, ModelConfig, RMSNorm
from maxctx.model.llama.layers import DecoderLayer
from maxctx.model.rope import rotary


def zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


class QwenAttention(Attention):
    """Grouped-query attention with bq[H, E], bk[K, E], bv[K, E] (split by heads with wq, wk, wv under
    attention_head_chunks) and q_norm, k_norm scales [E] shared by the heads."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        h, k, e, wd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
        if cfg.options.bias:
            self.bq = zeros((h, e), ("heads", "head_dim"), wd)
            self.bk = zeros((k, e), ("kv_heads", "head_dim"), wd)
            self.bv = zeros((k, e), ("kv_heads", "head_dim"), wd)
        if cfg.options.qk_norm:
            self.q_norm = RMSNorm(e, cfg.norm_eps, wd, rngs)
            self.k_norm = RMSNorm(e, cfg.norm_eps, wd, rngs)

    def head_weights(self):
        biases = ((self.bq, 0), (self.bk, 0), (self.bv, 0)) if self.cfg.options.bias else ()
        return (*super().head_weights(), *biases)

    def qkv(self, x_BSD, positions_BS, spec, wq, wk, wv, *biases):
        q, k, v = self.project(x_BSD, wq, wk, wv)
        if biases:
            q, k, v = (x + b.astype(x.dtype) for x, b in zip((q, k, v), biases))
        if self.cfg.options.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary(q, positions_BS, self.cfg.rope), rotary(k, positions_BS, self.cfg.rope), v


class QwenLayer(DecoderLayer):
    """Llama's pre-norm block with QwenAttention."""

    attention = QwenAttention
