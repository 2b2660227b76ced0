"""RoPE settings of Hugging Face configs that transformers accepts, read as transformers reads them
(modeling_rope_utils), and written back so that transformers computes the same frequencies and scale.
The config dicts are built here; transformers itself is not imported."""

import math

import pytest

from maxctx.config import ConfigError
from maxctx.model.llama.hf_layout import hf_config, model_keys
from maxctx.model.rope import RopeSpec


def llama(rope_scaling: dict, max_position_embeddings: int = 131072) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings, "rope_scaling": rope_scaling}


def spec(keys: dict) -> RopeSpec:
    return RopeSpec(kind=keys["rope_type"], factor=keys.get("rope_factor", 1.0),
                    attention_factor=keys.get("rope_attention_factor", 0.0))


def round_trip(keys: dict) -> dict:
    return model_keys(hf_config(keys, "llama", "float32", {}), "exported")


def test_llama3_scaling_without_original_max_position_embeddings_falls_back_to_max_position_embeddings():
    hf = llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 8192)
    keys = model_keys(hf, "config.json")
    assert keys["original_max_position_embeddings"] == 8192 and keys["rope_factor"] == 8.0
    exported = hf_config(keys, "llama", "float32", {"max_position_embeddings": 8192})
    assert exported["rope_scaling"]["original_max_position_embeddings"] == 8192
    assert exported["max_position_embeddings"] == 8192
    assert round_trip(keys) == keys


def test_llama3_scaling_without_any_context_length_is_refused_in_one_line():
    hf = llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    del hf["max_position_embeddings"]
    with pytest.raises(ConfigError, match=r"^config.json: rope_scaling type 'llama3' needs "
                                          r"original_max_position_embeddings .* or max_position_embeddings"):
        model_keys(hf, "config.json")


@pytest.mark.parametrize("mscale,mscale_all_dim,expected", [
    (1.0, 1.0, 1.0),  # DeepSeek-V3's setting: transformers scales by exactly 1
    (0.707, 0.707, 1.0),  # DeepSeek-V2's
    (2.0, 1.0, (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1)),
    (1.0, None, 0.1 * math.log(4.0) + 1),  # mscale_all_dim absent: the default
    (None, None, 0.1 * math.log(4.0) + 1),
])
def test_yarn_mscale_and_mscale_all_dim_set_the_attention_factor_as_transformers_does(mscale, mscale_all_dim,
                                                                                      expected):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, **({"mscale": mscale} if mscale else {}),
               **({"mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}
    keys = model_keys(llama(scaling, 16384), "config.json")
    assert spec(keys).attention_scaling == pytest.approx(expected, rel=1e-12)
    back = round_trip(keys)  # exported as attention_factor, which transformers takes as it is
    assert spec(back).attention_scaling == pytest.approx(expected, rel=1e-12)


def test_yarn_explicit_attention_factor_wins_over_mscale():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 0.8,
               "mscale": 1.0, "mscale_all_dim": 1.0}
    assert spec(model_keys(llama(scaling, 16384), "config.json")).attention_scaling == 0.8
