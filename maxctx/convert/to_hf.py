"""maxctx checkpoint -> Hugging Face model directory (LlamaForCausalLM / MistralForCausalLM).

Writes `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes` (one tensor may exceed it),
`model.safetensors.index.json` and `config.json`, replacing the weights an earlier export left in the folder
(export_hf says how). Each HF tensor is read, converted and written on its own: one
layer of a stacked parameter where the checkpoint stores layers as chunks (from_hf writes them so), else the
stacked parameter is read once for its layers (a training run's checkpoint, chunked by device shards). Host memory
holds one tensor, or one stacked parameter.

The model keys come from the checkpoint's meta item (a training run records them; from_hf records them and the
source config.json, whose token ids and context length are carried over), then the key=value overrides.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxctx.checkpoint.manager import META, STATE, resolve_step_dir
from maxctx.config import MODEL_KEYS
from maxctx.convert import safetensors
from maxctx.convert.from_hf import key_values, read_hf_config
from maxctx.convert.streaming import open_arrays, shapes
from maxctx.errors import ConfigError
from maxctx.loader import parse_config
from maxctx.model import families
from maxctx.model.llama.hf_layout import Tensor
from maxctx.validate import validate

OUT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}
TORCH_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
TOKENIZER_FILES = ("tokenizer", "special_tokens_map.json", "generation_config.json")
# Weights transformers loads from a folder (the safetensors single file or index, the PyTorch ones).
WEIGHT_FILES = ("model*.safetensors", safetensors.INDEX, "pytorch_model*.bin", "pytorch_model.bin.index.json")
STAGING = ".to_hf-tmp"


def _meta(step_dir: epath.Path, hf_base: str) -> dict[str, Any]:
    """The checkpoint's meta item; with `hf_base`, that directory's config.json and architecture replace its own."""
    meta = {}
    if (step_dir / META).is_dir():
        meta = ocp.JsonCheckpointHandler().restore(step_dir / META) or {}
    if hf_base:
        meta = {**meta, "hf_config": read_hf_config(hf_base)}
        where = os.path.join(hf_base, "config.json")
        layout = families.for_hf(meta["hf_config"], where).hf_layout
        meta["architecture"] = layout.architecture(meta["hf_config"], where)
    return meta


def _model_keys(step_dir: epath.Path, meta: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The model keys the checkpoint recorded, then the key=value overrides, as a validated config gives them."""
    saved_keys = {k: v for k, v in (meta.get("config") or {}).items() if k in MODEL_KEYS}
    if not saved_keys and not overrides:
        raise ConfigError(f"checkpoint {step_dir} records no model keys (no meta item); give them as key=value "
                          f"(e.g. model_name=llama3.1-8b)")
    config = parse_config(key_values(saved_keys, overrides))
    validate(config)  # e.g. a rope_factor <= 0 would reach config.json, which transformers reads without a check
    return {k: getattr(config, k) for k in MODEL_KEYS}


def _tensor_plan(step_dir: epath.Path, keys: dict[str, Any]) -> list[tuple]:
    """(hf name, hf shape, tensor, layer) of every HF tensor, in write order; a checkpoint parameter missing or of
    another shape than the model keys give is refused, naming both."""
    saved = shapes(step_dir / STATE)
    layers = keys["base_num_decoder_layers"]
    plan = []
    for t in families.get(keys["decoder_block"]).hf_layout.tensors(keys):
        path = ("params", *t.path)
        layers = t.layers(keys)
        want = ((layers,) if t.per_layer else ()) + t.mx_shape(keys)
        if path not in saved:
            raise ConfigError(f"checkpoint {step_dir} has no '{'/'.join(path)}' (shape {list(want)} in this "
                              f"config); check the model keys (key=value) or give a checkpoint of this model")
        if saved[path][0] != want:
            raise ConfigError(f"checkpoint {step_dir}: '{'/'.join(path)}' has shape {list(saved[path][0])} but "
                              f"this config gives {list(want)}; check the model keys (key=value)")
        parts = range(t.parts(keys)) if t.parts(keys) > 1 else [None]
        for i in range(layers) if t.per_layer else [None]:
            plan.extend((t.name(i, j), t.hf_shape(keys), t, i if j is None else (i, j)) for j in parts)
    return plan


def _shards(plan: list[tuple], out_dtype: np.dtype, max_shard_bytes: int) -> list[list[tuple]]:
    """`plan` cut in order into files of at most `max_shard_bytes` (a tensor larger than that gets a file alone)."""
    shards, size = [[]], 0
    for entry in plan:
        nbytes = out_dtype.itemsize * int(np.prod(entry[1]))
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


class _Reader:
    """Reads HF tensors from a checkpoint's parameters: one layer at a time where the checkpoint stores layers as
    chunks (from_hf writes them so), else the stacked parameter once for all its layers (a training run's
    checkpoint, chunked by device shards), holding only the latest."""

    def __init__(self, step_dir: epath.Path, keys: dict[str, Any], out_dtype: np.dtype):
        self.keys, self.out_dtype = keys, out_dtype
        self.opened = open_arrays(step_dir / STATE, [("params", *t.path) for t in
                                                          families.get(keys["decoder_block"]).hf_layout.tensors(keys)])
        self.whole: dict[tuple, np.ndarray] = {}

    def __call__(self, t: Tensor, layer: int | tuple[int, int] | None) -> np.ndarray:
        """The HF tensor of `layer`, or of (layer, part) for one of a layer's parts (Tensor.parts)."""
        layer, part = layer if isinstance(layer, tuple) else (layer, None)
        path = ("params", *t.path)
        array = self.opened[path]
        if t.per_layer and array.chunk_layout.read_chunk.shape[0] == 1 and part is None:  # layer chunks (from_hf)
            value = np.asarray(array[layer].read().result())
        elif t.per_layer and array.chunk_layout.read_chunk.shape[0] == 1:  # a layer once for all its parts
            if (path, layer) not in self.whole:
                self.whole.clear()
                self.whole[(path, layer)] = np.asarray(array[layer].read().result())
            value = self.whole[(path, layer)]
        else:  # chunks span the layers (a training run's shards): the parameter once, then its layers
            if path not in self.whole:
                self.whole.clear()
                self.whole[path] = np.asarray(array.read().result())
            value = self.whole[path][layer] if t.per_layer else self.whole[path]
        value = value if part is None else value[part]
        return np.ascontiguousarray(t.to_hf(value, self.keys).astype(self.out_dtype))


def _write_shards(out: epath.Path, shards: list[list[tuple]], read: _Reader, say) -> tuple[list[str], dict]:
    """Writes each shard's safetensors file, one tensor in memory at a time, saying each; returns the file names
    and the index's weight map (HF name -> file)."""
    names, weight_map, done = [], {}, 0
    count = sum(len(shard) for shard in shards)
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def arrays(shard=shard, name=name):
            nonlocal done
            for hf_name, shape, t, layer in shard:
                yield read(t, layer)
                done += 1
                say(f"[{done}/{count}] params/{'/'.join(t.path)}{'' if layer is None else f'[{layer}]'} -> "
                    f"{hf_name} {list(shape)} in {name}", flush=True)

        safetensors.write(str(out / name), [(n, read.out_dtype, s) for n, s, _, _ in shard], arrays())
        weight_map.update({n: name for n, _, _, _ in shard})
        names.append(name)
    return names, weight_map


def _staging(out: epath.Path) -> epath.Path:
    """An empty folder inside `out` for the new files: they move into `out` by renames (one file system, even where
    `out` is a mount point, and no write outside `out`), and transformers reads no subfolder."""
    staged = out / STAGING
    if staged.exists():
        shutil.rmtree(staged)  # an export cut off (kill -9) left it
    staged.mkdir(parents=True)
    return staged


def _publish(staged: epath.Path, out: epath.Path) -> list[str]:
    """Moves the finished export from `staged` into `out`; returns the weight files of an earlier model there that
    it removed (a new file of the same name replaces the old one)."""
    new = sorted(os.listdir(staged), key=lambda f: f == safetensors.INDEX)  # the index last: it names the shards
    stale = sorted(f for f in os.listdir(out) if f not in new and any(fnmatch.fnmatch(f, p) for p in WEIGHT_FILES))
    for name in stale:
        (out / name).unlink()
    for name in new:
        os.replace(staged / name, out / name)
    staged.rmdir()
    return stale


def export_hf(checkpoint_path: str, output_path: str, dtype: str = "bf16", overrides: list[str] = (),
              architecture: str = "", max_shard_bytes: int = 5 * 10**9, hf_base: str = "", say=print) -> list[str]:
    """Converts; returns the files written. `hf_base`: the HF directory the model started from; its config.json
    entries (token ids, context length, architecture) are carried over and its tokenizer files copied; nothing is
    written there.

    `output_path` may hold an earlier export, or the user's files (a README): as `save_pretrained` does, the export
    replaces the weights there and keeps the rest. It is written into a subfolder and moved in once complete,
    and only then are weight files it did not write removed (said in one line), since transformers would load a
    model.safetensors left there before the new index, or pytorch_model*.bin where no safetensors are: the folder
    holds one set of weights, and an export cut off before its last renames leaves it as it was."""
    out = epath.Path(os.path.abspath(output_path))
    if hf_base and os.path.commonpath([os.path.realpath(out), os.path.realpath(hf_base)]) == \
            os.path.realpath(hf_base):
        raise ConfigError(f"--output_path {output_path} is --hf_base {hf_base} or inside it; give another directory "
                          f"(the export leaves the model it started from as it is)")
    step_dir = resolve_step_dir(checkpoint_path, "--checkpoint_path")
    meta = _meta(step_dir, hf_base)
    keys = _model_keys(step_dir, meta, overrides)
    arch = architecture or meta.get("architecture") or "llama"
    layout = families.get(keys["decoder_block"]).hf_layout
    hf_config = layout.hf_config(keys, arch, TORCH_NAMES[dtype], meta.get("hf_config") or {})
    plan = _tensor_plan(step_dir, keys)
    out_dtype = OUT_DTYPES[dtype]
    staged = _staging(out)
    try:
        names, weight_map = _write_shards(staged, _shards(plan, out_dtype, max_shard_bytes),
                                          _Reader(step_dir, keys, out_dtype), say)
        total = sum(out_dtype.itemsize * int(np.prod(s)) for _, s, _, _ in plan)
        (staged / safetensors.INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                            "weight_map": weight_map}, indent=2))
        (staged / "config.json").write_text(json.dumps(hf_config, indent=2))
        copied = [f for f in sorted(os.listdir(hf_base)) if f.startswith(TOKENIZER_FILES)] if hf_base else []
        for name in copied:
            shutil.copyfile(os.path.join(hf_base, name), staged / name)
        stale = _publish(staged, out)
    finally:
        if staged.exists():
            shutil.rmtree(staged)
    if stale:
        say(f"removed the weights an earlier model left in {out}: {', '.join(stale)}")
    say(f"wrote {len(names)} safetensors files ({total / 2**30:.2f} GiB), {safetensors.INDEX}, config.json"
        f"{''.join(', ' + f for f in copied)} to {out}")
    return [*names, safetensors.INDEX, "config.json", *copied]
