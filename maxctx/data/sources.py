"""Random-access document sources: ArrayRecord shards, TFDS (its ArrayRecord data source) and local text files.

Every source has `len()`, `source[i] -> (value, i)` where value is a document's text (str) or its token ids
(int32 array, BOS/EOS not included), and `describe(i)`, the file and record of document i for error messages.
They are picklable (open file handles are reopened after unpickling), so grain worker processes can read them.

ArrayRecord records hold either UTF-8 text or token ids written by `encode_tokens` (scripts/prepare_data.py):
`TOKENS_MAGIC` followed by little-endian int32 ids. Text files: `.txt` holds one document per line, `.jsonl`
one JSON object per line with the document in `text_field` (a string, or a list of token ids); blank lines are
skipped in both.
A text file is indexed once, by line offsets; it must not change while a run reads it: each read compares the
file's size, modification time and inode with the index's, and a changed file is a DataError naming it (restarting
the run indexes it again).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import numpy as np

from maxctx.config import Config, ConfigError
from maxctx.data import DataError
from maxctx.datasets import DATASETS
from maxctx.errors import article
from maxctx.files import expand_files, local_copies, tfds_local_dir

TOKENS_MAGIC = b"MXTK"
TEXT_SUFFIXES = (".txt", ".jsonl")
Document = tuple[Any, int]
# Halves of UTF-16 surrogate pairs: a JSON escape such as \ud800 gives one alone, which no tokenizer can encode.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_tokens(ids: Any) -> bytes:
    """One ArrayRecord record holding token ids."""
    return TOKENS_MAGIC + np.asarray(ids, dtype="<i4").tobytes()


def decode_record(record: bytes, where: str) -> str | np.ndarray:
    """A record's text or token ids; DataError (naming `where`) for a record that is neither."""
    if record.startswith(TOKENS_MAGIC):
        body = record[len(TOKENS_MAGIC):]
        if len(body) % 4:
            raise DataError(f"{where} is corrupt: a token-id record of {len(body)} bytes is not whole int32 ids")
        return np.frombuffer(body, dtype="<i4").astype(np.int32)
    try:
        return record.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is corrupt: neither UTF-8 text nor token ids ({e})") from None


class ArrayRecordSource:
    """Documents in ArrayRecord shards (raw UTF-8 text or token ids), read through grain's ArrayRecordDataSource."""

    def __init__(self, files: list[str], key: str):
        from array_record.python.array_record_module import ArrayRecordReader

        self.files, self.key = files, key
        self.name = f"{key} ({len(files)} ArrayRecord files: {files[0]}, ...)"
        counts = []
        for path in files:
            try:
                reader = ArrayRecordReader(path)
                counts.append(reader.num_records())
                reader.close()
            except (RuntimeError, OSError, ValueError) as e:
                raise DataError(f"{path} (from {key}) is not a readable ArrayRecord file: {e}") from None
        self.ends = np.cumsum(counts)
        if not len(self):
            raise DataError(f"{key}: the {len(files)} file(s) it matches ({files[0]}, ...) hold no records; "
                            f"are they ArrayRecord files written with scripts/prepare_data.py?")
        self._source = None

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, index: int) -> Document:
        import grain

        if self._source is None:
            self._source = grain.sources.ArrayRecordDataSource(self.files)
        try:
            record = self._source[index]
        except RuntimeError as e:
            raise DataError(f"{self.describe(index)} is corrupt: {e}") from None
        return decode_record(record, self.describe(index)), index

    def describe(self, index: int) -> str:
        file = int(np.searchsorted(self.ends, index, side="right"))
        start = int(self.ends[file - 1]) if file else 0
        return f"{self.files[file]} record {index - start}"

    @classmethod
    def open(cls, config: Config, key: str) -> ArrayRecordSource:
        return cls(local_copies(expand_files(getattr(config, key), key)), key)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_source": None}


class TextSource:
    """Documents in local .txt (one per line) and .jsonl (one JSON object per line) files.

    The files are scanned once for line offsets; documents are then read on demand, so memory holds offsets only.
    For large corpora, scripts/prepare_data.py turns them into tokenized ArrayRecord shards.
    """

    def __init__(self, files: list[str], key: str, text_field: str):
        self.files, self.key, self.text_field = files, key, text_field
        self.name = f"{key} ({len(files)} text files: {files[0]}, ...)"
        for path in files:
            if not path.endswith(TEXT_SUFFIXES):
                raise ConfigError(f"{key}: '{path}' is not a .txt or .jsonl file; dataset_type=text reads those "
                                  f"(use dataset_type=arrayrecord for ArrayRecord shards)")
        file_ids, starts, lengths, lines, self.stamps = [], [], [], [], []
        for file_id, path in enumerate(files):
            with open(path, "rb") as f:
                self.stamps.append(stamp(os.fstat(f.fileno())))  # before the scan: a change during it is caught
                offset = 0
                for line_no, line in enumerate(f, start=1):
                    if line.strip():
                        file_ids.append(file_id)
                        starts.append(offset)
                        lengths.append(len(line))
                        lines.append(line_no)
                    offset += len(line)
        if not file_ids:
            raise DataError(f"{key}: the {len(files)} file(s) it matches ({files[0]}, ...) hold no documents "
                            f"(every line is blank)")
        self.file_ids = np.asarray(file_ids, np.int32)
        self.starts = np.asarray(starts, np.int64)
        self.lengths = np.asarray(lengths, np.int64)
        self.lines = np.asarray(lines, np.int64)
        self._fds: dict[int, int] = {}

    @classmethod
    def open(cls, config: Config, key: str) -> TextSource:
        return cls(local_copies(expand_files(getattr(config, key), key)), key, config.text_field)

    def __len__(self) -> int:
        return len(self.file_ids)

    def __getitem__(self, index: int) -> Document:
        file_id = int(self.file_ids[index])
        if file_id not in self._fds:
            self._fds[file_id] = os.open(self.files[file_id], os.O_RDONLY)
        raw = os.pread(self._fds[file_id], int(self.lengths[index]), int(self.starts[index]))
        self._check_unchanged(file_id)  # after the read: a change during it is caught too
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.describe(index)} is not UTF-8 text ({e})") from None
        if self.files[file_id].endswith(".txt"):
            return line, index
        return self._json_document(line, index), index

    def _check_unchanged(self, file_id: int) -> None:
        """DataError when the file was rewritten, truncated or replaced since it was indexed: its documents would be
        read at stale offsets (an emptied file read as endless empty documents). One fstat, about a microsecond."""
        now = stamp(os.fstat(self._fds[file_id]))
        if now != self.stamps[file_id]:
            (size, _, inode), path = self.stamps[file_id], self.files[file_id]
            what = (f"now {now[0]} bytes, {size} when indexed" if now[0] != size else
                    "replaced by another file" if now[2] != inode else "modified, same size")
            raise DataError(f"{path} (from {self.key}) changed while the run was reading it ({what}); its documents "
                            f"are read at the line offsets found when the run started: restart the run to index it "
                            f"again, and write new data to new files rather than over files a run is reading")

    def _json_document(self, line: str, index: int) -> str | np.ndarray:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{self.describe(index)} is not valid JSON ({e})") from None
        if not isinstance(record, dict) or self.text_field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{self.describe(index)} has no field '{self.text_field}' (text_field); it has: {keys}")
        value = record[self.text_field]
        if isinstance(value, str):
            bad = None if value.isascii() else LONE_SURROGATE.search(value)
            if bad:
                raise DataError(f"{self.describe(index)}: field '{self.text_field}' holds a lone surrogate "
                                f"{bad.group()!r} at character {bad.start()}, which is not Unicode text (a JSON "
                                f"escape of half a UTF-16 pair); fix or remove that escape")
            return value
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return np.asarray(value, np.int32)
        kind = article(type(value).__name__)
        raise DataError(f"{self.describe(index)}: field '{self.text_field}' is {kind}, not text or a list of token ids")

    def describe(self, index: int) -> str:
        return f"{self.files[int(self.file_ids[index])]} line {int(self.lines[index])}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)


def stamp(status: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is rewritten, truncated or replaced: (size, modification time in ns, inode)."""
    return status.st_size, status.st_mtime_ns, status.st_ino


class TfdsSource:
    """A prepared TFDS dataset read through `tfds.data_source` (ArrayRecord files; TensorFlow is not needed)."""

    def __init__(self, name: str, split: str, data_dir: str, text_field: str, split_key: str):
        import tensorflow_datasets as tfds

        self.dataset, self.split, self.text_field = name, split, text_field
        self.name = f"TFDS dataset '{name}' split '{split}'"
        if data_dir and not os.path.isdir(data_dir):
            raise ConfigError(f"tfds_data_dir='{data_dir}' does not exist; point it at the folder holding the "
                              f"prepared dataset '{name}'")
        where = f"tfds_data_dir='{data_dir}'" if data_dir else "the default TFDS data directory"
        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
        except tfds.core.registered.DatasetNotFoundError:
            raise ConfigError(f"dataset_name='{name}' is not prepared under {where}; prepare it there "
                              f"(builder.download_and_prepare(file_format='array_record')) or fix the name") from None
        except (ValueError, AssertionError, FileNotFoundError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"dataset_name='{name}' {split_key}='{split}' under {where} cannot be read: "
                              f"{first}") from None
        if not len(self._source):
            raise DataError(f"TFDS dataset '{name}' split '{split}' under {where} holds no examples")
        features = self._source.dataset_info.features
        if text_field not in features:
            raise ConfigError(f"text_field='{text_field}' is not a feature of TFDS dataset '{name}'; it has: "
                              f"{', '.join(features)}")

    @classmethod
    def open(cls, config: Config, key: str) -> TfdsSource:
        if not getattr(config, key):
            raise ConfigError(f"{key} is empty; name a split of dataset_name='{config.dataset_name}'"
                              + (", or set eval_interval=0" if key == "eval_split" else ""))
        return cls(config.dataset_name, getattr(config, key), tfds_local_dir(config.tfds_data_dir, config.dataset_name),
                   config.text_field, key)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Document:
        try:
            value = self._source[index][self.text_field]
        except RuntimeError as e:
            raise DataError(f"{self.describe(index)} is corrupt: {e}") from None
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8"), index
            except UnicodeDecodeError as e:
                raise DataError(f"{self.describe(index)}: field '{self.text_field}' is not UTF-8 ({e})") from None
        if isinstance(value, str):
            return value, index
        return np.asarray(value, np.int32).reshape(-1), index

    def describe(self, index: int) -> str:
        return f"{self.name} example {index}"


def make_source(config: Config, split: str):
    """The document source of `split` ('train' or 'eval') for a non-synthetic config: the class
    maxctx.datasets names for its dataset_type, opened on the split's key."""
    dataset = DATASETS[config.dataset_type]
    if not dataset.source:
        raise ConfigError(f"dataset_type={config.dataset_type} has no file source")
    key = dataset.split_keys[split != "train"]
    return getattr(sys.modules[__name__], dataset.source).open(config, key)
