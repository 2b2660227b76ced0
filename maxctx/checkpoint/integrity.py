"""Checkpoint integrity: a size and CRC-32 of every file of every item, recorded at save, checked before a restore.

Each item directory of a step (`state/`, `data/`, `meta/`) gets `maxctx_integrity.json`:

    {"format": "maxctx-integrity-1", "algorithm": "crc32", "files": {"<path in the item>": [bytes, "<crc32>"], ...}}

When it is written. Orbax commits a step in its `finalize`, on the primary process, once every process has
written its files: each item handler's `finalize(item_tmp_dir)` (for `state/`, the merge of the processes' OCDBT
databases, which writes files of its own), then the item's rename or commit_success.txt, then the step's. The
handlers below write the record at the end of their item's `finalize`, so it covers every byte of the item and
exists before the commit marker: a committed item without a record was not written by these handlers or was
damaged afterwards. The step-level `_CHECKPOINT_METADATA` (Orbax's bookkeeping, rewritten by Orbax) and the
commit markers are not covered.

Cost. With async checkpointing the record is written in Orbax's background thread, off the training loop; it reads
back what was just written (mostly from the page cache) at CRC-32 speed (zlib, several GB/s per core; it releases
the GIL). Verification reads the checkpoint once before Orbax reads it again. benchmarks/checkpoint_overhead.py
prints both next to the save time.

CRC-32 finds accidental damage (flipped, overwritten, truncated or lost bytes), not deliberate tampering.
"""

from __future__ import annotations

import json
import os
import posixpath
import zlib
from concurrent import futures

import orbax.checkpoint as ocp
from etils import epath

RECORD = "maxctx_integrity.json"
FORMAT = "maxctx-integrity-1"
_CHUNK = 16 * 1024 * 1024
_THREADS = min(8, os.cpu_count() or 1)


def _files(item_dir: epath.Path, prefix: str = "") -> list[str]:
    """Paths of every file under `item_dir`, relative to it, except the record and commit markers."""
    names = []
    for entry in sorted(item_dir.iterdir(), key=lambda p: p.name):
        rel = f"{prefix}{entry.name}"
        if entry.is_dir():
            names.extend(_files(entry, f"{rel}/"))
        elif rel not in (RECORD, "commit_success.txt"):
            names.append(rel)
    return names


def _digest(path: epath.Path) -> tuple[int, str]:
    size, crc = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)
    return size, f"{crc:08x}"


def _digests(item_dir: epath.Path, names: list[str]) -> list[tuple[int, str]]:
    with futures.ThreadPoolExecutor(_THREADS) as pool:
        return list(pool.map(lambda name: _digest(item_dir / name), names))


def digest(item_dir: epath.Path) -> dict[str, tuple[int, str]]:
    """{path in the item: (bytes, crc32)} of every file of an item."""
    item_dir = epath.Path(item_dir)
    names = _files(item_dir)
    return dict(zip(names, _digests(item_dir, names)))


def write_record(item_dir: epath.Path) -> None:
    """Records the size and CRC-32 of every file of a written item."""
    record = {"format": FORMAT, "algorithm": "crc32", "files": digest(item_dir)}
    (epath.Path(item_dir) / RECORD).write_text(json.dumps(record))


def _read_record(item_dir: epath.Path) -> dict[str, tuple[int, str]] | None:
    """{path: (bytes, crc32)} of an item's record; None when it is unreadable or malformed."""
    try:
        record = json.loads((item_dir / RECORD).read_text())
        files = {str(name): (int(size), str(crc)) for name, (size, crc) in record["files"].items()}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    inside = all(not posixpath.isabs(n) and posixpath.normpath(n) == n and not n.startswith("..") for n in files)
    return files if record.get("format") == FORMAT and files and inside else None  # a name out of the item: forged


def check_item(item_dir: epath.Path, item: str) -> str | None:
    """What is wrong with a saved item (one phrase naming the file), or None when every recorded file is there
    with its size and checksum."""
    if not item_dir.is_dir():
        return f"its '{item}' item is missing"
    try:
        files = _read_record(item_dir)
    except FileNotFoundError:
        return f"its '{item}' item has no integrity record ({RECORD}): its save did not finish"
    if files is None:
        return f"the integrity record of its '{item}' item ({item}/{RECORD}) is unreadable"
    for name, (size, _) in files.items():
        try:
            found = (item_dir / name).stat().length
        except OSError:
            return f"{item}/{name} is missing"
        if found != size:
            return f"{item}/{name} has {found} bytes, {size} were written"
    names = sorted(files)
    for name, (_, crc) in zip(names, _digests(item_dir, names)):
        if crc != files[name][1]:
            return f"{item}/{name} fails its checksum (crc32 {crc}, {files[name][1]} when written)"
    return None


def check_step(step_dir: epath.Path, items: tuple[str, ...]) -> str | None:
    """What is wrong with a checkpoint step directory (one phrase), or None when every item verifies."""
    step_dir = epath.Path(step_dir)
    try:
        if not any(step_dir.iterdir()):
            return "its directory is empty (a save cut off while creating it)"
        for item in items:
            problem = check_item(step_dir / item, item)
            if problem:
                return problem
    except OSError as e:
        return f"it cannot be read ({type(e).__name__}: {e})"
    return None


class VerifiedStandardHandler(ocp.StandardCheckpointHandler):
    """StandardCheckpointHandler that records the integrity of the item once its files are final. `use_ocdbt` and
    `use_zarr3`: Orbax's storage options (checkpoint_storage_use_ocdbt / _zarr3); StandardCheckpointHandler takes
    only the first, so its PyTree handler is made with both."""

    def __init__(self, use_ocdbt: bool = True, use_zarr3: bool = False):
        super().__init__(use_ocdbt=use_ocdbt)
        if use_zarr3:
            if not isinstance(getattr(self, "_impl", None), ocp.PyTreeCheckpointHandler):
                raise ValueError("checkpoint_storage_use_zarr3=true needs an Orbax whose StandardCheckpointHandler "
                                 "wraps a PyTreeCheckpointHandler; set checkpoint_storage_use_zarr3=false")
            self._impl = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=True)

    @classmethod
    def of(cls, config) -> VerifiedStandardHandler:
        """The handler for a run config's checkpoint_storage_use_ocdbt / _use_zarr3 (MaxText's keys)."""
        return cls(config.checkpoint_storage_use_ocdbt, config.checkpoint_storage_use_zarr3)

    def finalize(self, directory: epath.Path) -> None:
        super().finalize(directory)
        write_record(directory)


class VerifiedJsonHandler(ocp.JsonCheckpointHandler):
    """JsonCheckpointHandler that records the integrity of the item (every process's file) at its finalize."""

    def finalize(self, directory: epath.Path) -> None:
        super().finalize(directory)
        write_record(directory)
