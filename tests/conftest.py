"""Test set-up: 8 simulated CPU devices and XLA:CPU's quick backend (tests.support.processes.CPU_FLAGS), set before
JAX is imported anywhere."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.processes import CPU_FLAGS  # noqa: E402 (no JAX in it; the path first)

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), CPU_FLAGS,
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
