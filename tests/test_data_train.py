"""`python train.py` trains on every data source (ArrayRecord text and token ids, TFDS, jsonl) with eval, on 4
simulated CPU devices with context parallelism; a bad data path exits 2 with one line and leaves the run
directory as it was. All runs share one model shape and a persistent compilation cache, so the step compiles
once."""

import os

import pytest

from maxctx.data.prepare import prepare_shards
from tests.support import fixtures as F
from tests.support.processes import cpu_env, metrics, run, train_command

COMMON = ["steps=3", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=4",
          "ici_context_parallelism=2", "enable_checkpointing=false", "enable_tensorboard=false",
          "peak_tflops_per_device=1", "eval_interval=3", "eval_steps=1", "base_num_decoder_layers=1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    docs = F.make_documents(160, seed=3)
    tok = F.tiny_tokenizer(str(root / "sp.model"), docs)
    F.write_arrayrecord(str(root / "text-train.array_record"), [d.encode() for d in docs[:120]])
    F.write_arrayrecord(str(root / "text-eval.array_record"), [d.encode() for d in docs[120:]])
    F.write_jsonl(str(root / "train.jsonl"), docs[:120])
    F.write_jsonl(str(root / "eval.jsonl"), docs[120:])
    prepare_shards(str(root / "train.jsonl"), tok, str(root / "tok-train"), 2, progress=False)
    prepare_shards(str(root / "eval.jsonl"), tok, str(root / "tok-eval"), 1, progress=False)
    F.build_tfds(str(root / "tfds"), {"train": docs[:120], "validation": docs[120:]})
    return root, tok, cpu_env(compile_cache=tmp_path_factory.mktemp("jax_cache"))


def sources(root, tok):
    return {
        "arrayrecord_text": ["dataset_type=arrayrecord", f"grain_train_files={root}/text-train.array_record",
                             f"grain_eval_files={root}/text-eval.array_record", f"tokenizer_path={tok}"],
        "arrayrecord_tokens": ["dataset_type=arrayrecord", f"grain_train_files={root}/tok-train-*",
                               f"grain_eval_files={root}/tok-eval-*", "packing=concat"],
        "tfds": ["dataset_type=tfds", f"dataset_name={F.TFDS_NAME}", f"tfds_data_dir={root}/tfds",
                 "eval_split=validation", f"tokenizer_path={tok}"],
        "text": ["dataset_type=text", f"grain_train_files={root}/train.jsonl",
                 f"grain_eval_files={root}/eval.jsonl", f"tokenizer_path={tok}", "packing=none"],
    }


def train(env, out, run_name, *overrides):
    return run(train_command(*COMMON, f"base_output_directory={out}", f"run_name={run_name}", *overrides), env=env)


@pytest.mark.parametrize("source", ["arrayrecord_text", "arrayrecord_tokens", "tfds", "text"])
def test_train_py_trains_on_each_source(setup, tmp_path, source):
    root, tok, env = setup
    # The passkey grid too: haystacks of this source's eval documents, the key in its tokenizer's tokens (or, for
    # token ids, the token-id format), under CP (C = 2, zig-zag order).
    proc = train(env, tmp_path, source, *sources(root, tok)[source], "passkey_lengths=64,128", "passkey_depths=0,1",
                 "passkey_examples=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = metrics(tmp_path / source)
    train_losses = [r["loss"] for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    assert len(train_losses) == 3 and all(0 < loss < 7 for loss in train_losses)
    assert len(evals) == 1 and evals[0]["perplexity"] > 1 and evals[0]["tokens"] > 0
    assert list(evals[0]["loss_by_position"]) == ["1-2", "2-4", "4-8", "8-16", "16-32", "32-64"]
    assert sorted(evals[0]["passkey_accuracy"]) == ["128/0", "128/1", "64/0", "64/1"]
    assert "eval at step 3" in proc.stdout and "passkey at step 3" in proc.stdout


@pytest.mark.parametrize("bad,match", [
    ("grain_train_files={root}/missing-*", "grain_train_files='.*missing-\\*'.* matches no files"),
    ("tokenizer_path={root}/nope.model", "tokenizer_path='.*nope.model' does not exist"),
])
def test_bad_data_input_exits_2_and_leaves_the_run_directory_alone(setup, tmp_path, bad, match):
    import re

    root, tok, env = setup
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yml").write_text("earlier: run\n")
    (run_dir / "checkpoints" / "keep").write_text("x")
    proc = train(env, tmp_path, "run", *sources(root, tok)["arrayrecord_text"], bad.format(root=root))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(match, lines[0]), proc.stderr
    assert (run_dir / "config.yml").read_text() == "earlier: run\n"
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yml"]
    assert os.listdir(run_dir / "checkpoints") == ["keep"]
