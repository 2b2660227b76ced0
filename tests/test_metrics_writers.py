"""MetricsWriter: TensorBoard events read back from disk with the MaxText tags, metrics.jsonl records, and
nothing written by non-primary processes."""

import glob
import json
import math
import os
import struct

import jax
import jax.numpy as jnp
import pytest
from tensorboardX.proto import event_pb2

from maxctx.metrics import TAGS, MetricsWriter, compile_record


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TFRecord event files under log_dir: tag -> [(step, value)].

    A TFRecord is: uint64 length, uint32 masked CRC of the length, `length` bytes (an Event proto), uint32 CRC.
    """
    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True))
    assert files, f"no event files under {log_dir}"
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            payload = data[offset + 12:offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


STEP = {"loss": 3.25, "grad_norm": 0.75, "param_norm": 12.5, "learning_rate": 0.003, "tokens": 1024.0,
        "step_time_s": 0.5, "tokens_per_s": 2048.0, "per_device_tokens_per_sec": 256.0,
        "per_device_tflops_per_sec": 0.125, "mfu": 0.25}


def test_tensorboard_tags_and_values(tmp_path):
    with MetricsWriter(str(tmp_path), enable_tensorboard=True, is_primary=True) as writer:
        writer.write_step(10, STEP)
        writer.write_step(20, {**STEP, "loss": 3.0, "custom": 7.0})
        writer.write_eval(20, {"loss": 3.5, "tokens": 512.0})
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    for tag in ("learning/loss", "learning/grad_norm", "learning/param_norm", "learning/current_learning_rate",
                "perf/step_time_seconds", "perf/per_device_tflops_per_sec", "perf/per_device_tokens_per_sec",
                "perf/mfu"):
        assert tag in scalars, f"{tag} missing; found {sorted(scalars)}"
    for key, tag in TAGS.items():
        if key in STEP:
            assert scalars[tag][0] == (10, pytest.approx(STEP[key], rel=1e-6)), tag
    assert scalars["learning/loss"] == [(10, 3.25), (20, 3.0)]
    assert scalars["learning/custom"] == [(20, 7.0)]
    assert scalars["eval/avg_loss"] == [(20, 3.5)]
    assert scalars["eval/total_weights"] == [(20, 512.0)]


def test_eval_objects_get_a_tag_per_entry(tmp_path):
    """loss_by_position and passkey_accuracy: objects in metrics.jsonl, one TensorBoard tag per bucket or cell."""
    values = {"loss": 2.0, "loss_by_position": {"1-2": 5.0, "2-4": 3.0}, "passkey_accuracy": {"4096/0.5": 0.75},
              "checkpoint": "/ckpt/800"}
    with MetricsWriter(str(tmp_path), enable_tensorboard=True, is_primary=True) as writer:
        writer.write_eval(800, values)
    scalars = read_scalars(str(tmp_path / "tensorboard"))
    assert scalars["eval/loss_by_position/1-2"] == [(800, 5.0)] and scalars["eval/loss_by_position/2-4"] == [(800, 3.0)]
    assert scalars["eval/passkey_accuracy/4096/0.5"] == [(800, 0.75)] and scalars["eval/avg_loss"] == [(800, 2.0)]
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["loss_by_position"] == values["loss_by_position"] and record["checkpoint"] == "/ckpt/800"


def test_jsonl_records(tmp_path):
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 32)), jnp.ones((32, 16))).compile()
    record = compile_record(compiled, analytic_flops_per_device=2 * 64 * 32 * 16)
    assert record["xla_flops_per_device"] == pytest.approx(2 * 64 * 32 * 16, rel=0.01)
    assert record["argument_size_in_bytes"] == 4 * (64 * 32 + 32 * 16)
    with MetricsWriter(str(tmp_path), enable_tensorboard=False, is_primary=True) as writer:
        writer.write_compile(record)
        writer.write_step(1, {**STEP, "loss": jnp.float32(2.5), "grad_norm": float("nan")})
    assert not (tmp_path / "tensorboard").exists()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["compile", "train"]
    assert lines[0]["analytic_flops_per_device"] == 2 * 64 * 32 * 16
    assert lines[1]["step"] == 1 and lines[1]["loss"] == 2.5 and lines[1]["mfu"] == 0.25
    assert math.isnan(float(lines[1]["grad_norm"]))  # written as the string "nan": JSON has no NaN


def test_only_primary_writes(tmp_path):
    with MetricsWriter(str(tmp_path / "run"), enable_tensorboard=True, is_primary=False) as writer:
        writer.write_compile({"xla_flops_per_device": 1.0})
        writer.write_step(1, STEP)
        writer.write_eval(1, {"loss": 1.0})
    assert not (tmp_path / "run").exists()


def fake_bucket(monkeypatch, tmp_path, path_class=None):
    """Points etils.epath's gs:// at <tmp_path>/bucket (through `path_class`, a pathlib.Path subclass that may fail
    or stall); returns the local folder of gs://runs/r1."""
    import pathlib

    from etils import epath

    path_class = path_class or type(pathlib.Path())
    monkeypatch.setattr(epath, "Path", lambda p: path_class(str(p).replace("gs://", f"{tmp_path}/bucket/")))
    return tmp_path / "bucket" / "runs" / "r1"


def test_remote_run_dir_is_staged_and_mirrored(tmp_path, monkeypatch):
    # A gs:// run_dir: records go to a local staging folder and are copied through etils.epath (here mapped onto
    # a local "bucket" folder), at once for the first record, then at most once per period, and at close. A
    # second writer (a resumed run) continues the remote metrics.jsonl.
    remote = fake_bucket(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    with MetricsWriter("gs://runs/r1", enable_tensorboard=True, is_primary=True, sync_period_s=3600) as writer:
        writer.write_compile({"xla_flops_per_device": 1.0})
        writer._mirror.wait()  # copies run on a background thread
        assert [json.loads(x)["event"] for x in (remote / "metrics.jsonl").read_text().splitlines()] == ["compile"]
        writer.write_step(10, STEP)  # within the period: not copied yet
        assert len((remote / "metrics.jsonl").read_text().splitlines()) == 1
        staged = writer._mirror.local_dir
    assert not (tmp_path / "gs:").exists()
    assert [json.loads(x)["step"] for x in (remote / "metrics.jsonl").read_text().splitlines()[1:]] == [10]
    assert read_scalars(str(remote / "tensorboard"))["learning/loss"] == [(10, 3.25)]
    assert json.loads(open(os.path.join(staged, "metrics.jsonl")).read().splitlines()[-1])["step"] == 10

    with MetricsWriter("gs://runs/r1", enable_tensorboard=True, is_primary=True, sync_period_s=0) as writer:
        writer.write_step(20, {**STEP, "loss": 3.0})
        writer._mirror.wait()
        assert [json.loads(x).get("step") for x in (remote / "metrics.jsonl").read_text().splitlines()] == [
            None, 10, 20]
    # Two event files (one per run); within the same second their names sort by their random suffixes.
    assert sorted(read_scalars(str(remote / "tensorboard"))["learning/loss"]) == [(10, 3.25), (20, 3.0)]
    assert len(os.listdir(remote / "tensorboard")) == 2


def test_remote_copy_failure_warns_and_keeps_training(tmp_path, monkeypatch):
    import pathlib

    failing = {"on": True}

    class FlakyBucket(type(pathlib.Path())):
        def write_bytes(self, data):
            if failing["on"]:
                raise PermissionError("403 Forbidden")
            return super().write_bytes(data)

    remote = fake_bucket(monkeypatch, tmp_path, FlakyBucket) / "metrics.jsonl"
    writer = MetricsWriter("gs://runs/r1", enable_tensorboard=False, is_primary=True, sync_period_s=0)
    with pytest.warns(UserWarning, match="metrics.jsonl.*403 Forbidden.*next sync retries"):
        writer.write_step(1, STEP)
        writer._mirror.wait()
    assert not remote.exists()
    failing["on"] = False  # the bucket recovers: the next record's sync copies everything written so far
    writer.write_step(2, STEP)
    writer._mirror.wait()
    assert [json.loads(x)["step"] for x in remote.read_text().splitlines()] == [1, 2]
    failing["on"] = True
    with pytest.warns(UserWarning, match="next sync retries"):
        writer.write_step(3, STEP)  # fails again, and so does the last copy at close: the warning says so
        writer._mirror.wait()
    staged = writer._mirror.local_dir
    with pytest.warns(UserWarning, match="only there now: copy it by hand"):
        writer.close()
    assert [json.loads(x)["step"] for x in open(os.path.join(staged, "metrics.jsonl"))] == [1, 2, 3]


def test_a_stalled_bucket_does_not_hold_up_records(tmp_path, monkeypatch):
    # Copies run on a background thread: while one hangs, records keep being written and later syncs skip; at
    # close the writer waits for it and copies the rest.
    import pathlib
    import threading

    release = threading.Event()

    class SlowBucket(type(pathlib.Path())):
        def write_bytes(self, data):
            release.wait(timeout=30)
            return super().write_bytes(data)

    remote = fake_bucket(monkeypatch, tmp_path, SlowBucket) / "metrics.jsonl"
    writer = MetricsWriter("gs://runs/r1", enable_tensorboard=False, is_primary=True, sync_period_s=0)
    for step in range(1, 6):
        writer.write_step(step, STEP)  # returns at once although the first copy is stuck
    assert not remote.exists() and not writer._mirror._running.done()
    release.set()
    writer.close()
    assert [json.loads(x)["step"] for x in remote.read_text().splitlines()] == [1, 2, 3, 4, 5]

