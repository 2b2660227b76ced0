"""Cross-field checks of a Config, run before JAX initialises (maxctx.loader.load runs them on every config).

Each failure raises ConfigError whose message names the keys, their values and the fix. Checks that need the
device count run here when `cpu_devices` or `compile_topology` states it; otherwise maxctx.runtime.initialize runs
`check_devices` once JAX knows the count. The data keys' rules come from maxctx.datasets. Nothing here
imports JAX or numpy (tests/test_layering.py checks it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from maxctx import storage
from maxctx.attention.cp import strategies
from maxctx.config import REMAT_NAMES, Config, ConfigError, choices, layer_windows
from maxctx.datasets import DATASETS
from maxctx.files import REMOTE_KEYS, check_tokenizer_path, expand_files
from maxctx.model import families
from maxctx.model.moe import family as moe_family
from maxctx.parallelism import A2A_AXIS, BATCH_AXES, RING_AXIS, TENSOR_AXIS, check_expert_mesh, configured_sizes
from maxctx.plan import topology


def _check_eval_batch(config: Config, num_devices: int, batch_shards: int) -> None:
    if not config.eval_per_device_batch_size:
        return  # the training batch, checked above
    batch = config.eval_per_device_batch_size * num_devices
    if abs(batch - round(batch)) > 1e-9 or round(batch) < 1 or round(batch) % batch_shards:
        raise ConfigError(f"eval_per_device_batch_size={config.eval_per_device_batch_size} x {num_devices} devices "
                          f"= {batch:g} sequences is not a whole multiple of data x fsdp = {batch_shards}; choose an "
                          f"eval_per_device_batch_size that makes it one")


# splash's other block sizes (MaxText's sa_block_*): 0 = the forward's block, else a multiple of 128
SPLASH_BLOCK_KEYS = ("flash_block_kv_compute", "flash_block_q_dkv", "flash_block_kv_dkv", "flash_block_kv_dkv_compute",
                     "flash_block_q_dq", "flash_block_kv_dq")


def _positive(config: Config, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = getattr(config, key)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{key}={value} must be {bound}")


def check_devices(config: Config, num_devices: int) -> None:
    """Checks that need the device count: mesh product, batch and sequence divisibility, the strategy's rules."""
    axis = configured_sizes(config, num_devices)
    batch = config.per_device_batch_size * num_devices
    if abs(batch - round(batch)) > 1e-9 or round(batch) < 1:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = {batch} "
                          f"is not a whole number of sequences; choose a per_device_batch_size that makes it one")
    batch_shards = math.prod(axis[a] for a in BATCH_AXES)
    if round(batch) % batch_shards:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = "
                          f"{round(batch)} sequences is not divisible by data x fsdp = {batch_shards}; change "
                          f"per_device_batch_size or the data/fsdp parallelism")
    if config.eval_interval > 0:
        _check_eval_batch(config, num_devices, batch_shards)
    cp = axis[RING_AXIS]
    chunks = 2 * cp if config.context_parallel_load_balance is True and cp > 1 else cp
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
    tp = axis[TENSOR_AXIS]
    if config.base_num_query_heads % tp or config.base_num_kv_heads % tp and tp % config.base_num_kv_heads:
        raise ConfigError(f"ici/dcn tensor parallelism {tp} must divide base_num_query_heads="
                          f"{config.base_num_query_heads} and divide or be a multiple of base_num_kv_heads="
                          f"{config.base_num_kv_heads}; lower the tensor parallelism")
    if cp > 1:
        strategy = strategies.for_config(config)
        strategy.check(config, cp, tp)
        strategy.check_model(config, getattr(families.shape(config), "kv_lora_rank", 0))  # MLA's latent rank
        strategies.mesh_plan(config, num_devices)  # the A2A part inside a slice
    _check_head_chunks(config, tp, strategies.for_config(config).a2a_degree(config, cp) if cp > 1 else 1)
    moe_family.check_keys(config, cp)  # MoE placement keys for another family; a capacity that drops by design
    moe_family.check_expert_parallelism(config, axis)
    check_expert_mesh(config, strategies.mesh_plan(config, num_devices).sizes if cp > 1 else {**axis, A2A_AXIS: 1})
    _check_host_layers(config)
    # splash: asked for, or what auto/flash pick when compiling for a TPU topology
    if config.attention == "splash" or config.attention in ("auto", "flash") and config.compile_topology:
        _check_splash_rows(config, cp)
    for length in sorted(set(config.passkey_grid[0]) - {config.max_target_length}):
        try:  # a passkey example is a sequence of its length: the same rules
            check_devices(dataclasses.replace(config, max_target_length=length, passkey_lengths=""), num_devices)
        except ConfigError as e:
            raise ConfigError(f"passkey_lengths={config.passkey_lengths}: the passkey length {length} breaks a "
                              f"rule of sequence lengths: {e}") from None


def _check_splash_rows(config: Config, cp: int) -> None:
    """Splash tiles each device's query rows in blocks of 128 (TPU lanes)."""
    strategy = strategies.for_config(config)
    rows = strategy.query_rows(config.max_target_length, cp, strategy.a2a_degree(config, cp)) if cp > 1 else (
        config.max_target_length)
    if rows % 128:
        raise ConfigError(f"attention={config.attention} (splash on TPU) with max_target_length="
                          f"{config.max_target_length} and context_parallel_strategy="
                          f"{config.context_parallel_strategy} over {cp} devices gives {rows} query rows per device, "
                          f"not a multiple of 128; choose max_target_length a multiple of "
                          f"{128 * config.max_target_length // rows}, or attention=blockwise")


# Sizes index int32 arrays (token ids, positions, shapes): a larger one fails deep inside JAX or numpy.
_INT32_SIZES = ("vocab_size", "base_emb_dim", "base_mlp_dim", "head_dim", "base_num_query_heads", "base_num_kv_heads",
                "base_num_decoder_layers", "max_target_length", "gradient_accumulation_steps")
_INT32_MAX = 2**31 - 1


def _check_ranges(config: Config) -> None:
    """Values the code downstream would reject with a traceback (or silently misuse): seeds, optimizer
    hyperparameters, int32 sizes."""
    _positive(config, "seed", "data_shuffle_seed", "adam_eps", "adam_weight_decay", "gradient_clipping_threshold",
              "normalization_layer_epsilon", allow_zero=True)
    for key, default in (("adam_b1", 0.9), ("adam_b2", 0.95)):
        if not 0 <= getattr(config, key) < 1:
            raise ConfigError(f"{key}={getattr(config, key)} must be in [0, 1) (Adam's moment decay; {default} is "
                              f"the default)")
    if not 0 <= config.cosine_learning_rate_final_fraction <= 1:
        raise ConfigError(f"cosine_learning_rate_final_fraction={config.cosine_learning_rate_final_fraction} must "
                          f"be in [0, 1] (the final learning rate as a fraction of the peak)")
    for key in _INT32_SIZES:
        if getattr(config, key) > _INT32_MAX:
            raise ConfigError(f"{key}={getattr(config, key)} is beyond int32 ({_INT32_MAX}), which indexes token ids, "
                              f"positions and array shapes; choose a smaller {key}")
    tokens = config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps
    if tokens > _INT32_MAX:
        raise ConfigError(f"per_device_batch_size={config.per_device_batch_size} x max_target_length="
                          f"{config.max_target_length} x gradient_accumulation_steps="
                          f"{config.gradient_accumulation_steps} = {tokens:.3g} tokens per device per step is beyond "
                          f"int32 ({_INT32_MAX}); lower one of them")


def _check_custom_remat(config: Config) -> None:
    """The per-tensor keys of remat_policy=custom take effect only with it: a changed one alone is refused."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for name in REMAT_NAMES:
        if config.remat_policy != "custom" and getattr(config, name) != defaults[name]:
            raise ConfigError(f"{name}={getattr(config, name)} only applies with remat_policy=custom (now "
                              f"remat_policy={config.remat_policy}); add remat_policy=custom")


def _check_rope(config: Config) -> None:
    """The RoPE scaling keys (maxctx.model.rope has the rules they enter)."""
    for key in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "original_max_position_embeddings",
                "rope_linear_scaling_factor", "beta_fast", "beta_slow"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key}={getattr(config, key)} must be > 0; set it to {key}="
                              f"{getattr(Config, key)} (its default) or another positive value")
    if config.rope_attention_factor < 0:
        raise ConfigError(f"rope_attention_factor={config.rope_attention_factor} must be >= 0 (0: YaRN's "
                          f"0.1 ln(rope_factor) + 1)")
    if config.rope_type == "llama3" and config.rope_high_freq_factor <= config.rope_low_freq_factor:
        raise ConfigError(f"rope_type=llama3 needs rope_high_freq_factor={config.rope_high_freq_factor} > "
                          f"rope_low_freq_factor={config.rope_low_freq_factor}; Llama 3.1 uses 4 and 1")
    if config.rope_type == "yarn" and config.beta_fast < config.beta_slow:
        raise ConfigError(f"rope_type=yarn needs beta_fast={config.beta_fast} >= beta_slow={config.beta_slow}; "
                          f"YaRN's defaults are 32 and 1")
    # MaxText applies rope_linear_scaling_factor to plain RoPE; here it belongs to rope_type=linear.
    if config.rope_linear_scaling_factor != 1 and config.rope_type != "linear":
        raise ConfigError(f"rope_linear_scaling_factor={config.rope_linear_scaling_factor} only applies with "
                          f"rope_type=linear (now rope_type={config.rope_type}); add rope_type=linear")


def _check_data(config: Config) -> None:
    """Data keys that need no file access (paths, tokenizers and records are checked by maxctx.data)."""
    _positive(config, "grain_worker_count", "grain_prefetch_buffer_size", allow_zero=True)
    dataset = DATASETS[config.dataset_type]
    for key, hint in dataset.needs:
        if not getattr(config, key):
            raise ConfigError(f"dataset_type={config.dataset_type} needs {key}{hint}")
    if config.eval_interval <= 0:
        return
    for key, hint in dataset.eval_needs:
        if not getattr(config, key):
            raise ConfigError(f"eval_interval={config.eval_interval} with dataset_type={config.dataset_type} needs "
                              f"{key}{hint}; set it, or eval_interval=0")
    if config.eval_steps == -1 and not dataset.ends:
        raise ConfigError(f"eval_steps=-1 (the whole eval split) with eval_interval={config.eval_interval} needs a "
                          f"split that ends, and {config.dataset_type} data does not; set eval_steps to a number of "
                          f"batches")


def _check_literals(config: Config) -> None:
    """Literal keys (a Config built in code skips parse_config's check)."""
    for field in dataclasses.fields(Config):
        options = choices(field.name)
        if options and getattr(config, field.name) not in options:
            raise ConfigError(f"{field.name}='{getattr(config, field.name)}' is not one of "
                              f"{', '.join(map(str, options))}")


def _check_document_lengths(config: Config) -> None:
    if config.planner_document_lengths:
        from maxctx.plan.documents import document_lengths

        document_lengths(config.planner_document_lengths, max(config.max_target_length, 1))


def validate(config: Config) -> None:
    """All config checks that do not need JAX; raises ConfigError."""
    _check_literals(config)
    strategies.resolve(config.context_parallel_strategy)
    _check_document_lengths(config)
    _check_custom_remat(config)
    _check_outputs(config)
    if not config.base_output_directory.strip():
        raise ConfigError("base_output_directory='' is empty; give the folder for runs' outputs (e.g. outputs) or "
                          "gs://bucket/folder")
    _positive(config, "steps", "cpu_devices", "eval_interval", "jax_num_processes", "reuse_example_batch",
              "max_num_checkpoints_to_keep", "eval_per_device_batch_size", *SPLASH_BLOCK_KEYS, allow_zero=True)
    if config.eval_steps < -1:
        raise ConfigError(f"eval_steps={config.eval_steps} must be > 0, 0 (no eval batches: only the passkey grid) "
                          f"or -1 for the whole eval split")
    if config.tpu_scoped_vmem_limit_kib < -1:
        raise ConfigError(f"tpu_scoped_vmem_limit_kib={config.tpu_scoped_vmem_limit_kib} must be -1 (the TPU "
                          f"generation's default), 0 (libtpu's own) or a size in KiB")
    _positive(config, "jax_heartbeat_timeout_seconds", "jax_distributed_initialization_timeout", "base_emb_dim",
              "base_num_query_heads", "base_num_kv_heads",
              "base_mlp_dim", "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length", "log_period",
              "checkpoint_period", "gradient_accumulation_steps",
              "flash_block_q", "flash_block_kv", "per_device_batch_size", "rope_max_timescale", "num_vocab_tiling",
              "mlp_sequence_chunks", "attention_head_chunks")
    if not 0 <= config.learning_rate <= 3.4e38:  # float32's largest finite value: above it the schedule is inf
        raise ConfigError(f"learning_rate={config.learning_rate} must be >= 0 and finite in float32 (<= 3.4e38)")
    if not 0 <= config.warmup_steps_fraction < 1:
        raise ConfigError(f"warmup_steps_fraction={config.warmup_steps_fraction} must be in [0, 1)")
    _check_ranges(config)
    families.for_config(config).check(config)  # the model family's own checks (maxctx.model.families)
    _check_rope(config)
    _check_window(config)
    for key in SPLASH_BLOCK_KEYS:
        if getattr(config, key) % 128:
            raise ConfigError(f"{key}={getattr(config, key)} must be a multiple of 128 (splash's lane width), or 0 "
                              f"for the forward's block")
    if config.load_parameters_path and config.load_full_state_path:
        raise ConfigError("load_parameters_path and load_full_state_path are both set; set only one "
                          "(parameters only, or a whole training state)")
    if config.attention == "cudnn" and config.dtype == "float32":
        raise ConfigError("attention=cudnn needs dtype=bfloat16 or float16 (cuDNN flash attention has no float32); "
                          "set dtype=bfloat16, or attention=blockwise")
    cap = config.attn_logits_soft_cap
    if cap < 0 or cap and config.attention == "cudnn":
        raise ConfigError(f"attn_logits_soft_cap={cap} must be >= 0 (0: off)" if cap < 0 else
                          f"attn_logits_soft_cap={cap} needs attention=auto, blockwise, dot_product or splash; "
                          f"cudnn has no logit soft-cap")
    if config.context_parallel_a2a_degree < 0:
        raise ConfigError(f"context_parallel_a2a_degree={config.context_parallel_a2a_degree} must be >= 0 "
                          f"(0 picks the default)")
    _check_paths(config)
    _check_data(config)
    _check_passkey(config)
    _check_files(config)
    num_devices = topology.num_devices(config)  # cpu_devices, or a compile_topology's devices
    if num_devices is not None:
        check_devices(config, num_devices)


def _check_passkey(config: Config) -> None:
    """The passkey grid parses and is in range (maxctx.data.passkey: shortest example, the token-id format)."""
    try:
        lengths, depths = config.passkey_grid
    except ValueError:
        raise ConfigError(f"passkey_lengths='{config.passkey_lengths}' and passkey_depths='{config.passkey_depths}' "
                          f"must be comma-separated numbers (whole numbers for lengths), e.g. passkey_lengths=4096,"
                          f"8192 passkey_depths=0,0.5,1") from None
    if any(length < 32 for length in lengths):
        raise ConfigError(f"passkey_lengths={config.passkey_lengths}: every length must be >= 32 tokens (the key, "
                          f"its needle and the question alone take up to 21 of them)")
    if lengths and (not depths or any(not 0 <= d <= 1 for d in depths)):
        raise ConfigError(f"passkey_depths={config.passkey_depths} must list depths in [0, 1] (0: the key at the "
                          f"start of the haystack, 1: at its end)")
    if config.eval_steps == 0 and config.eval_interval > 0 and not lengths:
        raise ConfigError("eval_steps=0 scores no eval batches and passkey_lengths is empty, so an eval would do "
                          "nothing; set eval_steps > 0 (or -1), or passkey_lengths")
    if lengths and config.passkey_examples < 1:
        raise ConfigError(f"passkey_examples={config.passkey_examples} must be >= 1 with passkey_lengths set")
    if not 0 <= config.synthetic_passkey_fraction <= 1:
        raise ConfigError(f"synthetic_passkey_fraction={config.synthetic_passkey_fraction} must be in [0, 1]")
    token_format = (lengths or config.synthetic_passkey_fraction > 0) and not config.tokenizer_path
    if token_format and config.vocab_size < 32:
        raise ConfigError(f"vocab_size={config.vocab_size}: passkey documents without a tokenizer use the top 14 ids "
                          f"of the vocabulary for digits and markers; set vocab_size >= 32 or give tokenizer_path")


def _check_window(config: Config) -> None:
    w, pattern = config.sliding_window_size, config.attention_layer_pattern
    if w < 0:
        raise ConfigError(f"sliding_window_size={w} must be >= 0 (0: no sliding window)")
    if set(pattern) - {"L", "G"}:
        raise ConfigError(f"attention_layer_pattern='{pattern}' may only contain L (local, sliding-window) and G "
                          f"(global) layers, e.g. LLLLLG")
    if "L" in pattern and w == 0:
        raise ConfigError(f"attention_layer_pattern='{pattern}' has local layers but sliding_window_size=0; set "
                          f"sliding_window_size (e.g. 4096)")


def _check_files(config: Config) -> None:
    """The input files themselves: found here, before JAX starts, rather than after the mesh and the compile."""
    dataset = DATASETS[config.dataset_type]
    if dataset.files:
        train, evaluate = dataset.split_keys
        for key in (train, evaluate) if config.eval_interval > 0 else (train,):
            if not storage.is_remote(getattr(config, key)):
                expand_files(getattr(config, key), key)
    if config.tokenizer_path and not storage.is_remote(config.tokenizer_path):
        check_tokenizer_path(config.tokenizer_path, config.tokenizer_type)
    folder, fix = dataset.folder
    if folder and getattr(config, folder) and not storage.is_remote(getattr(config, folder)) and \
            not os.path.isdir(getattr(config, folder)):
        raise ConfigError(f"{folder}='{getattr(config, folder)}' does not exist (or is not a directory); {fix}")


def _check_outputs(config: Config) -> None:
    """Names the OS would refuse with a traceback when the run first writes there."""
    name = config.run_name
    if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ConfigError(f"run_name={name!r} must be a name (not empty, '.' or '..', no '/' or NUL): outputs go to "
                          f"<base_output_directory>/<run_name>")
    if len(name.encode()) > 255:
        raise ConfigError(f"run_name={name!r} is {len(name.encode())} bytes, over the 255 a folder name may have: "
                          f"outputs go to <base_output_directory>/<run_name>; choose a shorter run_name")
    path = config.metrics_file
    if "://" in path or os.path.isdir(path):
        raise ConfigError(f"metrics_file='{path}' is {'a URL' if '://' in path else 'a directory'}; give a local "
                          f"file path, e.g. metrics_file={os.path.join(config.run_dir, 'maxtext_metrics.txt')}")
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    while folder and not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if folder and not os.path.isdir(folder):
        raise ConfigError(f"metrics_file='{path}': {folder} is a file, not a directory; choose a metrics_file path "
                          f"whose folders are folders")


def _check_paths(config: Config) -> None:
    """gs:// paths need gcsfs; other URL schemes are refused. The buckets themselves are probed where a run starts
    (maxctx.files.check_remote_paths), not here: loading a config needs no network."""
    for key in REMOTE_KEYS:
        value = getattr(config, key)
        if "://" in value and not storage.is_remote(value):
            raise ConfigError(f"{key}={value}: only local paths and gs:// are read; mount the store (e.g. "
                              f"s3fs) and point {key} at the mount")
        if not storage.is_remote(value):
            continue
        if not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
            raise ConfigError(f"{key}={value}: gs:// paths need gcsfs (etils.epath's Google Cloud Storage backend), "
                              f"which is not installed; pip install -e '.[gcs]' (scripts/tpu/setup.sh and the "
                              f"Docker images install it)")



def _check_head_chunks(config: Config, tensor: int, a2a: int) -> None:
    """attention_head_chunks = N: every group holds K / (T N) whole kv heads of each tensor shard, and its
    H / (T N) query heads split evenly over the A2A degree U (a2a, usp)."""
    n = config.attention_head_chunks
    if n < 1:
        raise ConfigError(f"attention_head_chunks={n} must be >= 1 (1: all heads at once)")
    kv, q = config.base_num_kv_heads, config.base_num_query_heads
    if kv % (tensor * n):
        raise ConfigError(f"attention_head_chunks={n} x tensor parallelism {tensor} does not divide "
                          f"base_num_kv_heads={kv}; choose attention_head_chunks dividing {max(1, kv // tensor)}")
    if (q // (tensor * n)) % a2a:
        raise ConfigError(f"attention_head_chunks={n}: each group's {q // (tensor * n)} query heads per tensor shard "
                          f"are not divisible by the A2A degree {a2a} (context_parallel_strategy="
                          f"{config.context_parallel_strategy}); lower attention_head_chunks to a divisor of "
                          f"{q // tensor // a2a} or use context_parallel_strategy=p2p")


def _check_host_layers(config: Config) -> None:
    k, layers = config.decoder_layer_input_host_layers, config.base_num_decoder_layers
    period = len(layer_windows(config))
    if not (k == -1 or 0 <= k <= layers and k % period == 0):
        raise ConfigError(f"decoder_layer_input_host_layers={k} must be -1 (every layer) or a multiple of the "
                          f"attention layer pattern's period {period} from 0 to base_num_decoder_layers={layers}")
    n = config.decoder_layer_input_stride
    if n < 1 or n > 1 and layers % (n * period):  # n = 1: a pattern may end part-way (maxctx.model.stacks)
        raise ConfigError(f"decoder_layer_input_stride={n} x the attention layer pattern's period {period} must "
                          f"divide base_num_decoder_layers={layers}; choose a divisor of {layers // period}")
    if n > 1 and (not config.scan_layers or config.remat_policy == "none" or k != -1):
        raise ConfigError(f"decoder_layer_input_stride={n} needs scan_layers=true, a remat_policy other than none "
                          f"and decoder_layer_input_host_layers=-1 (got {config.scan_layers}, "
                          f"{config.remat_policy}, {k}); set decoder_layer_input_stride=1 or change those")
