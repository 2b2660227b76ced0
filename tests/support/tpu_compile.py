"""`python -m maxctx.compile` for an abstract TPU topology (libtpu, no TPU) in a subprocess that does not force the
CPU platform: start several, then collect each one's exit status, output and JSON report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import ROOT, tpu_env


def needs_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is not None:
        return
    message = ("libtpu is not installed, so no TPU topology can be compiled for; install it with "
               "pip install 'jax[tpu]==<the installed jax version>'")
    if os.environ.get("MAXCTX_REQUIRE_LIBTPU") == "1":
        pytest.fail(f"MAXCTX_REQUIRE_LIBTPU=1 but {message}")
    pytest.skip(message)


def start_compile(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "maxctx.compile", "configs/base.yml", *overrides], cwd=ROOT,
                            env=tpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, dict | None]:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        report = None
    return proc.returncode, out + err[-3000:], report
