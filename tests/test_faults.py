"""Fault injection: damaged checkpoints and kill -9 during async saves. Every case ends in a resume from a good
checkpoint that reproduces the straight run's losses bit for bit, or in exit 2 with one line; never a traceback,
never a deleted checkpoint. scripts/fault_matrix.py runs the long version (20 kill -9 trials).

Runs are `python train.py` subprocesses on 2 simulated CPU devices with tiny shapes and one persistent compilation
cache. A damaged run is a copy of the straight run's checkpoints 6 and 8 (as if it had stopped at step 8) whose
step 8 is damaged, resumed to step 10: it must set 8 aside and continue from 6."""

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.processes import ROOT, cpu_env, losses, run, steps_on_disk, train_command

STEPS = 10
COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=2",
          "learning_rate_schedule_steps=20", "checkpoint_period=2", "peak_tflops_per_device=1",
          "enable_tensorboard=false", f"steps={STEPS}"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cpu_env(compile_cache=tmp_path_factory.mktemp("jax_cache"))


def command(out: Path, run_name: str, *overrides: str) -> list[str]:
    return train_command(*COMMON, f"base_output_directory={out}", f"run_name={run_name}", *overrides)


def train(env, out: Path, run_name: str, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = run(command(out, run_name, *overrides), env=env, timeout=300)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-4000:]
    return lines[0]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """10 steps straight, saving every 2 and keeping 3 (6, 8, 10)."""
    out = tmp_path_factory.mktemp("ref")
    train(env, out, "straight")
    return out / "straight"


def stopped_at_8(reference: Path, run_dir: Path) -> Path:
    """A run directory holding the straight run's checkpoints 6 and 8; returns its checkpoint 8."""
    for step in ("6", "8"):
        shutil.copytree(reference / "checkpoints" / step, run_dir / "checkpoints" / step)
    return run_dir / "checkpoints" / "8"


def largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)


def overwrite_bytes(step: Path) -> None:
    with open(largest_array_file(step), "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        f.write(bytes(range(64)))


def truncate(step: Path) -> None:
    path = largest_array_file(step)
    os.truncate(path, path.stat().st_size // 3)


DAMAGE = {  # how to damage step 8 -> a phrase the one-line report holds
    "bytes_overwritten": (overwrite_bytes, "fails its checksum"),
    "array_file_truncated": (truncate, "bytes, "),
    "array_file_deleted": (lambda step: largest_array_file(step).unlink(), "is missing"),
    "state_metadata_deleted": (lambda step: (step / "state" / "_METADATA").unlink(), "state/_METADATA is missing"),
    "meta_item_deleted": (lambda step: shutil.rmtree(step / "meta"), "'meta' item is missing"),
    "integrity_record_deleted": (lambda step: (step / "data" / "maxctx_integrity.json").unlink(),
                                 "has no integrity record"),
}


def assert_continues(reference: Path, run_dir: Path, first: int) -> None:
    ref, resumed = losses(reference), losses(run_dir)
    assert sorted(resumed) == list(range(first, STEPS + 1)), sorted(resumed)
    assert [resumed[s] for s in range(first, STEPS + 1)] == [ref[s] for s in range(first, STEPS + 1)]


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes(env, reference, tmp_path, damage):
    damage_fn, phrase = DAMAGE[damage]
    damage_fn(stopped_at_8(reference, tmp_path / "run"))
    proc = train(env, tmp_path, "run")
    report = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint step 8 is unusable")]
    assert len(report) == 1 and phrase in report[0] and "set aside as 8.corrupt" in report[0], proc.stdout
    assert "resuming from checkpoint step 6" in proc.stdout
    assert steps_on_disk(tmp_path / "run") == ["10", "6", "8", "8.corrupt"]  # 8 saved again; nothing deleted
    assert_continues(reference, tmp_path / "run", first=7)


def test_empty_newer_step_directory(env, reference, tmp_path):
    """What a crash while Orbax creates a step directory leaves behind."""
    stopped_at_8(reference, tmp_path / "run")
    (tmp_path / "run/checkpoints/9").mkdir()
    proc = train(env, tmp_path, "run")
    assert "checkpoint step 9 is unusable: its directory is empty" in proc.stdout
    assert "resuming from checkpoint step 8" in proc.stdout
    assert_continues(reference, tmp_path / "run", first=9)


def test_no_good_checkpoint_left_exits_2(env, reference, tmp_path):
    step_8 = stopped_at_8(reference, tmp_path / "run")
    overwrite_bytes(step_8)
    truncate(step_8.parent / "6")
    proc = train(env, tmp_path, "run", expect=2)
    line = one_error_line(proc, "checkpoint error: no good checkpoint left")
    assert "6.corrupt" in line and "8.corrupt" in line and "step 0" in line, line
    assert steps_on_disk(tmp_path / "run") == ["6.corrupt", "8.corrupt"]


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_load_path_at_a_damaged_checkpoint_exits_2(env, reference, tmp_path, key):
    step_8 = stopped_at_8(reference, tmp_path / "source")
    overwrite_bytes(step_8)
    proc = train(env, tmp_path, "fresh", f"{key}={step_8}", expect=2)
    line = one_error_line(proc, f"checkpoint error: {key}=")
    assert "is damaged" in line and "fails its checksum" in line, line
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("trial", range(3))
def test_kill_9_during_async_saves_resumes_exactly(env, reference, tmp_path, trial):
    """Saves every step, so a kill at a random moment of the loop most likely cuts a save off midway."""
    killed = kill_at_random_moment(env, tmp_path, "killed", random.Random(trial))
    proc = train(env, tmp_path, "killed")
    resumed_from = int(proc.stdout.split("resuming from checkpoint step ")[1].split()[0]) if killed else 0
    ref, after = losses(reference), losses(tmp_path / "killed")
    assert [after[s] for s in range(resumed_from + 1, STEPS + 1)] == [ref[s] for s in range(resumed_from + 1,
                                                                                              STEPS + 1)]


def kill_at_random_moment(env, out: Path, run_name: str, rng: random.Random) -> bool:
    """Starts a run saving every step and kills it (SIGKILL) at a random moment after its first step; returns
    whether a checkpoint was on disk by then."""
    proc = subprocess.Popen(command(out, run_name, "checkpoint_period=1"), env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                break
        time.sleep(rng.uniform(0.0, 2.5))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return (out / run_name / "checkpoints").is_dir() and any(name.isdigit() for name in steps_on_disk(out / run_name))
