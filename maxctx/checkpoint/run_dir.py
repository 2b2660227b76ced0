"""The run directory `<base_output_directory>/<run_name>`: writable (checked before JAX starts) and owned by one
live run at a time.

The lock is `<run_dir>/maxctx.lock`, created with O_EXCL by process 0 of a job, holding {"pid", "host", "start"}
(the process's start time, so a reused pid is not mistaken for the holder). While the run lives, a thread touches
the file every HEARTBEAT_S seconds. A lock is stale, and is taken over with a one-line note, when its holder is on
this host and no longer running, or when it has not been touched for STALE_S seconds (a holder on another host
that died: after a preemption the job usually comes back on other hosts). Every process of a job learns process
0's outcome, so a second job on the same run directory exits 2 on all its processes. Only local paths are locked
(object stores have no exclusive create).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time

from maxctx.config import Config, ConfigError

LOCK = "maxctx.lock"
HEARTBEAT_S, STALE_S = 30.0, 600.0


def check_writable(config: Config) -> None:
    """ConfigError (one line) unless the run directory exists and is writable, or can be created: probes by
    creating and removing a file in it, or in its nearest existing ancestor. Creates nothing else."""
    base = config.base_output_directory
    if "://" in base:
        return
    path = config.run_dir
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    where = f"base_output_directory='{base}' (run directory {config.run_dir})"
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: {path} is a file, not a directory; choose another base_output_directory or "
                          f"run_name")
    folders = [path]
    if path == config.run_dir and os.path.isdir(os.path.join(path, "checkpoints")):
        folders.append(os.path.join(path, "checkpoints"))
    for folder in folders:
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".maxctx-write-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(f"{where}: cannot write in {folder} ({e.strerror or type(e).__name__}); choose a "
                              f"writable base_output_directory") from None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start is None or _start_time(pid) in (None, start)


class RunLock:
    """`<run_dir>/maxctx.lock`, held while the run lives (see the module docstring). `acquire` raises ConfigError
    (one line) when another live run holds it; `release` removes it and any folder it had to create that is still
    empty, so a run that failed before writing anything leaves nothing behind."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK)
        self._created: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str:
        """Takes the lock; returns a note to print when it took over a stale one ("" otherwise)."""
        folder = os.path.dirname(self.path)
        while not os.path.isdir(folder):
            self._created.insert(0, folder)
            folder = os.path.dirname(folder)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
        note = ""
        for attempt in range(3):  # a racing run may replace the file between our reads
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, stale = self._holder()
                if holder is not None and not stale:
                    self.release()
                    raise ConfigError(
                        f"{os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid')} on host "
                        f"{holder.get('host')}); wait for it to end or stop it, or choose another run_name (if that "
                        f"run is gone, delete {self.path})") from None
                if holder is not None and self._set_aside(holder, attempt):
                    note = (f"took over the lock of a run that is gone (pid {holder.get('pid')} on host "
                            f"{holder.get('host')})")
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._thread = threading.Thread(target=self._heartbeat, name="maxctx-lock-heartbeat", daemon=True)
            self._thread.start()
            return note
        self.release()
        raise ConfigError(f"could not take the lock {self.path}: other runs keep replacing it; make sure only one run "
                          f"uses run_name={os.path.basename(os.path.dirname(self.path))}")

    def _set_aside(self, holder: dict, attempt: int) -> bool:
        """Moves a stale lock out of the way; if what was moved is not the stale lock (a racing run replaced it
        first), puts it back. Returns whether the stale lock was moved."""
        moved = f"{self.path}.stale.{os.getpid()}.{attempt}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        try:
            with open(moved) as f:
                same = json.load(f) == holder
        except (OSError, ValueError):
            same = holder == {}
        if not same:
            try:
                os.link(moved, self.path)  # fails if yet another run has created one meanwhile: it holds the lock
            except OSError:
                pass
        os.unlink(moved)
        return same


    def _holder(self) -> tuple[dict | None, bool]:
        """(the lock's content, whether it is stale); (None, False) when it vanished meanwhile. Content that is
        not a lock's (a holder killed while writing it) is judged by its age alone."""
        age = 0.0
        try:
            age = time.time() - os.stat(self.path).st_mtime
            with open(self.path) as f:
                holder = json.load(f)
        except FileNotFoundError:
            return None, False
        except (OSError, ValueError):
            holder = None
        if not isinstance(holder, dict) or age >= STALE_S:
            return holder if isinstance(holder, dict) else {}, age >= STALE_S
        here = holder.get("host") == socket.gethostname()
        return holder, here and not _running(int(holder.get("pid", -1)), holder.get("start"))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Removes the lock (if held) and the folders `acquire` created that are still empty; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        for folder in reversed(self._created):
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty: the run wrote something
        self._created = []


def lock_run_dir(config: Config) -> RunLock:
    """Process 0 takes the run directory's lock; every process raises the same ConfigError when it is taken.
    Prints the note when a stale lock was taken over. Call after jax.distributed is initialised."""
    import jax
    import numpy as np

    lock, problem, note = RunLock(config.run_dir), "", ""
    if jax.process_index() == 0 and "://" not in config.run_dir:
        try:
            note = lock.acquire()
        except ConfigError as e:
            problem = str(e)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if int(multihost_utils.broadcast_one_to_all(np.int32(bool(problem)))) and not problem:
            problem = f"{config.run_dir} is in use by another run (process 0 says which)"
    if problem:
        raise ConfigError(problem)
    if note:
        print(note, flush=True)
    return lock
