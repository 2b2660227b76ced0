"""Resume on another slice: a checkpoint written by 2 processes x 4 CPU devices (C = 8, p2p, a real grain source)
resumes as 4 processes x 2 devices and as 1 process x 8 devices (scripts/run_local_multihost.sh 4 and 1), and the
losses equal the straight single-process run's: the data position and the arrays are both global."""

import shutil
import sys

import numpy as np
import pytest

from tests.support import fixtures as F
from tests.support.processes import cpu_env, losses, run, train_command

STEPS = 4
COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=0.25", "max_target_length=64",
          "ici_fsdp_parallelism=1", "ici_context_parallelism=8", "context_parallel_strategy=p2p",
          "enable_tensorboard=false", "peak_tflops_per_device=1", "checkpoint_period=2",
          f"learning_rate_schedule_steps={STEPS}", "base_num_decoder_layers=1", "jax_heartbeat_timeout_seconds=10"]


def launch(processes: int, devices: int, common: list[str], *keys: str, env: dict) -> str:
    command = ["bash", "scripts/run_local_multihost.sh", "--devices-per-process", str(devices), str(processes),
               "configs/base.yml", *common, *keys]
    proc = run(command, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The straight 1 x 8 run's losses, and a 2 x 4 run stopped at step 2 (its run directory)."""
    root = tmp_path_factory.mktemp("resume_multihost")
    common = [*COMMON, *F.text_dataset_keys(root), f"base_output_directory={root}"]
    env = cpu_env(compile_cache=root / "jax_cache", MAXCTX_PYTHON=sys.executable)
    single = run(train_command(*common, "run_name=single", "cpu_devices=8", f"steps={STEPS}"), env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    launch(2, 4, common, "run_name=two", f"steps={STEPS // 2}", env=env)
    return root, common, env, losses(root / "single")


@pytest.mark.parametrize("processes,devices", [(4, 2), (1, 8)])
def test_a_two_process_checkpoint_resumes_on_another_process_count(saved, processes, devices):
    root, common, env, reference = saved
    name = f"as_{processes}x{devices}"
    shutil.copytree(root / "two", root / name)  # its checkpoint and the losses of steps 1-2
    out = launch(processes, devices, common, f"run_name={name}", f"steps={STEPS}", env=env)
    assert f"resuming from checkpoint step {STEPS // 2}" in out
    resumed = losses(root / name)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([resumed[s] for s in range(1, STEPS + 1)],
                               [reference[s] for s in range(1, STEPS + 1)], rtol=1e-5)
