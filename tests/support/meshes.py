"""Meshes over the test process's simulated CPU devices, and compile options for tests that only need a program
that runs, not a fast one."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from maxctx.parallelism import MESH_AXES
from tests.support.processes import QUICK_BACKEND

# Compile time dominates the attention tests; XLA's backend optimisations change no result there (the suite's
# XLA_FLAGS set the same, conftest; kept explicit for the compiles that name it).
FAST_COMPILE = QUICK_BACKEND


def make_mesh(ring: int, a2a: int, tensor: int = 1) -> Mesh:
    """The first ring x a2a x tensor devices as a mesh of context=ring, context_a2a=a2a, tensor=tensor."""
    devices = np.asarray(jax.devices()[: ring * a2a * tensor]).reshape(1, 1, ring, a2a, tensor)
    return Mesh(devices, MESH_AXES)
