"""Which rows of the global batch each process loads, and per-host rows -> global arrays.

Batch arrays are laid out x[B_(data,fsdp), S_(context,context_a2a)]. A process loads, whole, exactly the rows its
own devices hold (whole rows because packing, the target shift and the zig-zag reorder need the full sequence):
its `row_blocks` of each global batch of the one row stream (maxctx.data.pipeline: the data position is global).
Processes whose devices hold the same rows (a context or tensor axis spanning processes) form one loading group
and load the same rows, so their copies agree. (`shard_index` of `shard_count`: the group, which an older version
read its own disjoint part of the documents by; a state it saved resumes on that pipeline.)
`jax.make_array_from_process_local_data` then takes each device's column block from the host's whole rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxctx.mesh import batch_sharding


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """This process's share of a [global_batch, seq_len] batch."""

    global_shape: tuple[int, int]
    row_blocks: tuple[tuple[int, int], ...]  # [start, stop) rows of the global batch this process loads, sorted
    shard_index: int  # this process's loading group
    shard_count: int  # the number of loading groups

    @property
    def local_rows(self) -> int:
        return sum(stop - start for start, stop in self.row_blocks)


def _row_blocks_by_process(sharding: NamedSharding, shape: tuple[int, int]) -> dict[int, frozenset]:
    blocks: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        start, stop, _ = index[0].indices(shape[0])
        blocks.setdefault(device.process_index, set()).add((start, stop))
    return {p: frozenset(b) for p, b in blocks.items()}


def host_layout(mesh: Mesh, global_batch: int, seq_len: int, process_index: int | None = None) -> HostLayout:
    """The rows `process_index` (default: this process) loads and the part of the data it reads."""
    process_index = jax.process_index() if process_index is None else process_index
    shape = (global_batch, seq_len)
    by_process = _row_blocks_by_process(batch_sharding(mesh), shape)
    groups = sorted(set(by_process.values()), key=min)
    rows = [r for group in groups for start, stop in group for r in range(start, stop)]
    if len(rows) != len(set(rows)):
        raise ValueError(f"the mesh {dict(mesh.shape)} gives processes overlapping but unequal row blocks of the "
                         f"batch; the input pipeline needs each process's rows to equal or avoid another's")
    mine = by_process.get(process_index, frozenset())
    return HostLayout(global_shape=shape, row_blocks=tuple(sorted(mine)),
                      shard_index=groups.index(mine) if mine else 0, shard_count=len(groups))


def to_global_arrays(local: dict[str, np.ndarray], mesh: Mesh, layout: HostLayout) -> dict[str, jax.Array]:
    """Per-host rows [local_rows, S] (already in CP order) -> global [B, S] arrays on `mesh`."""
    sharding = batch_sharding(mesh)
    return {name: jax.make_array_from_process_local_data(sharding, value, layout.global_shape)
            for name, value in local.items()}
