"""A real multi-host job: two local processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo collectives),
the context axis spanning both processes, a real data source (jsonl + sentencepiece). The job trains, checkpoints,
stops and resumes through scripts/run_local_multihost.sh, and its losses equal a single-process 8-device run,
without a peer watcher's line (a process that dies: tests/test_peers.py)."""

import sys

import numpy as np
import pytest

from maxctx.peers import PREFIX
from tests.support import fixtures as F
from tests.support.processes import cpu_env, losses, run, train_command

STEPS = 6
COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=0.25", "max_target_length=64",
          "ici_fsdp_parallelism=1", "ici_context_parallelism=8", "context_parallel_strategy=p2p",
          "enable_tensorboard=false", "peak_tflops_per_device=1", "checkpoint_period=3", "async_checkpointing=true",
          f"learning_rate_schedule_steps={STEPS}", "base_num_decoder_layers=1", "jax_heartbeat_timeout_seconds=10"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    data = F.text_dataset_keys(root)
    return root, [*COMMON, *data, f"base_output_directory={root}"], cpu_env(MAXCTX_PYTHON=sys.executable)


def test_two_processes_checkpoint_resume_and_match_one_process(job):
    root, common, env = job
    single = run(train_command(*common, "run_name=single", "cpu_devices=8", f"steps={STEPS}"), env=env)
    assert single.returncode == 0, single.stderr[-3000:]

    launch = ["bash", "scripts/run_local_multihost.sh", "--devices-per-process", "4", "2", "configs/base.yml",
              *common, "run_name=multi"]
    first = run([*launch, f"steps={STEPS // 2}"], env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (root / "multi" / "checkpoints" / str(STEPS // 2)).is_dir()
    second = run([*launch, f"steps={STEPS}"], env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resuming from checkpoint step {STEPS // 2}" in second.stdout
    assert PREFIX not in first.stdout + first.stderr + second.stdout + second.stderr  # all ended well: no watcher spoke
    # Only process 0 logs: each step once, first half from the first launch, the rest after the resume.
    multi = losses(root / "multi")
    assert sorted(multi) == list(range(1, STEPS + 1))
    reference = losses(root / "single")
    np.testing.assert_allclose([multi[s] for s in sorted(multi)], [reference[s] for s in sorted(reference)],
                               rtol=1e-5)

