"""Peers in a multi-process job. One that never arrives: one line naming the coordinator and the missing process
ids, exit 2, after jax_distributed_initialization_timeout (it was XLA's fatal log, exit 134, after 5 minutes).
One that dies later: the others print one line naming it, the last committed step and the command to resume,
before JAX's abort (maxctx.peers; without JAX here, with fake trainers; a real 2-process job in test_multihost)."""

import select
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from maxctx.peers import PREFIX, death_line, newest_step
from maxctx.runtime import PeerWatchdog
from tests.support.processes import ROOT, cpu_env, free_port, run, train_command


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


def test_the_death_line_names_the_newest_committed_step(tmp_path):
    for name in ("3", "6", "9.orbax-checkpoint-tmp-1712", "12.corrupt"):  # 9: a save cut off by the death
        (tmp_path / name).mkdir()
    (tmp_path / "15").write_text("")
    assert death_line(1, 4, str(tmp_path), "python train.py x=1") == (
        f"{PREFIX}process 1 of 4 died (last committed checkpoint: step 6 in {tmp_path}); the run stops here: rerun "
        f"the same command on every process to resume from step 6: python train.py x=1")
    assert f"(no checkpoint committed yet in {tmp_path / 'new'});" in death_line(0, 2, str(tmp_path / "new"), "c")
    assert death_line(0, 2, "", "c").endswith("(checkpointing is off); the run stops here: rerun the same command "
                                              "on every process to start over from step 0: c")
    assert "(checkpoints in gs://b/run/checkpoints); " in death_line(0, 2, "gs://b/run/checkpoints", "c")
    local = str(tmp_path / "local/run/process_0-of-4")
    assert death_line(1, 4, str(tmp_path), "c", local, 8) == (  # the local tier's step, when newer, is the resume's
        f"{PREFIX}process 1 of 4 died (last committed checkpoint: step 8 in the local tier {tmp_path / 'local/run'}, "
        f"beside {tmp_path}); the run stops here: rerun the same command on every process to resume from step 8 (on "
        f"another process count or mesh: from step 6): c")
    assert "(last committed checkpoint: step 6 in " in death_line(1, 4, str(tmp_path), "c", local, 6)
    assert "to resume from step 3 (on another process count or mesh: from step 0): c" in death_line(
        0, 2, str(tmp_path / "new"), "c", local, 3)
    assert "beside gs://b/c, or a newer one there); " in death_line(0, 2, "gs://b/c", "c", local, 3)


# A trainer without JAX: a PeerLink around waiting for a line on stdin, then the end the test names. The
# key-value store is a file.
FAKE_TRAINER = """
import os, sys, time
from pathlib import Path
from maxctx.peers import PeerLink

process, store, checkpoints = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def publish(key, value):
    (store / "tmp").write_text(value)
    (store / "tmp").rename(store / "hub")
def lookup(key):
    while not (store / "hub").exists():
        time.sleep(0.01)
    return (store / "hub").read_text()
local = sys.argv[4] + f"/process_{process}-of-2"
with PeerLink(process, 2, checkpoints, f"resume-{process}", publish, lookup, "127.0.0.1", local_dir=local):
    print("ready", flush=True)
    end = sys.stdin.readline().strip()
    if end == "abort":
        os.abort()
    if end == "fail":
        raise SystemExit(1)
"""


def fake_job(tmp_path):
    """Two fake trainers, each with its watcher, connected; their checkpoints directory holds step 4, their local
    tier (tmp_path/local/process_<i>-of-2) what the test puts there."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    args = [str(tmp_path), str(tmp_path / "checkpoints"), str(tmp_path / "local")]
    procs = [subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(i), *args], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        assert p.stdout.readline() == "ready\n", p.communicate(timeout=30)
    return procs


def end(proc, how: str) -> None:
    proc.stdin.write(how + "\n")
    proc.stdin.flush()


def stderr_lines(proc) -> list[str]:
    """The trainer's stderr once it and its watcher (which shares it) have both exited."""
    start = time.monotonic()
    err = proc.communicate(timeout=30)[1]
    assert time.monotonic() - start < 10, "the watcher outlived its trainer"
    return err.splitlines()


@pytest.mark.parametrize("dies, survivor_ends", [(1, "done"), (0, "fail"), (1, "abort_first")])
def test_a_dying_process_gets_one_line_from_the_other(tmp_path, dies, survivor_ends):
    procs = fake_job(tmp_path)
    survivor = procs[1 - dies]
    if survivor_ends == "abort_first":  # JAX's abort of the survivor may come before the news reaches its watcher
        end(survivor, "abort")
        survivor.wait(timeout=30)
        time.sleep(0.2)
    procs[dies].send_signal(signal.SIGKILL)
    line = (f"{PREFIX}process {dies} of 2 died (last committed checkpoint: step 4 in {tmp_path / 'checkpoints'}); the "
            f"run stops here: rerun the same command on every process to resume from step 4: resume-{1 - dies}")
    if survivor_ends == "abort_first":
        assert stderr_lines(survivor) == [line]
    else:  # the line comes while the survivor still runs, and nothing more at its end
        assert select.select([survivor.stderr], [], [], 10)[0], "no line within 10 s"
        assert survivor.stderr.readline() == line + "\n"
        end(survivor, survivor_ends)
        assert stderr_lines(survivor) == []
    procs[dies].communicate(timeout=30)


@pytest.mark.parametrize("dies", [0, 1])
def test_the_line_names_the_newest_local_step_both_hosts_hold(tmp_path, dies):
    """Local tiers newer than the persistent step 4: this host holds 5 and 6 (7 cut off), the dead one 5 to 7 (the
    resume takes 6, the newest both hold); the dead host's step reaches the survivor through the hub, or from it."""
    for process, steps in ((1 - dies, ["5", "6", "7.tmp"]), (dies, ["5", "6", "7"])):
        for step in steps:
            (tmp_path / "local" / f"process_{process}-of-2" / step).mkdir(parents=True)
    procs = fake_job(tmp_path)
    procs[dies].send_signal(signal.SIGKILL)
    assert select.select([procs[1 - dies].stderr], [], [], 10)[0], "no line within 10 s"
    line = procs[1 - dies].stderr.readline()
    assert line.startswith(f"{PREFIX}process {dies} of 2 died (last committed checkpoint: step 6 in the local tier "
                           f"{tmp_path / 'local'}, beside {tmp_path / 'checkpoints'}); "), line
    assert line.endswith(f"to resume from step 6 (on another process count or mesh: from step 4): resume-{1 - dies}\n")
    end(procs[1 - dies], "done")
    assert stderr_lines(procs[1 - dies]) == []
    procs[dies].communicate(timeout=30)


def test_a_clean_end_prints_nothing_and_the_watchers_exit(tmp_path):
    procs = fake_job(tmp_path)
    end(procs[1], "done")
    assert stderr_lines(procs[1]) == [] and procs[1].returncode == 0
    end(procs[0], "done")
    assert stderr_lines(procs[0]) == [] and procs[0].returncode == 0


def test_a_process_killed_mid_run_gets_one_line_from_the_other(tmp_path):
    """A real 2-process job (jax.distributed, gloo) checkpointing every 2 steps: once a step is committed,
    process 1 is killed; process 0 ends (JAX's abort, any status but 0) with exactly one maxctx line naming
    process 1, the step the run directory holds and its command to resume. Process 0's stderr is read to its end,
    which is its watcher's exit too: when gloo aborts the trainer before the news arrives, the watcher prints after
    the trainer has gone (up to LINGER_S s), and a test that read a file at the trainer's exit missed the line."""
    port, procs = free_port(), []
    command = train_command("cpu_devices=1", "steps=100000", f"base_output_directory={tmp_path}", "run_name=dies",
                            "checkpoint_period=2", "log_period=1", "enable_tensorboard=false", "max_target_length=32",
                            "per_device_batch_size=1", "base_num_decoder_layers=1", "base_emb_dim=32",
                            "peak_tflops_per_device=1", "jax_heartbeat_timeout_seconds=10")
    for pid in range(2):
        env = cpu_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    errs = [[] for _ in procs]  # drained as they come, so that a full pipe never blocks a process
    readers = [threading.Thread(target=lambda p, e: e.extend((time.monotonic(), line) for line in p.stderr),
                                args=(p, e), daemon=True) for p, e in zip(procs, errs)]
    for reader in readers:
        reader.start()
    checkpoints = tmp_path / "dies" / "checkpoints"
    try:
        deadline = time.monotonic() + 300
        while newest_step(str(checkpoints)) is None:
            assert time.monotonic() < deadline and procs[0].poll() is None, "".join(e[1] for e in errs[0])[-3000:]
            time.sleep(0.05)  # soon after a commit, well before the next one
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = procs[0].wait(timeout=180)
        ended = time.monotonic()
        took = ended - killed
        readers[0].join(timeout=30)  # the end of the pipe: the trainer and its watcher have both exited
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = "".join(line for _, line in errs[0])
    said = [line.rstrip("\n") for _, line in errs[0] if line.startswith(PREFIX)]
    step = newest_step(str(checkpoints))
    assert not readers[0].is_alive() and status != 0 and took < 90 and len(said) == 1, (status, took, err[-5000:])
    assert said[0].startswith(f"{PREFIX}process 1 of 2 died (last committed checkpoint: step {step} in {checkpoints})")
    assert said[0].endswith(f"to resume from step {step}: {shlex.join(command)}"), said[0]
    (at,) = [at for at, line in errs[0] if line.startswith(PREFIX)]
    print(f"process 0 ended with status {status} {took:.1f} s after the kill; its line came {at - killed:.2f} s "
          f"after the kill ({at - ended:+.2f} s from its end); {len(err.splitlines())} stderr lines")
