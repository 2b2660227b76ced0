"""Checkpointing as one job of two processes x 4 CPU devices (jax.distributed on 127.0.0.1, the mesh spanning
both): SIGTERM to one process, an agreed save step, per-process data-iterator states, and resume."""

import os
import subprocess

from tests.support.processes import HOOKED_TRAIN, ROOT, cpu_env, free_port, losses, steps_on_disk, train_command

# test_checkpoint.py's tiny run, on 8 devices in two processes.
KEYS = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=4",
        "ici_fsdp_parallelism=4", "ici_context_parallelism=2", "learning_rate_schedule_steps=20", "steps=12",
        "checkpoint_period=100", "peak_tflops_per_device=1", "enable_tensorboard=false"]


def test_two_processes_agree_on_sigterm_step_and_resume(tmp_path):
    """Two processes x 4 devices (fsdp=4 x context=2 spans both); only process 1 gets SIGTERM. JAX's preemption
    service makes both save the same step and exit 0; each writes its own data-iterator state; the same command
    resumes both from it."""
    port = free_port()
    keys = [*KEYS, f"base_output_directory={tmp_path}", "run_name=two"]

    def launch(script=None, **extra):
        env = cpu_env(compile_cache=tmp_path / "jax_cache", **extra, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                      JAX_NUM_PROCESSES="2")
        procs = [subprocess.Popen(train_command(*keys, script=script), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env={**env, "JAX_PROCESS_ID": str(pid)})
                 for pid in range(2)]
        logs = [p.communicate(timeout=300)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-3000:]
        return logs

    logs = launch(HOOKED_TRAIN, SIGTERM_STEP="3", SIGTERM_PROCESS="1")
    saved = steps_on_disk(tmp_path / "two")
    assert len(saved) == 1 and 3 <= int(saved[0]) < 12, saved
    assert f"preemption notice (SIGTERM): saved step {saved[0]}" in logs[0]
    data_files = sorted(os.listdir(tmp_path / "two/checkpoints" / saved[0] / "data"))
    assert data_files == ["commit_success.txt", "maxctx_integrity.json", "process_0-of-2.json", "process_1-of-2.json"]
    logs = launch()
    assert f"resuming from checkpoint step {saved[0]}" in logs[0]
    assert steps_on_disk(tmp_path / "two") == sorted([saved[0], "12"])
    assert max(losses(tmp_path / "two")) == 12
