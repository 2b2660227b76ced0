"""The qwen3_next layer kind (`qwen3_next` in maxctx.model.stacks): one period of P layers, P - 1 Gated DeltaNet
layers then one gated full-attention layer (Qwen3.5's, maxctx.model.qwen35.layers), each with the MoE layer
(maxctx.model.moe.layers.MoeBlock) and a shared expert, as transformers' Qwen3NextDecoderLayer computes them.

Legend: B batch, S sequence, D model width, N linear value heads, V their head dim, K linear key heads (Nk), G = N / K
value heads per key head, Dk key head dim, C = 2 Dk + 2 G V one key head's group of q, k, v and z.

Qwen3-Next's linear layer is Qwen3.5's with its projections fused per key head, as the released checkpoints hold
them: w_qkvz [D, K, C] (per group q | k | v | z), w_ba [D, K, 2 G] (per group b | a); value head j is group j // G.
The shared expert: y = moe(x) + sigmoid(x w_sg) shared(x) (w_sg [D, 1]), shared a SwiGLU of shared_experts x M.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.model.layers import MLP, ModelConfig, param
from maxctx.model.moe.layers import MoeBlock, aux_terms
from maxctx.model.qwen35.hf_layout import place_name
from maxctx.model.qwen35.layers import GatedAttention, GatedDeltaNet, norm


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's linear layer with Qwen3-Next's fused, per-key-head projections (module doc)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        # Qwen3.5's four projections give way to the fused two; its convolution, decay, norm and output stay, as
        # does its forward past `project`.
        del self.w_qkv, self.w_z, self.w_b, self.w_a
        nk, nv, dk, dv = cfg.options.linear_dims
        g, d = nv // nk, cfg.emb_dim
        self.w_qkvz = param(rngs, (d, nk, 2 * dk + 2 * g * dv), ("embed", None, None), cfg.weight_dtype)
        self.w_ba = param(rngs, (d, nk, 2 * g), ("embed", None, None), cfg.weight_dtype)

    def project(self, x_BSD):
        nk, nv, dk, dv = self.cfg.options.linear_dims
        g, dt, (batch, seq, _) = nv // nk, self.cfg.dtype, x_BSD.shape
        qkvz = jnp.einsum("BSD,DKC->BSKC", x_BSD, self.w_qkvz[...].astype(dt))
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + g * dv], axis=-1)
        qkv = jnp.concatenate([t.reshape(batch, seq, -1) for t in (q, k, v)], axis=-1)  # Qwen3.5's q | k | v
        b, a = jnp.split(jnp.einsum("BSD,DKC->BSKC", x_BSD, self.w_ba[...].astype(dt)), [g], axis=-1)
        return (checkpoint_name(qkv, "query_proj"), z.reshape(batch, seq, nv, dv), b.reshape(batch, seq, nv),
                a.reshape(batch, seq, nv))


class SharedExpertMoe(nnx.Module):
    """The routed experts (MoeBlock: router, w_gate, w_up, w_down) and the shared expert with its sigmoid gate
    shared_gate [D, 1]; returns (y[B, S, D], MoeBlock's load sums)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        o = cfg.options
        self.routed = MoeBlock(cfg, rngs, mesh)
        self.shared = MLP(dataclasses.replace(cfg, mlp_dim=o.shared_experts * o.mlp_dim), rngs, mesh)
        self.shared_gate = param(rngs, (cfg.emb_dim, 1), ("embed", None), cfg.weight_dtype)
        self.dtype = cfg.dtype

    def __call__(self, x_BSD, segment_ids_BS):
        y, sums = self.routed(x_BSD, segment_ids_BS)
        gate = jax.nn.sigmoid(jnp.einsum("BSD,DO->BSO", x_BSD, self.shared_gate[...].astype(self.dtype)))
        return y + gate * self.shared(x_BSD), sums


class Block(nnx.Module):
    """x + mixer(norm(x)), then + moe(norm(x)); the mixer a FusedGatedDeltaNet or a GatedAttention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None, linear: bool = True):
        self.attn_norm = norm(cfg.emb_dim, cfg, rngs)
        if linear:
            self.mixer = FusedGatedDeltaNet(cfg, rngs, mesh)
        else:
            self.attn = GatedAttention(cfg, rngs, mesh)
        self.mlp_norm = norm(cfg.emb_dim, cfg, rngs)
        self.moe = SharedExpertMoe(cfg, rngs, mesh)
        self.linear = linear

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        mix = self.mixer if self.linear else self.attn
        x_BSD = x_BSD + mix(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        y_BSD, sums = self.moe(self.mlp_norm(x_BSD), segment_ids_BS)
        return x_BSD + y_BSD, sums


class Qwen3NextPeriod(nnx.Module):
    """One period: places linear_0 .. linear_(P-2), then full; returns (x, the period's MoE load sums)."""

    aux_terms = staticmethod(aux_terms)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.period = cfg.options.interval
        for place in range(self.period):
            setattr(self, place_name(place, self.period), Block(cfg, rngs, mesh, linear=place < self.period - 1))

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        total = None
        for place in range(self.period):
            x_BSD, sums = getattr(self, place_name(place, self.period))(x_BSD, positions_BS, segment_ids_BS, window)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
        return x_BSD, total
