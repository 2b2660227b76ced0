"""The safetensors format, read and written with numpy alone (no torch, no `safetensors` package).

A file is: 8 bytes (little-endian u64) N, N bytes of JSON header
`{"<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
tensors' bytes, offsets relative to the end of the header. A sharded model adds `model.safetensors.index.json`:
`{"metadata": {"total_size": bytes}, "weight_map": {"<name>": "<file>"}}`.

Reading is one tensor at a time (`read` fills a fresh array from the file with one `readinto`), so what the
process holds is the tensor being converted, never the file. A `BlockScaled` weight (float8 with a scale per block,
DeepSeek-V3's FP8 releases) is read dequantised. Every problem is a ConfigError naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from maxctx import storage
from maxctx.errors import ConfigError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


class TensorInfo:
    """One tensor of a file: where its bytes are and what they hold."""

    def __init__(self, path: str, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.path, self.name, self.dtype, self.shape, self.begin, self.end = path, name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one .safetensors file, checked against the file's size (a truncated download is caught
    here, before any tensor is converted)."""
    fix = "download it again"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ConfigError(f"{path} is not a safetensors file ({size} bytes, no header); {fix}")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                raise ConfigError(f"{path} is truncated or not a safetensors file (header of {n} bytes in a file "
                                  f"of {size}); {fix}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror}); check the path and its permissions") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"{path} has an unreadable safetensors header; {fix}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} has a safetensors header that is a JSON {type(header).__name__}, not an object "
                          f"of tensor entries; {fix}")
    start, tensors = 8 + n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: the header entry of '{name}' is malformed; {fix}") from None
        if dtype not in DTYPES or np.dtype(DTYPES[dtype]).itemsize * int(np.prod(shape)) != end - begin:
            raise ConfigError(f"{path}: tensor '{name}' ({dtype}, shape {list(shape)}) does not match its "
                              f"{end - begin} bytes; {fix}")
        tensors[name] = TensorInfo(path, name, dtype, shape, start + begin, start + end)
    last = max((t.end for t in tensors.values()), default=start)
    if last > size:
        raise ConfigError(f"{path} is truncated: {size} bytes, its header needs {last}; {fix}")
    return tensors


class BlockScaled(TensorInfo):
    """A float8 weight [O, I] stored with a scale per b0 x b1 block, `scale` [ceil(O / b0), ceil(I / b1)] (the last
    block of a dim not a multiple of b partial): its value is float8 x its block's scale, in float32."""

    def __init__(self, info: TensorInfo, scale: TensorInfo, block: tuple[int, int]):
        super().__init__(info.path, info.name, info.dtype, info.shape, info.begin, info.end)
        self.scale, self.block = scale, block


def read(info: TensorInfo) -> np.ndarray:
    """The tensor's values (a new array of the file's dtype; a BlockScaled weight's dequantised, float32)."""
    if isinstance(info, BlockScaled):
        return _dequantized(info)
    out = np.empty(info.shape, DTYPES[info.dtype])
    with open(info.path, "rb") as f:
        f.seek(info.begin)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != info.nbytes:
        raise ConfigError(f"{info.path} is truncated at tensor '{info.name}'; download it again")
    return out


def _dequantized(info: BlockScaled) -> np.ndarray:
    """One block row at a time, so that besides the float8 weight only its float32 result is held."""
    quantized = read(TensorInfo(info.path, info.name, info.dtype, info.shape, info.begin, info.end))
    scale = read(info.scale).astype(np.float32)
    (b0, b1), out = info.block, np.empty(info.shape, np.float32)
    for r in range(scale.shape[0]):
        rows = slice(r * b0, (r + 1) * b0)
        np.multiply(quantized[rows].astype(np.float32), np.repeat(scale[r], b1)[:info.shape[1]], out=out[rows])
    return out


def model_tensors(directory: str) -> dict[str, TensorInfo]:
    """Every tensor of a Hugging Face model directory: the files named by model.safetensors.index.json, or the
    directory's one *.safetensors file."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = dict(json.load(f)["weight_map"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index} is not a safetensors index (no weight_map); download it again") from None
        for tensor, file in weight_map.items():  # before any file is opened
            storage.join_under(directory, str(file), f"{index}: the entry of '{tensor}'", "an index names files "
                               "of its own folder (model-00001-of-00004.safetensors): download it again")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if len(files) > 1:
            raise ConfigError(f"{directory} has {len(files)} .safetensors files but no {INDEX}; download the index "
                              f"too")
    if not files:
        bins = [f for f in os.listdir(directory) if f.endswith((".bin", ".pth", ".pt"))]
        hint = (f"it has PyTorch pickles ({bins[0]}); save the model with save_pretrained(..., "
                f"safe_serialization=True)" if bins else "download the model's *.safetensors files")
        raise ConfigError(f"{directory} has no .safetensors weights; {hint}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} (named by {INDEX}) is missing; download it")
        tensors.update(read_header(path))
    return tensors


def listed_in(directory: str, name: str) -> str | None:
    """The file model.safetensors.index.json says holds tensor `name`, if it names one."""
    try:
        with open(os.path.join(directory, INDEX)) as f:
            file = json.load(f)["weight_map"].get(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return os.path.join(directory, file) if file else None


def _header(tensors: Iterable[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    entries, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape in tensors:
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape))
        entries[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # tensors start 8-byte aligned, as the safetensors library writes them
    return struct.pack("<Q", len(header)) + header


def write(path: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]], arrays: Iterator[np.ndarray],
          metadata: dict[str, str] | None = None) -> None:
    """Writes one file whose tensors are `specs` (name, dtype, shape), their values taken from `arrays` in the
    same order, one at a time."""
    with open(path, "wb") as f:
        f.write(_header(specs, {"format": "pt", **(metadata or {})}))
        for (name, dtype, shape), array in zip(specs, arrays, strict=True):
            array = np.ascontiguousarray(array)
            assert array.dtype == dtype and array.shape == tuple(shape), (name, array.dtype, array.shape)
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
