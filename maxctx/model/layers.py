"""Shared building blocks in Flax NNX: RMSNorm, grouped-query attention (RoPE: maxctx.model.rope), SwiGLU; a
family's layer kind (maxctx.model.llama.layers) puts them together.

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim, F mlp width, V vocab.
Every parameter carries logical axis names (metadata `axes`), mapped to mesh axes by maxctx.parallelism.LOGICAL_RULES.
Parameters are stored in `weight_dtype` and cast to the compute `dtype` where used.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.config import NAMED_POLICIES, REMAT_NAMES, Config, layer_windows
from maxctx.mesh import logical_to_spec
from maxctx.model import families
from maxctx.model.family import Stack
from maxctx.model.rope import RopeSpec, rotary
from maxctx.model.shape import ModelShape
from maxctx.model.tiling import map_chunks
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES, TENSOR_AXIS


@dataclasses.dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The model's narrow view of the run config (defaults: maxctx.config.Config's): its shape, with the parameter
    counts, FLOPs and bytes per dtype derived from it (maxctx.model.shape), and what the layers read besides."""

    rope: RopeSpec = RopeSpec()
    norm_eps: float = Config.normalization_layer_epsilon
    remat_policy: str = Config.remat_policy
    # remat_policy=custom: (name, "remat" | "device" | "offload") for each of REMAT_NAMES.
    remat_custom: tuple[tuple[str, str], ...] = ()
    # decoder_layer_input=offload: the first this many layers offload their input, the rest keep it (-1: all).
    host_input_layers: int = Config.decoder_layer_input_host_layers
    layer_input_stride: int = Config.decoder_layer_input_stride  # only every N-th layer's input is kept
    scan_layers: bool = Config.scan_layers
    use_iota_embed: bool = Config.use_iota_embed
    num_vocab_tiling: int = Config.num_vocab_tiling
    mlp_sequence_chunks: int = Config.mlp_sequence_chunks
    attention_head_chunks: int = Config.attention_head_chunks
    attention: AttentionSpec = AttentionSpec()
    moe_kernel: str = Config.moe_kernel  # unresolved, as `attention`: the MoE layers resolve it per mesh platform
    expert_parallelism: int = Config.expert_parallelism  # maxctx.model.moe.dispatch
    expert_dispatch: str = Config.expert_dispatch
    # The sliding window of each layer of one repeating group (0: global); maxctx.config.layer_windows.
    layer_windows: tuple[int, ...] = (0,)
    # The family's layer stacks (maxctx.model.family.Stack); () is one `llama` stack of num_layers, layer_windows.
    stacks: tuple[Stack, ...] = ()
    # The family's own layer settings (maxctx.model.family.ModelFamily.options), read by its layer kinds.
    options: object = None
    final_logits_soft_cap: float = Config.final_logits_soft_cap  # the decoder's logits -> cap tanh(logits / cap)

    @classmethod
    def from_config(cls, config: Config) -> ModelConfig:
        # `attention=auto` stays unresolved here: `attend` picks the kernel from the mesh's platform, so a step
        # compiled for a TPU topology on a CPU host gets splash.
        family = families.for_config(config)
        shape = family.shape(config)
        return cls(
            **{f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)},
            rope=RopeSpec.from_config(config), norm_eps=config.normalization_layer_epsilon,
            remat_policy=config.remat_policy, scan_layers=config.scan_layers, use_iota_embed=config.use_iota_embed,
            remat_custom=tuple((name, getattr(config, name)) for name in REMAT_NAMES),
            host_input_layers=config.decoder_layer_input_host_layers,
            layer_input_stride=config.decoder_layer_input_stride,
            num_vocab_tiling=config.num_vocab_tiling, mlp_sequence_chunks=config.mlp_sequence_chunks,
            attention_head_chunks=config.attention_head_chunks,
            attention=AttentionSpec.from_config(config), layer_windows=layer_windows(config),
            stacks=family.stacks(config), options=family.options(config),
            final_logits_soft_cap=config.final_logits_soft_cap, moe_kernel=config.moe_kernel,
            expert_parallelism=config.expert_parallelism, expert_dispatch=config.expert_dispatch,
        )

    @property
    def layer_stacks(self) -> tuple[Stack, ...]:
        return self.stacks or (Stack("llama", self.num_layers, self.layer_windows),)


# The metadata tag of a parameter the step moves by -rate sign(its gradient) instead of the optimizer's update
# (maxctx.train_step; DeepSeek-V3's correction bias, whose "gradient" is its layer's load imbalance).
SIGN_UPDATE = "sign_update"


def param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    """Truncated-normal parameter with fan-in scaling (or ones when scale == 0), tagged with logical axes."""
    if scale == 0.0:
        return nnx.Param(jnp.ones(shape, dtype), axes=axes)
    std = scale if scale is not None else shape[0] ** -0.5
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + w): offset 0 (w starts at 1), or Gemma's 1 (w starts at 0, stored as HF stores it)."""

    def __init__(self, dim: int, eps: float, weight_dtype, rngs: nnx.Rngs, offset: float = 0.0):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, weight_dtype), axes=("norm",))
        self.eps, self.offset = eps, offset

    def __call__(self, x_BSD):
        x = x_BSD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x * (scale + self.offset if self.offset else scale)).astype(x_BSD.dtype)


def remat_names(cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(kept on the device, moved to pinned host memory): the REMAT_NAMES the remat policy keeps for the backward
    (remat_policy=none and full: none of them)."""
    if cfg.remat_policy == "custom":
        return (tuple(name for name, where in cfg.remat_custom if where == "device"),
                tuple(name for name, where in cfg.remat_custom if where == "offload"))
    return NAMED_POLICIES.get(cfg.remat_policy, ((), ()))


def names_policy(saved, offloaded):
    """jax's checkpoint policy keeping the tensors named `saved` on the device and moving `offloaded` to the host."""
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded), offload_src="device",
        offload_dst="pinned_host")


class Attention(nnx.Module):
    """Grouped-query self-attention; the kernel and context-parallel strategy come from `cfg.attention`.

    With attention_head_chunks = N > 1 the layer's attention runs over N groups of K / N kv heads with their
    H / N query heads, one group at a time (a `lax.scan`): project q, k, v for the group, run the strategy, add
    the group's output projection. Each group is rematerialised keeping only its attention output (`context`;
    under p2p and usp that is the ring's out and log-sum-exp, so the backward does not run the ring's forward
    again), so q, k, v, the kernels' fp32 blocks and the ring's accumulators exist for one group at a time, in
    the forward and in the backward. Exact (the output is a sum over heads). The strategy moves the same K/V
    bytes in N times as many messages of 1 / N the size; what moves more (tests/test_head_chunks.py): the int32
    positions and segment ids (up to N times), a2a/usp's all-to-all of q, k, v (once more: the group's backward
    recomputes them), a2a/usp's kv heads where K / N must be repeated for the all-to-all and K need not
    (maxctx.attention.cp.a2a), and under tensor parallelism the output projection's all-reduce (once per group).
    With tensor parallelism T, group g takes heads g H/(TN) .. (g+1) H/(TN) - 1 of every tensor shard, so each
    device still computes only its own heads."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d, h, k, e, wd = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
        self.wq = param(rngs, (d, h, e), ("embed", "heads", "head_dim"), wd)
        self.wk = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), wd)
        self.wv = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), wd)
        self.wo = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), wd, scale=(h * e) ** -0.5)
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        spec = dataclasses.replace(self.cfg.attention, window=window)
        weights = [w[...] for w, _ in self.head_weights()]
        n = self.cfg.attention_head_chunks
        if n == 1:
            out_BSD = self._heads(x_BSD, positions_BS, segment_ids_BS, spec, *weights)
            return checkpoint_name(out_BSD, "out_proj")
        tensor = self.mesh.shape.get(TENSOR_AXIS, 1) if self.mesh is not None else 1
        groups = [_head_groups(w, axis, n, tensor) for w, (_, axis) in zip(weights, self.head_weights())]
        saved, offloaded = remat_names(self.cfg)
        keep = saved if "context" in offloaded else (*saved, "context")
        group = jax.checkpoint(functools.partial(self._heads, x_BSD, positions_BS, segment_ids_BS, spec),
                               policy=names_policy(keep, offloaded), prevent_cse=False)

        axes = [w.get_metadata()["axes"] for w, _ in self.head_weights()]

        def body(out_BSD, group_weights):
            # Cast and gathered over the embed axis outside the group's remat, so the backward's recompute of a
            # group reuses them: the layer gathers its weights as often as unchunked (forward, and remat's forward).
            group_weights = [self._gathered(w.astype(self.cfg.dtype), a) for w, a in zip(group_weights, axes)]
            return out_BSD + constrain_activations(group(*group_weights), self.mesh), None

        out_BSD, _ = jax.lax.scan(body, constrain_activations(jnp.zeros_like(x_BSD), self.mesh), groups)
        return checkpoint_name(out_BSD, "out_proj")

    def head_weights(self) -> tuple[tuple[nnx.Param, int], ...]:
        """Each parameter split by heads, with its heads axis: wq, wk, wv, wo, then any a family's attention adds
        (biases), which `qkv` receives after wv. attention_head_chunks gives each group its slice of every one."""
        return ((self.wq, 1), (self.wk, 1), (self.wv, 1), (self.wo, 0))

    def _heads(self, x_BSD, positions_BS, segment_ids_BS, spec, wq, wk, wv, wo, *extra):
        """The attention of the heads whose weights are given: projections, strategy, output projection [B, S, D]."""
        q, k, v = self.qkv(x_BSD, positions_BS, spec, wq, wk, wv, *extra)
        out_BSHE = checkpoint_name(attend(q, k, v, positions_BS, segment_ids_BS, spec, self.mesh), "context")
        return jnp.einsum("BSHE,HED->BSD", out_BSHE, wo.astype(self.cfg.dtype))

    def qkv(self, x_BSD, positions_BS, spec, wq, wk, wv, *extra):
        """(q[B, S, H, E], k[B, S, K, E], v) of the heads whose weights are given, rotated: the step a family's
        attention overrides (biases, QK-norm, a query scale) before the shared kernels and strategies; `extra`:
        the heads' slices of the parameters its `head_weights` adds."""
        q, k, v = self.project(x_BSD, wq, wk, wv)
        return rotary(q, positions_BS, self.cfg.rope), rotary(k, positions_BS, self.cfg.rope), v

    def project(self, x_BSD, wq, wk, wv):
        """(q[B, S, H, E], k[B, S, K, E], v): the projections, each tagged with its remat name."""
        dt = self.cfg.dtype
        q = checkpoint_name(jnp.einsum("BSD,DHE->BSHE", x_BSD, wq.astype(dt)), "query_proj")
        k = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, wk.astype(dt)), "key_proj")
        v = checkpoint_name(jnp.einsum("BSD,DKE->BSKE", x_BSD, wv.astype(dt)), "value_proj")
        return q, k, v

    def _gathered(self, w, axes):
        if self.mesh is None:
            return w
        spec = logical_to_spec(tuple(None if name == "embed" else name for name in axes), w.shape, self.mesh)
        return jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))



def constrain_activations(x_BSD, mesh):
    """x[B, S, D] laid out as activations between layers: batch over (data, fsdp), sequence over the context axes."""
    if mesh is None:
        return x_BSD
    return jax.lax.with_sharding_constraint(x_BSD, NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXES, None)))


def _head_groups(w, axis: int, n: int, tensor: int):
    """A weight's heads axis (H, sharded over `tensor` = T) split into n groups: [n, ..., H / n, ...], group g
    holding heads g H/(Tn) .. (g+1) H/(Tn) - 1 of each tensor shard (so its H / n stay sharded over T)."""
    shape = w.shape
    heads = shape[axis]
    parts = w.reshape(*shape[:axis], tensor, n, heads // (tensor * n), *shape[axis + 1:])
    parts = jnp.moveaxis(parts, axis + 1, 0)
    return parts.reshape(n, *shape[:axis], heads // n, *shape[axis + 1:])


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); a family's subclass may set another `activation` (Gemma's GeGLU). With
    mlp_sequence_chunks = N > 1 it runs over N chunks of each device's tokens (maxctx.model.tiling), so its
    [B, S, F] intermediates exist one chunk at a time, forward and backward; the chunks' own intermediates are then
    always recomputed, whatever the remat policy."""

    activation = staticmethod(jax.nn.silu)

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
            return checkpoint_name(jnp.einsum("BSF,FD->BSD", self.activation(gate) * up, w_down.astype(dt)),
                                   "mlpwo")

        return map_chunks(swiglu, self.chunks, self.mesh, x_BSD)

