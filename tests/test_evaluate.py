"""Eval with MaxText's meanings, on 8 simulated devices and a jsonl eval split with one document per row
(packing=none), so the sequences and tokens an eval scores can be counted from the documents:
eval_per_device_batch_size sets the rows of an eval batch, and eval_steps=-1 scores the whole split once, also
when two processes' parts of it end at different batches."""

import json
import subprocess
import sys

import numpy as np
import pytest

from maxctx.data.sources import encode_tokens
from maxctx.data.tokenizer import Tokenizer
from maxctx.evaluate.loop import Evaluator
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.train_step import init_state, make_setup
from tests.support import fixtures as F
from tests.support.processes import ROOT, cpu_env, free_port

SEQ, EVAL_DOCS = 32, 44  # 44 documents: not a whole number of 8- or 24-row batches


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    docs = F.make_documents(EVAL_DOCS + 16, seed=5)
    tok = F.tiny_tokenizer(str(root / "sp.model"), docs)
    F.write_jsonl(str(root / "train.jsonl"), docs[:16])
    F.write_jsonl(str(root / "eval.jsonl"), docs[16:])
    sp = Tokenizer(tok, 256)
    # Each document is one row: BOS + tokens + EOS gives len + 1 (input, target) pairs, trimmed to the row.
    tokens = [min(len(sp.encode(d)) + 1, SEQ) for d in docs[16:]]
    args = ["dataset_type=text", f"grain_train_files={root}/train.jsonl", f"grain_eval_files={root}/eval.jsonl",
            f"tokenizer_path={tok}", "packing=none", "per_device_batch_size=1", f"max_target_length={SEQ}",
            "dtype=float32", "base_num_decoder_layers=1", "eval_interval=5", "grain_prefetch_buffer_size=2"]
    config = load_config(args)
    setup = make_setup(config, create_mesh(config))
    return {"args": args, "setup": setup, "params": init_state(setup)["params"], "tokens": tokens}


def scores(data, *overrides):
    evaluator = Evaluator(load_config([*data["args"], *overrides]), data["setup"])
    try:
        return evaluator.scores(data["params"]), evaluator.scores(data["params"])
    finally:
        evaluator.data.close()


def test_eval_per_device_batch_size_sets_the_sequences_scored(data):
    (default, _), (two, _) = scores(data, "eval_steps=1"), scores(data, "eval_steps=1", "eval_per_device_batch_size=2")
    assert (default["sequences"], default["batches"]) == (8, 1)  # per_device_batch_size x 8 devices
    assert (two["sequences"], two["batches"]) == (16, 1)
    assert two["tokens"] == sum(data["tokens"][:16])
    (same, _) = scores(data, "eval_steps=2")  # the same 16 documents, in two batches of 8
    assert same["tokens"] == two["tokens"]
    np.testing.assert_allclose(same["loss"], two["loss"], rtol=1e-5)


@pytest.mark.parametrize("per_device", [1, 3])
def test_eval_steps_minus_one_scores_the_whole_split_every_eval(data, per_device):
    first, second = scores(data, "eval_steps=-1", f"eval_per_device_batch_size={per_device}")
    rows = 8 * per_device
    assert first["batches"] == -(-EVAL_DOCS // rows)  # the last batch padded
    assert first["sequences"] == EVAL_DOCS and first["tokens"] == sum(data["tokens"])
    assert second == first  # rewound after the split ended: the next eval scores it again
    whole = scores(data, "eval_steps=-1")[0]  # padding rows weigh nothing: any batch size, the same loss
    np.testing.assert_allclose(first["loss"], whole["loss"], rtol=1e-5)


class _DataState:
    def get_state(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def checkpoints(data, tmp_path_factory):
    """<root>/{good,nan}/checkpoints/1: the fixture's initial parameters, and the same made NaN, saved as training
    saves them (no training)."""
    import jax

    from maxctx.checkpoint.manager import Checkpointer

    root = tmp_path_factory.mktemp("checkpoints")
    state = init_state(data["setup"])
    for name, params in (("good", state["params"]), ("nan", jax.tree.map(lambda p: p * np.nan, state["params"]))):
        config = load_config([*data["args"], f"base_output_directory={root}", f"run_name={name}", "steps=1"])
        checkpointer = Checkpointer(config, data["setup"])
        checkpointer.save(1, {**state, "params": params}, _DataState())
        checkpointer.close()
    return root


def evaluate(data, *overrides: str) -> int:
    from maxctx.evaluate.cli import main

    args = [arg for arg in data["args"] if not arg.startswith("eval_interval=")]  # the command sets it
    return main([*args, "eval_steps=1", "base_output_directory=evals", "enable_tensorboard=false", *overrides])


def test_evaluate_a_relative_checkpoint_path(data, checkpoints, monkeypatch, capsys):
    """Orbax refused a relative path with a traceback; it is resolved against the working directory at load."""
    monkeypatch.chdir(checkpoints)
    assert evaluate(data, "load_parameters_path=good/checkpoints", "run_name=relative") == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["checkpoint"] == str(checkpoints / "good/checkpoints/1") and np.isfinite(record["loss"])
    assert (checkpoints / "evals/relative/metrics.jsonl").is_file()


def test_evaluate_refuses_a_live_runs_directory(data, checkpoints, monkeypatch, capsys):
    """It appended to a training run's metrics while that run wrote them; now it takes the run's lock."""
    from maxctx.checkpoint.run_dir import LOCK, RunLock

    monkeypatch.chdir(checkpoints)
    lock = RunLock(str(checkpoints / "evals/live"))
    lock.acquire()
    try:
        assert evaluate(data, "load_parameters_path=good/checkpoints", "run_name=live") == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "evals/live is in use by another run" in err, err
    assert not (checkpoints / "evals/live").exists() and not (checkpoints / f"evals/live/{LOCK}").exists()


def test_evaluate_exits_3_on_a_nan_loss(data, checkpoints, monkeypatch, capsys):
    """It exited 0 and recorded loss NaN."""
    monkeypatch.chdir(checkpoints)
    assert evaluate(data, "load_parameters_path=nan/checkpoints", "run_name=nan_eval") == 3
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: eval loss nan on checkpoint"), err
    assert not (checkpoints / "evals/nan_eval/metrics.jsonl").exists()


WORKER = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from maxctx import runtime
from maxctx.loader import load_config

pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
config = load_config([f"jax_coordinator_address=127.0.0.1:{port}", "jax_num_processes=2", f"jax_process_id={pid}",
                      "cpu_devices=4", "dataset_type=arrayrecord", f"grain_train_files={path}",
                      f"grain_eval_files={path}", "eval_interval=5", "eval_steps=-1", "packing=none",
                      "max_target_length=32", "per_device_batch_size=1", "ici_fsdp_parallelism=8"])
runtime.initialize(config)
from maxctx.data.pipeline import create_data_iterator
from maxctx.mesh import create_mesh

mesh = create_mesh(config)
rows = jax.jit(lambda w: jnp.sum(jnp.any(w > 0, axis=1)), out_shardings=NamedSharding(mesh, P()))
it = create_data_iterator(config, mesh, "eval")
start = it.get_state()
first = [int(rows(batch["weights"])) for batch in it]
it.set_state(start)
print(json.dumps([first, [int(rows(batch["weights"])) for batch in it]]))
"""


def test_whole_split_eval_stops_on_every_process_together(tmp_path):
    """9 documents over two processes of 4 rows each: process 0 reads 5 (two batches), process 1 reads 4 (one);
    process 1 pads the second batch instead of stopping early, which would leave process 0 waiting."""
    path = F.write_arrayrecord(str(tmp_path / "eval.array_record"),
                               [encode_tokens([10 + i, 20, 30, 40]) for i in range(9)])
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(pid), str(port), path], cwd=ROOT,
                              env=cpu_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for pid in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    for log in logs:  # rows holding a document, per global batch; the same again after rewinding
        assert json.loads(log.strip().splitlines()[-1]) == [[8, 1], [8, 1]]
