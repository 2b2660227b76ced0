"""Rotary position embeddings: the inverse frequencies of each `rope_type`, and their application to q and k.

Legend: B batch, S sequence, N heads (query or kv), E head dim.
The rules are Hugging Face transformers' (modeling_rope_utils: `_compute_*_parameters`), so a released checkpoint
sees the frequencies it was trained with:
- default: theta^(-2i/E), i < E/2.
- linear: default / factor (position interpolation: positions divided by the factor).
- llama3 (Llama 3.1): wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
  the factor, those shorter than original / high_freq_factor kept, the band between blended linearly in
  original / wavelength.
- yarn: per dimension a blend of default (extrapolation) and default / factor (interpolation), the ramp running
  between the dimensions that make beta_fast and beta_slow rotations over the original context; cos and sin are
  then multiplied by the attention factor (0.1 ln(factor) + 1 unless set), as transformers does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from maxctx.config import Config


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """The RoPE settings of the run config (defaults: maxctx.config.Config's)."""

    kind: str = Config.rope_type
    theta: float = Config.rope_max_timescale
    factor: float = Config.rope_factor
    low_freq_factor: float = Config.rope_low_freq_factor
    high_freq_factor: float = Config.rope_high_freq_factor
    original_max_position_embeddings: int = Config.original_max_position_embeddings
    linear_factor: float = Config.rope_linear_scaling_factor
    beta_fast: float = Config.beta_fast
    beta_slow: float = Config.beta_slow
    truncate: bool = Config.rope_truncate
    attention_factor: float = Config.rope_attention_factor

    @classmethod
    def from_config(cls, config: Config) -> RopeSpec:
        return cls(kind=config.rope_type, theta=config.rope_max_timescale, factor=config.rope_factor,
                   low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                   original_max_position_embeddings=config.original_max_position_embeddings,
                   linear_factor=config.rope_linear_scaling_factor, beta_fast=config.beta_fast,
                   beta_slow=config.beta_slow, truncate=config.rope_truncate,
                   attention_factor=config.rope_attention_factor)

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: 1 except for yarn."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor > 0:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> jax.Array:
    """[E/2] fp32 angular frequencies (radians per position) of the rotary dimension pairs."""
    half = head_dim // 2
    # `default` is the expression maxctx has always used: its values (and the pinned losses) stay bit-identical.
    freqs = rope.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if rope.kind == "linear":
        return freqs / rope.linear_factor
    if rope.kind == "llama3":
        return _llama3(freqs, rope)
    if rope.kind == "yarn":
        return _yarn(freqs, rope, head_dim)
    return freqs


def _llama3(freqs, rope: RopeSpec):
    original = rope.original_max_position_embeddings
    wavelength = 2 * math.pi / freqs
    long = wavelength > original / rope.low_freq_factor  # low frequencies: interpolated by the factor
    short = wavelength < original / rope.high_freq_factor  # high frequencies: kept
    smooth = (original / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * freqs / rope.factor + smooth * freqs
    return jnp.where(long, freqs / rope.factor, jnp.where(short, freqs, blended))


def _yarn(freqs, rope: RopeSpec, head_dim: int):
    def dimension(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    return freqs / rope.factor * (1 - extrapolation) + freqs * extrapolation


def rotary(x_BSNE, positions_BS, rope: RopeSpec):
    """Rotary position embedding (rotate-half form) at the given token positions, computed in fp32."""
    half = x_BSNE.shape[-1] // 2
    angles_BSE = positions_BS[..., None].astype(jnp.float32) * inverse_frequencies(rope, x_BSNE.shape[-1])
    sin, cos = jnp.sin(angles_BSE)[:, :, None], jnp.cos(angles_BSE)[:, :, None]
    if rope.attention_scaling != 1.0:
        sin, cos = sin * rope.attention_scaling, cos * rope.attention_scaling
    x = x_BSNE.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BSNE.dtype)
