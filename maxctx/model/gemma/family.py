"""The Gemma 2 / Gemma 3 family as maxctx.model.family states a family (no JAX).

Legend: D model, H query heads, K kv heads, Dh head dim, F mlp, L layers, T tensor parallelism, b bytes per
activation. Llama's layer (maxctx.model.llama.family) with:

    sandwich norms   a second RMSNorm after the attention and after the MLP: 2 D parameters per layer, two more
                     [t, D] written and read per layer
    GeGLU            down(gelu_tanh(gate(x)) * up(x)): SwiGLU's three matmuls, so the same tensors and tile
    QK-norm (gemma3) q_norm, k_norm scales [Dh] shared by the heads: 2 Dh parameters per layer
    layer types      local (sliding-window) and global layers by attention_layer_pattern (Gemma 2: LG, Gemma 3:
                     LLLLLG); Gemma 3's local layers rotate with their own RoPE (local_rope_max_timescale)

and around the stacks (maxctx.model.decoder): embeddings times sqrt(D), a (1 + w) final norm, tied embeddings, and
the final logits soft-capped (final_logits_soft_cap, a key of every family).
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model.family import DecoderOptions, Stack
from maxctx.model.gemma import hf_layout
from maxctx.model.llama import family as llama
from maxctx.model.shape import ModelShape


@dataclasses.dataclass(frozen=True)
class GemmaOptions(DecoderOptions):
    """The gemma layer kind's settings (ModelConfig.options), besides the decoder's."""

    qk_norm: bool = False
    # q is multiplied by this before the kernels' own Dh^-1/2, so the scores get query_pre_attn_scalar^-1/2.
    query_scale: float = 1.0
    local_rope_theta: float = 0.0  # RoPE theta of the local layers (default rope_type); 0: the global layers' RoPE


@dataclasses.dataclass(frozen=True)
class GemmaShape(ModelShape):
    """Llama's shape with each layer's post-norms (2 D) and QK-norm scales (2 Dh, Gemma 3) counted."""

    extra_layer_params: int = 0

    @property
    def num_params(self) -> int:
        return super().num_params + self.num_layers * self.extra_layer_params


def _is_gemma3(config: Config) -> bool:
    return config.decoder_block == "gemma3"


def shape(config: Config) -> GemmaShape:
    base = ModelShape.from_config(config)
    qk_norm = 2 * config.head_dim if _is_gemma3(config) else 0
    return GemmaShape(**dataclasses.asdict(base), extra_layer_params=2 * config.base_emb_dim + qk_norm)


def options(config: Config) -> GemmaOptions:
    scalar = config.query_pre_attn_scalar
    return GemmaOptions(embed_scale=True, norm_offset=1.0, qk_norm=_is_gemma3(config),
                        query_scale=(config.head_dim / scalar) ** 0.5 if scalar > 0 else 1.0,
                        local_rope_theta=max(0.0, config.local_rope_max_timescale))


def activation(shape: ModelShape, tp: int) -> float:
    """Llama's, and the two post-norms' [t, D] outputs written and read once."""
    return llama.activation(shape, tp) + 2 * shape.itemsize * 2 * shape.emb_dim


def check(config: Config) -> None:
    llama.check(config)
    for key in ("attention_bias", "use_qk_norm"):
        if getattr(config, key):
            raise ConfigError(f"{key}=true is not a Gemma setting (decoder_block={config.decoder_block}: no biases; "
                              f"gemma3's per-head QK-norm is built in); set {key}=false")
    if config.query_pre_attn_scalar < 0:
        raise ConfigError(f"query_pre_attn_scalar={config.query_pre_attn_scalar} must be >= 0 (0: head_dim, the "
                          f"usual 1/sqrt(head_dim) scale; Gemma 2 27B: 144)")


def stacks(config: Config) -> tuple[Stack, ...]:
    """One stack of the pattern's local and global layers; a pattern that does not divide the layer count (Gemma 3's
    26 layers of LLLLLG) ends with the first layers of one more period (maxctx.model.stacks)."""
    return (Stack("gemma", config.base_num_decoder_layers, layer_windows(config)),)


GEMMA2 = dataclasses.replace(
    llama.LLAMA, name="gemma2", shape=shape, activation=activation, check=check, stacks=stacks,
    hf_layout=hf_layout, options=options)
GEMMA3 = dataclasses.replace(GEMMA2, name="gemma3")
