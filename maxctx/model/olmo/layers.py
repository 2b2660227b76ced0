"""The OLMo layer kind (`olmo` in maxctx.model.stacks): transformers' Olmo2DecoderLayer / Olmo3DecoderLayer.

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim.
Post-norm only: x + norm(attn(x)), then x + norm(mlp(x)). With use_qk_norm, q and k are RMS-normalised over their
whole projection (q over H x E, k over K x E, scales [H, E] and [K, E]) before RoPE; under tensor parallelism
the mean over heads spans the tensor shards (XLA adds the reduction). Local layers (window > 0) rotate with plain
RoPE at rope_max_timescale and the global ones with the configured rope_type, as transformers' Olmo3 applies its
rope_scaling to the full-attention layers only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from maxctx.model.layers import MLP, Attention, ModelConfig, RMSNorm, param
from maxctx.model.rope import rotary


class ProjectionNorm(nnx.Module):
    """RMSNorm over the last two axes (heads, head dim) of x[B, S, N, E], in fp32."""

    def __init__(self, heads: int, head_dim: int, axes: tuple[str, str], eps: float, weight_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (heads, head_dim), axes, weight_dtype, scale=0.0)
        self.eps = eps

    def __call__(self, x_BSNE):
        x = x_BSNE.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=(-2, -1), keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(x_BSNE.dtype)


class OlmoAttention(Attention):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        if cfg.options.qk_norm:
            e, eps, wd = cfg.head_dim, cfg.norm_eps, cfg.weight_dtype
            self.q_norm = ProjectionNorm(cfg.num_heads, e, ("heads", "head_dim"), eps, wd, rngs)
            self.k_norm = ProjectionNorm(cfg.num_kv_heads, e, ("kv_heads", "head_dim"), eps, wd, rngs)

    def qkv(self, x_BSD, positions_BS, spec, wq, wk, wv):
        q, k, v = self.project(x_BSD, wq, wk, wv)
        if self.cfg.options.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = self.cfg.rope if spec.window == 0 else local_rope(self.cfg.rope)
        return rotary(q, positions_BS, rope), rotary(k, positions_BS, rope), v


def local_rope(rope):
    """A local layer's RoPE: the global one's theta, unscaled."""
    return dataclasses.replace(rope, kind="default")


class OlmoLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.attn = OlmoAttention(cfg, rngs, mesh)
        self.post_attn_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.mlp = MLP(cfg, rngs, mesh)
        self.post_mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        x_BSD = x_BSD + self.post_attn_norm(self.attn(x_BSD, positions_BS, segment_ids_BS, window))
        return x_BSD + self.post_mlp_norm(self.mlp(x_BSD))
