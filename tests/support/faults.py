"""Faults to inject into a run, shared by tests/test_faults.py and scripts/fault_matrix.py: damage to a saved
checkpoint step (DAMAGE), and kill -9 at a random moment of a run that saves every step."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.support.processes import ROOT, steps_on_disk


def copy_steps(reference_run: Path, run_dir: Path, steps: list[int]) -> None:
    """A run directory holding copies of `steps` of a reference run's checkpoints (as if it had stopped there)."""
    for step in steps:
        shutil.copytree(reference_run / "checkpoints" / str(step), run_dir / "checkpoints" / str(step))


def largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)


def overwrite_bytes(step_dir: Path) -> None:
    with open(largest_array_file(step_dir), "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        f.write(bytes(range(64)))


def truncate(step_dir: Path) -> None:
    path = largest_array_file(step_dir)
    os.truncate(path, path.stat().st_size // 3)


DAMAGE = {  # name -> (how to damage a step directory, a phrase of the one-line report)
    "bytes_overwritten": (overwrite_bytes, "fails its checksum"),
    "array_file_truncated": (truncate, "bytes, "),
    "array_file_deleted": (lambda step: largest_array_file(step).unlink(), "is missing"),
    "state_metadata_deleted": (lambda step: (step / "state" / "_METADATA").unlink(), "state/_METADATA is missing"),
    "meta_item_deleted": (lambda step: shutil.rmtree(step / "meta"), "'meta' item is missing"),
    "integrity_record_deleted": (lambda step: (step / "data" / "maxctx_integrity.json").unlink(),
                                 "has no integrity record"),
    "empty_step_directory": (lambda step: (shutil.rmtree(step), step.mkdir()), "its directory is empty"),
}


def kill_at_random_moment(command: list[str], env: dict, run_dir: Path, rng: random.Random,
                          window_s: float = 2.5) -> float:
    """Starts `command` (a run saving every step) and kills it (SIGKILL) a random time within `window_s` after
    its first step; returns that delay."""
    proc = subprocess.Popen([str(c) for c in command], env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    delay = rng.uniform(0.0, window_s)
    try:
        for line in proc.stdout:
            if line.startswith("step 1/"):
                break
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return delay


def saved_steps(run_dir: Path) -> list[int]:
    """The committed step directories of a run (not tmp, not set aside)."""
    if not (run_dir / "checkpoints").is_dir():
        return []
    return sorted(int(s) for s in steps_on_disk(run_dir) if s.isdigit())
