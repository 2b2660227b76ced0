"""The parallelism arithmetic, without JAX: the table of mesh axes, the logical rules, axis sizes from the
ici_*/dcn_* keys, the context-parallel degree and its split, the mesh as a value (`MeshPlan`), the process count.
Every other module takes the axis names from here; maxctx.mesh builds the JAX mesh from a MeshPlan.

The table (AXES): data, fsdp, context, tensor, one ici_* and one dcn_* key each. The context degree
C = ici x dcn context parallelism is split into a ring part R (mesh axis RING_AXIS, `context`, outer) and an
all-to-all part U (A2A_AXIS, `context_a2a`, inner), C = R x U, so the mesh has MESH_AXES. Which U a strategy uses
is the strategy's rule (maxctx.attention.cp.<strategy>.a2a_degree; maxctx.attention.cp.strategies.mesh_plan);
this module only does the arithmetic.

Experts have no axis of their own: they borrow the devices of fsdp and context (EXPERT_AXES), as torchtitan's
expert parallelism borrows all of context parallelism and some of data-parallel sharding: an expert degree E is
a product of the leading axes the experts are sharded over (`ep_axes`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from maxctx.config import Config, ConfigError

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
RING_AXIS, A2A_AXIS = "context", "context_a2a"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
CONTEXT_AXES = (RING_AXIS, A2A_AXIS)  # the sequence's shards: index = ring rank x U + a2a rank
EXPERT_AXES = (FSDP_AXIS, *CONTEXT_AXES)  # the devices experts borrow (module doc)

# Logical name -> mesh axes. Weights shard their embed dimension over fsdp and the context axes too (as MaxText
# does): CP devices would otherwise hold replicas. Activations use the `activation_*` names.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "length": CONTEXT_AXES,
    "embed": (FSDP_AXIS, *CONTEXT_AXES),
    "lora": (FSDP_AXIS, *CONTEXT_AXES),  # MLA's low-rank dimension of wq_b and wkv_b: sharded like a weight's embed
    "heads": (TENSOR_AXIS,),
    "kv_heads": (TENSOR_AXIS,),
    "mlp": (TENSOR_AXIS,),
    "vocab": (TENSOR_AXIS,),
    "expert": EXPERT_AXES,
    "head_dim": (),
    "layers": (),
    "norm": (),
    "activation_embed": (),
    "activation_heads": (TENSOR_AXIS,),
    "activation_kv_heads": (TENSOR_AXIS,),
    "activation_mlp": (TENSOR_AXIS,),
    "activation_vocab": (TENSOR_AXIS,),
}


def resolve_axes(names: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
                 sizes: Mapping[str, int] | None = None) -> tuple[tuple[str, ...], ...]:
    """The mesh axes each dimension of an array with logical axis `names` is split over (LOGICAL_RULES). With the
    mesh axes' `sizes`, size-1 axes are left out; with `shape` too, axes that do not divide a dimension (or that an
    earlier dimension already uses) are dropped, so that dimension is replicated over them instead."""
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        keep: list[str] = []
        for axis in LOGICAL_RULES[name] if name is not None else ():
            if axis in used or (sizes is not None and sizes[axis] == 1):
                continue
            if sizes is not None and shape is not None and shape[i] % (sizes[axis] * math.prod(sizes[a] for a in keep)):
                continue
            keep.append(axis)
        used.update(keep)
        out.append(tuple(keep))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One configured parallelism: `name` (its ici_<name>_parallelism and dcn_<name>_parallelism keys) and the mesh
    axes it splits into, outer first."""

    name: str
    mesh_axes: tuple[str, ...]

    @property
    def keys(self) -> tuple[str, str]:
        return f"ici_{self.name}_parallelism", f"dcn_{self.name}_parallelism"

    @property
    def serves(self) -> tuple[str, ...]:
        """The logical names that shard over this axis (LOGICAL_RULES)."""
        return tuple(name for name, axes in LOGICAL_RULES.items() if set(axes) & set(self.mesh_axes))


AXES = (Axis(DATA_AXIS, (DATA_AXIS,)), Axis(FSDP_AXIS, (FSDP_AXIS,)), Axis(RING_AXIS, CONTEXT_AXES),
        Axis(TENSOR_AXIS, (TENSOR_AXIS,)))
CONFIGURED_AXES = tuple(axis.name for axis in AXES)
MESH_AXES = tuple(mesh_axis for axis in AXES for mesh_axis in axis.mesh_axes)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The mesh as a value, built once (`mesh_plan`) and read by mesh creation, validation, the planner, the time
    model and data: `ici` and `dcn` per configured axis (CONFIGURED_AXES, context unsplit), and the A2A degree U."""

    ici: Mapping[str, int]
    dcn: Mapping[str, int]
    a2a: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        """Total size (ici x dcn) of each of MESH_AXES, context split into R (RING_AXIS) and U (A2A_AXIS)."""
        total = {a: self.ici[a] * self.dcn[a] for a in CONFIGURED_AXES}
        total.update({RING_AXIS: total[RING_AXIS] // self.a2a, A2A_AXIS: self.a2a})
        return {a: total[a] for a in MESH_AXES}

    def _split(self, sizes: Mapping[str, int], a2a: int) -> tuple[int, ...]:
        return tuple(s for axis in AXES for s in ((sizes[axis.name] // a2a, a2a) if axis.name == RING_AXIS
                                                   else (sizes[axis.name],)))

    @property
    def ici_shape(self) -> tuple[int, ...]:
        """Devices per slice along MESH_AXES (the A2A part always inside a slice)."""
        return self._split(self.ici, self.a2a)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        """Slices along MESH_AXES."""
        return self._split(self.dcn, 1)

    @property
    def cp(self) -> int:
        """The context-parallel degree C = R x U."""
        return self.ici[RING_AXIS] * self.dcn[RING_AXIS]

    @property
    def ring(self) -> int:
        return self.cp // self.a2a

    @property
    def batch_shards(self) -> int:
        """Shards of the batch dimension (data x fsdp)."""
        return math.prod(self.sizes[a] for a in BATCH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @classmethod
    def one_slice(cls, sizes: Mapping[str, int]) -> MeshPlan:
        """The plan of one slice with these MESH_AXES sizes (a built mesh's `mesh.shape`, or a benchmark's)."""
        ici = {a: sizes[a] for a in CONFIGURED_AXES if a != RING_AXIS}
        ici[RING_AXIS] = sizes[RING_AXIS] * sizes[A2A_AXIS]
        return cls(ici, dict.fromkeys(CONFIGURED_AXES, 1), sizes[A2A_AXIS])

    @property
    def dcn_cp(self) -> int:
        """Slices the context axis spans (its ring crosses DCN there)."""
        return self.dcn[RING_AXIS]


def entry_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry's mesh axes (None, a name or a tuple), the tensor axis left out."""
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return tuple(a for a in axes if a != TENSOR_AXIS)


def ep_axes(entry, sizes: Mapping[str, int], degree: int) -> tuple[str, ...]:
    """The leading mesh axes of the experts' dimension (its PartitionSpec `entry` in the stored layout) whose
    `sizes` multiply to the expert-parallel `degree`; () for degree 1."""
    axes, run = entry_axes(entry), 1
    degrees = [1]
    for a in axes:
        run *= sizes[a]
        degrees.append(run)
    if degree in degrees:
        return axes[:degrees.index(degree)]
    shown = ", ".join(f"{a}={sizes[a]}" for a in axes) or "none"
    raise ConfigError(f"expert_parallelism={degree} is not a product of the leading axes the experts are sharded "
                      f"over ({shown}, in that order, of {', '.join(EXPERT_AXES)}); choose one of "
                      f"{', '.join(map(str, degrees))}")


def expert_parallel_axes(config: Config, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of expert_parallelism (`ep_axes` of the experts' dimension as resolve_axes splits
    num_experts over the axes' `sizes`), refusing a degree they cannot make; () without it."""
    if config.expert_parallelism == 1:
        return ()
    return ep_axes(resolve_axes(("expert",), (config.num_experts,), sizes)[0], sizes, config.expert_parallelism)


def check_expert_mesh(config: Config, sizes: Mapping[str, int]) -> None:
    """Refuses an expert_parallelism that the mesh axes' `sizes` cannot make, before JAX: the planner's candidates
    and maxctx.validate (a degree that does not divide num_experts: maxctx.model.moe.family's message)."""
    if config.num_experts % config.expert_parallelism == 0:
        expert_parallel_axes(config, sizes)


def num_slices(config: Config) -> int:
    """Slices the job spans: `compile_topology_num_slices` when compiling for a topology; else 1 (every CPU and
    GPU run, and one TPU slice)."""
    return max(1, config.compile_topology_num_slices) if config.compile_topology else 1


def mesh_sizes(config: Config, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """Resolves the ici_* and dcn_* sizes (one -1 per group fills the rest) for `num_devices` devices.

    Single-slice runs have dcn product 1: a -1 there becomes 1.
    """
    ici = {axis.name: getattr(config, axis.keys[0]) for axis in AXES}
    dcn = {axis.name: getattr(config, axis.keys[1]) for axis in AXES}
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


def mesh_plan(config: Config, num_devices: int, a2a: int) -> MeshPlan:
    """The MeshPlan of `config` on `num_devices` with A2A degree `a2a` (the strategy's: strategies.mesh_plan).

    All-to-all runs inside a slice, so U must divide ici_context_parallelism (and so C).
    """
    ici, dcn = mesh_sizes(config, num_devices)
    if ici[RING_AXIS] % a2a:
        raise ConfigError(f"the A2A degree {a2a} (context_parallel_a2a_degree, or the strategy's default) does not "
                          f"divide ici_context_parallelism={ici[RING_AXIS]}; all-to-all runs inside a slice, so "
                          f"choose a divisor of {ici[RING_AXIS]}")
    return MeshPlan(ici, dcn, a2a)


def split_context(config: Config, num_devices: int, a2a: int) -> dict[str, int]:
    """Sizes of MESH_AXES, with context split into the ring part R (RING_AXIS) and the A2A part U (A2A_AXIS)."""
    return mesh_plan(config, num_devices, a2a).sizes


def balanced_a2a_degree(cp: int, heads: int) -> int:
    """The largest divisor U of C with U x U <= C that divides `heads` (C=4 -> 2, C=8 -> 2, C=16 -> 4): both the
    all-to-all and the ring part take part."""
    return max(u for u in range(1, cp + 1) if cp % u == 0 and u * u <= cp and heads % u == 0)


def num_processes(config: Config) -> int:
    """Processes in the job as configured: `jax_num_processes`, else env JAX_NUM_PROCESSES, else 0 (unknown)."""
    return config.jax_num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
