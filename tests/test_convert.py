"""Hugging Face conversion (maxctx.convert): imported models give transformers' logits (fixtures made by
scripts/make_hf_fixtures.py) under every CP strategy, HF -> maxctx -> HF is bit-identical, training continues from
the imported loss, and bad inputs exit 2 with one line naming the file and the fix."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from maxctx.checkpoint.manager import Checkpointer
from maxctx.convert import safetensors
from maxctx.convert.cli import main as convert_main
from maxctx.convert.from_hf import import_hf
from maxctx.convert.to_hf import export_hf
from maxctx.errors import ConfigError
from maxctx.mesh import batch_sharding
from maxctx.train_step import jit_train_step
from tests.support.hf import (
    import_fixtures,
    logits as _logits,
    relative_error as _relative_error,
    setup as _setup,
    tensors as _tensors,
)
from tests.support.processes import python
from tests.support.strategies import config_args, names as strategy_names

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ("llama", "llama3_1", "mistral")
quiet = lambda *args, **kwargs: None  # noqa: E731


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_imported_logits_match_transformers(imported, name):
    expected = np.load(FIXTURES / name / "logits.npy")
    got = _logits(imported[name], np.load(FIXTURES / name / "tokens.npy"))
    assert _relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("name", MODELS)
def test_imported_logits_match_transformers_under_cp(imported, name, strategy):
    expected = np.load(FIXTURES / name / "logits.npy")
    got = _logits(imported[name], np.load(FIXTURES / name / "tokens.npy"), 4, *config_args(strategy, 4))
    assert _relative_error(got, expected) < 1e-5


def test_llama3_scaling_is_what_makes_llama3_1_match(imported):
    """The negative control: the same weights with plain RoPE miss transformers' logits past the original
    context (positions 64..127), so the test above checks the scaling."""
    expected = np.load(FIXTURES / "llama3_1" / "logits.npy")
    got = _logits(imported["llama3_1"], np.load(FIXTURES / "llama3_1" / "tokens.npy"), 1, "rope_type=default")
    assert _relative_error(got, expected) > 1e-2


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> Path:
    """The Mistral fixture with config.json's sliding_window=32 (Mistral v0.1's kind of model), imported."""
    out = tmp_path_factory.mktemp("windowed")
    shutil.copytree(FIXTURES / "mistral", out / "hf")
    config = json.loads((out / "hf" / "config.json").read_text())
    (out / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    import_hf(str(out / "hf"), str(out / "ckpt"), [], say=quiet)
    return out


@pytest.mark.parametrize("cp,strategy", [(1, "all_gather")] + [(4, s) for s in strategy_names()])
def test_mistral_sliding_window_imports_as_local_layers(windowed, cp, strategy):
    expected = np.load(FIXTURES / "mistral" / "logits_sliding_window_32.npy")
    got = _logits(windowed / "ckpt", np.load(FIXTURES / "mistral" / "tokens.npy"), cp, *config_args(strategy, cp))
    assert _relative_error(got, expected) < 1e-5
    model = (windowed / "ckpt" / "model.yml").read_text()
    assert "sliding_window_size: 32" in model and "attention_layer_pattern: L" in model


def test_mistral_sliding_window_exports(windowed, tmp_path):
    export_hf(str(windowed / "ckpt"), str(tmp_path), "fp32", say=quiet)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == 32
    with pytest.raises(ConfigError, match="no Hugging Face LlamaForCausalLM equivalent"):
        export_hf(str(windowed / "ckpt"), str(tmp_path / "llama"), "fp32", architecture="llama", say=quiet)
    assert not (tmp_path / "llama").exists()


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_identical(imported, tmp_path, name):
    export_hf(str(imported[name]), str(tmp_path), "fp32", max_shard_bytes=40_000, say=quiet)
    before, after = _tensors(FIXTURES / name), _tensors(tmp_path)
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # sharded, read back through the index
    config = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "tie_word_embeddings", "eos_token_id"):
        assert config[key] == source[key], key
    assert config["architectures"] == source["architectures"]


def test_export_with_hf_base_keeps_its_entries_and_tokenizer_files(imported, tmp_path, capsys):
    assert convert_main(["to_hf", "--checkpoint_path", str(imported["mistral"]), "--output_path", str(tmp_path),
                         "--hf_base", str(FIXTURES / "mistral")]) == 0
    assert "generation_config.json" in capsys.readouterr().out
    config, source = (json.loads((d / "config.json").read_text()) for d in (tmp_path, FIXTURES / "mistral"))
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] is None
    assert (config["bos_token_id"], config["max_position_embeddings"]) == (source["bos_token_id"], 128)
    assert (tmp_path / "generation_config.json").read_bytes() == (FIXTURES / "mistral" /
                                                                   "generation_config.json").read_bytes()
    assert all(v.dtype == ml_dtypes.bfloat16 for v in _tensors(tmp_path).values())


def _write_model(directory: Path, tensors: dict[str, np.ndarray], config: dict, shards: int = 1) -> Path:
    """An HF directory written with numpy: config.json, `shards` safetensors files and their index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        safetensors.write(str(directory / file), [(n, tensors[n].dtype, tensors[n].shape) for n in part],
                          (tensors[n] for n in part))
        weight_map.update({n: file for n in part})
    (directory / safetensors.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _random_bf16_llama(directory: Path) -> tuple[Path, dict[str, np.ndarray]]:
    config = json.loads((FIXTURES / "llama3_1" / "config.json").read_text())
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(v.shape).astype(ml_dtypes.bfloat16)
               for n, v in _tensors(FIXTURES / "llama3_1").items()}
    return _write_model(directory, tensors, config, shards=3), tensors


def test_bf16_round_trip_through_fp32_weights_is_bit_identical(tmp_path):
    source, tensors = _random_bf16_llama(tmp_path / "hf")
    import_hf(str(source), str(tmp_path / "ckpt"), [], say=quiet)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), "bf16", say=quiet)
    after = _tensors(tmp_path / "out")
    assert sorted(after) == sorted(tensors)
    for key, value in tensors.items():
        assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key


class _NoData:
    def get_state(self) -> dict:
        return {}


def test_training_continues_from_the_imported_loss_and_exports(imported, tmp_path):
    """The first step's loss (before its update) on the fixture's tokens is transformers' loss of the imported
    model, far below ln(V), the loss of a fresh model; the trained checkpoint exports to HF tensors that are its
    parameters (the model keys read from the training checkpoint's own record)."""
    tokens = np.load(FIXTURES / "llama" / "tokens.npy")
    logits = np.load(FIXTURES / "llama" / "logits.npy").astype(np.float64)[0, :-1]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    expected = float(np.mean(log_z - logits[np.arange(len(logits)), tokens[0, 1:]]))
    config, setup, state = _setup(imported["llama"], 1, "max_target_length=127", "steps=2",
                                  "enable_checkpointing=true", f"base_output_directory={tmp_path}")
    seq = tokens.shape[1] - 1
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.arange(seq, dtype=np.int32)[None],
             "segment_ids": np.ones((1, seq), np.int32), "weights": np.ones((1, seq), np.float32)}
    batch = {k: jax.device_put(v, batch_sharding(setup.mesh)) for k, v in batch.items()}
    step = jit_train_step(setup)
    state, first = step(state, batch)
    state, second = step(state, batch)  # donates the state the first step returned
    assert abs(float(first["loss"]) - expected) < 1e-4 * expected
    assert abs(expected - math.log(64)) > 0.5 and float(second["loss"]) < float(first["loss"])

    checkpointer = Checkpointer(config, setup)
    checkpointer.save(2, state, _NoData())
    checkpointer.close()
    export_hf(config.checkpoint_dir, str(tmp_path / "hf"), "fp32", say=quiet)
    exported, params = _tensors(tmp_path / "hf"), jax.device_get(state["params"])
    assert np.array_equal(exported["model.layers.1.self_attn.q_proj.weight"],
                          params["layers"]["attn"]["wq"][1].reshape(32, 64).T)
    assert np.array_equal(exported["lm_head.weight"], params["unembed"].T)
    assert not np.array_equal(exported["lm_head.weight"], _tensors(FIXTURES / "llama")["lm_head.weight"])


# ---- bad inputs: exit 2, one line naming the file and the fix ----------------------------------------------------

def _one_line(capsys, argv: list[str]) -> str:
    assert convert_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _broken(tmp_path: Path, edit) -> Path:
    directory = tmp_path / "broken"
    shutil.copytree(FIXTURES / "llama", directory)
    edit(directory)
    return directory


def _from_hf(directory: Path, tmp_path: Path, *keys: str) -> list[str]:
    return ["from_hf", "--hf_path", str(directory), "--output_path", str(tmp_path / "out"), *keys]


def test_missing_tensor(tmp_path, capsys):
    def drop(d):
        tensors = _tensors(d)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        (d / "model.safetensors").unlink()
        _write_model(d, tensors, json.loads((d / "config.json").read_text()))

    directory = _broken(tmp_path, drop)
    line = _one_line(capsys, _from_hf(directory, tmp_path))
    assert line.startswith(f"convert error: {directory}: tensor 'model.layers.1.mlp.up_proj.weight' is missing")
    assert "download it again" in line
    index = json.loads((directory / safetensors.INDEX).read_text())  # the index still lists it: the file is named
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-00001-of-00001.safetensors"
    (directory / safetensors.INDEX).write_text(json.dumps(index))
    line = _one_line(capsys, _from_hf(directory, tmp_path))
    assert f"{directory / 'model-00001-of-00001.safetensors'}: tensor 'model.layers.1.mlp.up_proj.weight'" in line
    assert "the file is damaged: download it again" in line


def test_unknown_architecture(tmp_path, capsys):
    def gpt2(d):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))

    line = _one_line(capsys, _from_hf(_broken(tmp_path, gpt2), tmp_path))
    assert "config.json" in line and "GPT2LMHeadModel" in line and "LlamaForCausalLM" in line
    for other in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Olmo3ForCausalLM", "MixtralForCausalLM"):
        assert other in line, line  # every family's architectures, not Llama's alone


def test_dtype_the_model_cannot_take(tmp_path, capsys):
    def quantize(d):
        tensors = _tensors(d)
        tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((64, 32), np.int8)
        (d / "model.safetensors").unlink()
        _write_model(d, tensors, json.loads((d / "config.json").read_text()))

    line = _one_line(capsys, _from_hf(_broken(tmp_path, quantize), tmp_path))
    assert "model-00001-of-00001.safetensors" in line and "is I8" in line and "bf16 or fp32" in line
    line = _one_line(capsys, _from_hf(FIXTURES / "llama", tmp_path, "weight_dtype=bfloat16"))
    assert "is F32" in line and "weight_dtype=float32" in line


def test_truncated_safetensors_file(tmp_path):
    def truncate(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[:-1000])

    directory = _broken(tmp_path, truncate)
    proc = python("-m", "maxctx.convert", *_from_hf(directory, tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{directory / 'model.safetensors'} is truncated" in lines[0] and "download it again" in lines[0]
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_names_the_tensor_both_shapes_and_the_key(capsys, tmp_path):
    line = _one_line(capsys, _from_hf(FIXTURES / "llama", tmp_path, "model_name=tiny"))
    assert "'model.embed_tokens.weight' has shape [64, 32] but this config gives [256, 128]" in line
    assert "set vocab_size=64 base_emb_dim=32" in line


LLAMA3_WITHOUT_FACTOR = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}
LLAMA3 = {**LLAMA3_WITHOUT_FACTOR, "factor": 8.0}
# config.json as the fixture's, edited; the field the one line must name.
MALFORMED_CONFIGS = {
    "llama3 without factor": (lambda c: {**c, "rope_scaling": LLAMA3_WITHOUT_FACTOR}, "factor"),
    "linear without factor": (lambda c: {**c, "rope_scaling": {"rope_type": "linear"}}, "factor"),
    "yarn without factor": (lambda c: {**c, "rope_scaling": {"rope_type": "yarn"}}, "factor"),
    "negative factor": (lambda c: {**c, "rope_scaling": {**LLAMA3, "factor": -2.0}}, "factor"),
    "zero factor": (lambda c: {**c, "rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
    "NaN factor": (lambda c: {**c, "rope_scaling": {"rope_type": "yarn", "factor": math.nan}}, "factor"),
    "no num_attention_heads": (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"},
                               "num_attention_heads"),
    "no hidden_size": (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "hidden_size"),
    "a list": (lambda c: [c], "a JSON object"),
    "rope_scaling a string": (lambda c: {**c, "rope_scaling": "abc"}, "rope_scaling"),
    "rms_norm_eps a string": (lambda c: {**c, "rms_norm_eps": "abc"}, "rms_norm_eps"),
}


@pytest.mark.parametrize("case", MALFORMED_CONFIGS)
def test_malformed_config_json(tmp_path, capsys, case):
    edit, field = MALFORMED_CONFIGS[case]

    def rewrite(d):
        (d / "config.json").write_text(json.dumps(edit(json.loads((d / "config.json").read_text()))))

    directory = _broken(tmp_path, rewrite)
    line = _one_line(capsys, _from_hf(directory, tmp_path))
    assert line.startswith(f"convert error: {directory / 'config.json'}") and field in line, line
    assert not (tmp_path / "out").exists()


def test_safetensors_header_that_is_not_an_object(tmp_path, capsys):
    def listed(d):
        (d / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"[]      ")

    directory = _broken(tmp_path, listed)
    line = _one_line(capsys, _from_hf(directory, tmp_path))
    assert f"{directory / 'model.safetensors'}" in line and "header" in line and "download it again" in line


@pytest.mark.parametrize("command", ["from_hf", "to_hf"])
@pytest.mark.parametrize("under", ["", "out"])
def test_output_path_at_or_under_a_regular_file(imported, tmp_path, capsys, command, under):
    (tmp_path / "file").write_text("")
    output = str(tmp_path / "file" / under)
    argv = (["from_hf", "--hf_path", str(FIXTURES / "llama")] if command == "from_hf" else
            ["to_hf", "--checkpoint_path", str(imported["llama"])])
    line = _one_line(capsys, [*argv, "--output_path", output])
    assert f"--output_path {output}" in line and f"{tmp_path / 'file'} is a file" in line


@pytest.mark.parametrize("size", ["nan", "inf", "0", "-1"])
def test_shard_size_that_is_not_a_positive_number(imported, tmp_path, capsys, size):
    line = _one_line(capsys, ["to_hf", "--checkpoint_path", str(imported["llama"]), "--output_path",
                              str(tmp_path / "out"), "--max_shard_gb", size])
    assert f"--max_shard_gb {size}" in line and "positive" in line
    assert not (tmp_path / "out").exists()


def test_relative_paths_are_taken_from_the_working_directory(imported, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = os.path.relpath(imported["llama"], tmp_path)
    assert not os.path.isabs(checkpoint)
    assert convert_main(["to_hf", "--checkpoint_path", checkpoint, "--output_path", "out"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("factor", ["-2", "0"])
def test_export_refuses_a_rope_factor_that_is_not_positive(imported, tmp_path, capsys, factor):
    line = _one_line(capsys, ["to_hf", "--checkpoint_path", str(imported["llama3_1"]), "--output_path",
                              str(tmp_path / "out"), f"rope_factor={factor}"])
    assert f"rope_factor={float(factor)} must be > 0" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", ["../outside.safetensors", "absolute"])
def test_index_entry_outside_the_model_directory(tmp_path, capsys, entry):
    outside = tmp_path / "outside.safetensors"
    entry = str(outside) if entry == "absolute" else entry

    def point_outside(d):
        (d / "model.safetensors").rename(outside)
        names = safetensors.read_header(str(outside))
        (d / safetensors.INDEX).write_text(json.dumps({"weight_map": {n: entry for n in names}}))

    directory = _broken(tmp_path, point_outside)
    line = _one_line(capsys, _from_hf(directory, tmp_path))
    assert f"{directory / safetensors.INDEX}" in line and f"'{entry}'" in line
    assert not (tmp_path / "out").exists()


def _transformers_weights(directory: Path) -> list[Path]:
    """The weight files transformers loads from a folder, in its order (modeling_utils): model.safetensors, else
    the safetensors index's files, else pytorch_model.bin, else the PyTorch index's files."""
    for single, index in (("model.safetensors", safetensors.INDEX), ("pytorch_model.bin",
                                                                      "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            files = json.loads((directory / index).read_text())["weight_map"].values()
            return [directory / f for f in sorted(set(files))]
    return []


def _weight_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(("model", "pytorch_model")))


def test_export_replaces_the_weights_its_output_folder_held(imported, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(FIXTURES / "mistral" / "model.safetensors", out / "model.safetensors")  # an earlier export
    (out / "pytorch_model.bin").write_bytes(b"older still")
    (out / "README.md").write_text("the user's")
    assert convert_main(["to_hf", "--checkpoint_path", str(imported["llama"]), "--output_path", str(out),
                         "--dtype", "fp32", "--max_shard_gb", "4e-5"]) == 0
    removed = [line for line in capsys.readouterr().out.splitlines() if "removed" in line]
    assert len(removed) == 1 and "model.safetensors" in removed[0] and "pytorch_model.bin" in removed[0]
    loaded = _transformers_weights(out)
    assert len(loaded) > 1 and _weight_files(out) == sorted([safetensors.INDEX, *(p.name for p in loaded)])
    tensors = {}
    for path in loaded:
        tensors.update({n: safetensors.read(i) for n, i in safetensors.read_header(str(path)).items()})
    expected = _tensors(FIXTURES / "llama")
    assert sorted(tensors) == sorted(expected)
    assert all(tensors[n].tobytes() == v.tobytes() for n, v in expected.items())
    assert (out / "README.md").read_text() == "the user's" and sorted(os.listdir(tmp_path)) == ["out"]


def test_an_interrupted_export_leaves_the_earlier_one(imported, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_hf(str(imported["llama"]), str(out), "fp32", max_shard_bytes=40_000, say=quiet)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write, calls = safetensors.write, []

    def disk_full_at_the_second_file(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(*args, **kwargs)

    monkeypatch.setattr(safetensors, "write", disk_full_at_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        export_hf(str(imported["mistral"]), str(out), "fp32", max_shard_bytes=40_000, say=quiet)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("inside", ["", "export"])
def test_export_into_hf_base_is_refused(imported, tmp_path, capsys, inside):
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "mistral", base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    line = _one_line(capsys, ["to_hf", "--checkpoint_path", str(imported["mistral"]), "--output_path",
                              str(base / inside), "--hf_base", str(base)])
    assert "--hf_base" in line and "--output_path" in line
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
