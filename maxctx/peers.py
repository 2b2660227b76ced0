"""A process of a multi-process job that dies: the others say so in one line before JAX aborts them.

When one process dies, JAX ends the others with SIGABRT (exit 134) after 0-55 s and 68-91 lines of gloo and
coordination-service errors, none of which names the dead process or says how to go on. Their own Python cannot
say it: the abort comes from a C++ thread (a Check failure calls abort(), Python signal handlers never run).

So each training process of a multi-process run starts a watcher: a small separate process (no JAX) that JAX's
abort of its trainer cannot cut short. It holds
  - a pipe from its trainer, which writes "done" when it ends cleanly, "failed" when it ends with an error, and,
    through faulthandler, "Fatal Python error: Aborted" when it is aborted. End of file without any of them (or
    with another fatal signal) means the trainer died: kill -9, the OOM killer, a segfault;
  - a TCP connection between process 0's watcher (the hub, listening on a port published in JAX's coordination
    key-value store, on process 0's host: the coordinator's) and every other watcher, made before training starts
    (`hello <i> <token>`, answered `welcome`), so that a death at any moment of training is news to the hub.
A watcher whose trainer died tells the others `died <i> <step>` (the hub relays); a connection that ends without
`bye` means the same. Every watcher whose trainer still runs, or was aborted or failed up to LINGER_S s before, prints
ONE line on its stderr (`peer error: process 1 of 2 died (last committed checkpoint: step 20 in ...); ...`),
with the last committed step read from the checkpoint directory at that moment and this process's command to
resume. With the local checkpoint tier on (maxctx.checkpoint.local_tier), the step named is the one the resume
takes: the newest local step that both the dead process's host and this one hold, when it is newer than the
persistent tier's (`<step>` is the dead host's newest local step; -1: none, or a host that vanished, its local
disk most likely with it). A watcher exits when its trainer does (at most LINGER_S s later); it never prints after
a clean end, never blames an aborted process (JAX aborts the survivors too), and a single-process run has none. It
costs the training loop nothing: the trainer writes to it only at its end.
"""

from __future__ import annotations

import faulthandler
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

PREFIX = "peer error: "
LINGER_S = 2.0  # how long a watcher whose trainer was aborted waits for the news of the peer that caused it
KEY = "maxctx/peer_watcher"  # the hub's port and token in the coordination key-value store
_FATAL = "Fatal Python error: "


def newest_step(checkpoint_dir: str) -> int | None:
    """The newest committed step in a local checkpoints directory: Orbax renames `<step>.orbax-checkpoint-tmp*`
    to `<step>` only once every process has written it (the local tier, `<step>.tmp` once this host has), so a save
    cut off by the death is not counted."""
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return None
    return max((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, n))),
               default=None)


def death_line(dead: int, num: int, checkpoint_dir: str, command: str, local_dir: str = "",
               local_step: int | None = None) -> str:
    """The line a surviving process prints; `checkpoint_dir` is empty when checkpointing is off. `local_step`: the
    newest step of the local tier (this process's `local_dir`) that the dead process's host holds too, if any."""
    step = None if not checkpoint_dir or "://" in checkpoint_dir else newest_step(checkpoint_dir)
    local = local_step is not None and (step is None or local_step > step)  # the resume takes the newer tier's
    if not checkpoint_dir:
        where, then = "checkpointing is off", "start over from step 0"
    elif local:
        newer = ", or a newer one there" if "://" in checkpoint_dir else ""
        where = (f"last committed checkpoint: step {local_step} in the local tier {os.path.dirname(local_dir)}, "
                 f"beside {checkpoint_dir}{newer}")
        other = (f"the newest step committed in {checkpoint_dir}" if "://" in checkpoint_dir else
                 f"step {step}" if step is not None else "step 0")
        then = f"resume from step {local_step} (on another process count or mesh: from {other})"
    elif "://" in checkpoint_dir:  # listing an object store needs its client; the resume finds the step itself
        where, then = f"checkpoints in {checkpoint_dir}", "resume from the newest step committed there"
    elif step is None:
        where, then = f"no checkpoint committed yet in {checkpoint_dir}", "start over from step 0"
    else:
        where, then = f"last committed checkpoint: step {step} in {checkpoint_dir}", f"resume from step {step}"
    return (f"{PREFIX}process {dead} of {num} died ({where}); the run stops here: rerun the same command on every "
            f"process to {then}: {command}")


class PeerLink:
    """The trainer's end: starts this process's watcher and tells it how the trainer ended. A context manager
    around training: leaving it normally writes "done", by an exception "failed".

    `publish(key, value)` / `lookup(key)`: the job's key-value store (process 0 publishes, the others wait for it);
    `hub_host`: process 0's host as the other processes reach it; `local_dir`: this process's local checkpoint
    tier ("": none)."""

    def __init__(self, process: int, num: int, checkpoint_dir: str, command: str,
                 publish: Callable[[str, str], None], lookup: Callable[[str], str], hub_host: str,
                 local_dir: str = ""):
        if process == 0:
            token = secrets.token_hex(16)
            dual = socket.has_dualstack_ipv6()
            sock = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                        backlog=min(max(num, 16), socket.SOMAXCONN), dualstack_ipv6=dual)
            publish(KEY, f"{sock.getsockname()[1]} {token}")
        else:
            port, token = lookup(KEY).split()
            sock = socket.create_connection((hub_host, int(port)), timeout=60)
            sock.sendall(f"hello {process} {token}\n".encode())
            _await_welcome(sock)  # from here on the hub knows this process, and its death is news to it
            sock.settimeout(None)
        header = {"process": process, "num": num, "fd": sock.fileno(), "token": token,
                  "checkpoint_dir": checkpoint_dir, "command": command, "echo": faulthandler.is_enabled(),
                  "local_dir": local_dir}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        boot = f"import sys; sys.path.insert(0, {root!r}); from maxctx.peers import main; main()"
        self._watcher = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, pass_fds=[sock.fileno()])
        sock.close()
        self._echo = header["echo"]
        self._send(json.dumps(header))
        # The fatal-signal handler writes in C, where Python cannot run: JAX's abort shows in the watcher.
        faulthandler.enable(file=self._watcher.stdin, all_threads=True)

    def _send(self, line: str) -> None:
        try:
            self._watcher.stdin.write(f"{line}\n".encode())
            self._watcher.stdin.flush()
        except OSError:  # the watcher is gone: training goes on without it
            pass

    def __enter__(self) -> PeerLink:
        return self

    def __exit__(self, kind, value, trace) -> bool:
        faulthandler.disable()
        if self._echo:
            faulthandler.enable()
        self._send("done" if kind is None else "failed")
        try:
            self._watcher.stdin.close()
        except OSError:
            pass
        return False


def _await_welcome(sock: socket.socket) -> None:
    """Reads the hub's `welcome` line, byte by byte: what follows it is the watcher's to read."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("the hub's watcher closed the connection before its welcome")
        line += byte


class Watcher:
    """The watcher process's state; `run` returns when it should exit (see the module doc)."""

    def __init__(self, header: dict):
        self.process, self.num, self.token = header["process"], header["num"], header["token"]
        self.checkpoint_dir, self.command, self.echo = header["checkpoint_dir"], header["command"], header["echo"]
        self.local_dir = header["local_dir"]
        sock = socket.socket(fileno=header["fd"])
        self.listener = sock if self.process == 0 else None
        self.peers: dict[socket.socket, int | None] = {} if self.listener else {sock: 0}  # connection -> process
        self.buffers: dict[object, bytes] = {sock: b"", 0: b""}
        self.ending: str | None = None  # how the trainer said it ends: done, failed, aborted, died
        self.deadline: float | None = None
        self.said = False

    def run(self) -> None:
        while self.deadline is None or time.monotonic() < self.deadline:
            trainer = [0] if self.deadline is None else []  # after its end, only the peers
            sources = [*trainer, *self.peers, *([self.listener] if self.listener else [])]
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            for source in select.select(sources, [], [], timeout)[0]:
                if source is self.listener:
                    conn = self.listener.accept()[0]
                    self.peers[conn], self.buffers[conn] = None, b""
                elif source in self.peers or source == 0:
                    if not self._read(source):
                        self._leave("bye")  # every connection ends in bye or died: a bare close means death
                        return
        self._leave("bye")

    def _read(self, source) -> bool:
        """Handles what `source` (0: the trainer's pipe, or a peer's connection) sent; False: exit now."""
        try:
            data = os.read(0, 65536) if source == 0 else source.recv(65536)
        except OSError:  # a peer killed with unread data resets its connection
            data = b""
        *lines, self.buffers[source] = (self.buffers[source] + data).split(b"\n")
        for line in lines:
            if not (self._from_trainer(line.decode(errors="replace")) if source == 0 else
                    self._from_peer(source, line)):
                return False
        if data:
            return True
        if source != 0:
            return source not in self.peers or self._peer_gone(source, self.peers.pop(source))
        if self.ending in ("failed", "aborted") and not self.said:
            self.deadline = time.monotonic() + LINGER_S  # the news of the peer that caused it may be on its way
            return True
        self._leave(f"died {self.process} {self._newest_local()}" if self.ending in (None, "died") else "bye")
        return False

    def _from_trainer(self, line: str) -> bool:
        if line.startswith(_FATAL):
            self.ending = self.ending or ("aborted" if line == f"{_FATAL}Aborted" else "died")
        elif line in ("done", "failed"):
            self.ending = self.ending or line
        if self.echo and line and line not in ("done", "failed"):
            print(line, file=sys.stderr, flush=True)
        return True

    def _from_peer(self, conn: socket.socket, raw: bytes) -> bool:
        if conn not in self.peers:  # closed by an earlier line
            return True
        words = raw.decode(errors="replace").split()
        if self.peers[conn] is None:  # a connection's first line: hello <process> <token>
            if len(words) == 3 and words[0] == "hello" and words[1].isdigit() and words[2] == self.token:
                self.peers[conn] = int(words[1])
                self._tell(conn, "welcome")
                return True
            words = ["bye"]  # not one of the job's watchers
        if words == ["bye"]:
            self.peers.pop(conn)
            conn.close()
            return True
        if len(words) == 3 and words[0] == "died" and words[1].isdigit() and words[2].lstrip("-").isdigit():
            return self._peer_gone(conn, self.peers.pop(conn), dead=int(words[1]), dead_local=int(words[2]))
        return True

    def _peer_gone(self, conn: socket.socket, process: int | None, dead: int | None = None,
                   dead_local: int = -1) -> bool:
        """A peer connection ended (`died <dead> <dead_local>`, or closed without `bye`); False: exit now."""
        conn.close()
        if process is None:  # it never said hello: not one of the job's watchers
            return True
        dead = process if dead is None or self.listener is not None else dead  # only the hub relays others
        for other in list(self.peers):
            self._tell(other, f"died {dead} {dead_local}")
        if self.said or self.ending in ("done", "died"):
            return True
        common = min(self._newest_local(), dead_local)  # a local step serves only if every host holds it
        print(death_line(dead, self.num, self.checkpoint_dir, self.command, self.local_dir,
                         common if common >= 0 else None), file=sys.stderr, flush=True)
        self.said = True
        return self.deadline is None  # an ended trainer's watcher waited only for this

    def _newest_local(self) -> int:
        """This host's newest committed local step (-1: none, or no local tier)."""
        step = newest_step(self.local_dir) if self.local_dir else None
        return -1 if step is None else step

    def _tell(self, conn: socket.socket, line: str) -> None:
        try:
            conn.sendall(f"{line}\n".encode())
        except OSError:
            pass

    def _leave(self, line: str) -> None:
        for conn in list(self.peers):
            self._tell(conn, line)
            conn.close()
        self.peers.clear()


def main() -> None:
    """The watcher process: its header is the first line from the trainer."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)  # a job-wide signal is for the trainer; the watcher follows it out
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            return
        header += byte
    Watcher(json.loads(header)).run()
