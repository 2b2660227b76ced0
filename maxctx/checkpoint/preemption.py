"""Preemption notices and Ctrl-C: when to stop, agreed by every process (maxctx.checkpoint.manager saves there).

Preemption (SIGTERM): the run finishes its current step, saves it, waits for the save to commit and exits 0.
Single process: a signal handler sets a flag read after each step. Multi-process: processes get the signal at
different times and are at different steps, so they must agree on one step to save; JAX's preemption service
(started by jax.distributed.initialize, with its own SIGTERM notifier) spreads the notice and
`reached_preemption_sync_point(step)` turns True on every process at the same step (max step seen + 1). Both are
checked in Checkpointer.should_save (maxctx.checkpoint.manager), which every process calls after every step. Ctrl-C
(SIGINT) does the same; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """Has a preemption notice (SIGTERM) or a Ctrl-C (SIGINT) arrived, agreed by every process for the same step?
    The module docstring has the single- and multi-process mechanisms. A Ctrl-C is handled like SIGTERM (in a
    multi-process job, by sending SIGTERM to this process, which JAX's preemption service spreads); a second
    Ctrl-C exits at once (status 130) without saving."""

    def __init__(self) -> None:
        self.multi_process = jax.process_count() > 1
        self.flag = False
        self.reason = "preemption notice (SIGTERM)"
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            if not self.multi_process:
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_signal(self, signum, frame) -> None:
        self.flag = True

    def _on_interrupt(self, signum, frame) -> None:
        if self.reason.startswith("interrupt"):
            print("second Ctrl-C: stopping now without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.reason = "interrupt (Ctrl-C)"
        print("Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C again stops at once)", flush=True)
        if self.multi_process:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.flag = True

    def pending(self) -> bool:
        """A notice has arrived in this single-process run (multi-process runs agree on it at a step instead)."""
        return self.flag and not self.multi_process

    def reached(self, step: int) -> bool:
        if self.multi_process and not self.flag:
            try:
                self.flag = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service=false)
                self.multi_process = False
        return self.flag

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
