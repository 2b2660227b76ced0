"""Launch environments: two local processes x 2 CPU devices started with only the variables GKE sets on TPU pods
(multi-slice: MEGASCALE_*) or SLURM sets on each task; maxctx finds the processes, slices and coordinator through
JAX's cluster detection, and the job's losses equal a one-process run of the same global batch."""

import random
import socket
import subprocess

import numpy as np
import pytest

from tests.support.processes import ROOT, cpu_env, free_port, losses, run, train_command

COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "steps=3",
          "enable_checkpointing=false", "enable_tensorboard=false", "peak_tflops_per_device=1",
          "base_num_decoder_layers=1", "learning_rate_schedule_steps=3", "jax_heartbeat_timeout_seconds=10"]


def gke(port: int, pid: int) -> dict[str, str]:
    """Two slices of one host each: GKE's TPU webhook sets TPU_WORKER_ID / TPU_WORKER_HOSTNAMES per slice, the
    JobSet MEGASCALE_* (maxctx.launch.gke writes them)."""
    return {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost", "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(pid), "MEGASCALE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}


def slurm(port: int, pid: int) -> dict[str, str]:
    """`srun --ntasks=2` on one node; the job id puts JAX's port in the range it picks from."""
    return {"SLURM_JOB_ID": str(port - (65535 - 2 ** 12 + 1)), "SLURM_NTASKS": "2", "SLURM_PROCID": str(pid),
            "SLURM_LOCALID": str(pid), "SLURM_STEP_NODELIST": "127.0.0.1"}


def slurm_port() -> int:
    """A free port in the range JAX's SLURM detection picks from (61440 + job id % 4096), above Linux's
    ephemeral ports, so free_port() never returns one there."""
    for port in random.Random().sample(range(65535 - 2 ** 12 + 1, 65536), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("jax_cache")
    proc = run(train_command(*COMMON, f"base_output_directory={out}", "run_name=single", "cpu_devices=4"),
               env=cpu_env(compile_cache=cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, losses(out / "single"), cache


@pytest.mark.parametrize("kind", ["gke", "slurm"])
def test_two_processes_find_the_cluster_and_match_one_process(single, kind, tmp_path):
    out, reference, cache = single
    port = free_port() if kind == "gke" else slurm_port()
    logs = [(open(tmp_path / f"{pid}.out", "w+"), open(tmp_path / f"{pid}.err", "w+")) for pid in range(2)]
    procs = [subprocess.Popen(train_command(*COMMON, f"base_output_directory={out}", f"run_name={kind}",
                                            "cpu_devices=2"),
                              env=cpu_env(cache, **(gke if kind == "gke" else slurm)(port, pid)), cwd=ROOT, text=True,
                              stdout=logs[pid][0], stderr=logs[pid][1]) for pid in range(2)]
    for p in procs:
        p.wait(timeout=300)
    outputs = [((tmp_path / f"{pid}.out").read_text(), (tmp_path / f"{pid}.err").read_text()) for pid in range(2)]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
    name, slices = ("GKE TPU pod", 2) if kind == "gke" else ("SLURM", 1)
    for pid, (stdout, _) in enumerate(outputs):
        line = f"cluster: {name}: process {pid} of 2, slice {pid if kind == 'gke' else 0} of {slices}, " \
               f"coordinator 127.0.0.1:{port}"
        assert line in stdout, stdout[-2000:]
    job = losses(out / kind)
    np.testing.assert_allclose([job[s] for s in sorted(job)], [reference[s] for s in sorted(reference)], rtol=1e-5)
