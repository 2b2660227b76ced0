"""The GPT-OSS family (decoder_block=gpt_oss) as maxctx.model.family states a family (no JAX): the MoE families'
pre-norm block (maxctx.model.moe) with GPT-OSS's attention (q, k, v and output biases, a learned sink per head,
sliding-window and full layers in turn) and its experts (a router with a bias, top-k then softmax over the k
logits, each expert's clamped SwiGLU with biases), as transformers' GptOssForCausalLM computes them.

Legend: D model, H query heads, K kv heads, Dh head dim, X experts, k experts per token, M an expert's width,
L layers. Per layer, besides the MoE families' parameters (maxctx.model.moe.family, with the attention biases
(H + 2K) Dh of maxctx.model.qwen.family):

    parameters   output bias D, sinks H, router bias X, expert biases X (2M + D)     (what the model holds)
    active       the same, but k (2M + D) of the expert biases                       (what a token uses)

The clamped SwiGLU's constants are GPT-OSS's (transformers' swiglu_alpha, swiglu_limit): no config key, every
release has them (hf_layout refuses others). Named tensors, activation bytes and tiles are the MoE families'.
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model.family import Stack
from maxctx.model.gpt_oss import hf_layout
from maxctx.model.moe import family as moe
from maxctx.model.qwen import family as qwen

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class GptOssOptions(moe.ExpertOptions, qwen.AttentionOptions):
    """What the gpt_oss layer kind reads (ModelConfig.options): the attention's biases, the experts'
    (maxctx.model.moe.family.ExpertOptions; its router softmaxes the top k, so `renormalize` is unused), and the
    clamped SwiGLU's constants."""

    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT


@dataclasses.dataclass(frozen=True)
class GptOssShape(moe.ExpertCounts, qwen.AttentionShape):
    """The attention's shape (with q, k, v biases) and X experts of width M, k per token; `mlp_params` counts what
    a token multiplies in a layer (the router and k experts), `num_params` every parameter (module doc)."""

    num_experts: int = 1
    top_k: int = 1
    moe_mlp_dim: int = 1

    @property
    def mlp_params(self) -> int:
        return self.emb_dim * self.num_experts + 3 * self.top_k * self.emb_dim * self.moe_mlp_dim

    @property
    def expert_bias_params(self) -> int:
        """One expert's biases: gate and up 2M, down D."""
        return 2 * self.moe_mlp_dim + self.emb_dim

    @property
    def idle_params(self) -> int:
        """The experts a token does not run, with their biases: (X - k) (3 D M + 2M + D) L."""
        return super().idle_params + self.num_layers * (self.num_experts - self.top_k) * self.expert_bias_params

    @property
    def num_params(self) -> int:
        out_bias = self.emb_dim if self.attention_bias else 0
        per_layer = out_bias + self.num_heads + self.num_experts + self.top_k * self.expert_bias_params
        return super().num_params + self.num_layers * per_layer


def shape(config: Config) -> GptOssShape:
    base = qwen.AttentionShape.from_config(config)
    return GptOssShape(**dataclasses.asdict(base), num_experts=config.num_experts,
                       top_k=config.num_experts_per_tok, moe_mlp_dim=moe.expert_width(config))


def check(config: Config) -> None:
    moe.check(config)
    if config.use_qk_norm:
        raise ConfigError("use_qk_norm=true: decoder_block=gpt_oss has no QK-norm (GPT-OSS's attention has biases "
                          "and sinks instead); set use_qk_norm=false")


def options(config: Config) -> GptOssOptions:
    return GptOssOptions(bias=config.attention_bias, num_experts=config.num_experts,
                         top_k=config.num_experts_per_tok, mlp_dim=moe.expert_width(config),
                         load_balance_loss_weight=config.load_balance_loss_weight,
                         router_z_loss_weight=config.router_z_loss_weight)


def stacks(config: Config) -> tuple[Stack, ...]:
    """One stack: every layer the same block, local or global by the attention layer pattern (GPT-OSS: LG)."""
    return (Stack("gpt_oss", config.base_num_decoder_layers, layer_windows(config)),)


GPT_OSS = dataclasses.replace(moe.MIXTRAL, name="gpt_oss", shape=shape, check=check, stacks=stacks,
                              hf_layout=hf_layout, options=options)
