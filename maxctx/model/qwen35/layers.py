"""The qwen3_5 layer kind (`qwen3_5` in maxctx.model.stacks): one period of P layers, P - 1 Gated DeltaNet layers
then one gated full-attention layer, each a pre-norm block with the SwiGLU MLP and (1 + w) RMSNorms, as
transformers' Qwen3_5DecoderLayer computes them.

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim, N linear value heads, V their
head dim, X convolution channels, W kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.attention.dispatch import attend
from maxctx.model.layers import MLP, Attention, ModelConfig, RMSNorm, param
from maxctx.model.qwen35.cp import sharded_mix
from maxctx.model.qwen35.hf_layout import place_name
from maxctx.model.rope import rotary


def norm(dim: int, cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, cfg.weight_dtype, rngs, offset=1.0)


class GatedDeltaNet(nnx.Module):
    """The linear layer: x -> q | k | v (one projection, then the short convolution and silu), z, b, a; the delta
    rule (maxctx.model.qwen35.cp) with beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); its output
    RMSNormed per head, times silu(z), projected out."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        nk, nv, dk, dv = cfg.options.linear_dims
        d, wd, x = cfg.emb_dim, cfg.weight_dtype, 2 * nk * dk + nv * dv
        self.w_qkv = param(rngs, (d, x), ("embed", None), wd)
        self.w_z = param(rngs, (d, nv, dv), ("embed", None, None), wd)
        self.w_b = param(rngs, (d, nv), ("embed", None), wd)
        self.w_a = param(rngs, (d, nv), ("embed", None), wd)
        self.conv = param(rngs, (x, 1, cfg.options.conv_width), (None, None, None), wd,
                          scale=cfg.options.conv_width**-0.5)
        a = jax.random.uniform(rngs.params(), (nv,), jnp.float32, 1.0, 16.0)
        self.a_log = nnx.Param(jnp.log(a).astype(wd), axes=("norm",))
        self.dt_bias = nnx.Param(jnp.ones((nv,), wd), axes=("norm",))
        self.norm = RMSNorm(dv, cfg.norm_eps, wd, rngs)
        self.w_out = param(rngs, (nv, dv, d), (None, None, "embed"), wd, scale=(nv * dv) ** -0.5)
        self.cfg, self.mesh, self.dims = cfg, mesh, (nk, dk, dv)

    def project(self, x_BSD):
        """(qkv[B, S, X], z[B, S, N, V], b, a[B, S, N]); Qwen3-Next's layer (maxctx.model.qwen3_next.layers) takes
        them from its fused projections."""
        dt = self.cfg.dtype
        qkv = checkpoint_name(jnp.einsum("BSD,DX->BSX", x_BSD, self.w_qkv[...].astype(dt)), "query_proj")
        z = jnp.einsum("BSD,DNV->BSNV", x_BSD, self.w_z[...].astype(dt))
        b = jnp.einsum("BSD,DN->BSN", x_BSD, self.w_b[...].astype(dt))
        a = jnp.einsum("BSD,DN->BSN", x_BSD, self.w_a[...].astype(dt))
        return qkv, z, b, a

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        dt = self.cfg.dtype
        qkv, z, b, a = self.project(x_BSD)
        o = sharded_mix(self.mesh, qkv, b, a, segment_ids_BS, self.conv[...][:, 0], self.a_log[...],
                        self.dt_bias[...].astype(jnp.float32), self.dims, self.cfg.attention.load_balance is True)
        o = checkpoint_name(o.astype(dt), "context")
        gated = (self.norm(o).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)
        return checkpoint_name(jnp.einsum("BSNV,NVD->BSD", gated, self.w_out[...].astype(dt)), "out_proj")


class GatedAttention(Attention):
    """Qwen3.5's full attention: q with its per-head output gate (wq [D, H, 2, E]: query, gate), q and k
    RMSNormed per head (1 + w), RoPE on the first `rotary_dims` of each head, the output times sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        d, h, e = cfg.emb_dim, cfg.num_heads, cfg.head_dim
        self.wq = param(rngs, (d, h, 2, e), ("embed", "heads", None, "head_dim"), cfg.weight_dtype)
        self.q_norm, self.k_norm = norm(e, cfg, rngs), norm(e, cfg, rngs)

    def _heads(self, x_BSD, positions_BS, segment_ids_BS, spec, wq, wk, wv, wo, *extra):
        dt = self.cfg.dtype
        qg = checkpoint_name(jnp.einsum("BSD,DHTE->BSHTE", x_BSD, wq.astype(dt)), "query_proj")
        k = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, wk.astype(dt)), "key_proj")
        v = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, wv.astype(dt)), "value_proj")
        q, k = self._rotate(self.q_norm(qg[:, :, :, 0]), positions_BS), self._rotate(self.k_norm(k), positions_BS)
        out_BSHE = checkpoint_name(attend(q, k, v, positions_BS, segment_ids_BS, spec, self.mesh), "context")
        out_BSHE = out_BSHE * jax.nn.sigmoid(qg[:, :, :, 1])
        return jnp.einsum("BSHE,HED->BSD", out_BSHE, wo.astype(dt))

    def _rotate(self, x_BSNE, positions_BS):
        r = self.cfg.options.rotary_dims
        return jnp.concatenate([rotary(x_BSNE[..., :r], positions_BS, self.cfg.rope), x_BSNE[..., r:]], axis=-1)


class Block(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)); the mixer a GatedDeltaNet or a GatedAttention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None, linear: bool = True):
        self.attn_norm = norm(cfg.emb_dim, cfg, rngs)
        if linear:
            self.mixer = GatedDeltaNet(cfg, rngs, mesh)
        else:
            self.attn = GatedAttention(cfg, rngs, mesh)
        self.mlp_norm = norm(cfg.emb_dim, cfg, rngs)
        self.mlp = MLP(cfg, rngs, mesh)
        self.linear = linear

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        mix = self.mixer if self.linear else self.attn
        x_BSD = x_BSD + mix(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class Qwen35Period(nnx.Module):
    """One period: places linear_0 .. linear_(P-2), then full (maxctx.model.qwen35.hf_layout's names)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.period = cfg.options.interval
        for place in range(self.period):
            setattr(self, place_name(place, self.period), Block(cfg, rngs, mesh, linear=place < self.period - 1))

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        for place in range(self.period):
            x_BSD = getattr(self, place_name(place, self.period))(x_BSD, positions_BS, segment_ids_BS, window)
        return x_BSD
