"""A multi-process job whose peers never arrive ends in one line naming the coordinator and the missing process
ids, exit 2, after jax_distributed_initialization_timeout (it was XLA's fatal log, exit 134, after 5 minutes)."""

import time

import pytest

from maxctx.runtime import PeerWatchdog
from tests.support.processes import cpu_env, free_port, run, train_command


@pytest.mark.parametrize("pid, missing", [(0, "1"), (1, "0")], ids=["only_process_0", "only_process_1"])
def test_a_process_alone_in_a_two_process_job_exits_2_naming_the_missing_one(tmp_path, pid, missing):
    address = f"127.0.0.1:{free_port()}"
    env = cpu_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    start = time.monotonic()
    proc = run(train_command("cpu_devices=2", "steps=2", f"base_output_directory={tmp_path}",
                             "jax_distributed_initialization_timeout=3"), env=env, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - start < 60, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"launch error: jax.distributed: process {pid} of 2 "), lines
    assert f"coordinator {address}" in lines[0] and f"missing process id {missing};" in lines[0], lines[0]


def test_the_message_names_what_this_process_can_know():
    watchdog = PeerWatchdog({"coordinator_address": "10.0.0.1:1234", "num_processes": 8, "process_id": 0}, 600)
    watchdog.cancel()
    assert "process 0 of 8 waited 600 s at the coordinator 10.0.0.1:1234 (hosted by this process)" in \
        watchdog.message() and "missing process id one or more of 1-7;" in watchdog.message()
    watchdog.pid, watchdog.reached_coordinator = 3, True
    assert "missing process id one or more of 1, 2, 4, 5, 6, 7;" in watchdog.message()
