"""Hugging Face model directory -> maxctx parameter checkpoint (`load_parameters_path`).

Steps: config.json -> maxctx model keys (or a preset and overrides, checked against it); every tensor's presence,
shape and dtype checked from the safetensors headers before anything is written; then one parameter at a time
and one layer at a time (each layer of a stacked [L, ...] parameter is read, converted and written on its own)
into an Orbax checkpoint:

    <output_path>/0/state   {"params": ...} as a training checkpoint holds them (with maxctx's integrity record)
    <output_path>/0/meta    {"config": model keys, "architecture", "hf_config"}: what to_hf needs to go back
    <output_path>/model.yml the model keys, for `python train.py <output_path>/model.yml ...`

Peak host memory: about one HF tensor (read, converted, written), never a whole stacked parameter or the model.
A layout with `quantization` (DeepSeek's) takes FP8 block-quantised releases: each float8 weight is read with its
`<name>_scale_inv` and dequantised (safetensors.BlockScaled) as it is converted; with `without_mtp`, the
multi-token prediction layers are left out on request (`skip_mtp_layers`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import ml_dtypes
import numpy as np
import yaml
from etils import epath

from maxctx.config import MODEL_KEYS, Config
from maxctx.convert import safetensors
from maxctx.convert.streaming import Deferred, save_deferred, save_json
from maxctx.errors import ConfigError
from maxctx.loader import parse_config
from maxctx.model import families
from maxctx.model.llama.hf_layout import DIM_KEYS, Tensor
from maxctx.validate import validate

STEP = "0"
# Source dtypes each weight_dtype holds exactly; anything else (quantized, fp64) is refused, never rounded.
EXACT = {"float32": ("F32", "BF16", "F16"), "bfloat16": ("BF16",), "float16": ("F16",)}
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float16": np.dtype(np.float16)}
# Buffers some exports carry that are no parameters (recomputed from the config).
IGNORED = (".rotary_emb.inv_freq",)
SCALE = "_scale_inv"  # a block-quantised weight's scales, beside it (DeepSeek-V3's FP8 releases)


def read_hf_config(hf_path: str) -> dict[str, Any]:
    path = os.path.join(hf_path, "config.json")
    if not os.path.isdir(hf_path):
        raise ConfigError(f"--hf_path {hf_path} is not a directory; give a Hugging Face model directory "
                          f"(config.json and *.safetensors)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing; a Hugging Face model directory has config.json next to its "
                          f"*.safetensors: download it too") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); download it again") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds a JSON {type(hf).__name__}, not a JSON object of the model's settings "
                          f"(hidden_size, ...); download it again")
    return hf


def key_values(keys: dict[str, Any], overrides: list[str]) -> list[str]:
    """`keys` as key=value arguments, less those the overrides set, then the overrides: each key given once (the
    command line's notice of a key given twice would be about keys the user never typed)."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [*(f"{k}={v}" for k, v in keys.items() if k not in given), *overrides]


def target_config(hf_keys: dict[str, Any], overrides: list[str]) -> Config:
    """The maxctx config to convert into: config.json's keys, or with model_name=... that preset; the key=value
    overrides win either way."""
    config = parse_config(key_values({} if any(o.startswith("model_name=") for o in overrides) else hf_keys,
                                     overrides))
    validate(config)
    return config


def _key_to_change(t: Tensor, hf_keys: dict, keys: dict) -> str:
    changes = [f"{DIM_KEYS[c]}={hf_keys[DIM_KEYS[c]]}" for group in t.hf for c in group
               if hf_keys[DIM_KEYS[c]] != keys[DIM_KEYS[c]]]
    return (f"set {' '.join(dict.fromkeys(changes))} (config.json's value)" if changes else
            "check model_name and the shape keys " + ", ".join(sorted(set(DIM_KEYS.values()))))


def _stored(info: safetensors.TensorInfo, files: dict, block: tuple[int, int] | None, used: set,
            weight_dtype: str) -> safetensors.TensorInfo:
    """`info`, or where it is a float8 weight of a block-quantised release (`block`), it with its scale tensor
    (marked used); refused where weight_dtype cannot take its dtype."""
    if block is not None and info.dtype == "F8_E4M3":
        scale = files.get(info.name + SCALE)
        want = tuple(-(-n // b) for n, b in zip(info.shape, block))
        if scale is None or len(info.shape) != 2 or scale.shape != want or scale.dtype not in EXACT["float32"]:
            found = "is missing" if scale is None else f"is {scale.dtype}{list(scale.shape)}"
            raise ConfigError(f"{info.path}: tensor '{info.name}' is F8_E4M3 [O, I] but its '{info.name}{SCALE}' "
                              f"{found}; maxctx dequantises float8 weights with a float32 scale per block of "
                              f"quantization_config's weight_block_size {list(block)} ({list(want)} here): "
                              f"download the file again or give the bf16 release")
        used.add(scale.name)
        return safetensors.BlockScaled(info, scale, block)
    if info.dtype not in EXACT[weight_dtype]:
        fix = ("it is quantized or not a float the model uses: give the bf16 or fp32 release" if
               info.dtype not in EXACT["float32"] else "convert with weight_dtype=float32")
        raise ConfigError(f"{info.path}: tensor '{info.name}' is {info.dtype}, which weight_dtype="
                          f"{weight_dtype} cannot hold exactly; {fix}")
    return info


def plan(hf_path: str, hf_keys: dict, config: Config, block: tuple[int, int] | None = None,
         skip: tuple[str, ...] = ()) -> tuple[list[tuple[Tensor, list[safetensors.TensorInfo]]], int]:
    """(each parameter with its HF tensors (one per layer), the count of tensors skipped), all checked: present,
    of the expected shape, of a dtype weight_dtype holds exactly (or float8 with its scales, a release quantized
    in `block`s); no HF tensor left over but those whose names start with a `skip` prefix."""
    keys = {k: getattr(config, k) for k in MODEL_KEYS}
    files = safetensors.model_tensors(hf_path)
    used, result = {n for n in files if n.startswith(skip)} if skip else set(), []
    skipped = len(used)
    for t in families.get(keys["decoder_block"]).hf_layout.tensors(keys):
        infos = []
        parts = range(t.parts(keys)) if t.parts(keys) > 1 else [None]
        for i, j in ((i, j) for i in (range(t.layers(keys)) if t.per_layer else [None])
                     for j in parts):
            name = t.name(i, j)
            if name == "lm_head.weight" and name not in files and hf_keys["logits_via_embedding"]:
                name = "model.embed_tokens.weight"  # tied in the checkpoint, untied in this config
            info = files.get(name)
            if info is None:
                listed = safetensors.listed_in(hf_path, name)
                if listed:
                    raise ConfigError(f"{listed}: tensor '{name}' is missing, though {safetensors.INDEX} puts it "
                                      f"there; the file is damaged: download it again")
                raise ConfigError(f"{hf_path}: tensor '{name}' is missing from its *.safetensors; the download is "
                                  f"incomplete (download it again) or the model differs from this config "
                                  f"({'num_hidden_layers' if t.per_layer else 'tie_word_embeddings'} in config.json)")
            if info.shape != t.hf_shape(keys):
                raise ConfigError(f"{info.path}: tensor '{name}' has shape {list(info.shape)} but this config gives "
                                  f"{list(t.hf_shape(keys))}; {_key_to_change(t, hf_keys, keys)}")
            used.add(name)
            infos.append(_stored(info, files, block, used, config.weight_dtype))
        result.append((t, infos))
    if keys["logits_via_embedding"] and not hf_keys["logits_via_embedding"]:
        raise ConfigError(f"{hf_path}: the checkpoint has its own lm_head.weight but logits_via_embedding=true "
                          f"would drop it; set logits_via_embedding=false")
    extra = sorted(n for n in files if n not in used and not n.endswith(IGNORED)
                   and not (n == "lm_head.weight" and hf_keys["logits_via_embedding"]))
    mtp = [n for n in extra if n.startswith("mtp.")]  # Qwen3.5 / Qwen3-Next releases' prediction layers
    if mtp:
        raise ConfigError(f"{files[mtp[0]].path}: tensor '{mtp[0]}' is a multi-token prediction layer's (mtp.*), "
                          f"which maxctx does not train; convert the main model without them with from_hf "
                          f"--skip_mtp_layers")
    if extra:
        raise ConfigError(f"{files[extra[0]].path}: tensor '{extra[0]}' has no place in this config's model "
                          f"(base_num_decoder_layers={keys['base_num_decoder_layers']}, config.json's "
                          f"num_hidden_layers={hf_keys['base_num_decoder_layers']}); set the keys as config.json "
                          f"has them")
    return result, skipped


def _deferred(t: Tensor, infos: list[safetensors.TensorInfo], keys: dict, dtype: np.dtype, progress) -> Deferred:
    """The parameter as a leaf made when written: layer i from its HF tensor (or the one tensor)."""

    parts = t.parts(keys)

    def part(info: safetensors.TensorInfo) -> np.ndarray:
        value = t.to_maxctx(safetensors.read(info), keys).astype(dtype)
        progress(info, t)
        return value

    def make(i: int | None) -> np.ndarray:
        first = (0 if i is None else i) * parts
        if parts == 1:
            return part(infos[first])
        return np.stack([part(info) for info in infos[first:first + parts]])  # one layer's experts

    shape = ((len(infos) // parts,) if t.per_layer else ()) + t.mx_shape(keys)
    return Deferred(shape, dtype, make, stacked=t.per_layer)


def import_hf(hf_path: str, output_path: str, overrides: list[str], say=print, skip_mtp_layers: bool = False) -> str:
    """Converts; returns the step directory written. `skip_mtp_layers`: a checkpoint's multi-token prediction
    layers (its layout's `without_mtp`: DeepSeek-V3's) are left out, the rest converted."""
    hf = read_hf_config(hf_path)
    where = os.path.join(hf_path, "config.json")
    layout = families.for_hf(hf, where).hf_layout
    skip: tuple[str, ...] = ()
    if skip_mtp_layers and hasattr(layout, "without_mtp"):
        hf, skip = layout.without_mtp(hf)
    # Only a layout with `quantization` (DeepSeek's) reads quantized releases; the others refuse their dtypes.
    block = layout.quantization(hf, where) if hasattr(layout, "quantization") else None
    arch = layout.architecture(hf, where)
    hf_keys = {**layout.model_keys(hf, where), "decoder_block": layout.DECODER_BLOCKS[arch]}
    config = target_config(hf_keys, overrides)
    keys = {k: getattr(config, k) for k in MODEL_KEYS}
    for key, value in hf_keys.items():
        if key not in DIM_KEYS.values() and keys[key] != value:
            say(f"note: config.json has {key}={value}, the converted model keeps {key}={keys[key]}")
    params, skipped = plan(hf_path, hf_keys, config, block, skip)
    if skip_mtp_layers:
        where_skipped = ", ".join(p + "*" for p in skip) or "config.json has none"
        say(f"skipped {skipped} tensors of multi-token prediction layers ({where_skipped})")
    out = epath.Path(os.path.abspath(output_path))  # a local directory: copy it to a bucket afterwards
    if (out / STEP).exists():
        raise ConfigError(f"--output_path {output_path} already holds a checkpoint ({out / STEP}); give a new "
                          f"directory")
    total, done, start = sum(len(infos) for _, infos in params), [0], time.time()

    def progress(info: safetensors.TensorInfo, t: Tensor) -> None:
        done[0] += 1
        say(f"[{done[0]}/{total}] {info.name} {info.dtype}{list(info.shape)} -> params/{'/'.join(t.path)} "
            f"({time.time() - start:.1f}s)", flush=True)

    dtype = NP_DTYPES[config.weight_dtype]
    tree: dict = {}
    for t, infos in params:
        node = tree.setdefault("params", {})
        for key in t.path[:-1]:
            node = node.setdefault(key, {})
        node[t.path[-1]] = _deferred(t, infos, keys, dtype, progress)
    tmp = out / f"{STEP}.orbax-checkpoint-tmp-convert"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_deferred(tmp / "state", tree)
    save_json(tmp / "meta", {"config": keys, "architecture": arch, "hf_config": hf, "weight_dtype":
                             config.weight_dtype, "source": os.path.abspath(hf_path)})
    (tmp / "commit_success.txt").write_text("")  # what Orbax's finality check looks for on object stores
    tmp.rename(out / STEP)
    model_yml = {**({"model_name": config.model_name} if any(o.startswith("model_name=") for o in overrides)
                    else {}), **keys, "weight_dtype": config.weight_dtype}
    (out / "model.yml").write_text(f"# maxctx model of {os.path.abspath(hf_path)} ({arch})\n" +
                                   yaml.safe_dump(model_yml, sort_keys=False))
    say(f"wrote {out / STEP}; train from it with: python train.py {out / 'model.yml'} load_parameters_path={out} "
        f"key=value ...")
    return str(out / STEP)
