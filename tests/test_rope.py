"""RoPE variants: each rope_type's inverse frequencies against a numpy reference written here from the published
rules (Meta's Llama 3.1 `apply_scaling`, position interpolation, the YaRN paper as transformers implements it),
yarn's cos/sin scaling, the config checks and the Llama 3.1 presets."""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.model.layers import ModelConfig
from maxctx.model.rope import RopeSpec, inverse_frequencies, rotary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")


def reference_default(theta, dim):
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def reference_llama3(theta, dim, factor, low_freq_factor, high_freq_factor, original):
    """Meta's llama3.1 apply_scaling, one frequency at a time."""
    out = []
    for freq in reference_default(theta, dim):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high_freq_factor:
            out.append(freq)
        elif wavelength > original / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def reference_yarn(theta, dim, factor, original, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """YaRN's "NTK-by-parts": dimension d keeps its frequency when it turns more than beta_fast times over the
    original context, is divided by the factor when it turns fewer than beta_slow times, linear in d between."""
    def d_of(rotations):  # solve original / (2 pi theta^(2d/dim)) = rotations for d
        return dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo, hi = d_of(beta_fast), d_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    freqs = reference_default(theta, dim)
    out = []
    for d, freq in enumerate(freqs):
        interpolate = min(max((d - lo) / (hi - lo if hi != lo else 0.001), 0.0), 1.0)
        out.append(freq * (1 - interpolate) + freq / factor * interpolate)
    return np.array(out)


def reference_rotary(x, positions, freqs, scale=1.0):
    angles = positions[..., None].astype(np.float64) * freqs
    cos, sin = scale * np.cos(angles)[:, :, None], scale * np.sin(angles)[:, :, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_default_is_plain_rope_and_unchanged():
    spec = RopeSpec(theta=10000.0)
    np.testing.assert_allclose(inverse_frequencies(spec, 32), reference_default(10000.0, 32), rtol=1e-6)
    # bit-identical to the expression maxctx used before rope_type existed (the pinned losses depend on it)
    before = 10000.0 ** (-jnp.arange(16, dtype=jnp.float32) / 16)
    assert np.array_equal(np.asarray(inverse_frequencies(spec, 32)), np.asarray(before))
    assert spec.attention_scaling == 1.0


def test_llama3_matches_llama31_8b_rule():
    spec = RopeSpec(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    want = reference_llama3(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(inverse_frequencies(spec, 128), want, rtol=1e-6, atol=0)
    base = reference_default(500000.0, 128)
    ratio = base / want
    # all three bands occur: kept (high frequencies), divided by 8 (low), blended between
    assert np.isclose(ratio, 1).sum() > 0 and np.isclose(ratio, 8).sum() > 0
    assert ((ratio > 1.001) & (ratio < 7.999)).sum() > 0
    assert spec.attention_scaling == 1.0


def test_linear_divides_positions():
    spec = RopeSpec(kind="linear", theta=10000.0, linear_factor=4.0)
    np.testing.assert_allclose(inverse_frequencies(spec, 64), reference_default(10000.0, 64) / 4.0, rtol=1e-6)
    x = np.random.default_rng(0).standard_normal((1, 8, 2, 64)).astype(np.float32)
    positions = np.arange(0, 32, 4, dtype=np.int32)[None]
    # rotating at position p with factor 4 is plain RoPE at position p / 4
    plain = rotary(jnp.asarray(x), jnp.asarray(positions // 4), RopeSpec(theta=10000.0))
    np.testing.assert_allclose(rotary(jnp.asarray(x), jnp.asarray(positions), spec), plain, atol=1e-5)


@pytest.mark.parametrize("theta,dim,factor,original,truncate", [
    (1_000_000.0, 128, 4.0, 32768, True),  # Qwen2.5's YaRN setting
    (150_000.0, 64, 32.0, 4096, False),  # gpt-oss's (truncate: false)
    (10_000.0, 32, 2.0, 64, True),  # the tiny model, whose ramp is clipped at dimension 0
])
def test_yarn_matches_reference(theta, dim, factor, original, truncate):
    spec = RopeSpec(kind="yarn", theta=theta, factor=factor, original_max_position_embeddings=original,
                    truncate=truncate)
    want = reference_yarn(theta, dim, factor, original, truncate=truncate)
    np.testing.assert_allclose(inverse_frequencies(spec, dim), want, rtol=1e-6, atol=0)
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(factor) + 1)


def test_yarn_scales_cos_and_sin():
    spec = RopeSpec(kind="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=64)
    x = np.random.default_rng(1).standard_normal((2, 16, 3, 32)).astype(np.float32)
    positions = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) * 7
    want = reference_rotary(x, positions, reference_yarn(10000.0, 32, 4.0, 64), scale=0.1 * math.log(4.0) + 1)
    np.testing.assert_allclose(rotary(jnp.asarray(x), jnp.asarray(positions), spec), want, atol=2e-4)
    fixed = RopeSpec(kind="yarn", factor=4.0, attention_factor=1.25)
    assert fixed.attention_scaling == 1.25


def test_llama31_presets_use_llama3_scaling():
    for name in ("llama3.1-8b", "llama3.1-70b"):
        config = load_config([BASE, f"model_name={name}"])
        assert (config.rope_type, config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                config.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 8192)
        rope = ModelConfig.from_config(config).rope
        assert rope.kind == "llama3" and rope.theta == 500000.0 and rope.factor == 8.0
    # context extension is an override
    config = load_config([BASE, "model_name=llama3.1-8b", "rope_factor=16", "original_max_position_embeddings=16384"])
    assert (config.rope_factor, config.original_max_position_embeddings) == (16.0, 16384)
    assert load_config([BASE, "model_name=llama3-8b"]).rope_type == "default"


@pytest.mark.parametrize("overrides,named", [
    (["rope_factor=0"], "rope_factor=0.0 must be > 0"),
    (["rope_type=linear", "rope_linear_scaling_factor=-2"], "rope_linear_scaling_factor=-2.0 must be > 0"),
    (["rope_type=llama3", "rope_low_freq_factor=4", "rope_high_freq_factor=4"], "rope_high_freq_factor=4.0 >"),
    (["rope_type=yarn", "beta_fast=1", "beta_slow=32"], "beta_fast=1.0 >= beta_slow=32.0"),
    (["rope_linear_scaling_factor=4"], "add rope_type=linear"),
    (["rope_type=ntk"], "rope_type='ntk'"),
])
def test_bad_rope_settings_are_refused(overrides, named):
    with pytest.raises(ConfigError) as error:
        load_config([BASE, *overrides])
    assert named in str(error.value) and "\n" not in str(error.value)
