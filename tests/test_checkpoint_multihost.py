"""Checkpointing as one job of two processes x 4 CPU devices (jax.distributed on 127.0.0.1, the mesh spanning
both): SIGTERM to one process, an agreed save step, per-process data-iterator states, and resume."""

import os
import socket
import subprocess

import pytest
from test_checkpoint import HOOKED_TRAIN, ROOT, command, losses, steps_on_disk


@pytest.fixture
def env(tmp_path):
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def test_two_processes_agree_on_sigterm_step_and_resume(env, tmp_path):
    """Two processes x 4 devices (fsdp=4 x context=2 spans both); only process 1 gets SIGTERM. JAX's preemption
    service makes both save the same step and exit 0; each writes its own data-iterator state; the same command
    resumes both from it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys = ["steps=12", "checkpoint_period=100", "ici_fsdp_parallelism=4", "ici_context_parallelism=2"]

    def launch(script=None, **extra):
        procs = [subprocess.Popen(command(tmp_path, "two", *keys, script=script), cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**env, **extra, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                       "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)})
                 for pid in range(2)]
        logs = [p.communicate(timeout=300)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-3000:]
        return logs

    hooked = tmp_path / "hooked_train.py"
    hooked.write_text(HOOKED_TRAIN.format(root=str(ROOT)))
    logs = launch(hooked, SIGTERM_STEP="3", SIGTERM_PROCESS="1")
    saved = steps_on_disk(tmp_path, "two")
    assert len(saved) == 1 and 3 <= int(saved[0]) < 12, saved
    assert f"preemption notice (SIGTERM): saved step {saved[0]}" in logs[0]
    data_files = sorted(os.listdir(tmp_path / "two/checkpoints" / saved[0] / "data"))
    assert data_files == ["commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
    logs = launch()
    assert f"resuming from checkpoint step {saved[0]}" in logs[0]
    assert steps_on_disk(tmp_path, "two") == sorted([saved[0], "12"])
    assert max(losses(tmp_path, "two")) == 12
