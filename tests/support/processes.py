"""Child processes for tests: their environments, `python train.py ...` commands, free ports, and what a run
wrote (metrics, losses, checkpoint steps).

The test process runs JAX on 8 simulated CPU devices (conftest sets XLA_FLAGS and JAX_PLATFORMS=cpu). A child that
trains picks its own device count with `cpu_devices=N`, so `cpu_env` drops the forced count; a child that compiles
for an abstract TPU must not be held to the CPU platform at all (`tpu_env`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_YML = ROOT / "configs" / "base.yml"
HOOKED_TRAIN = ROOT / "tests" / "support" / "hooked_train.py"  # train.py with the checkpoint tests' hooks
# XLA:CPU's code generation without LLVM's slow optimisations, for the tests and their CPU children: compiling
# dominates the suite (a tiny train step: 9.2 s -> 6.2 s), and the HLO passes, so the programs' buffers and
# collectives, are XLA's usual ones. The tests compare runs compiled alike; none times a step.
# (tests.support.meshes.FAST_COMPILE passes the same options to single compiles.)
QUICK_BACKEND = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CPU_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in QUICK_BACKEND.items())


def cpu_env(compile_cache: str | Path | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child on the CPU platform that sets its own device count (XLA_FLAGS: the
    quick backend's only); with
    `compile_cache`, the child keeps every compiled program there, so later runs of the same shapes reuse them."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=CPU_FLAGS)
    if compile_cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(compile_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return {**env, **extra}


def tpu_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that compiles for abstract TPU devices (libtpu, no TPU): neither the
    CPU platform nor the simulated devices, and the repository importable from any working directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def train_command(*overrides: str, script: str | Path | None = None) -> list[str]:
    """`python train.py configs/base.yml key=value ...` (absolute paths, so it runs from any directory), or the
    same arguments to `script`. A later value of a key replaces an earlier one, so a test's own keys can follow
    and override its common ones."""
    keys = dict(kv.split("=", 1) for kv in overrides)
    return [sys.executable, str(script or ROOT / "train.py"), str(BASE_YML), *(f"{k}={v}" for k, v in keys.items())]


def run(command: list, env: dict[str, str] | None = None, cwd: str | Path = ROOT,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `command` to the end (default environment: `cpu_env()`) and returns it with its text output."""
    return subprocess.run([str(c) for c in command], cwd=cwd, env=cpu_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def python(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    """`run` of `python args...` with this interpreter."""
    return run([sys.executable, *args], **kwargs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: str | Path) -> dict[int, float]:
    """Step -> training loss of every logged step of a run."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if r.get("event") == "train"}


def steps_on_disk(run_dir: str | Path) -> list[str]:
    """The names in a run's checkpoint folder (saved steps, and any save cut off midway), sorted."""
    return sorted(os.listdir(Path(run_dir, "checkpoints")))
