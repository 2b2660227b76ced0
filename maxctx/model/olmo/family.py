"""The OLMo family as maxctx.model.family states a family (no JAX): Qwen's attention shape and prices
(maxctx.model.qwen.family) with the QK-norm scales over the whole projection, (H + K) Dh parameters per layer, and
no biases. Its two post-norms take the place of Llama's two pre-norms: the same parameters and bytes.

Legend: H query heads, K kv heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model.family import Stack
from maxctx.model.llama import family as llama
from maxctx.model.olmo import hf_layout
from maxctx.model.qwen import family as qwen


@dataclasses.dataclass(frozen=True)
class OlmoOptions:
    """The layer kind's settings (ModelConfig.options)."""

    qk_norm: bool = False


def shape(config: Config) -> qwen.AttentionShape:
    return qwen.AttentionShape.with_attention(config, (config.base_num_query_heads + config.base_num_kv_heads) *
                                              config.head_dim)


def check(config: Config) -> None:
    llama.check(config)
    if config.attention_bias:
        raise ConfigError(f"attention_bias=true: decoder_block={config.decoder_block} has no attention biases; set "
                          f"attention_bias=false (or decoder_block=qwen2 for Qwen's biased attention)")
    if config.use_qk_norm and config.attention_head_chunks > 1:
        raise ConfigError(f"attention_head_chunks={config.attention_head_chunks}: decoder_block="
                          f"{config.decoder_block}'s QK-norm spans every head of the projection, so its heads cannot "
                          f"run in groups; set attention_head_chunks=1")


def stacks(config: Config) -> tuple[Stack, ...]:
    return (Stack("olmo", config.base_num_decoder_layers, layer_windows(config)),)


OLMO = dataclasses.replace(
    llama.LLAMA, name="olmo3", shape=shape, tensors=qwen.tensors, activation=qwen.activation, check=check,
    stacks=stacks, hf_layout=hf_layout, options=lambda config: OlmoOptions(qk_norm=config.use_qk_norm))
