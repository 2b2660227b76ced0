"""Whole runs of train.py: outputs, the loss falls, and sharded meshes train exactly like one device."""

import numpy as np
import pytest

from tests.support.processes import metrics, run, train_command

STEPS = 20


def run_train(tmp_path, run_name, *overrides, timeout=600):
    """Runs train.py in a subprocess (its own device count) and returns (records of metrics.jsonl, stdout)."""
    result = run(train_command(f"base_output_directory={tmp_path}", f"run_name={run_name}", *overrides),
                 timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(tmp_path / run_name), result.stdout


def losses(records):
    return np.array([r["loss"] for r in records if r.get("event") == "train"])


EXACT = ("dtype=float32", "attention=dot_product", f"steps={STEPS}", "log_period=1", "max_target_length=64",
         "enable_checkpointing=false", "enable_tensorboard=false")


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("single"), "one", "cpu_devices=1", "per_device_batch_size=8", *EXACT)


def test_outputs_and_falling_loss(single_device, tmp_path_factory):
    records, stdout = single_device
    assert records[0]["event"] == "compile"
    assert records[0]["temp_size_in_bytes"] > 0 and records[0]["analytic_flops_per_device"] > 0
    train = [r for r in records if r.get("event") == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "mfu"):
        assert all(key in r for r in train), key
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert f"step {STEPS}/{STEPS}" in stdout and "done:" in stdout


@pytest.mark.parametrize("mesh", [("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
                                  ("ici_data_parallelism=8", "ici_fsdp_parallelism=1")],
                         ids=["fsdp4_tensor2", "data8"])
def test_sharded_run_matches_one_device(single_device, tmp_path, mesh):
    records, _ = run_train(tmp_path, "sharded", "cpu_devices=8", "per_device_batch_size=1", *mesh, *EXACT)
    np.testing.assert_allclose(losses(records), losses(single_device[0]), rtol=1e-5)


def test_relative_output_directory_checkpoints_and_writes_the_resolved_config(tmp_path):
    """The Quickstart's default: base_output_directory=outputs, relative to where train.py runs."""
    import yaml

    result = run(train_command("cpu_devices=1", "steps=3", "checkpoint_period=2", "log_period=1"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "default_run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "3"]
    saved = yaml.safe_load(open(run_dir / "config.yml"))
    assert saved["steps"] == 3 and saved["base_emb_dim"] == 128
    assert saved["base_output_directory"] == str(tmp_path / "outputs")


@pytest.mark.parametrize("message,expected", [
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 99.5G of "
     "95.74G hbm.\nLargest program allocations in hbm:\n  1. Size: 12.0G", "python -m maxctx.compile configs/base.yml "
     "steps=3 compile_topology="),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. Used 1.00M of "
     "1.00M smem.", "overflowed on-chip SMEM: raise flash_block_q"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. Used 130M of "
     "128M vmem.", "needs 130.00 MiB of VMEM, more than the chip's 128.00 MiB: lower flash_block_q"),
])
def test_out_of_memory_exits_4_with_what_to_change(monkeypatch, capsys, message, expected):
    import jax

    from maxctx import runtime, train

    def out_of_memory(config, plan=None):
        raise jax.errors.JaxRuntimeError(message)

    monkeypatch.setattr(runtime, "initialize", lambda config: None)
    monkeypatch.setattr(train, "train", out_of_memory)
    assert train.main(["configs/base.yml", "steps=3"]) == train.EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert err.startswith(f"out of memory: {message}\nwhat to change: ") and expected in err, err


@pytest.mark.parametrize("error", [
    RuntimeError("boom"),
    RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0G"),  # not an XLA error
    "RESOURCE_EXHAUSTED: grpc message larger than max (coordination service)",  # XLA, but not device memory
])
def test_other_errors_are_not_called_out_of_memory(monkeypatch, error):
    import jax

    from maxctx import runtime, train

    error = jax.errors.JaxRuntimeError(error) if isinstance(error, str) else error

    def fails(config, plan=None):
        raise error

    monkeypatch.setattr(runtime, "initialize", lambda config: None)
    monkeypatch.setattr(train, "train", fails)
    with pytest.raises(type(error)):
        train.main(["configs/base.yml", "steps=3"])


def test_the_peak_is_measured_before_the_model_and_the_data(monkeypatch, tmp_path):
    """On CPU the peak is a timed matmul: it runs first, before the data pipeline's threads load the host."""
    import maxctx.data.pipeline
    import maxctx.metrics
    import maxctx.train_step
    from maxctx.loader import load_config
    from maxctx.train import _train

    calls, make_setup = [], maxctx.train_step.make_setup

    class Stop(Exception):
        pass

    def data(*args):
        calls.append("data")
        raise Stop

    monkeypatch.setattr(maxctx.metrics, "peak_flops_per_device", lambda *a: calls.append("peak") or (1e9, "measured"))
    monkeypatch.setattr(maxctx.train_step, "make_setup", lambda *a: calls.append("setup") or make_setup(*a))
    monkeypatch.setattr(maxctx.data.pipeline, "create_data_iterator", data)
    with pytest.raises(Stop):
        _train(load_config([f"base_output_directory={tmp_path}", "enable_checkpointing=false"]))
    assert calls == ["peak", "setup", "data"]
