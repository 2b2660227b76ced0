"""The Gemma family (maxctx.model.gemma): each feature is needed to give transformers' logits. The Gemma 2 and Gemma 3
HF fixtures (tests/fixtures/hf/gemma2, gemma3: tiny random models transformers made, their fp32 logits) are
imported once; with one feature dropped (its key set off, or its code path replaced here) the logits on 1 device
no longer equal transformers' (tests/test_family_matrix.py checks they do with every feature on, under every
strategy). Then config.json's two forms, the refusals, and the planner on the Gemma 3 27B preset.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from maxctx.config import MODEL_KEYS, Config, ConfigError
from maxctx.convert.from_hf import import_hf
from maxctx.loader import load_config
from maxctx.model import families
from maxctx.model.decoder import Decoder
from maxctx.model.gemma import hf_layout, layers as gemma_layers
from maxctx.model.layers import ModelConfig, RMSNorm
from maxctx.plan import planner
from tests.support.hf import FIXTURES, relative_error, setup

quiet = lambda *args, **kwargs: None  # noqa: E731


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """name -> (its config, its restored parameters), imported from the fixture."""
    out = tmp_path_factory.mktemp("gemma")
    loaded = {}
    for name in ("gemma2", "gemma3"):
        import_hf(str(FIXTURES / name), str(out / name), [], say=quiet)
        config, _, state = setup(out / name, 1)
        loaded[name] = (config, state["params"])
    return loaded


def error(restored, name: str, **overrides) -> float:
    """Relative error against transformers' logits of the fixture's model built with `overrides` of its config."""
    config, params = restored[name]
    cfg = ModelConfig.from_config(dataclasses.replace(config, **{"attention": "dot_product", **overrides}))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    tokens = np.load(FIXTURES / name / "tokens.npy")
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    got = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, np.ones_like(tokens)))(params)
    return relative_error(np.asarray(got), np.load(FIXTURES / name / "logits.npy"))


def test_every_feature_on_gives_transformers_logits(restored):
    assert error(restored, "gemma2") < 1e-5 and error(restored, "gemma3") < 1e-5


@pytest.mark.parametrize("name,overrides", [
    ("gemma2", {"final_logits_soft_cap": 0.0}),
    ("gemma2", {"attn_logits_soft_cap": 0.0}),
    ("gemma2", {"query_pre_attn_scalar": 0.0}),  # head_dim^-1/2 (16) instead of 24^-1/2
    ("gemma2", {"attention_layer_pattern": "G"}),  # no local layers
    ("gemma3", {"local_rope_max_timescale": -1.0}),  # the local layers rotated like the global ones
], ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_a_key_off_changes_the_logits(restored, name, overrides):
    assert error(restored, name, **overrides) > 1e-2


def _options_without(**changes):
    family = families.get("gemma2")
    return dataclasses.replace(family, options=lambda config: dataclasses.replace(family.options(config), **changes))


def test_embedding_scale_and_final_norm_offset_are_needed(restored, monkeypatch):
    monkeypatch.setitem(families._FAMILIES, "gemma2", _options_without(embed_scale=False))
    assert error(restored, "gemma2") > 1e-2
    monkeypatch.setitem(families._FAMILIES, "gemma2", _options_without(norm_offset=0.0))  # final norm scales by w
    assert error(restored, "gemma2") > 1e-2


class _Identity(RMSNorm):
    def __call__(self, x):
        return x


@pytest.mark.parametrize("name,norm", [
    ("gemma2", lambda dim, cfg, rngs: RMSNorm(dim, cfg.norm_eps, cfg.weight_dtype, rngs)),  # scales by w, not 1 + w
    ("gemma3", lambda dim, cfg, rngs: (_Identity if dim == cfg.head_dim else RMSNorm)(
        dim, cfg.norm_eps, cfg.weight_dtype, rngs, offset=1.0)),  # no QK-norm (its weights still loaded)
], ids=["one_plus_w", "qk_norm"])
def test_layer_norms_are_needed(restored, monkeypatch, name, norm):
    monkeypatch.setattr(gemma_layers, "gemma_norm", norm)
    assert error(restored, name) > 1e-2


def _released_gemma3_1b() -> dict:
    """google/gemma-3-1b-pt's config.json as transformers 4.x wrote it (its entries that matter)."""
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
            "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "num_hidden_layers": 26, "vocab_size": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768}


def test_config_json_forms_of_transformers_4_and_5_read_alike():
    old = _released_gemma3_1b()
    keys = hf_layout.model_keys(old, "config.json")
    preset = load_config(["configs/base.yml", "model_name=gemma3-1b"])
    assert {k: getattr(preset, k) for k in keys} == keys  # the preset is the released model
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                                                     "sliding_window_pattern")}
    new.update(layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)],
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert hf_layout.model_keys(new, "config.json") == keys
    gemma2 = {**old, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "rope_theta": 10000.0}
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window_pattern"):
        gemma2.pop(key)  # transformers' Gemma 2 defaults: caps 30 and 50, local and global layers in turn
    keys2 = hf_layout.model_keys(gemma2, "config.json")
    assert (keys2["final_logits_soft_cap"], keys2["attn_logits_soft_cap"], keys2["attention_layer_pattern"],
            keys2["local_rope_max_timescale"]) == (30.0, 50.0, "LG", -1.0)


@pytest.mark.parametrize("change,expected", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "with its vision tower"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"layer_types": ["sliding_attention"] * 25 + ["chunked_attention"]}, "layer_types="),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding_attention is"),
])
def test_what_maxctx_cannot_run_is_refused_in_one_line(change, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        hf_layout.model_keys({**_released_gemma3_1b(), **change}, "config.json")
    assert "\n" not in str(caught.value)


def test_the_fixture_keeps_its_form_through_an_export():
    keys = hf_layout.model_keys(json.loads((FIXTURES / "gemma3" / "config.json").read_text()), "config.json")
    defaults = {key: getattr(Config(), key) for key in MODEL_KEYS}
    out = hf_layout.hf_config({**defaults, **keys, "decoder_block": "gemma3"}, "gemma3_text", "float32", {})
    assert hf_layout.model_keys(out, "config.json") == keys
    assert out["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    every_layer_local = {**defaults, **keys, "decoder_block": "gemma3", "attention_layer_pattern": ""}
    assert set(hf_layout.hf_config(every_layer_local, "gemma3_text", "float32", {})["layer_types"]) == \
        {"sliding_attention"}


@pytest.mark.parametrize("key", ["use_qk_norm", "attention_bias"])
def test_another_familys_attention_key_is_refused(key):
    with pytest.raises(ConfigError, match=f"{key}=true is not a Gemma setting"):
        load_config(["configs/base.yml", "model_name=gemma3-1b", f"{key}=true"])


def test_the_planner_plans_gemma3_layers_from_the_family():
    """The 5 : 1 pattern ending part-way (8 layers: LLLLLG LL), priced with the family's norms and shape."""
    config = load_config(["configs/base.yml", "decoder_block=gemma3", "sliding_window_size=16",
                          "attention_layer_pattern=LLLLLG", "base_num_decoder_layers=8", "cpu_devices=8",
                          "ici_context_parallelism=8", "context_parallel_strategy=auto", "max_target_length=1024"])
    llama = families.shape(dataclasses.replace(config, decoder_block="llama2"))
    assert families.shape(config).num_params - llama.num_params == 8 * (2 * 128 + 2 * 32)  # post-norms, QK-norms
    assert planner.plan(config).choice.valid
