"""The Qwen3-Next family as maxctx.model.family states a family (no JAX): Qwen3.5's periods (maxctx.model.qwen35.family:
P - 1 Gated DeltaNet layers then one gated full-attention layer, (1 + w) RMSNorms), every layer's MLP a routed MoE
(maxctx.model.moe) with a shared expert behind a sigmoid gate, as transformers' Qwen3NextSparseMoeBlock.

Legend: D model, X experts, k experts per token, M an expert's width, S = s M the shared expert's width (s =
shared_experts), L layers, T tensor parallelism, b bytes per activation. Each layer's MLP:

    parameters   router D X, experts 3 X D M, shared 3 D S, its gate D        (total: what the model holds)
    active       router D X, k experts 3 k D M, shared 3 D S, its gate D      (what a token multiplies: MFU)

Per token and device the MLP's remat names are the MoE family's with the shared expert's S added (as DeepSeek's
shared experts, maxctx.model.deepseek.family); the mixers' are Qwen3.5's, averaged over a period.
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError
from maxctx.model.family import Stack, Tensor
from maxctx.model.moe import family as moe
from maxctx.model.qwen3_next import hf_layout
from maxctx.model.qwen35 import family as qwen35


@dataclasses.dataclass(frozen=True)
class Qwen3NextOptions(moe.ExpertOptions, qwen35.Qwen35Options):
    """What the qwen3_next layer kind reads (ModelConfig.options): Qwen3.5's, the MoE layer's
    (maxctx.model.moe.family.ExpertOptions), and the shared experts."""

    renormalize: bool = True
    shared_experts: int = 1


@dataclasses.dataclass(frozen=True)
class Qwen3NextShape(moe.ExpertCounts, qwen35.Qwen35Shape):
    """Qwen3.5's shape with the MoE MLP: `mlp_params` what a token multiplies, `num_params` every expert."""

    num_experts: int = 1
    top_k: int = 1
    moe_mlp_dim: int = 1
    shared_experts: int = 1

    @property
    def shared_dim(self) -> int:
        return self.shared_experts * self.moe_mlp_dim

    @property
    def mlp_params(self) -> int:
        d = self.emb_dim
        return d * self.num_experts + 3 * d * (self.top_k * self.moe_mlp_dim + self.shared_dim) + d


def shape(config: Config) -> Qwen3NextShape:
    base = qwen35.shape(config)
    return Qwen3NextShape(**dataclasses.asdict(base), num_experts=config.num_experts,
                          top_k=config.num_experts_per_tok, moe_mlp_dim=moe.expert_width(config),
                          shared_experts=config.shared_experts)


def _experts(shape: Qwen3NextShape, tp: int) -> float:
    """Expert width a token runs, per device: k M + S over T."""
    return (shape.top_k * shape.moe_mlp_dim + shape.shared_dim) / tp


def tensors(shape: Qwen3NextShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    named = qwen35.tensors(shape, tp, context_copies)
    d, x, w = shape.emb_dim, shape.num_experts, _experts(shape, tp)
    router = 2 * d * x + moe.ROUTER_FLOPS * x + 2 * d  # and the shared expert's gate
    named["mlpwi"] = Tensor(2 * w * shape.itemsize, 4 * d * w + router)
    named["mlpwo"] = Tensor(d * shape.itemsize, 2 * w * d + 2 * shape.top_k * d)
    return named


def activation(shape: Qwen3NextShape, tp: int) -> float:
    """Qwen3.5's bytes with the experts' in place of the SwiGLU's: [k M + S] / T three times, the sorted copy and
    the slots' outputs [k D], the router's probabilities [X] fp32, each written and read."""
    dense = qwen35.activation(shape, tp) - 2 * shape.itemsize * 3 * shape.mlp_dim / tp
    b = shape.itemsize
    return dense + 2 * (b * (3 * _experts(shape, tp) + 2 * shape.top_k * shape.emb_dim) + 4 * shape.num_experts)


def tile(shape: Qwen3NextShape, tp: int) -> float:
    """The larger of the experts' tile (MoE family's, with the shared expert) and the delta rule's chunk operands."""
    experts = shape.itemsize * (3 * _experts(shape, tp) + 2 * shape.top_k * shape.emb_dim) + 4 * shape.num_experts
    return max(experts, qwen35.delta_rule_tile(shape.linear_dims))


def check(config: Config) -> None:
    qwen35.check(config)
    moe.check(config)
    if config.shared_experts < 1:
        raise ConfigError(f"shared_experts={config.shared_experts}: decoder_block=qwen3_next's MoE layer has a gated "
                          f"shared expert of shared_experts x base_moe_mlp_dim; set shared_experts >= 1 "
                          f"(Qwen3-Next-80B-A3B: 1)")


def options(config: Config) -> Qwen3NextOptions:
    base = qwen35.options(config)
    return Qwen3NextOptions(**dataclasses.asdict(base), num_experts=config.num_experts,
                            top_k=config.num_experts_per_tok, mlp_dim=moe.expert_width(config),
                            renormalize=config.norm_topk_prob, load_balance_loss_weight=config.load_balance_loss_weight,
                            router_z_loss_weight=config.router_z_loss_weight, shared_experts=config.shared_experts)


def stacks(config: Config) -> tuple[Stack, ...]:
    return (Stack("qwen3_next", config.base_num_decoder_layers // config.full_attention_interval),)


QWEN3_NEXT = dataclasses.replace(
    qwen35.QWEN3_5, name="qwen3_next", shape=shape, tensors=tensors, activation=activation, tile=tile, check=check,
    stacks=stacks, hf_layout=hf_layout, options=options, logical_axes=(*qwen35.QWEN3_5.logical_axes, "expert"))
