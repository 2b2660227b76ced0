"""Both checkpoint tiers on, in a real 2-process job (2 processes x 2 CPU devices): the local tier every step, the
persistent one every 2. Process 1 is killed (SIGKILL) while the persistent save of step 4 is in flight: process
0 stops within bounded time with one line naming process 1 and the step the relaunch resumes from. Relaunched,
the job resumes from the newest local step every process holds (newer than the persistent tier's 2), nothing
committed lost; with process 1's local directory deleted instead, it falls back to the persistent step 2, saying
so in one line. Both go on with the losses the job would have had (those the killed run logged, and each
other's)."""

import shutil
import signal
import subprocess
import time

import pytest

from maxctx.peers import PREFIX
from tests.support.processes import HOOKED_TRAIN, ROOT, cpu_env, free_port, losses, steps_on_disk, train_command

STEPS = 6
KEYS = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=32", "cpu_devices=2",
        "base_num_decoder_layers=1", "learning_rate_schedule_steps=10", f"steps={STEPS}", "checkpoint_period=2",
        "peak_tflops_per_device=1", "enable_tensorboard=false", "jax_heartbeat_timeout_seconds=10",
        "enable_emergency_checkpoint=true", "local_checkpoint_period=1"]


def start(root, run_name: str, cache, script=None, **extra) -> list[subprocess.Popen]:
    port = free_port()
    command = train_command(*KEYS, f"base_output_directory={root}", f"local_checkpoint_directory={root}/local",
                            f"run_name={run_name}", script=script)
    return [subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=cpu_env(compile_cache=cache, **extra, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                         JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)))
            for pid in range(2)]


def finish(procs) -> list[str]:
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A job whose process 1 was killed mid-save, and a copy of its directories (run 'copy') for the second
    resume."""
    root = tmp_path_factory.mktemp("tiers")
    cache = root / "jax_cache"
    procs = start(root, "run", cache, HOOKED_TRAIN, SLOW_STEP="4")
    try:
        for line in procs[1].stdout:  # process 1's data item of step 4 is being written
            if line.startswith("SAVING 4"):
                break
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        out = procs[0].communicate(timeout=120)[0]
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    said = [line for line in out.splitlines() if line.startswith(PREFIX)]
    assert procs[0].returncode != 0 and took < 90 and len(said) == 1, (took, out[-4000:])
    assert said[0].startswith(f"{PREFIX}process 1 of 2 died"), said[0]
    assert "2" in steps_on_disk(root / "run") and "4" not in steps_on_disk(root / "run")  # 4 was cut off
    shutil.copytree(root / "run", root / "copy")
    shutil.copytree(root / "local/run", root / "local/copy")
    return root, cache, losses(root / "run"), said[0]


@pytest.fixture(scope="module")
def resumed(killed):
    """The killed job relaunched: (the local step it resumed from, its losses)."""
    root, cache, _, _ = killed
    logs = finish(start(root, "run", cache))
    (line,) = [line for line in logs[0].splitlines() if line.startswith("resuming from local checkpoint step")]
    return int(line.split()[5]), losses(root / "run")


def test_a_kill_mid_save_resumes_from_the_newest_local_step(killed, resumed):
    """... and process 0's line named that step (the local tier's, not the persistent tier's 2)."""
    step, after = resumed
    assert step >= 4, step  # newer than the persistent tier's 2: nothing committed lost
    assert f"(last committed checkpoint: step {step} in the local tier " in killed[3], killed[3]
    assert f"to resume from step {step} (on another process count or mesh: from step 2): " in killed[3], killed[3]
    assert sorted(after) == list(range(1, STEPS + 1))
    assert steps_on_disk(killed[0] / "run")[-1] == str(STEPS)


def test_a_lost_local_directory_falls_back_to_the_persistent_tier(killed, resumed):
    """Resumed from step 2, the job recomputes steps 3-6: the losses the killed run logged up to the step the
    other resume took, and that resume's after it."""
    root, cache, _, _ = killed
    shutil.rmtree(root / "local/copy/process_1-of-2")
    logs = finish(start(root, "copy", cache))
    lines = [line for line in logs[0].splitlines() if line.startswith("the local checkpoint tier cannot serve")]
    assert len(lines) == 1 and "no intact copy" in lines[0] and "persistent tier (step 2)" in lines[0], logs[0]
    assert "resuming from checkpoint step 2" in logs[0]
    after, reference = losses(root / "copy"), resumed[1]
    assert [after[s] for s in range(3, STEPS + 1)] == [reference[s] for s in range(3, STEPS + 1)]
