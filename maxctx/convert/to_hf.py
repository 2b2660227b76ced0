"""maxctx checkpoint -> Hugging Face model directory (LlamaForCausalLM / MistralForCausalLM).

Writes `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes` (one tensor may exceed it),
`model.safetensors.index.json` and `config.json`. One stacked parameter is read from the checkpoint at a time and
its per-layer HF tensors are written from it, so host memory holds one parameter and one tensor.

The model keys come from the checkpoint's meta item (a training run records them; from_hf records them and the
source config.json, whose token ids and context length are carried over), then the key=value overrides.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxctx.checkpoint import META, STATE, resolve_step_dir
from maxctx.config import MODEL_KEYS, parse_config
from maxctx.convert import hf_layout, safetensors
from maxctx.convert.streaming import restore_one, shapes
from maxctx.errors import ConfigError

OUT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}
TORCH_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


def _meta(step_dir: epath.Path) -> dict[str, Any]:
    if not (step_dir / META).is_dir():
        return {}
    return ocp.JsonCheckpointHandler().restore(step_dir / META) or {}


def export_hf(checkpoint_path: str, output_path: str, dtype: str = "bf16", overrides: list[str] = (),
              architecture: str = "", max_shard_bytes: int = 5 * 10**9, say=print) -> list[str]:
    """Converts; returns the files written."""
    step_dir = resolve_step_dir(checkpoint_path, "--checkpoint_path")
    meta = _meta(step_dir)
    saved_keys = {k: v for k, v in (meta.get("config") or {}).items() if k in MODEL_KEYS}
    if not saved_keys and not overrides:
        raise ConfigError(f"checkpoint {step_dir} records no model keys (no meta item); give them as key=value "
                          f"(e.g. model_name=llama3.1-8b)")
    config = parse_config([*(f"{k}={v}" for k, v in saved_keys.items()), *overrides])
    keys = {k: getattr(config, k) for k in MODEL_KEYS}
    arch = architecture or meta.get("architecture") or "llama"
    saved = shapes(step_dir / STATE)
    layers = keys["base_num_decoder_layers"]
    plan = []  # (hf name, shape, tensor, layer)
    for t in hf_layout.tensors(keys):
        path = ("params", *t.path)
        want = ((layers,) if t.per_layer else ()) + t.mx_shape(keys)
        if path not in saved:
            raise ConfigError(f"checkpoint {step_dir} has no '{'/'.join(path)}' (shape {list(want)} in this "
                              f"config); check the model keys (key=value) or give a checkpoint of this model")
        if saved[path][0] != want:
            raise ConfigError(f"checkpoint {step_dir}: '{'/'.join(path)}' has shape {list(saved[path][0])} but "
                              f"this config gives {list(want)}; check the model keys (key=value)")
        for i in range(layers) if t.per_layer else [None]:
            plan.append((t.name(i), t.hf_shape(keys), t, i))

    out_dtype = OUT_DTYPES[dtype]
    shards, size = [[]], 0
    for entry in plan:
        nbytes = out_dtype.itemsize * int(np.prod(entry[1]))
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    out = epath.Path(os.path.abspath(output_path))
    out.mkdir(parents=True, exist_ok=True)
    cache: dict[tuple, np.ndarray] = {}

    def tensor(t: hf_layout.Tensor, layer: int | None) -> np.ndarray:
        path = ("params", *t.path)
        if path not in cache:
            cache.clear()  # one stacked parameter at a time
            cache[path] = restore_one(step_dir / STATE, path, *saved[path])
        value = cache[path][layer] if t.per_layer else cache[path]
        return np.ascontiguousarray(t.to_hf(value, keys).astype(out_dtype))

    names, weight_map, done = [], {}, 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def arrays(shard=shard, name=name):
            nonlocal done
            for hf_name, shape, t, layer in shard:
                yield tensor(t, layer)
                done += 1
                say(f"[{done}/{len(plan)}] params/{'/'.join(t.path)}{'' if layer is None else f'[{layer}]'} -> "
                    f"{hf_name} {list(shape)} in {name}", flush=True)

        safetensors.write(str(out / name), [(n, out_dtype, s) for n, s, _, _ in shard], arrays())
        weight_map.update({n: name for n, _, _, _ in shard})
        names.append(name)
    total = sum(out_dtype.itemsize * int(np.prod(s)) for _, s, _, _ in plan)
    (out / safetensors.INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2))
    hf_config = hf_layout.hf_config(keys, arch, TORCH_NAMES[dtype], meta.get("hf_config") or {})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    say(f"wrote {len(names)} safetensors files ({total / 2**30:.2f} GiB), {safetensors.INDEX} and config.json to "
        f"{out}")
    return [*names, safetensors.INDEX, "config.json"]
