"""Orbax parameter checkpoints written and read one layer at a time.

Writing. Orbax saves a tree of arrays that all exist at once; a converted model would then sit in host memory
whole. Here each leaf is a `Deferred` (shape, dtype and a function that makes one slice of it), and its handler
writes the leaves one after the other and a stacked [L, ...] leaf one layer at a time, each layer its own zarr
chunk, so the process holds one layer of one parameter. The handler's type name is numpy's and the files are
Orbax's own format (zarr arrays in an OCDBT database, the tree metadata): the checkpoint is an ordinary one,
restored by `maxctx.checkpoint.manager` like any other (`load_parameters_path`).

Reading. `open_arrays` opens parameters of a checkpoint's `state` item for reading slices of them (a layer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import future as ocp_future, type_handlers
from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils

from maxctx.checkpoint.integrity import write_record


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A leaf made only when it is written. Stacked (`stacked=True`): `make(i)` returns layer i, of shape
    `shape[1:]`; otherwise `make(None)` returns the whole array."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[int | None], np.ndarray]
    stacked: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)


class _DeferredHandler(type_handlers.NumpyHandler):
    """Orbax's numpy handler, one leaf, and one layer of a stacked leaf, at a time: make it, write it, drop it."""

    def __init__(self) -> None:
        super().__init__(deepcopy_host_arrays=False)

    async def _write(self, value: Deferred, info, arg) -> None:
        await info.await_path_creation()
        # The "local" (per-write) shape sets the zarr chunk: one layer, so each layer is written whole on its own.
        local = (1, *value.shape[1:]) if value.stacked else value.shape
        spec = tensorstore_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=local, dtype=value.dtype,
            use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint)).json
        array = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
        for i in range(value.shape[0]) if value.stacked else [None]:
            part = value.make(i)
            want = value.shape[1:] if value.stacked else value.shape
            if part.shape != tuple(want) or part.dtype != value.dtype:
                raise AssertionError(f"{info.name}: made {part.shape} {part.dtype}, declared {want} {value.dtype}")
            await (array[i] if value.stacked else array).write(part)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)

        async def one_by_one():
            for value, info, arg in zip(values, infos, args):
                await self._write(value, info, arg)

        return [ocp_future.CommitFutureAwaitingContractedSignals(one_by_one(), name="deferred_numpy")]


def save_deferred(item_dir: epath.Path, tree: dict[str, Any]) -> None:
    """Writes `tree` (leaves: Deferred) as an Orbax PyTree item at `item_dir`, with maxctx's integrity record."""
    registry = type_handlers.create_type_handler_registry((Deferred, _DeferredHandler()),
                                                          (jax.Array, type_handlers.ArrayHandler()))
    # Uncompressed: with zstd, tensorstore keeps encoded chunks of earlier parameters in memory while it writes
    # (benchmarks/convert_memory.md).
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(item_dir, args=ocp.args.PyTreeSave(tree))
    write_record(item_dir)


def save_json(item_dir: epath.Path, value: dict) -> None:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        checkpointer.save(item_dir, args=ocp.args.JsonSave(value))
    write_record(item_dir)


def shapes(item_dir: epath.Path) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """{path: (shape, dtype)} of every array of a saved PyTree item."""
    tree = ocp.PyTreeCheckpointHandler().metadata(item_dir).tree
    flat = ocp.tree.to_flat_dict(tree)
    return {tuple(str(k) for k in path): (tuple(m.shape), np.dtype(m.dtype)) for path, m in flat.items()}


def open_arrays(item_dir: epath.Path, paths: list[tuple[str, ...]]) -> dict[tuple[str, ...], Any]:
    """Arrays of a saved PyTree item, opened (not read) with tensorstore: `array[i].read().result()` reads one
    layer of a stacked parameter (cheaply where each layer is its own chunk)."""
    saved = json.loads((item_dir / "_METADATA").read_text())
    context, arrays = type_handlers.get_ts_context(), {}
    for path in paths:
        info = type_handlers.ParamInfo(name=".".join(path), parent_dir=item_dir, ts_context=context,
                                       is_ocdbt_checkpoint=saved.get("use_ocdbt", True),
                                       use_zarr3=saved.get("use_zarr3", False))
        spec = type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
        arrays[path] = ts.open(spec, open=True, context=context).result()
    return arrays
