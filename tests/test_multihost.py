"""A real multi-host job: two local processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo collectives),
the context axis spanning both processes, a real data source (jsonl + sentencepiece). The job trains, checkpoints,
stops and resumes through scripts/run_local_multihost.sh, and its losses equal a single-process 8-device run.
If one process dies, the other stops with an error within a bounded time instead of hanging."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support import fixtures as F
from tests.support.processes import ROOT, cpu_env, free_port, losses, run, train_command

STEPS = 6
COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=0.25", "max_target_length=64",
          "ici_fsdp_parallelism=1", "ici_context_parallelism=8", "context_parallel_strategy=p2p",
          "enable_tensorboard=false", "peak_tflops_per_device=1", "checkpoint_period=3", "async_checkpointing=true",
          f"learning_rate_schedule_steps={STEPS}", "base_num_decoder_layers=1", "jax_heartbeat_timeout_seconds=10"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    docs = F.make_documents(200, seed=5)
    tokenizer = F.tiny_tokenizer(str(root / "sp.model"), docs)
    F.write_jsonl(str(root / "train.jsonl"), docs)
    data = ["dataset_type=text", f"grain_train_files={root}/train.jsonl", f"tokenizer_path={tokenizer}"]
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
    # Only process 0 logs: each step once, first half from the first launch, the rest after the resume.
    multi = losses(root / "multi")
    assert sorted(multi) == list(range(1, STEPS + 1))
    reference = losses(root / "single")
    np.testing.assert_allclose([multi[s] for s in sorted(multi)], [reference[s] for s in sorted(reference)],
                               rtol=1e-5)


def test_a_dead_process_stops_the_other_with_an_error(job, tmp_path):
    root, common, env = job
    port = free_port()
    procs = []
    for pid in range(2):
        penv = {**env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen(train_command(*common, "run_name=dies", "cpu_devices=4", "steps=1000",
                                                    "enable_checkpointing=false"), cwd=ROOT,
                                      env=penv, stdout=open(tmp_path / f"out{pid}.txt", "w"),
                                      stderr=subprocess.STDOUT))
    try:
        deadline = time.time() + 300
        while "step 1/" not in (tmp_path / "out0.txt").read_text():
            assert time.time() < deadline and procs[0].poll() is None, (tmp_path / "out0.txt").read_text()[-3000:]
            time.sleep(1)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.time()
        status = procs[0].wait(timeout=180)
        assert status != 0
        assert time.time() - killed < 180
        assert "stopped sending heartbeats" in (tmp_path / "out0.txt").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
