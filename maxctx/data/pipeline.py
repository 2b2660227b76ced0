"""Builds the training (and eval) iterator for a config: host numpy batches -> CP order -> global arrays.

`create_data_iterator(config, mesh, split)` returns an iterator of batch dicts (see maxctx.data) with
`get_state()` / `set_state(state)` so a checkpoint can hold and restore the position in the data.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from maxctx.attention.load_balance import reorder_batch
from maxctx.config import Config
from maxctx.data.synthetic import SyntheticSource
from maxctx.mesh import batch_sharding, context_degree


def to_global_arrays(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global [B, S] arrays laid out x[B_(data,fsdp), S_(context,context_a2a)] from a batch every process holds
    in full; each process materialises only its addressable shards."""
    sharding = batch_sharding(mesh)
    return {name: jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
            for name, value in batch.items()}


class SyntheticIterator:
    """Synthetic batches, a pure function of the step: the state is just the next step."""

    def __init__(self, config: Config, mesh: Mesh, seed_offset: int = 0):
        self.mesh = mesh
        self.cp = context_degree(mesh) if config.context_parallel_load_balance else 1
        global_batch = config.global_batch_size(mesh.devices.size) * config.gradient_accumulation_steps
        self.source = SyntheticSource(config.vocab_size, config.max_target_length, global_batch,
                                      config.seed + seed_offset)
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        batch = reorder_batch(self.source.batch(self.step), self.cp)
        self.step += 1
        return to_global_arrays(batch, self.mesh)

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def create_data_iterator(config: Config, mesh: Mesh, split: str = "train"):
    """The iterator for `split` ('train' or 'eval')."""
    if config.dataset_type == "synthetic":
        return SyntheticIterator(config, mesh, seed_offset=0 if split == "train" else 1_000_003)
    raise NotImplementedError(f"dataset_type={config.dataset_type} is not available yet")
