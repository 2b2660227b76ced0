"""Cross-field checks of a Config, run before JAX initialises.

Each failure raises ConfigError whose message names the keys, their values and the fix. Checks that need the
device count use `cpu_devices` when it is set; `check_devices` repeats them once JAX knows the real count.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from maxctx.config import STRATEGY_ALIASES, Config, ConfigError

ATTENTION_KERNELS = ("auto", "dot_product", "flash", "splash", "cudnn")
CP_STRATEGIES = ("all_gather", "a2a", "p2p", "usp")
REMAT_POLICIES = ("none", "minimal", "full", "custom")
REMAT_PLACES = ("remat", "device", "offload")
# The tensors remat_policy=custom places (MaxText's names; maxctx.model.layers tags them with checkpoint_name).
REMAT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi",
               "mlpwo")
DTYPES = ("float32", "bfloat16", "float16")
DATASET_TYPES = ("synthetic", "arrayrecord", "tfds", "text")
PACKING = ("first_fit", "concat", "none")
MESH_AXES = ("data", "fsdp", "context", "tensor")


def _choice(config: Config, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, key)
    if value not in choices:
        raise ConfigError(f"{key}='{value}' is not one of {', '.join(choices)}; pick one of them")


def _positive(config: Config, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = getattr(config, key)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{key}={value} must be {bound}")


def mesh_sizes(config: Config, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """Resolves the ici_* and dcn_* sizes (one -1 per group fills the rest) for `num_devices` devices.

    Single-slice runs (the only kind on CPU and GPU) have dcn product 1: a -1 there becomes 1.
    """
    dcn = {a: getattr(config, f"dcn_{a}_parallelism") for a in MESH_AXES}
    ici = {a: getattr(config, f"ici_{a}_parallelism") for a in MESH_AXES}
    num_slices = max(1, config.compile_topology_num_slices) if config.compile_topology else 1
    dcn = _fill(dcn, num_slices, "dcn", "number of slices")
    per_slice, rem = divmod(num_devices, num_slices)
    if rem:
        raise ConfigError(f"{num_devices} devices do not split into {num_slices} slices")
    ici = _fill(ici, per_slice, "ici", "devices per slice")
    return ici, dcn


def _fill(sizes: dict[str, int], total: int, group: str, what: str) -> dict[str, int]:
    names = {a: f"{group}_{a}_parallelism" for a in sizes}
    free = [a for a, s in sizes.items() if s == -1]
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ConfigError(f"{names[a]}={s} must be a positive size or -1 (fill the rest)")
    if len(free) > 1:
        raise ConfigError(f"{' and '.join(names[a] + '=-1' for a in free)}: at most one {group}_* size may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if total % fixed:
            raise ConfigError(f"{names[free[0]]}=-1 cannot fill {total} {what}: the other {group}_* sizes multiply "
                              f"to {fixed}, which does not divide {total}")
        sizes = {**sizes, free[0]: total // fixed}
    elif fixed != total:
        given = " x ".join(f"{names[a]}={s}" for a, s in sizes.items())
        raise ConfigError(f"{given} = {fixed}, but there are {total} {what}; make the product {total} or set one "
                          f"size to -1")
    return sizes


def check_devices(config: Config, num_devices: int) -> None:
    """Checks that need the device count: mesh product, batch and sequence divisibility."""
    ici, dcn = mesh_sizes(config, num_devices)
    axis = {a: ici[a] * dcn[a] for a in MESH_AXES}
    batch = config.per_device_batch_size * num_devices
    if abs(batch - round(batch)) > 1e-9 or round(batch) < 1:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = {batch} "
                          f"is not a whole number of sequences; choose a per_device_batch_size that makes it one")
    batch_shards = axis["data"] * axis["fsdp"]
    if round(batch) % batch_shards:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = "
                          f"{round(batch)} sequences is not divisible by data x fsdp = {batch_shards}; change "
                          f"per_device_batch_size or the data/fsdp parallelism")
    cp = axis["context"]
    chunks = 2 * cp if config.context_parallel_load_balance and cp > 1 else cp
    if config.max_target_length % chunks:
        fix = " (2 x context parallelism, for context_parallel_load_balance=true)" if chunks != cp else ""
        raise ConfigError(f"max_target_length={config.max_target_length} is not divisible by {chunks}{fix}; "
                          f"choose a multiple of {chunks}")
    for key in ("num_vocab_tiling", "mlp_sequence_chunks"):
        n = getattr(config, key)
        per_shard = config.max_target_length // cp  # whole: checked above
        if per_shard % n:
            raise ConfigError(f"{key}={n} does not divide the {per_shard} tokens each of the {cp} context shards "
                              f"holds (max_target_length={config.max_target_length}); choose a divisor of "
                              f"{per_shard}")
    tp = axis["tensor"]
    if config.base_num_query_heads % tp or config.base_num_kv_heads % tp and tp % config.base_num_kv_heads:
        raise ConfigError(f"ici/dcn tensor parallelism {tp} must divide base_num_query_heads="
                          f"{config.base_num_query_heads} and divide or be a multiple of base_num_kv_heads="
                          f"{config.base_num_kv_heads}; lower the tensor parallelism")
    if config.cp_strategy in ("a2a", "usp") and cp > 1:
        u = a2a_degree(config)
        if cp % u:
            raise ConfigError(f"context_parallel_a2a_degree={u} does not divide the context parallelism {cp}; "
                              f"choose a divisor of {cp}")
        if (config.base_num_query_heads // tp) % u:
            raise ConfigError(f"base_num_query_heads={config.base_num_query_heads} / tensor {tp} is not divisible "
                              f"by the A2A degree {u} (context_parallel_strategy={config.context_parallel_strategy}); "
                              f"use a head count divisible by {u}, or context_parallel_strategy=p2p or all_gather")
    if config.attention == "splash":
        # Splash tiles each device's query rows in blocks of 128 (TPU lanes); the rows a device attends are S / C
        # (all_gather, p2p), S (a2a, after the all-to-all) or S / ring degree (usp).
        rows = config.max_target_length // (1 if config.cp_strategy == "a2a" else cp // a2a_degree(config)
                                            if config.cp_strategy == "usp" else cp)
        if rows % 128:
            raise ConfigError(f"attention=splash with max_target_length={config.max_target_length} and "
                              f"context_parallel_strategy={config.context_parallel_strategy} over {cp} devices gives "
                              f"{rows} query rows per device, not a multiple of 128; choose max_target_length a "
                              f"multiple of {128 * config.max_target_length // rows}, or attention=flash")


def _check_custom_remat(config: Config) -> None:
    """The per-tensor keys of remat_policy=custom take effect only with it: a changed one alone is refused."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for name in REMAT_NAMES:
        _choice(config, name, REMAT_PLACES)
        if config.remat_policy != "custom" and getattr(config, name) != defaults[name]:
            raise ConfigError(f"{name}={getattr(config, name)} only applies with remat_policy=custom (now "
                              f"remat_policy={config.remat_policy}); add remat_policy=custom")


def _check_data(config: Config) -> None:
    """Data keys that need no file access (paths, tokenizers and records are checked by maxctx.data)."""
    _positive(config, "grain_worker_count", "grain_prefetch_buffer_size", allow_zero=True)
    if config.dataset_type == "text" and not config.tokenizer_path:
        raise ConfigError("dataset_type=text needs tokenizer_path (a sentencepiece model; scripts/train_tokenizer.py "
                          "trains one)")
    if config.eval_interval > 0 and config.dataset_type in ("arrayrecord", "text") and not config.grain_eval_files:
        raise ConfigError(f"eval_interval={config.eval_interval} with dataset_type={config.dataset_type} needs "
                          f"grain_eval_files (a file glob); set it, or eval_interval=0")
    if config.eval_interval > 0 and config.dataset_type == "tfds" and not config.eval_split:
        raise ConfigError(f"eval_interval={config.eval_interval} with dataset_type=tfds needs eval_split (e.g. "
                          f"eval_split=validation); set it, or eval_interval=0")


def a2a_degree(config: Config) -> int:
    """A2A degree U of the a2a and usp strategies (ring degree R = C / U).

    a2a: U = C. usp with context_parallel_a2a_degree > 0: that value. usp default (0): across slices
    (dcn_context_parallelism > 1) U = ici_context_parallelism, so all-to-all stays on ICI and the ring spans DCN;
    on one slice, the largest divisor U of C with U * U <= C that divides the query heads (C=4 -> 2x2, C=8 -> 2x4),
    so both parts take part.
    """
    cp = config.context_parallelism
    if config.cp_strategy == "a2a":
        return cp
    if config.cp_strategy != "usp":
        return 1
    if config.context_parallel_a2a_degree > 0:
        return config.context_parallel_a2a_degree
    if config.dcn_context_parallelism > 1:
        return config.ici_context_parallelism
    heads = config.base_num_query_heads
    return max(u for u in range(1, cp + 1) if cp % u == 0 and u * u <= cp and heads % u == 0)


def num_processes(config: Config) -> int:
    """Processes in the job as configured: `jax_num_processes`, else env JAX_NUM_PROCESSES, else 0 (unknown)."""
    return config.jax_num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)


def validate(config: Config) -> None:
    """All config checks that do not need JAX; raises ConfigError."""
    _choice(config, "attention", ATTENTION_KERNELS)
    strategy = config.context_parallel_strategy
    if strategy not in CP_STRATEGIES and strategy not in STRATEGY_ALIASES:
        raise ConfigError(f"context_parallel_strategy='{strategy}' is not one of "
                          f"{', '.join(CP_STRATEGIES + tuple(STRATEGY_ALIASES))}; pick one of them")
    _choice(config, "remat_policy", REMAT_POLICIES)
    _check_custom_remat(config)
    _choice(config, "dtype", DTYPES)
    _choice(config, "weight_dtype", DTYPES)
    _choice(config, "dataset_type", DATASET_TYPES)
    _choice(config, "packing", PACKING)
    if not config.run_name or "/" in config.run_name:
        raise ConfigError(f"run_name='{config.run_name}' must be a non-empty name without '/'")
    _positive(config, "steps", "cpu_devices", "eval_interval", "jax_num_processes", allow_zero=True)
    _positive(config, "jax_heartbeat_timeout_seconds", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
              "base_mlp_dim", "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length", "log_period",
              "checkpoint_period", "gradient_accumulation_steps", "max_num_checkpoints_to_keep", "eval_steps",
              "flash_block_q", "flash_block_kv", "per_device_batch_size", "rope_max_timescale", "num_vocab_tiling",
              "mlp_sequence_chunks")
    if config.learning_rate < 0:
        raise ConfigError(f"learning_rate={config.learning_rate} must be >= 0")
    if not 0 <= config.warmup_steps_fraction < 1:
        raise ConfigError(f"warmup_steps_fraction={config.warmup_steps_fraction} must be in [0, 1)")
    if config.base_num_query_heads % config.base_num_kv_heads:
        raise ConfigError(f"base_num_query_heads={config.base_num_query_heads} is not divisible by "
                          f"base_num_kv_heads={config.base_num_kv_heads}; grouped-query attention needs a multiple")
    if config.head_dim % 2:
        raise ConfigError(f"head_dim={config.head_dim} must be even for rotary embeddings")
    if config.load_parameters_path and config.load_full_state_path:
        raise ConfigError("load_parameters_path and load_full_state_path are both set; set only one "
                          "(parameters only, or a whole training state)")
    if config.attention == "cudnn" and config.dtype == "float32":
        raise ConfigError("attention=cudnn needs dtype=bfloat16 or float16 (cuDNN flash attention has no float32); "
                          "set dtype=bfloat16, or attention=flash")
    if config.context_parallel_a2a_degree < 0:
        raise ConfigError(f"context_parallel_a2a_degree={config.context_parallel_a2a_degree} must be >= 0 "
                          f"(0 picks the default)")
    if config.dataset_type != "synthetic" and config.dataset_type != "tfds" and not config.grain_train_files:
        raise ConfigError(f"dataset_type={config.dataset_type} needs grain_train_files (a file glob)")
    for key in ("base_output_directory", "load_parameters_path", "load_full_state_path"):
        value = getattr(config, key)
        if value.startswith("gs://") and not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
            raise ConfigError(f"{key}={value}: gs:// paths need gcsfs (etils.epath's Google Cloud Storage backend), "
                              f"which is not installed; pip install -e '.[gcs]' (scripts/tpu/setup.sh and the "
                              f"Docker images install it)")
    for key in ("grain_train_files", "grain_eval_files", "tokenizer_path", "tfds_data_dir"):
        if "://" in getattr(config, key):
            raise ConfigError(f"{key}={getattr(config, key)}: data and tokenizer files are read from local paths; "
                              f"mount the bucket (e.g. gcsfuse, docs/tpu.md) and point {key} at the mount")
    if config.dataset_type == "tfds" and not config.dataset_name:
        raise ConfigError("dataset_type=tfds needs dataset_name, e.g. dataset_name=my_dataset:1.0.0")
    _check_data(config)
    if config.cpu_devices:
        check_devices(config, config.cpu_devices * max(1, num_processes(config)))
