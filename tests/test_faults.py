"""Fault injection: damaged checkpoints and kill -9 during async saves. Every case ends in a resume from a good
checkpoint that reproduces the straight run's losses bit for bit, or in exit 2 with one line; never a traceback,
never a deleted checkpoint. scripts/fault_matrix.py runs the long version (20 kill -9 trials).

Runs are `python train.py` subprocesses on 2 simulated CPU devices with tiny shapes and one persistent compilation
cache. A damaged run is a copy of the straight run's checkpoints 6 and 8 (as if it had stopped at step 8) whose
step 8 is damaged, resumed to step 10: it must set 8 aside and continue from 6."""

import json
import math
import random
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.faults import DAMAGE, copy_steps, kill_at_random_moment, overwrite_bytes, saved_steps, truncate
from tests.support.processes import HOOKED_TRAIN, cpu_env, losses, metrics, run, steps_on_disk, train_command

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
    copy_steps(reference, run_dir, [6, 8])
    return run_dir / "checkpoints" / "8"


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


def test_no_good_checkpoint_left_exits_2(env, reference, tmp_path):
    step_8 = stopped_at_8(reference, tmp_path / "run")
    overwrite_bytes(step_8)
    truncate(step_8.parent / "6")
    proc = train(env, tmp_path, "run", expect=2)
    line = one_error_line(proc, "checkpoint error: no good checkpoint left")
    assert "6.corrupt" in line and "8.corrupt" in line and "step 0" in line, line
    assert steps_on_disk(tmp_path / "run") == ["6.corrupt", "8.corrupt"]


@pytest.mark.parametrize("change", ["dataset_type", "model_shape"])
def test_resume_with_another_data_source_or_model_exits_2_naming_the_key(env, reference, tmp_path, change):
    stopped_at_8(reference, tmp_path / "run")
    if change == "dataset_type":
        from tests.support.fixtures import make_documents, tiny_tokenizer, write_txt

        documents = make_documents(100)
        overrides = ["dataset_type=text", f"grain_train_files={write_txt(str(tmp_path / 'docs.txt'), documents)}",
                     f"tokenizer_path={tiny_tokenizer(str(tmp_path / 'tok.model'), documents, vocab_size=200)}"]
        expected = "saved with dataset_type='synthetic' but this run has 'text'; resume with dataset_type=synthetic"
    else:
        overrides, expected = ["base_mlp_dim=256"], "saved with base_mlp_dim=384 but this run has 256"
    proc = train(env, tmp_path, "run", *overrides, expect=2)
    line = one_error_line(proc, "config error: checkpoint ")
    assert expected in line and "load_full_state_path=" in line, line
    assert steps_on_disk(tmp_path / "run") == ["6", "8"]


def test_resume_with_another_global_batch_reads_on_and_says_so(env, reference, tmp_path):
    """Stopped at 8 with 2 sequences a step, resumed with 4 and schedule_on_batch_change=tokens: one line names the
    change; the data position goes on from the 16 rows read (2 steps x 4 more: 24), in the stream the run started
    (2 rows a block); the schedule goes on from its step 4 (16 sequences at 4 a step): steps 9 and 10 take the
    learning rates of the straight run's steps 5 and 6."""
    stopped_at_8(reference, tmp_path / "run")
    proc = train(env, tmp_path, "run", "per_device_batch_size=2", "schedule_on_batch_change=tokens")
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("resuming at step 8 with a global batch")]
    assert "of 4 sequences" in line and "not the 2 it was saved with" in line and "from its step 8 to 4" in line, line
    state = json.loads((tmp_path / "run/checkpoints/10/data/process_0-of-1.json").read_text())
    assert state == {"position": "global", "rows": 24, "block": 2}, state
    assert sorted(losses(tmp_path / "run")) == [9, 10]
    rates = [{r["step"]: r["learning_rate"] for r in metrics(run_dir) if r.get("event") == "train"}
             for run_dir in (reference, tmp_path / "run")]
    assert [rates[1][9], rates[1][10]] == [rates[0][5], rates[0][6]] and rates[0][5] != rates[0][9], rates


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_load_path_at_a_damaged_checkpoint_exits_2(env, reference, tmp_path, key):
    step_8 = stopped_at_8(reference, tmp_path / "source")
    overwrite_bytes(step_8)
    proc = train(env, tmp_path, "fresh", f"{key}={step_8}", expect=2)
    line = one_error_line(proc, f"checkpoint error: {key}=")
    assert "is damaged" in line and "fails its checksum" in line, line
    assert not (tmp_path / "fresh").exists()


def test_divergence_guard_names_the_last_good_checkpoint_and_its_command_works(env, reference, tmp_path):
    """From the straight run's step 6, learning_rate=1e4 diverges: the loss jumps at step 8 (the state after step 7
    is poisoned but finite) and turns NaN by step 10. Saving every step and keeping 1, retention still keeps 6; the
    guard sets the checkpoints saved after the divergence aside and prints a command that resumes from 6 with a
    lower learning rate; that command reproduces the straight run."""
    shutil.copytree(reference / "checkpoints/6", tmp_path / "run/checkpoints/6")
    proc = train(env, tmp_path, "run", "learning_rate=1e4", "checkpoint_period=1", "max_num_checkpoints_to_keep=1",
                 expect=3)
    line = one_error_line(proc, "error: step ")
    assert "suspect since step 8" in line and "checkpoint step 6 predates it" in line, line
    on_disk = steps_on_disk(tmp_path / "run")
    assert "6" in on_disk and not [s for s in on_disk if s.isdigit() and s != "6"], on_disk  # nothing deleted: 6 kept
    assert [s for s in on_disk if s.endswith(".suspect")], on_disk
    advice = shlex.split(line.split("resume from it with a lower learning rate: ")[1])
    assert advice[-1] == "learning_rate=0.003", advice  # the rate checkpoint 6 was trained with
    proc = run(advice, env=env, timeout=300)
    assert proc.returncode == 0 and "resuming from checkpoint step 6" in proc.stdout, proc.stderr[-3000:]
    ref, after = losses(reference), losses(tmp_path / "run")
    assert [after[s] for s in range(7, STEPS + 1)] == [ref[s] for s in range(7, STEPS + 1)]


def test_non_finite_learning_rate_is_a_config_error():
    from maxctx.config import ConfigError
    from maxctx.loader import load_config
    from tests.support.processes import BASE_YML

    with pytest.raises(ConfigError, match=r"learning_rate=1e\+39 must be >= 0 and finite in float32"):
        load_config([str(BASE_YML), "learning_rate=1e39"])


@pytest.mark.parametrize("trial", range(3))
def test_kill_9_during_async_saves_resumes_exactly(env, reference, tmp_path, trial):
    """Saves every step, so a kill at a random moment of the loop most likely cuts a save off midway."""
    kill_at_random_moment(command(tmp_path, "killed", "checkpoint_period=1"), env, tmp_path / "killed",
                          random.Random(trial))
    saved = saved_steps(tmp_path / "killed")
    proc = train(env, tmp_path, "killed")
    if saved:
        assert f"resuming from checkpoint step {saved[-1]}" in proc.stdout, proc.stdout[-2000:]
    first = (saved[-1] if saved else 0) + 1
    ref, after = losses(reference), losses(tmp_path / "killed")
    assert [after[s] for s in range(first, STEPS + 1)] == [ref[s] for s in range(first, STEPS + 1)]


def test_failed_async_save_with_policy_continue_trains_on_and_saves_again(env, reference, tmp_path):
    """Step 4's save fails as on a full disk, in Orbax's background thread (it surfaces at step 6's save): one
    line, training goes on unchanged, steps 6, 8 and 10 are saved, nothing of step 4 is left."""
    proc = run(train_command(*COMMON, f"base_output_directory={tmp_path}", "run_name=run",
                             "checkpoint_failure_policy=continue", script=HOOKED_TRAIN),
               env={**env, "ENOSPC_STEPS": "4"}, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    report = [line for line in proc.stdout.splitlines() if line.startswith("saving checkpoint step 4")]
    assert len(report) == 1 and "no space left on device (disk full); checkpoint step 2 and older are intact; " \
        "training on (checkpoint_failure_policy=continue)" in report[0], proc.stdout
    assert steps_on_disk(tmp_path / "run") == ["10", "6", "8"]
    assert losses(tmp_path / "run") == losses(reference)


def test_failed_save_exits_2_by_default_and_the_run_resumes_from_the_previous_one(env, reference, tmp_path):
    """A synchronous save of step 6 fails (disk full): exit 2 with one line; no half-written step 6 is left for a
    resume to pick, and re-running the same command resumes from 4 and reproduces the straight run."""
    overrides = [*COMMON, f"base_output_directory={tmp_path}", "run_name=run", "async_checkpointing=false"]
    proc = run(train_command(*overrides, script=HOOKED_TRAIN), env={**env, "ENOSPC_STEPS": "6"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    line = one_error_line(proc, "checkpoint error: saving checkpoint step 6 ")
    assert "no space left on device (disk full); checkpoint step 4 and older are intact" in line, line
    assert "re-run the same command to resume from step 4" in line and "checkpoint_failure_policy=continue" in line
    assert steps_on_disk(tmp_path / "run") == ["2", "4"]
    proc = train(env, tmp_path, "run", "async_checkpointing=false")
    assert "resuming from checkpoint step 4" in proc.stdout, proc.stdout[-2000:]
    assert losses(tmp_path / "run") == losses(reference)  # steps 5 and 6 logged twice, alike


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged user and mount namespaces (unshare -rm)")
def test_a_really_full_disk_exits_2_and_leaves_the_checkpoints_loadable(env, reference, tmp_path):
    """A 12 MiB tmpfs holds two checkpoints of 4.9 MiB: the asynchronous save of step 6 fails with ENOSPC in
    TensorStore. Exit 2 with the one line last (TensorStore itself prints 'Event loop is closed' tracebacks from
    its callbacks); steps 2 and 4 stay, and a copy of the run on a roomy disk resumes from 4 exactly."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=12m tmpfs {disk} && {shlex.join(command(disk, 'run'))}; status=$?; "
              f"cp -r {disk}/run {kept}; exit $status")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("checkpoint error: saving checkpoint step 6 ") and "no space left on device" in last
    assert steps_on_disk(kept) == ["2", "4"]
    proc = train(env, tmp_path, "kept")
    assert "resuming from checkpoint step 4" in proc.stdout, proc.stdout[-2000:]
    assert losses(kept) == losses(reference)


def test_resume_with_another_schedule_length_says_what_changes_in_one_line(env, reference, tmp_path):
    """The straight run was saved on a 20-step schedule; resuming it with the schedule following steps=12 is
    allowed (it is how a run is extended), with one line naming the jump in learning rate and the key that keeps
    the old schedule; with that key the run reproduces the straight one."""
    stopped_at_8(reference, tmp_path / "run")
    proc = train(env, tmp_path, "run", "steps=12", "learning_rate_schedule_steps=-1")
    notice = [line for line in proc.stdout.splitlines() if line.startswith("resuming at step 8 on a learning-rate")]
    assert len(notice) == 1 and "schedule of 12 steps (steps=12), not the 20 it was saved with" in notice[0], \
        proc.stdout
    assert notice[0].endswith("to keep the old schedule, add learning_rate_schedule_steps=20"), notice[0]
    stopped_at_8(reference, tmp_path / "kept")
    proc = train(env, tmp_path, "kept", "learning_rate_schedule_steps=20")
    assert "learning-rate schedule" not in proc.stdout
    assert_continues(reference, tmp_path / "kept", first=9)


def test_resume_notices_name_the_change_and_the_old_value():
    import dataclasses

    from maxctx.checkpoint.compatibility import resume_notices
    from maxctx.loader import load_config
    from tests.support.processes import BASE_YML

    config = load_config([str(BASE_YML), "steps=200", "learning_rate=1e-3"])
    config = dataclasses.replace(config, grain_train_files="new/*.txt")  # not read: the notice only names it
    saved = {"schedule_steps": 100, "grain_train_files": "old/*.txt"}
    schedule, data = resume_notices(saved, config, step=50)
    assert "learning rate at step 50 goes from 0.000628 to 0.00094" in schedule, schedule
    assert data.startswith("resuming with grain_train_files='new/*.txt', not 'old/*.txt' as saved") and \
        data.endswith("resume with grain_train_files='old/*.txt'"), data
    assert resume_notices({**saved, "schedule_steps": 200, "grain_train_files": "new/*.txt"}, config, 50) == []
    assert resume_notices(None, config, 50) == []  # checkpoints from before the record


def test_skip_nonfinite_steps_drops_a_nan_step_and_trains_on(env, reference, tmp_path):
    """Step 5's batch makes its loss and gradient NaN: with skip_nonfinite_steps=true the update is dropped (the
    weights after step 4 are kept), the run goes on to step 10 and saves, and the metrics count one skip."""
    proc = run(train_command(*COMMON, f"base_output_directory={tmp_path}", "run_name=run", "skip_nonfinite_steps=true",
                             script=HOOKED_TRAIN), env={**env, "NAN_STEPS": "5"}, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "step 5: loss nan, gradient norm nan; update skipped, weights kept" in proc.stdout, proc.stdout
    records = [r for r in metrics(tmp_path / "run") if r.get("event") == "train"]
    assert [r["skipped"] for r in records] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert records[-1]["skipped_steps"] == 1 and steps_on_disk(tmp_path / "run") == ["10", "6", "8"]
    ref, after = losses(reference), losses(tmp_path / "run")
    assert [after[s] for s in range(1, 5)] == [ref[s] for s in range(1, 5)]
    assert all(math.isfinite(after[s]) for s in range(6, STEPS + 1))
