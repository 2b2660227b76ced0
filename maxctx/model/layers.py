"""Llama-family building blocks in Flax NNX: RMSNorm, grouped-query attention (RoPE: maxctx.model.rope), SwiGLU.

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim, F mlp width, V vocab.
Every parameter carries logical axis names (metadata `axes`), mapped to mesh axes by maxctx.mesh.LOGICAL_RULES.
Parameters are stored in `weight_dtype` and cast to the compute `dtype` where used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.config import REMAT_NAMES, Config, layer_windows
from maxctx.model.rope import RopeSpec, rotary
from maxctx.model.shape import ModelShape
from maxctx.model.tiling import map_chunks


@dataclasses.dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The model's narrow view of the run config (defaults: maxctx.config.Config's): its shape, with the parameter
    counts, FLOPs and bytes per dtype derived from it (maxctx.model.shape), and what the layers read besides."""

    rope: RopeSpec = RopeSpec()
    norm_eps: float = Config.normalization_layer_epsilon
    remat_policy: str = Config.remat_policy
    # remat_policy=custom: (name, "remat" | "device" | "offload") for each of REMAT_NAMES.
    remat_custom: tuple[tuple[str, str], ...] = ()
    scan_layers: bool = Config.scan_layers
    use_iota_embed: bool = Config.use_iota_embed
    num_vocab_tiling: int = Config.num_vocab_tiling
    mlp_sequence_chunks: int = Config.mlp_sequence_chunks
    attention: AttentionSpec = AttentionSpec()
    # The sliding window of each layer of one repeating group (0: global); maxctx.config.layer_windows.
    layer_windows: tuple[int, ...] = (0,)

    @classmethod
    def from_config(cls, config: Config) -> ModelConfig:
        # `attention=auto` stays unresolved here: `attend` picks the kernel from the mesh's platform, so a step
        # compiled for a TPU topology on a CPU host gets splash.
        shape = ModelShape.from_config(config)
        return cls(
            **{f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)},
            rope=RopeSpec.from_config(config), norm_eps=config.normalization_layer_epsilon,
            remat_policy=config.remat_policy, scan_layers=config.scan_layers, use_iota_embed=config.use_iota_embed,
            remat_custom=tuple((name, getattr(config, name)) for name in REMAT_NAMES),
            num_vocab_tiling=config.num_vocab_tiling, mlp_sequence_chunks=config.mlp_sequence_chunks,
            attention=AttentionSpec.from_config(config), layer_windows=layer_windows(config),
        )


def param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    """Truncated-normal parameter with fan-in scaling (or ones when scale == 0), tagged with logical axes."""
    if scale == 0.0:
        return nnx.Param(jnp.ones(shape, dtype), axes=axes)
    std = scale if scale is not None else shape[0] ** -0.5
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, weight_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), weight_dtype, scale=0.0)
        self.eps = eps

    def __call__(self, x_BSD):
        x = x_BSD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(x_BSD.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention; the kernel and context-parallel strategy come from `cfg.attention`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d, h, k, e, wd = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
        self.wq = param(rngs, (d, h, e), ("embed", "heads", "head_dim"), wd)
        self.wk = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), wd)
        self.wv = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), wd)
        self.wo = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), wd, scale=(h * e) ** -0.5)
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        dt = self.cfg.dtype
        q = checkpoint_name(jnp.einsum("BSD,DHE->BSHE", x_BSD, self.wq[...].astype(dt)), "query_proj")
        k = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, self.wk[...].astype(dt)), "key_proj")
        v = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, self.wv[...].astype(dt)), "value_proj")
        q = rotary(q, positions_BS, self.cfg.rope)
        k = rotary(k, positions_BS, self.cfg.rope)
        spec = dataclasses.replace(self.cfg.attention, window=window)
        out_BSHE = checkpoint_name(attend(q, k, v, positions_BS, segment_ids_BS, spec, self.mesh), "context")
        return checkpoint_name(jnp.einsum("BSHE,HED->BSD", out_BSHE, self.wo[...].astype(dt)), "out_proj")


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). With mlp_sequence_chunks = N > 1 it runs over N chunks of each
    device's tokens (maxctx.model.tiling), so its [B, S, F] intermediates exist one chunk at a time, forward and
    backward; the chunks' own intermediates are then always recomputed, whatever the remat policy."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d, f, wd = cfg.emb_dim, cfg.mlp_dim, cfg.weight_dtype
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), wd)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), wd)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), wd)
        self.dtype, self.chunks, self.mesh = cfg.dtype, cfg.mlp_sequence_chunks, mesh

    def __call__(self, x_BSD):
        w_gate, w_up, w_down, dt = self.w_gate[...], self.w_up[...], self.w_down[...], self.dtype

        def swiglu(x):
            gate = checkpoint_name(jnp.einsum("BSD,DF->BSF", x, w_gate.astype(dt)), "mlpwi")
            up = checkpoint_name(jnp.einsum("BSD,DF->BSF", x, w_up.astype(dt)), "mlpwi")
            return checkpoint_name(jnp.einsum("BSF,FD->BSD", jax.nn.silu(gate) * up, w_down.astype(dt)), "mlpwo")

        return map_chunks(swiglu, self.chunks, self.mesh, x_BSD)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); `window` > 0 makes the attention local."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.attn_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.attn = Attention(cfg, rngs, mesh)
        self.mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.mlp = MLP(cfg, rngs, mesh)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))
