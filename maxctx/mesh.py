"""The JAX device mesh built from a MeshPlan (maxctx.parallelism), and PartitionSpecs from logical axis names
through maxctx.parallelism.LOGICAL_RULES.

Mesh axes (maxctx.parallelism.MESH_AXES): data, fsdp, context, context_a2a, tensor. The context-parallel degree C
is split as context (ring part R, outer) x context_a2a (all-to-all part U, inner): a2a uses U = C, p2p and
all_gather R = C, usp both. The sequence is sharded over (context, context_a2a) whatever the strategy, so token
shard index = ring_rank * U + a2a_rank. The config is checked against the device count before the mesh is built
(maxctx.validate.check_devices, from maxctx.validate or maxctx.runtime.initialize), not here.
"""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxctx.attention.cp import strategies
from maxctx.config import Config, ConfigError
from maxctx.parallelism import BATCH_AXES, CONFIGURED_AXES, CONTEXT_AXES, MESH_AXES, MeshPlan, resolve_axes


def axis_sizes(config: Config, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes (ici x dcn) for `num_devices`, with context split into ring x a2a parts (MESH_AXES)."""
    return strategies.mesh_plan(config, num_devices).sizes


def create_mesh(config: Config, devices: list | None = None, plan: MeshPlan | None = None) -> Mesh:
    """Builds the mesh over `devices` (default: all of JAX's) for a config already checked against their count;
    `plan`: its MeshPlan, when the caller has built it (strategies.mesh_plan)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    plan = plan or strategies.mesh_plan(config, len(devices))
    if math.prod(plan.dcn_shape) > 1:
        grid = mesh_utils.create_hybrid_device_mesh(plan.ici_shape, plan.dcn_shape, devices)
    elif devices[0].platform == "cpu":
        grid = np.asarray(devices).reshape(plan.ici_shape)
    else:
        # The physical mapping is chosen for context unsplit (its ring and A2A parts together); splitting it
        # afterwards keeps each A2A group on adjacent devices of that axis.
        shape = tuple(plan.ici[a] for a in CONFIGURED_AXES)
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except NotImplementedError as e:  # JAX's one way of saying an axis cannot be laid over whole physical axes
            raise ConfigError(_layout_error(shape, devices)) from e
        grid = grid.reshape(plan.ici_shape)
    return Mesh(grid, MESH_AXES)


def _layout_error(shape: tuple[int, ...], devices: list) -> str:
    """The one line for an ICI mesh that JAX cannot lay over the slice's physical axes."""
    coords = np.asarray([d.coords for d in devices])
    physical = [int(n) for n in coords.max(axis=0) - coords.min(axis=0) + 1]
    cores = len(devices) // math.prod(physical)
    physical += [cores] if cores > 1 else []
    named = " x ".join(f"{a} {n}" for a, n in zip(CONFIGURED_AXES, shape) if n > 1) or "1"
    sizes = sorted({math.prod(c) for k in range(1, len(physical) + 1) for c in itertools.combinations(physical, k)})
    return (f"the ICI mesh ({named}) cannot be laid over this slice's physical axes "
            f"({' x '.join(map(str, physical))}{', the last the cores of a chip' if cores > 1 else ''}): JAX gives "
            f"each mesh axis whole physical axes, so each ici_*_parallelism above 1 must be one of "
            f"{', '.join(map(str, sizes))}, together using each physical axis once; choose such a split")


def logical_to_spec(names: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
                    mesh: Mesh | None = None) -> P:
    """PartitionSpec for logical axis names (maxctx.parallelism.resolve_axes: with `mesh`, size-1 mesh axes are
    left out; with `shape` too, mesh axes that do not divide a dimension, or that an earlier dimension already
    uses, are dropped, so that dimension is replicated over them instead)."""
    axes = resolve_axes(names, shape, dict(mesh.shape) if mesh is not None else None)
    return P(*(a if len(a) > 1 else (a[0] if a else None) for a in axes))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Layout of every [B, S] batch array: x[B_(data,fsdp), S_(context,context_a2a)]."""
    return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXES))
