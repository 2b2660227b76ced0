"""The Gemma layer kind (`gemma` in maxctx.model.stacks), as transformers' Gemma2DecoderLayer and
Gemma3DecoderLayer compute it: x + post_norm(attn(norm(x))), then + post_norm(mlp(norm(x))), every norm Gemma's
RMSNorm x / rms(x) * (1 + w), the MLP a GeGLU (tanh GELU).

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxctx.model.layers import MLP, Attention, ModelConfig, RMSNorm
from maxctx.model.rope import RopeSpec, rotary


def gemma_norm(dim: int, cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    """Gemma's RMSNorm: its weight w is stored as Hugging Face stores it (0 at init) and scales by 1 + w."""
    return RMSNorm(dim, cfg.norm_eps, cfg.weight_dtype, rngs, offset=1.0)


class GemmaAttention(Attention):
    """Grouped-query attention whose q and k are normed per head (Gemma 3: q_norm, k_norm [E], shared by the heads)
    before RoPE, rotated by the local layers' own RoPE where `window` > 0 (Gemma 3: theta 10k, against the global
    layers' 1M with linear scaling 8), and q scaled for query_pre_attn_scalar."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        if cfg.options.qk_norm:
            self.q_norm = gemma_norm(cfg.head_dim, cfg, rngs)
            self.k_norm = gemma_norm(cfg.head_dim, cfg, rngs)
        theta = cfg.options.local_rope_theta
        self.local_rope = RopeSpec(kind="default", theta=theta) if theta > 0 else cfg.rope

    def qkv(self, x_BSD, positions_BS, spec, wq, wk, wv, *extra):
        q, k, v = self.project(x_BSD, wq, wk, wv)
        if self.cfg.options.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = self.local_rope if spec.window > 0 else self.cfg.rope
        q, k = rotary(q, positions_BS, rope), rotary(k, positions_BS, rope)
        scale = self.cfg.options.query_scale
        # Scaling q before the kernel's E^-1/2 gives the scores transformers' query_pre_attn_scalar^-1/2 (and caps
        # them with the attention soft-cap the same way).
        return (q * jnp.asarray(scale, q.dtype) if scale != 1.0 else q), k, v


class GeGLU(MLP):
    """down(gelu_tanh(gate(x)) * up(x)): the shared MLP with Gemma's activation (gelu_pytorch_tanh)."""

    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class GemmaLayer(nnx.Module):
    """The sandwich-normed block; `window` > 0 makes the attention local."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d = cfg.emb_dim
        self.attn_norm = gemma_norm(d, cfg, rngs)
        self.attn = GemmaAttention(cfg, rngs, mesh)
        self.post_attn_norm = gemma_norm(d, cfg, rngs)
        self.mlp_norm = gemma_norm(d, cfg, rngs)
        self.mlp = GeGLU(cfg, rngs, mesh)
        self.post_mlp_norm = gemma_norm(d, cfg, rngs)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        x_BSD = x_BSD + self.post_attn_norm(self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window))
        return x_BSD + self.post_mlp_norm(self.mlp(self.mlp_norm(x_BSD)))
