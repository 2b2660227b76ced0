"""The parallelism arithmetic, without JAX: the mesh axis names, axis sizes from the ici_*/dcn_* keys, the
context-parallel degree and its split, the process count. Every other module takes these names from here.

Configured axes (CONFIGURED_AXES): data, fsdp, context, tensor, one ici_* and one dcn_* key each. The context degree
C = ici x dcn context parallelism is split into a ring part R (mesh axis RING_AXIS, `context`, outer) and an
all-to-all part U (A2A_AXIS, `context_a2a`, inner), C = R x U, so the mesh has MESH_AXES. Which U a strategy uses
is the strategy's rule (maxctx.attention.<strategy>.a2a_degree); this module only does the arithmetic.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from maxctx.config import Config, ConfigError

RING_AXIS, A2A_AXIS = "context", "context_a2a"
BATCH_AXES = ("data", "fsdp")
CONTEXT_AXES = (RING_AXIS, A2A_AXIS)  # the sequence's shards: index = ring rank x U + a2a rank
CONFIGURED_AXES = (*BATCH_AXES, RING_AXIS, "tensor")
MESH_AXES = (*BATCH_AXES, *CONTEXT_AXES, "tensor")


def num_slices(config: Config) -> int:
    """Slices the job spans: `compile_topology_num_slices` when compiling for a topology; else 1 (every CPU and
    GPU run, and one TPU slice)."""
    return max(1, config.compile_topology_num_slices) if config.compile_topology else 1


def mesh_sizes(config: Config, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """Resolves the ici_* and dcn_* sizes (one -1 per group fills the rest) for `num_devices` devices.

    Single-slice runs have dcn product 1: a -1 there becomes 1.
    """
    dcn = {a: getattr(config, f"dcn_{a}_parallelism") for a in CONFIGURED_AXES}
    ici = {a: getattr(config, f"ici_{a}_parallelism") for a in CONFIGURED_AXES}
    slices = num_slices(config)
    dcn = _fill(dcn, slices, "dcn", "number of slices")
    per_slice, rem = divmod(num_devices, slices)
    if rem:
        raise ConfigError(f"{num_devices} devices do not split into {slices} slices")
    ici = _fill(ici, per_slice, "ici", "devices per slice")
    return ici, dcn


def _fill(sizes: dict[str, int], total: int, group: str, what: str) -> dict[str, int]:
    names = {a: f"{group}_{a}_parallelism" for a in sizes}
    free = [a for a, s in sizes.items() if s == -1]
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ConfigError(f"{names[a]}={s} must be a positive size or -1 (fill the rest)")
    if len(free) > 1:
        raise ConfigError(f"{' and '.join(names[a] + '=-1' for a in free)}: at most one {group}_* size may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if total % fixed:
            raise ConfigError(f"{names[free[0]]}=-1 cannot fill {total} {what}: the other {group}_* sizes multiply "
                              f"to {fixed}, which does not divide {total}")
        sizes = {**sizes, free[0]: total // fixed}
    elif fixed != total:
        given = " x ".join(f"{names[a]}={s}" for a, s in sizes.items())
        raise ConfigError(f"{given} = {fixed}, but there are {total} {what}; make the product {total} or set one "
                          f"size to -1")
    return sizes


def configured_sizes(config: Config, num_devices: int) -> dict[str, int]:
    """Total size (ici x dcn) of each of CONFIGURED_AXES for `num_devices` devices (context not yet split)."""
    ici, dcn = mesh_sizes(config, num_devices)
    return {a: ici[a] * dcn[a] for a in CONFIGURED_AXES}


def context_degree(config: Config, num_devices: int) -> int:
    """The context-parallel degree C the config asks for on `num_devices` devices."""
    return configured_sizes(config, num_devices)[RING_AXIS]


def mesh_context_degree(shape: Mapping[str, int]) -> int:
    """C of a built mesh: R x U from its axis sizes (`mesh.shape`, or `split_context`'s sizes)."""
    return shape[RING_AXIS] * shape[A2A_AXIS]


def split_context(config: Config, num_devices: int, a2a: int) -> dict[str, int]:
    """Sizes of MESH_AXES, with context split into the ring part R (RING_AXIS) and the A2A part U (A2A_AXIS).

    All-to-all runs inside a slice, so U must divide ici_context_parallelism (and so C).
    """
    ici, dcn = mesh_sizes(config, num_devices)
    if ici[RING_AXIS] % a2a:
        raise ConfigError(f"the A2A degree {a2a} (context_parallel_a2a_degree, or the strategy's default) does not "
                          f"divide ici_context_parallelism={ici[RING_AXIS]}; all-to-all runs inside a slice, so "
                          f"choose a divisor of {ici[RING_AXIS]}")
    sizes = {a: ici[a] * dcn[a] for a in CONFIGURED_AXES}
    sizes.update({RING_AXIS: sizes[RING_AXIS] // a2a, A2A_AXIS: a2a})
    return {a: sizes[a] for a in MESH_AXES}


def balanced_a2a_degree(cp: int, heads: int) -> int:
    """The largest divisor U of C with U x U <= C that divides `heads` (C=4 -> 2, C=8 -> 2, C=16 -> 4): both the
    all-to-all and the ring part take part."""
    return max(u for u in range(1, cp + 1) if cp % u == 0 and u * u <= cp and heads % u == 0)


def num_processes(config: Config) -> int:
    """Processes in the job as configured: `jax_num_processes`, else env JAX_NUM_PROCESSES, else 0 (unknown)."""
    return config.jax_num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
