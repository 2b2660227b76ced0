"""A checkpoint save that fails on storage (disk full, quota, read-only or failing disk): what went wrong, in words,
and what it left behind.

Where it surfaces. A synchronous save raises from `CheckpointManager.save`. An asynchronous one fails in Orbax's
background thread, and the error is raised once, at the next wait: the start of the next save, a preemption save's
wait, or the wait at the end of the run. TensorStore reports a failed write as a ValueError whose message carries
the OS error (`... No space left on device [os_error_code='28']`); Python writers (JSON items, the integrity
record, Orbax's metadata) raise OSError.

What it leaves. Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it only once every item is
written, and the integrity record (maxctx.checkpoint.integrity) is written before that rename; so a failed save
leaves a tmp directory, never a `<step>` directory a resume would pick, and the committed steps are untouched.
Once the failed save's other writes have ended (`settle_writes`: Orbax raises at the first failed write while the
others are still running), the tmp directory is removed (it is this run's own partial write, not a checkpoint), so
that a full disk gets its space back before the next try. maxctx.checkpoint.manager applies `checkpoint_failure_policy`.

Orbax logs each failed write with its traceback; `QuietStorageErrors` drops those records, since the run reports
the failure itself in one line. Orbax also closes a write's event loop at its first failed write while TensorStore
still holds callbacks into it; each then fails with "Event loop is closed", which Python reports as an unraisable
error, and the futures of the other failed writes go unawaited, which asyncio logs when they are collected;
`quiet_abandoned_writes` drops exactly those reports.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from etils import epath

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_STORAGE_WORDS = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|Input/output error|"
                            r"Permission denied")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def storage_problem(error: BaseException) -> str | None:
    """'no space left on device (disk full)', ..., for an error of the storage under a save; None for any other
    error (a bug, which should surface as one)."""
    for cause in _chain(error):
        code = cause.errno if isinstance(cause, OSError) and cause.errno else None
        found = _OS_ERROR_CODE.search(str(cause))
        if code is None and found:
            code = int(found.group(1))
        if code is not None:
            words = os.strerror(code).lower()
            return f"{words} (disk full)" if code in (errno.ENOSPC, errno.EDQUOT) else words
        if isinstance(cause, OSError) or _STORAGE_WORDS.search(str(cause)):
            line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            return f"{type(cause).__name__}: {line[:200]}"
    return None


def storage_error(action: Callable[[], object]) -> Exception | None:
    """Runs `action` (an Orbax save or wait); returns the storage error it raised, if any; raises any other."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 - storage errors only; anything else is re-raised
        if storage_problem(e) is None:
            raise
        return e
    return None


def failure_report(step: int, error: Exception | None, directory: epath.Path, good_step: str | None, policy: str,
                   last: bool) -> tuple[str, bool]:
    """(the one line about the failed save of `step`, whether training goes on): it goes on with
    policy 'continue' unless `last` (no later save will try again)."""
    problem = storage_problem(error) if error is not None else "another process could not write its part"
    head = (f"saving checkpoint step {step} to {directory} failed: {problem}; "
            f"{f'checkpoint step {good_step} and older are intact' if good_step else 'no earlier checkpoint'}")
    if policy == "continue" and not last:
        return f"{head}; training on (checkpoint_failure_policy=continue), the next save tries again", True
    resume = f"resume from step {good_step}" if good_step else "start over"
    alternative = (", or set checkpoint_failure_policy=continue to train on through failed saves"
                   if policy == "exit" and not last else "")
    return (f"{head}; free space (or lower max_num_checkpoints_to_keep) and re-run the same command to {resume}"
            f"{alternative}"), False


def remove_partial_save(directory: epath.Path, step: int) -> None:
    """Deletes what a failed save of `step` wrote: its `<step>.orbax-checkpoint-tmp*` directories, never a committed
    step. Best effort: on a failing disk the removal may fail too, and the next start removes them anyway."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.startswith(f"{step}{_TMP_SUFFIX}"):
            try:
                path.rmtree()
            except OSError:
                pass


def settle_writes(timeout_s: float = 60.0) -> None:
    """Waits (at most `timeout_s`) for Orbax's write threads still running after a failed save to end."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if type(thread).__name__ == "_SignalingThread" and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


class QuietStorageErrors(logging.Filter):
    """Drops log records (Orbax's, through absl) that carry a storage error: the run reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or storage_problem(error) is None


def quiet_abandoned_writes() -> None:
    """Wraps sys.unraisablehook and sys.excepthook (TensorStore's callbacks report through either) to drop "Event
    loop is closed" from callbacks into a failed save's closed event loop; everything else passes on. Also drops
    asyncio's "Future exception was never retrieved" for a storage error: the other writes of a failed save, whose
    futures nobody awaits once the first failure is reported, logged when they are collected, as late as the
    interpreter's exit, after the run's one line. Installed once per process and kept to its end."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, QuietStorageErrors) for f in asyncio_log.filters):
        asyncio_log.addFilter(QuietStorageErrors())
    def closed_loop(exc_type, value) -> bool:
        return exc_type is RuntimeError and str(value) == "Event loop is closed"

    if not getattr(sys.unraisablehook, "maxctx_quiet", False):
        unraisable_hook = sys.unraisablehook

        def quiet_unraisable(unraisable) -> None:
            if not closed_loop(unraisable.exc_type, unraisable.exc_value):
                unraisable_hook(unraisable)

        quiet_unraisable.maxctx_quiet = True
        sys.unraisablehook = quiet_unraisable
    if not getattr(sys.excepthook, "maxctx_quiet", False):
        except_hook = sys.excepthook

        def quiet_except(exc_type, value, traceback) -> None:
            if not closed_loop(exc_type, value):
                except_hook(exc_type, value, traceback)

        quiet_except.maxctx_quiet = True
        sys.excepthook = quiet_except
