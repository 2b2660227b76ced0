"""Builds the training (and eval) iterator for a config: per-host numpy rows -> CP order -> global arrays.

`create_data_iterator(config, mesh, split)` returns an iterator of batch dicts (see maxctx.data) with
`get_state()` / `set_state(state)`: the state is a JSON-serialisable dict, restoring it makes the iterator yield
exactly the batches it would have yielded next.

The data position is global: the stream of packed rows is one function of the config (documents, shuffle seed,
packing, grain_worker_count), the same on every process and for every mesh, and global batch k is its next
`global_batch_rows` rows. The state is that row stream's (grain's batch keeps no state of its own: it is the
state of its parent after all the rows taken so far), so it is the same on every process and any process count or
global batch resumes from it: each process takes its own rows of the next batches. Nothing is read twice or
skipped. The cost: every process reads and tokenizes every document (and keeps only its rows); that is what makes
the position exact under packing, where the documents a row holds depend on every document before it.

The grain pipeline of a file or TFDS source, on each process:

    documents -> shuffle (train: data_shuffle_seed, reshuffled every epoch) -> repeat forever
    -> read + tokenize + shift (tokenizer.EncodeDocument; documents of zero tokens are skipped and counted)
    -> pack into rows (packing.py, PACKING_BINS) -> batch of the global rows -> this process's rows
    -> zig-zag CP reorder
    -> grain worker processes (grain_worker_count) or a prefetch thread (grain_prefetch_buffer_size)

A state saved per process by an older version (`process_index` / `process_count`, each process reading its own
loading group's documents) is still restored, onto that older per-group pipeline, when the process count matches.

Eval uses the same steps without shuffling (and one prefetch thread, never worker processes) at its own batch
size (`Config.eval_batch_size`), cycling over the eval data forever; with eval_steps=-1 it reads the eval data
once instead: the last batch is padded with rows of weight 0, and the iterator stops when every process's part has
ended (until then, a process whose part ended yields padding). To score the same batches at every eval, keep its
`get_state()` from creation and `set_state` it before each eval. Errors: ConfigError for bad keys, paths or
tokenizers (raised here, when the iterator is built), maxctx.data.DataError for bad data (here, or from `next()`
for a bad record).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from maxctx.attention.cp.load_balance import reorder_batch
from maxctx.config import Config, ConfigError
from maxctx.data import BATCH_KEYS, DataError
from maxctx.data.global_batch import HostLayout, host_layout, to_global_arrays
from maxctx.data.packing import pack
from maxctx.data.sources import make_source
from maxctx.data.synthetic import SyntheticSource
from maxctx.data.tokenizer import EncodeDocument, load_tokenizer
from maxctx.datasets import DATASETS
from maxctx.parallelism import mesh_context_degree

SPLITS = ("train", "eval")
# First-fit packing's bin count; fixed, not a function of the batch, so the row stream (and a position in it)
# does not change with the global batch.
PACKING_BINS = 16


class CPReorder:
    """The load-balanced order for CP degree `cp` on a [rows, S] batch (a grain map, so workers do it): the zig-zag,
    or with `mode` 'documents' each row's documents placed on the ranks (maxctx.attention.cp.load_balance)."""

    def __init__(self, cp: int, mode=True):
        self.cp, self.mode = cp, mode

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return reorder(batch, self.cp, self.mode)


def reorder(batch: dict[str, np.ndarray], cp: int, mode) -> dict[str, np.ndarray]:
    """reorder_batch, with a row the documents placement cannot take (documents not numbered in order) refused as
    DataError: one line from train.py, not a traceback."""
    try:
        return reorder_batch(batch, cp, mode)
    except ValueError as e:
        raise DataError(str(e)) from None


class ProcessRows:
    """This process's rows of a global [rows, S] batch (a grain map, so workers do it)."""

    def __init__(self, row_blocks: tuple[tuple[int, int], ...]):
        self.row_blocks = row_blocks or ((0, 0),)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {key: np.concatenate([value[start:stop] for start, stop in self.row_blocks])
                for key, value in batch.items()}


class DataIterator:
    """Global-array batches from a grain iterator of this process's rows; the state is the global row stream's.
    `per_group`: builds the older per-loading-group grain iterator, for a state saved per process."""

    def __init__(self, iterator, mesh: Mesh, layout: HostLayout, finite: bool = False,
                 per_group: Callable[[], Any] | None = None):
        self.mesh, self.layout, self.finite, self.per_group = mesh, layout, finite, per_group
        # The grain iterator lives in a list that `close` empties: closing it (prefetch threads, worker processes)
        # when this iterator is dropped or at exit, while grain's modules still exist, keeps grain's own __del__
        # from failing at interpreter teardown.
        self._holder = [iterator]
        self.close = weakref.finalize(self, _close, self._holder)
        self.legacy = False  # reading the older per-group pipeline (restored from a per-process state)

    @property
    def iterator(self):
        if not self._holder:
            raise ValueError("the data iterator is closed")
        return self._holder[0]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if not self.finite:
            return to_global_arrays(next(self.iterator), self.mesh, self.layout)
        local = next(self.iterator, None)
        if not _any_process(local is not None):  # every process has read its whole part: all stop together
            raise StopIteration
        if local is None:
            local = padding_rows(self.layout.local_rows, self.layout.global_shape[1])
        return to_global_arrays(local, self.mesh, self.layout)

    def get_state(self) -> dict[str, Any]:
        if self.legacy:
            return {"process_index": jax.process_index(), "process_count": jax.process_count(),
                    "grain": self.iterator.get_state()}
        return {"position": "global", "grain": self.iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if "process_count" in state:  # saved per process (by an older version): only that process's own
            _check_processes(state)
            if not self.legacy and self.per_group is not None:
                _close(self._holder)
                self._holder.append(self.per_group())
                self.legacy = True
        self.iterator.set_state(state["grain"])


class SyntheticIterator:
    """Synthetic batches, a pure function of (seed, global row): row g of the stream is row g % B of the source's
    step g // B, B the global batch the run started with (kept in the state, so a resume with another batch reads
    on in the same stream). The state is that and the number of rows the job has consumed: global, like a grain
    stream's. Each process generates only the rows its devices hold."""

    def __init__(self, config: Config, mesh: Mesh, layout: HostLayout, stream: int = 0):
        self.mesh, self.layout = mesh, layout
        self.cp = mesh_context_degree(mesh.shape) if config.context_parallel_load_balance else 1
        self.mode = config.context_parallel_load_balance
        self.make_source = lambda block: SyntheticSource(config.vocab_size, config.max_target_length, block,
                                                         config.seed, stream, config.synthetic_passkey_fraction)
        self.rows, self.source = 0, self.make_source(layout.global_shape[0])

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        parts = [part for start, stop in self.layout.row_blocks
                 for part in self._rows(self.rows + start, self.rows + stop)]
        local = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        self.rows += self.layout.global_shape[0]
        return to_global_arrays(reorder(local, self.cp, self.mode), self.mesh, self.layout)

    def _rows(self, start: int, stop: int) -> list[dict[str, np.ndarray]]:
        """Global rows [start, stop) of the stream, as the source's blocks (split where a step of it ends)."""
        parts = []
        while start < stop:
            step, first = divmod(start, self.source.global_batch)
            end = min(stop, (step + 1) * self.source.global_batch)
            parts.append(self.source.batch(step, slice(first, first + end - start)))
            start = end
        return parts

    def get_state(self) -> dict[str, Any]:
        return {"position": "global", "rows": self.rows, "block": self.source.global_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        if "process_count" not in state:
            self.rows, self.source = int(state["rows"]), self.make_source(int(state["block"]))
            return
        _check_processes(state)  # an older version's, per process: the steps it had read, of this global batch
        self.source = self.make_source(self.layout.global_shape[0])
        self.rows = int(state["step"]) * self.source.global_batch


def padding_rows(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """[rows, seq_len] of padding: segment id 0, weight 0 (scored by nothing)."""
    return {key: np.zeros((rows, seq_len), np.float32 if key == "weights" else np.int32) for key in BATCH_KEYS}


class PadBatch:
    """Pads a batch of fewer than `rows` rows (the end of a split read once) with padding rows."""

    def __init__(self, rows: int):
        self.rows = rows

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = self.rows - len(batch["inputs"])
        if missing == 0:
            return batch
        pad = padding_rows(missing, batch["inputs"].shape[1])
        return {key: np.concatenate([value, pad[key]]) for key, value in batch.items()}


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def _close(holder: list) -> None:
    while holder:
        iterator = holder.pop()
        if hasattr(iterator, "close"):
            iterator.close()


def _check_processes(state: dict[str, Any]) -> None:
    saved = (state.get("process_index"), state.get("process_count"))
    if saved != (jax.process_index(), jax.process_count()):
        raise DataError(f"the data iterator state was saved by process {saved[0]} of {saved[1]}, but this is "
                        f"process {jax.process_index()} of {jax.process_count()}; resume with the same number of "
                        f"processes (each process restores its own state)")


def global_batch_rows(config: Config, mesh: Mesh, split: str = "train") -> int:
    """Rows per batch: for training, per optimiser step (global_batch_size x gradient_accumulation_steps); for
    eval, eval_per_device_batch_size (or per_device_batch_size) x devices."""
    if split == "eval":
        return config.eval_batch_size(mesh.devices.size)
    return config.global_batch_size(mesh.devices.size) * config.gradient_accumulation_steps


def build_host_dataset(config: Config, split: str, layout: HostLayout, cp: int, once: bool = False,
                       per_group: bool = False) -> grain.IterDataset:
    """The grain dataset yielding this process's [local_rows, S] numpy batches of `split`: its rows of the global
    row stream, endless, or with `once` the split read once, the last batch padded. `per_group`: the older
    pipeline, where each loading group reads its own part of the documents (`layout.shard_index`)."""
    source = make_source(config, split)
    tokenizer = load_tokenizer(config)
    mode = config.context_parallel_load_balance
    ds = grain.MapDataset.source(source)
    if per_group:
        if len(source) < layout.shard_count:
            raise DataError(f"{source.name} has {len(source)} documents, fewer than the "
                            f"{layout.shard_count} data-loading process groups that each need a disjoint part")
        ds = ds[layout.shard_index::layout.shard_count]
    if split == "train" and config.enable_data_shuffling:
        ds = ds.shuffle(seed=config.data_shuffle_seed)
    rows = layout.local_rows if per_group else layout.global_shape[0]
    read_ahead = max(64, 4 * rows)  # records the reader's threads map ahead of the one being consumed
    seq_len = config.max_target_length
    kept = seq_len + 1 if config.packing == "none" else None  # a row of packing=none: a document's first tokens
    encode = EncodeDocument(source, tokenizer, config.vocab_size, config.add_bos, config.add_eos, read_ahead, kept)
    ds = (ds if once else ds.repeat()).map(encode)
    ds = ds.filter(_is_document)  # documents of zero tokens, skipped and counted
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=read_ahead))
    ds = pack(ds, config.packing, seq_len, num_bins=max(PACKING_BINS, rows) if per_group else PACKING_BINS)
    ds = ds.batch(rows, drop_remainder=not once)
    if once:
        ds = ds.map(PadBatch(rows))
    if not per_group:
        ds = ds.map(ProcessRows(layout.row_blocks))
    return ds.map(CPReorder(cp, mode))


def _is_document(pair: dict | None) -> bool:
    """False for what EncodeDocument makes of a document of zero tokens (a module function: workers pickle it)."""
    return pair is not None


def _start(ds: grain.IterDataset, config: Config, split: str):
    if config.grain_worker_count > 0 and split == "train":
        from absl import flags

        # grain reads its absl flags when it spawns workers and fails if nothing parsed them; take the defaults.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        options = grain.MultiprocessingOptions(num_workers=config.grain_worker_count,
                                               per_worker_buffer_size=max(1, config.grain_prefetch_buffer_size))
        return iter(ds.mp_prefetch(options))
    if config.grain_prefetch_buffer_size > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(
            ds, prefetch_buffer_size=config.grain_prefetch_buffer_size)
    return iter(ds)


def create_data_iterator(config: Config, mesh: Mesh, split: str = "train"):
    """The iterator for `split` ('train' or 'eval'): an endless iterator of global-array batches.

    Build it before writing anything to the run directory: bad paths, tokenizers and datasets raise here.
    """
    if split not in SPLITS:
        raise ValueError(f"split='{split}' is not one of {', '.join(SPLITS)}")
    if config.max_target_length <= 0:
        raise ConfigError(f"max_target_length={config.max_target_length} must be > 0")
    layout = host_layout(mesh, global_batch_rows(config, mesh, split), config.max_target_length)
    cp = mesh_context_degree(mesh.shape) if config.context_parallel_load_balance else 1
    if not DATASETS[config.dataset_type].source:  # synthetic: generated, not read
        return SyntheticIterator(config, mesh, layout, stream=SPLITS.index(split))
    once = split == "eval" and config.eval_steps == -1  # the whole eval split
    ds = build_host_dataset(config, split, layout, cp, once)
    per_group = lambda: _start(build_host_dataset(config, split, layout, cp, once, per_group=True),  # noqa: E731
                               config, split)
    return DataIterator(_start(ds, config, split), mesh, layout, finite=once, per_group=per_group)
