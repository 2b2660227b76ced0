"""The Qwen (maxctx.model.qwen) and OLMo (maxctx.model.olmo) families: each feature is what makes the imported
fixture (tests/fixtures/hf/<name>) give transformers' logits, and without it they miss (so tests/test_family_matrix.py
would notice its loss); head chunking splits the biases with their heads and refuses the whole-projection norm;
both config.json forms import alike; the planner prices each family's own preset."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from maxctx.config import ConfigError
from maxctx.convert.from_hf import import_hf
from maxctx.loader import load_config
from maxctx.model.decoder import Decoder
from maxctx.model.layers import ModelConfig
from maxctx.model.llama import family as llama
from maxctx.model.olmo import hf_layout as olmo_hf, layers as olmo_layers
from maxctx.model.qwen import family as qwen, hf_layout as qwen_hf
from maxctx.model.shape import ModelShape
from maxctx.plan import planner, step_time
from tests.support.hf import FIXTURES, relative_error, setup

MODELS = ("qwen2", "qwen3", "olmo2", "olmo3")
quiet = lambda *args, **kwargs: None  # noqa: E731


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, tuple]:
    """Each fixture imported and loaded on 1 device: (its checkpoint's model.yml, the setup, the state)."""
    out = tmp_path_factory.mktemp("imported")
    result = {}
    for name in MODELS:
        import_hf(str(FIXTURES / name), str(out / name), [], say=quiet)
        result[name] = (out / name / "model.yml", *setup(out / name, 1)[1:])
    return result


def error(loaded, name: str, *overrides: str) -> float:
    """The fixture's logits on 1 device against transformers', relative to their range, from a model built with
    the key=value `overrides` (a feature dropped: its parameters left out) holding the fixture's parameters."""
    model_yml, made, state = loaded[name]
    config = load_config([str(model_yml), "dtype=float32", "max_target_length=128", *overrides])
    model = nnx.eval_shape(lambda: Decoder(ModelConfig.from_config(config), nnx.Rngs(0), made.mesh))
    graphdef, abstract = nnx.split(model)
    names = lambda path: tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))  # noqa: E731
    fixture = {names(path): x for path, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    params = jax.tree_util.tree_unflatten(treedef, [fixture[names(path)] for path, _ in paths])
    tokens = np.load(FIXTURES / name / "tokens.npy")
    positions, segments = np.arange(tokens.shape[1], dtype=np.int32)[None], np.ones_like(tokens)
    got = np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, segments))(params))
    return relative_error(got, np.load(FIXTURES / name / "logits.npy"))


@pytest.mark.parametrize("name,dropped", [
    ("qwen2", ["attention_bias=false"]),  # the q, k, v biases (random in the fixture)
    ("qwen3", ["use_qk_norm=false"]),  # the per-head QK-norm
    ("olmo2", ["use_qk_norm=false"]),  # the QK-norm over the whole projection
    ("olmo3", ["sliding_window_size=0", "attention_layer_pattern="]),  # layer 0's 32-token window
])
def test_each_feature_is_what_matches_transformers(loaded, name, dropped):
    assert error(loaded, name) < 1e-5
    assert error(loaded, name, *dropped) > 1e-2


def test_olmo3_local_layers_rotate_without_the_global_layers_yarn(loaded, monkeypatch):
    monkeypatch.setattr(olmo_layers, "local_rope", lambda rope: rope)  # YaRN in every layer, as MaxText's olmo3
    assert error(loaded, "olmo3") > 1e-3


def test_head_chunks_split_the_biases_and_refuse_the_whole_projection_norm(loaded):
    assert error(loaded, "qwen2", "attention_head_chunks=2") < 1e-5
    with pytest.raises(ConfigError, match="attention_head_chunks=2: decoder_block=olmo2's QK-norm spans every head"):
        load_config(["configs/base.yml", "model_name=olmo2-7b", "attention_head_chunks=2"])


def test_olmo3_config_json_in_transformers_4_form_imports_as_in_5():
    v5 = json.loads((FIXTURES / "olmo3" / "config.json").read_text())
    full = v5["rope_parameters"]["full_attention"]
    v4 = {**{k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")},
          "rope_theta": full["rope_theta"], "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}}
    keys = olmo_hf.model_keys(v5, "config.json")
    assert keys == olmo_hf.model_keys({**v4, "layer_types": v5["layer_types"]}, "config.json")
    assert (keys["sliding_window_size"], keys["attention_layer_pattern"], keys["rope_type"]) == (32, "LG", "yarn")
    # A checkpoint trained in maxctx (no source architecture) exports in the 4.x form, which imports back alike.
    assert olmo_hf.model_keys(olmo_hf.hf_config({**keys, "decoder_block": "olmo3"}, "llama", "float32", {}),
                              "config.json") == keys
    # Without layer_types, transformers' default: every fourth layer global.
    assert olmo_hf.model_keys({**v4, "num_hidden_layers": 8}, "c")["attention_layer_pattern"] == "LLLG"
    v5["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e4
    with pytest.raises(ConfigError, match="sliding_attention=.* is not plain RoPE of the full layers'"):
        olmo_hf.model_keys(v5, "config.json")


def test_qwen_refuses_what_it_cannot_run_or_export():
    hf = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    with pytest.raises(ConfigError, match="use_sliding_window=true"):
        qwen_hf.model_keys({**hf, "use_sliding_window": True}, "config.json")
    keys = {**qwen_hf.model_keys(hf, "config.json"), "decoder_block": "qwen2"}
    with pytest.raises(ConfigError, match="attention_bias=False use_qk_norm=False has no Hugging Face"):
        qwen_hf.hf_config({**keys, "attention_bias": False}, "qwen2", "float32", {})


@pytest.mark.parametrize("name", ["qwen3-32b", "olmo3-32b"])
def test_the_planner_prices_each_family_through_it(name):
    config = load_config(["configs/base.yml", "compile_topology=v5p-128", f"model_name={name}",
                          "max_target_length=131072", "ici_context_parallelism=16", "ici_fsdp_parallelism=4",
                          "per_device_batch_size=0.25", "attention=splash", "context_parallel_strategy=auto"])
    flops = step_time.per_token(config, 1)["flops"]
    dense = llama.tensors(ModelShape.from_config(config), 1, 1)
    heads, dim = config.base_num_query_heads, config.head_dim
    assert flops["query_proj"] == dense["query_proj"].flops + qwen.NORM_FLOPS * heads * dim  # its QK-norm
    plan = planner.plan(config)
    assert plan.choice.valid
