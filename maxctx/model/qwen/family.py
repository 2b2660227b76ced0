"""The Qwen family as maxctx.model.family states a family (no JAX): Llama's, with the attention's own parameters
counted and priced.

Legend: D model, H query heads, K kv heads, Dh head dim, L layers, T tensor parallelism, b bytes per activation.
Per layer, besides Llama's parameters (maxctx.model.shape):

    attention_bias   bq [H, Dh], bk, bv [K, Dh]      (H + 2K) Dh parameters, 1 FLOP per q, k, v element
    use_qk_norm      q_norm, k_norm scales [Dh]      2 Dh parameters, 4 FLOPs per q, k element (square, mean,
                                                     rsqrt scale, weight), its output written and read once more

maxctx.model.olmo reuses AttentionShape, `tensors` and `activation` with its norm over the whole projection
((H + K) Dh parameters; the same FLOPs and bytes per element).
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, layer_windows
from maxctx.model.family import Stack, Tensor
from maxctx.model.llama import family as llama
from maxctx.model.qwen import hf_layout
from maxctx.model.shape import ModelShape

BIAS_FLOPS, NORM_FLOPS = 1, 4  # per element of q and k (and v, for the bias)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The attention's own settings the layer kinds read (ModelConfig.options)."""

    bias: bool = False
    qk_norm: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionShape(ModelShape):
    """Llama's shape with the attention's biases and QK-norm scales: `qk_norm_params` per layer (per head: 2 Dh;
    over the whole projection: (H + K) Dh)."""

    attention_bias: bool = False
    qk_norm_params: int = 0

    @classmethod
    def from_config(cls, config: Config) -> AttentionShape:
        return cls.with_attention(config, 2 * config.head_dim)

    @classmethod
    def with_attention(cls, config: Config, qk_norm_params: int) -> AttentionShape:
        base = ModelShape.from_config(config)
        return cls(**dataclasses.asdict(base), attention_bias=config.attention_bias,
                   qk_norm_params=qk_norm_params if config.use_qk_norm else 0)

    @property
    def bias_params(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0

    @property
    def num_params(self) -> int:
        return super().num_params + self.num_layers * (self.bias_params + self.qk_norm_params)


def tensors(shape: AttentionShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    """Llama's tensors, q, k and v with the FLOPs of their bias and norm."""
    named = llama.tensors(shape, tp, context_copies)
    bias = BIAS_FLOPS if shape.attention_bias else 0
    norm = NORM_FLOPS if shape.qk_norm_params else 0
    heads = {"query_proj": shape.num_heads // tp, "key_proj": max(1, shape.num_kv_heads // tp),
             "value_proj": max(1, shape.num_kv_heads // tp)}
    for name, h in heads.items():
        per_element = bias + (norm if name != "value_proj" else 0)
        named[name] = Tensor(named[name].bytes, named[name].flops + per_element * h * shape.head_dim)
    return named


def activation(shape: AttentionShape, tp: int) -> float:
    """Llama's, and the normed q and k written and read once more."""
    normed = (shape.num_heads + shape.num_kv_heads) * shape.head_dim / tp if shape.qk_norm_params else 0
    return llama.activation(shape, tp) + 2 * shape.itemsize * normed


def options(config: Config) -> AttentionOptions:
    return AttentionOptions(bias=config.attention_bias, qk_norm=config.use_qk_norm)


def stacks(config: Config) -> tuple[Stack, ...]:
    return (Stack("qwen", config.base_num_decoder_layers, layer_windows(config)),)


QWEN = dataclasses.replace(
    llama.LLAMA, name="qwen3", shape=AttentionShape.from_config, tensors=tensors, activation=activation,
    stacks=stacks, hf_layout=hf_layout, options=options)
