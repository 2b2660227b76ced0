"""The MoE families as maxctx.model.family states a family (no JAX): Mixtral (Llama's attention) and Qwen3-MoE (Qwen
3's, with per-head QK-norm), every layer a dropless routed MoE layer (maxctx.model.moe.layers).

Legend: D model, H query heads, K kv heads, Dh head dim, X experts, k experts per token, M an expert's width,
L layers, T tensor parallelism, b bytes per activation. Per layer:

    parameters   attention, two norms, router D X, experts 3 X D M            (total: what the model holds)
    active       attention, router D X, k of the experts: 3 k D M             (what a token multiplies: MFU)

Per token and device, the remat names as maxctx.model.llama.family has them, the MLP's being the experts':

    mlpwi        2 k M/T b     forward 4 k D M/T FLOPs, and the router's 2 D X (and its softmax, top-k)
    mlpwo        D b           2 k M/T D, and the combine's 2 k D
    besides      the sorted copy of the token [k D] and each slot's output [k D] (b each), p [X] fp32

Dense layers among the MoE ones (interleave_moe_layer_step, mlp_only_layers: maxctx.model.moe.hf_layout.runs) are
Llama's (mixtral) or Qwen 3's (qwen3_moe) layer with a SwiGLU of width F, a stack per run of like layers; the
counts add Ld (3 D F - the MoE MLP's) to the parameters and the matmul FLOPs; the per-token tensors above price
every layer as a MoE one. The layer's working set is Llama's fit (maxctx.model.llama.family.WORK): not yet
calibrated on a compiled MoE step.
"""

from __future__ import annotations

import dataclasses
import math

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model.family import Stack, Tensor
from maxctx.model.llama import family as llama
from maxctx.model.moe import hf_layout
from maxctx.model.qwen import family as qwen

ROUTER_FLOPS = 8  # per token and expert besides the matmul: softmax (exp, sum, divide) and the top-k compares


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """The fields maxctx.model.moe.layers reads from ModelConfig.options: every MoE family's options class takes
    them from here (with its attention's options), so a field the layer gains reaches them all."""

    num_experts: int = 1
    top_k: int = 1
    mlp_dim: int = 1
    renormalize: bool = False
    load_balance_loss_weight: float = 0.0
    router_z_loss_weight: float = 0.0
    capacity_factor: float = 0.0  # 0: dropless (maxctx.model.moe.capacity)


@dataclasses.dataclass(frozen=True)
class MoeOptions(ExpertOptions, qwen.AttentionOptions):
    """What the MoE layer kinds read (ModelConfig.options): Qwen's attention settings, and the experts'."""


class ExpertCounts:
    """Every expert's parameters on a shape whose `mlp_params` counts what a token multiplies (X experts of width
    M, k per token: the fields num_experts, top_k, moe_mlp_dim); shared by the MoE families' shapes."""

    @property
    def moe_layers(self) -> int:
        return self.num_layers

    @property
    def idle_params(self) -> int:
        """The experts a token does not run, over the MoE layers: (X - k) 3 D M Lm."""
        return self.moe_layers * 3 * (self.num_experts - self.top_k) * self.emb_dim * self.moe_mlp_dim

    @property
    def num_params(self) -> int:
        return super().num_params + self.idle_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses, as model cards count them (embedding and output projection included)."""
        return self.num_params - self.idle_params


@dataclasses.dataclass(frozen=True)
class MoeShape(ExpertCounts, qwen.AttentionShape):
    """The attention's shape with X experts of width M, k per token: `mlp_params` counts what a token multiplies
    in a MoE layer (the router and k experts: the matmul FLOPs and MFU), `num_params` every expert; the
    `dense_layers` (maxctx.model.moe.hf_layout.runs) have a SwiGLU of width F instead."""

    num_experts: int = 1
    top_k: int = 1
    moe_mlp_dim: int = 1
    dense_layers: int = 0

    @classmethod
    def from_config(cls, config: Config) -> MoeShape:
        base = qwen.AttentionShape.from_config(config)
        dense = config.base_num_decoder_layers - hf_layout.moe_layers(model_keys(config))
        return cls(**dataclasses.asdict(base), num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   moe_mlp_dim=expert_width(config), dense_layers=dense)

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def dense_delta(self) -> int:
        """What the dense layers hold and multiply beyond the MoE layers' `mlp_params`: Ld (3 D F - mlp_params)."""
        return self.dense_layers * (3 * self.emb_dim * self.mlp_dim - self.mlp_params)

    @property
    def matmul_params(self) -> int:
        return super().matmul_params + self.dense_delta

    @property
    def num_params(self) -> int:
        return super().num_params + self.dense_delta

    @property
    def router_params(self) -> int:
        return self.emb_dim * self.num_experts

    @property
    def mlp_params(self) -> int:
        return self.router_params + 3 * self.top_k * self.emb_dim * self.moe_mlp_dim


def expert_width(config: Config) -> int:
    return config.base_moe_mlp_dim or config.base_mlp_dim


def model_keys(config: Config) -> dict:
    return {k: getattr(config, k) for k in ("base_num_decoder_layers", "interleave_moe_layer_step",
                                            "mlp_only_layers")}


def tensors(shape: MoeShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    named = qwen.tensors(shape, tp, context_copies)
    d, k, m, x = shape.emb_dim, shape.top_k, shape.moe_mlp_dim / tp, shape.num_experts
    router = 2 * d * x + ROUTER_FLOPS * x
    named["mlpwi"] = Tensor(2 * k * m * shape.itemsize, 4 * k * d * m + router)
    named["mlpwo"] = Tensor(d * shape.itemsize, 2 * k * m * d + 2 * k * d)
    return named


def activation(shape: MoeShape, tp: int) -> float:
    """The attention's bytes (Llama's, Qwen's norms), the experts' in place of the SwiGLU's: [k M / T] three times,
    the sorted copy and the slots' outputs [k D], and the router's probabilities [X] fp32, each written and read."""
    dense = qwen.activation(shape, tp) - 2 * shape.itemsize * 3 * shape.mlp_dim / tp
    k, b = shape.top_k, shape.itemsize
    return dense + 2 * (b * (3 * k * shape.moe_mlp_dim / tp + 2 * k * shape.emb_dim) + 4 * shape.num_experts)


def tile(shape: MoeShape, tp: int) -> float:
    """Bytes per token of the experts' tile: gate, up and product [k M / T], the sorted copy and the slots'
    outputs [k D], the router's probabilities [X] fp32."""
    k, b = shape.top_k, shape.itemsize
    return b * (3 * k * shape.moe_mlp_dim / tp + 2 * k * shape.emb_dim) + 4 * shape.num_experts


def check(config: Config) -> None:
    llama.check(config)
    if config.num_experts < 2:
        raise ConfigError(f"num_experts={config.num_experts}: decoder_block={config.decoder_block} is a mixture "
                          f"of experts; set num_experts >= 2 (Mixtral 8x7B: 8)")
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ConfigError(f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                          f"num_experts={config.num_experts}")
    if config.base_moe_mlp_dim < 0:
        raise ConfigError(f"base_moe_mlp_dim={config.base_moe_mlp_dim} is negative; give the experts' width, or 0 "
                          f"for base_mlp_dim")
    for key in ("load_balance_loss_weight", "router_z_loss_weight"):
        if not getattr(config, key) >= 0:  # NaN too
            raise ConfigError(f"{key}={getattr(config, key)} must be >= 0 (0: off); a negative weight rewards the "
                              f"imbalance the term measures")
    if not hf_layout.moe_layers(model_keys(config)):
        raise ConfigError(f"interleave_moe_layer_step={config.interleave_moe_layer_step} mlp_only_layers="
                          f"{config.mlp_only_layers!r} leave no MoE layer in base_num_decoder_layers="
                          f"{config.base_num_decoder_layers}; lower the step or list fewer layers (or use a dense "
                          f"decoder_block)")
    if config.decoder_block == "mixtral" and not config.norm_topk_prob:
        raise ConfigError("norm_topk_prob=false: Mixtral always renormalises its top-k router weights; set "
                          "norm_topk_prob=true, or use decoder_block=qwen3_moe for a router without it")


BLOCKS = ("mixtral", "qwen3_moe")  # the families that read capacity_factor, interleave_moe_layer_step, mlp_only_layers


def capacity_per_sequence(factor: float, tokens: int, top_k: int, experts: int) -> int:
    """c = ceil(f S k / X): the pairs of one sequence of S `tokens` an expert takes (maxctx.model.moe.capacity)."""
    return math.ceil(factor * tokens * top_k / experts)


def check_keys(config: Config, cp: int) -> None:
    """This family's keys set for a family that would ignore them; capacity_factor's refusals where it drops
    tokens by design (maxctx.model.moe.capacity's rule), at `cp` context-parallel devices (from
    maxctx.validate.check_devices)."""
    f = config.capacity_factor
    if config.decoder_block not in BLOCKS and (config.interleave_moe_layer_step != 1 or config.mlp_only_layers):
        raise ConfigError(f"interleave_moe_layer_step={config.interleave_moe_layer_step} mlp_only_layers="
                          f"{config.mlp_only_layers!r}: decoder_block={config.decoder_block} does not place its "
                          f"layers by them (only {' and '.join(BLOCKS)} do); set 1 and \"\"")
    if f == 0:
        return
    if config.decoder_block not in BLOCKS:
        raise ConfigError(f"capacity_factor={f}: decoder_block={config.decoder_block}'s MoE layers are dropless "
                          f"and take no capacity; set capacity_factor=0, or use {' or '.join(BLOCKS)}")
    if not f >= 1:
        raise ConfigError(f"capacity_factor={f} drops tokens by design: below 1 an expert takes fewer pairs than a "
                          f"perfectly balanced router gives it (S k / X of a sequence); set it >= 1 (Switch "
                          f"Transformer: 1.0 to 1.25), or 0 for dropless")
    if cp * config.mlp_sequence_chunks > 1:
        raise ConfigError(f"capacity_factor={f} counts each expert's pairs over whole sequences, but "
                          f"max_target_length={config.max_target_length} is split over {cp} context shards x "
                          f"mlp_sequence_chunks={config.mlp_sequence_chunks}: the tokens dropped would depend on "
                          f"where the mesh cuts each sequence (C = 1 and C N = {cp * config.mlp_sequence_chunks} "
                          f"would train different models); at this length run dropless (capacity_factor=0), or "
                          f"hold each sequence on one device (context parallelism 1, mlp_sequence_chunks=1)")


def check_expert_parallelism(config: Config, sizes: dict) -> None:
    """expert_parallelism E: a mixture of experts', dividing num_experts and the devices experts borrow (fsdp x the
    context axes, mesh axis `sizes`); which leading axes make E, maxctx.parallelism.check_expert_mesh."""
    degree = config.expert_parallelism
    if degree == 1:
        return
    if degree < 1:
        raise ConfigError(f"expert_parallelism={degree} must be >= 1 (1: every device gathers every expert)")
    if config.num_experts < 2:
        raise ConfigError(f"expert_parallelism={degree}: decoder_block={config.decoder_block} with num_experts="
                          f"{config.num_experts} has no experts to spread; set expert_parallelism=1")
    if config.num_experts % degree:
        raise ConfigError(f"expert_parallelism={degree} does not divide num_experts={config.num_experts}: each EP "
                          f"rank holds whole experts; choose a divisor of {config.num_experts}")
    borrowed = sizes["fsdp"] * sizes["context"]
    if borrowed % degree:
        raise ConfigError(f"expert_parallelism={degree} does not divide fsdp x context = {sizes['fsdp']} x "
                          f"{sizes['context']} = {borrowed}, the devices experts borrow; choose a divisor of "
                          f"{borrowed}")


def options(config: Config) -> MoeOptions:
    return MoeOptions(bias=config.attention_bias, qk_norm=config.use_qk_norm, num_experts=config.num_experts,
                      top_k=config.num_experts_per_tok, mlp_dim=expert_width(config),
                      renormalize=config.norm_topk_prob, load_balance_loss_weight=config.load_balance_loss_weight,
                      router_z_loss_weight=config.router_z_loss_weight, capacity_factor=config.capacity_factor)


def _stacks(kind: str, dense: str):
    def stacks(config: Config) -> tuple[Stack, ...]:
        """A stack per run of like layers (hf_layout.runs), each with the window pattern from its first
        layer on: one stack of MoE layers where every layer is one."""
        windows = layer_windows(config)
        period = len(windows)
        return tuple(Stack(kind if run.moe else dense, run.count,
                           tuple(windows[(run.first + j) % period] for j in range(period)))
                     for run in hf_layout.runs(model_keys(config)))

    return stacks


MIXTRAL = dataclasses.replace(
    llama.LLAMA, name="mixtral", shape=MoeShape.from_config, tensors=tensors, activation=activation, tile=tile,
    check=check, stacks=_stacks("mixtral", "llama"), hf_layout=hf_layout, options=options,
    logical_axes=(*llama.LLAMA.logical_axes, "expert"))
QWEN3_MOE = dataclasses.replace(MIXTRAL, name="qwen3_moe", stacks=_stacks("qwen3_moe", "qwen"))
