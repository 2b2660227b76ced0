"""The local checkpoint tier: each host's own shards on its own fast disk, saved often, beside the persistent tier.

`enable_emergency_checkpoint=true` (MaxText's keys) makes every process save, every `local_checkpoint_period`
steps, the shards its devices hold, with the data position and the resume record, to

    <local_checkpoint_directory>/<run_name>/process_<i>-of-<n>/<step>/
        shards.npz   every addressable shard of every state array, "<leaf>/<device id>"
        local.json   step, seed, resume record, data state, and the map: process count, this process, the mesh
                     shape and its device ids in order (which shards a process holds follows from them)
        maxctx_integrity.json   sizes and CRC-32 of both (maxctx.checkpoint.integrity)

written into `<step>.tmp` and renamed once complete, so a save cut off (kill -9) is never a step. A host keeps
its newest two. No process reads another's directory: the tier costs no shared storage and no network.

Resume (`newest_common`): a local step serves only if every process holds it intact and saved it under the same
map; the newest such step is taken when it is newer than the persistent tier's newest good step. A local step
that fails its integrity check is set aside (`<step>.corrupt`, one line) like a persistent one; a newer local step
that cannot serve (another process count or mesh, a process whose directory is gone) is named in one line and the
persistent tier is used.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from maxctx.checkpoint.integrity import check_item, write_record
from maxctx.checkpoint.steps import set_aside
from maxctx.config import Config, ConfigError

KEEP = 2  # newest local steps a host keeps
SHARDS, META = "shards.npz", "local.json"
_MAX_STEPS = 8  # local steps a process reports when the processes compare theirs


def check_keys(config: Config) -> None:
    """The tier's keys, checked when the Checkpointer is built (before anything is written)."""
    if not config.enable_emergency_checkpoint:
        return
    if not config.local_checkpoint_directory:
        raise ConfigError("enable_emergency_checkpoint=true needs local_checkpoint_directory (a directory on each "
                          "host's fast local disk); set it, or enable_emergency_checkpoint=false")
    if config.local_checkpoint_period <= 0:
        raise ConfigError(f"local_checkpoint_period={config.local_checkpoint_period} must be > 0 with "
                          f"enable_emergency_checkpoint=true (save the local tier every this many steps)")


def process_map(mesh) -> dict[str, Any]:
    """What must be unchanged for a process's local shards to be its shards again."""
    return {"process_count": jax.process_count(), "process_index": jax.process_index(),
            "mesh": dict(mesh.shape), "device_ids": np.asarray(mesh.device_ids).ravel().tolist()}


class LocalTier:
    """This process's local checkpoints of run `config.run_name`."""

    def __init__(self, config: Config, mesh, say):
        self.config, self.mesh, self.say = config, mesh, say
        self.directory = epath.Path(config.local_checkpoint_dir(jax.process_index(), jax.process_count()))
        self.root = self.directory.parent
        for stale in (self.directory.glob("*.tmp") if self.directory.exists() else []):
            _remove(stale)  # a save cut off

    def due(self, step: int) -> bool:
        return step % self.config.local_checkpoint_period == 0

    def steps(self) -> list[int]:
        """This process's committed local steps, newest first."""
        if not self.directory.is_dir():
            return []
        return sorted((int(p.name) for p in self.directory.iterdir() if p.name.isdigit()), reverse=True)

    def save(self, step: int, state: dict, meta: dict, data_state: dict) -> None:
        """Writes this process's shards of `state` after `step` steps (waits for them to leave the devices)."""
        target = self.directory / str(step)
        tmp = self.directory / f"{step}.tmp"
        _remove(tmp)
        tmp.mkdir(parents=True)
        shards = {f"{i}/{shard.device.id}": np.asarray(shard.data)
                  for i, leaf in enumerate(jax.tree_util.tree_leaves(state)) for shard in leaf.addressable_shards}
        with (tmp / SHARDS).open("wb") as f:
            np.savez(f, **shards)
        record = {**meta, "data": data_state, "map": process_map(self.mesh)}
        (tmp / META).write_text(json.dumps(record))
        write_record(tmp)
        _remove(target)  # a step saved again (after a resume from an older one)
        tmp.rename(target)
        for old in self.steps()[KEEP:]:
            _remove(self.directory / str(old))

    def meta(self, step: int) -> dict[str, Any]:
        """The record saved with `step` (its "config" is the resume record)."""
        return json.loads((self.directory / str(step) / META).read_text())

    def set_aside_after(self, good_until: int) -> None:
        """After a divergence: the local steps newer than the last good state become `<step>.suspect`."""
        for step in self.steps():
            if step > good_until:
                set_aside(self.directory / str(step), "suspect")

    def _usable(self, step: int) -> str | None:
        """Why this process's copy of `step` cannot serve (None: it can); a damaged copy is set aside."""
        step_dir = self.directory / str(step)
        problem = check_item(step_dir, f"local step {step}")
        if problem:
            target = set_aside(step_dir, "corrupt")
            print(f"local checkpoint step {step} of process {jax.process_index()} is unusable: {problem}; set "
                     f"aside as {target}", flush=True)  # each process, of its own copy
            return problem
        saved = json.loads((step_dir / META).read_text())["map"]
        if saved != process_map(self.mesh):
            return (f"it was saved by {saved['process_count']} processes on mesh {saved['mesh']}, this run has "
                    f"{jax.process_count()} on {dict(self.mesh.shape)}")
        return None

    def newest_common(self, persistent: int) -> int | None:
        """The newest local step every process holds intact under this map, if newer than `persistent` (the
        persistent tier's newest good step, -1 for none); otherwise None, with one line when a newer local step
        exists but cannot serve. Collective: every process calls it."""
        mine = [s for s in self.steps()[:_MAX_STEPS] if s > persistent]
        reasons = {s: self._usable(s) for s in mine}
        table = np.full((_MAX_STEPS,), -1, np.int64)
        good = [s for s in mine if reasons[s] is None]
        table[:len(good)] = good
        common = set.intersection(*(set(row.tolist()) for row in _gather(table))) - {-1}
        if common:
            return max(common)
        elsewhere = self._newest_elsewhere()  # saved here by another process count
        newest = int(_gather(np.array([max([*mine, elsewhere[0]])], np.int64)).max())
        if newest > persistent:
            why = reasons.get(newest) or (
                f"it was saved by another process count ({elsewhere[1]} on this host), this run has "
                f"{jax.process_count()} processes" if newest == elsewhere[0] else
                "a process has no intact copy of it (its local directory is gone or damaged)")
            self.say(f"the local checkpoint tier cannot serve step {newest}: {why}; resuming from the persistent "
                     f"tier ({f'step {persistent}' if persistent >= 0 else 'none: from step 0'})")
        return None

    def _newest_elsewhere(self) -> tuple[int, str]:
        """(the newest step, its directory) among this host's local directories of other process counts."""
        found = [(int(step.name), folder.name) for folder in (self.root.iterdir() if self.root.is_dir() else [])
                 if folder.name.startswith("process_") and folder.name != self.directory.name and folder.is_dir()
                 for step in folder.iterdir() if step.name.isdigit()]
        return max(found, default=(-1, ""))

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """(the state, the local record) of `step` from this process's shards, in `abstract_state`'s shardings."""
        step_dir = self.directory / str(step)
        record = json.loads((step_dir / META).read_text())
        with (step_dir / SHARDS).open("rb") as f:
            shards = dict(np.load(f))
        leaves, tree = jax.tree_util.tree_flatten(abstract_state)
        arrays = []
        for i, leaf in enumerate(leaves):
            devices = leaf.sharding.addressable_devices_indices_map(leaf.shape)
            pieces = [jax.device_put(shards[f"{i}/{device.id}"], device) for device in devices]
            arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces))
        return jax.tree_util.tree_unflatten(tree, arrays), record


def _gather(values: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values))


def _remove(path: epath.Path) -> None:
    if path.exists():
        path.rmtree() if path.is_dir() else path.unlink()
