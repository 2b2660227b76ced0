"""The run directory: names and writability checked before JAX starts (one line, exit 2); one live run per
directory (a lock, stale locks taken over); Ctrl-C saves and exits 0 like SIGTERM, a second Ctrl-C stops at once."""

import json
import os
import signal
import subprocess
import sys

import pytest

from maxctx import train
from maxctx.checkpoint.run_dir import LOCK, STALE_S, RunLock
from maxctx.config import ConfigError
from tests.support.processes import BASE_YML, ROOT, cpu_env, run, steps_on_disk, train_command

TINY = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=2",
        "peak_tflops_per_device=1", "enable_tensorboard=false"]


def main_error(capsys, *overrides):
    status = train.main([str(BASE_YML), *overrides])
    err = capsys.readouterr().err
    assert status == train.EXIT_CONFIG and len(err.splitlines()) == 1 and err.startswith("config error: "), err
    return err


# A name over 255 bytes or holding NUL was an OSError / ValueError traceback when the run directory was created.
@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "..", ".", "x" * 300, "a\0b"])
def test_run_name_is_a_name(tmp_path, capsys, name):
    err = main_error(capsys, f"base_output_directory={tmp_path / 'out'}", f"run_name={name}")
    assert f"run_name={name!r}" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "elsewhere").exists()


def test_empty_output_directory_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "base_output_directory=''" in main_error(capsys, "base_output_directory=")
    assert not os.listdir(tmp_path)


def test_output_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = main_error(capsys, f"base_output_directory={tmp_path / 'file' / 'out'}")
    assert "is a file, not a directory" in err


def test_output_directory_that_cannot_be_written(tmp_path, capsys):
    if os.geteuid() == 0:
        parent = "/proc"  # not writable even by root
    else:
        parent = tmp_path / "read_only"
        parent.mkdir(mode=0o555)
    err = main_error(capsys, f"base_output_directory={parent}/out")
    assert "cannot write in" in err


def test_lock_conflict_stale_takeover_and_cleanup(tmp_path):
    run_dir = tmp_path / "base" / "run"
    first = RunLock(str(run_dir))
    assert first.acquire() == ""
    holder = json.loads((run_dir / LOCK).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} on host"):
        RunLock(str(run_dir)).acquire()
    first.release()
    assert not (tmp_path / "base").exists()  # nothing was written: the folders it created are gone

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir.mkdir(parents=True)
    (run_dir / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "start": None}))
    lock = RunLock(str(run_dir))
    assert f"pid {dead.pid}" in lock.acquire()  # same host, not running: taken over
    lock.release()

    (run_dir / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "start": None}))
    with pytest.raises(ConfigError, match="host elsewhere"):  # another host, recently alive
        RunLock(str(run_dir)).acquire()
    old = os.stat(run_dir / LOCK).st_mtime - STALE_S - 1
    os.utime(run_dir / LOCK, (old, old))
    lock = RunLock(str(run_dir))
    assert "host elsewhere" in lock.acquire()  # silent for longer than STALE_S: taken over
    lock.release()
    assert run_dir.exists()  # it existed before


def test_second_run_exits_2_and_ctrl_c_saves_then_exits_0(tmp_path):
    env = cpu_env(compile_cache=tmp_path / "jax_cache")
    command = train_command(*TINY, f"base_output_directory={tmp_path}", "run_name=busy", "steps=100000",
                            "checkpoint_period=1000")
    first = subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in first.stdout:
            if line.startswith("step 2/"):
                break
        second = run(command, env=env, timeout=300)
        assert second.returncode == 2 and len(second.stderr.splitlines()) == 1, second.stderr
        assert "is in use by another run (pid" in second.stderr
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 0, err[-3000:]
    saved = [s for s in steps_on_disk(tmp_path / "busy") if s.isdigit()]
    assert len(saved) == 1 and f"interrupt (Ctrl-C): saved step {saved[0]}" in out, out[-2000:]
    assert not (tmp_path / "busy" / LOCK).exists()


def test_second_ctrl_c_stops_at_once(tmp_path):
    env = cpu_env(compile_cache=tmp_path / "jax_cache", SLOW_STEP="2")
    command = train_command(*TINY, f"base_output_directory={tmp_path}", "run_name=stuck", "steps=100",
                            "checkpoint_period=2", script=ROOT / "tests/support/hooked_train.py")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("SAVING 2"):  # the save of step 2 hangs: the first Ctrl-C would wait for it
                break
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            if line.startswith("Ctrl-C: saving"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1].startswith("second Ctrl-C"), err[-2000:]
