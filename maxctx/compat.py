"""MaxText's command lines, read into maxctx's schema: its key names, its values and its sentinels.

A MaxText key is one of
- RENAMED: the same concept under maxctx's name (dataset_path -> tfds_data_dir, sa_block_q -> flash_block_q, ...);
- a key maxctx has too, with MaxText's spellings of its values (VALUES: attention=autoselected, packing=false,
  dataset_type=grain, ...) or sentinels (-1, None), resolved in `resolve` once every layer is merged;
- MAXTEXT_ONLY: a key for something maxctx does not do. Given the value that asks for what maxctx does anyway (for
  example enable_goodput_recording=false) it is accepted and has no effect; any other value is refused with
  "MaxText's <key> is not supported by maxctx: <why, what to do>".
docs/from_maxtext.md is the table of all three.
"""

from __future__ import annotations

import math
from typing import Any

from maxctx.errors import ConfigError

RENAMED = {
    "dataset_path": "tfds_data_dir",
    "train_split": "dataset_split",
    "init_weights_seed": "seed",
    "learning_rate_final_fraction": "cosine_learning_rate_final_fraction",
    "sa_block_q": "flash_block_q",
    "sa_block_kv": "flash_block_kv",
    "sa_block_kv_compute": "flash_block_kv_compute",
    "sa_block_q_dkv": "flash_block_q_dkv",
    "sa_block_kv_dkv": "flash_block_kv_dkv",
    "sa_block_kv_dkv_compute": "flash_block_kv_dkv_compute",
    "sa_block_q_dq": "flash_block_q_dq",
    "sa_block_kv_dq": "flash_block_kv_dq",
    "sa_use_fused_bwd_kernel": "splash_fused_backward",
    "profiler_steps": "profile_steps",
}
VALUES = {
    "attention": {"autoselected": "auto", "cudnn_flash_te": "cudnn", "cudnn_flash_jax": "cudnn"},
    "dataset_type": {"grain": "arrayrecord"},
    "packing": {True: "first_fit", False: "none"},
    "rope_type": {"llama3.1": "llama3"},
}
_ONE_MESH = "maxctx's mesh has the axes data, fsdp, context and tensor; use those"
# key -> (values that ask for nothing maxctx lacks, why it is refused otherwise)
MAXTEXT_ONLY: dict[str, tuple[tuple, str]] = {
    "enable_goodput_recording": ((False,), "goodput recording needs Google's ml-goodput-measurement service"),
    "monitor_goodput": ((False,), "goodput recording needs Google's ml-goodput-measurement service"),
    "gcs_metrics": ((False, True), ""),  # maxctx always writes metrics.jsonl into the run directory (gs:// too)
    "upload_all_profiler_results": ((False,), "the profile is written by process 0 into the run's tensorboard dir"),
    "dropout_rate": ((0, 0.0), "the model has no dropout"),
    "enable_dropout": ((False, True), ""),  # dropout_rate is 0: no dropout either way
    "opt_type": (("adamw",), "the optimizer is AdamW"),
    "quantization": (("",), "matmuls run in dtype, without quantization"),
    "use_qwix_quantization": ((False,), "matmuls run in dtype, without quantization"),
    "override_model_config": ((False, True), ""),  # command-line keys always override the preset
    "enable_single_controller": ((False,), "Pathways single-controller mode is not supported"),
    "skip_jax_distributed_system": ((False,), "multi-process runs always call jax.distributed.initialize"),
    "num_slices": ((-1,), "the slice count comes from the devices (compile_topology_num_slices when compiling)"),
    "mtp_num_layers": ((0,), "multi-token prediction is not implemented"),
    "logits_dot_in_fp32": ((False,), "the output projection runs in dtype, its loss in fp32"),
    "use_jax_splash": ((False, True), ""),  # maxctx's splash is JAX's either way
    "ring_scan_unroll": ((1,), "the ring's hop loop is not unrolled"),
    "dq_reduction_steps": ((0,), "splash's dq is reduced in one step"),
    "context_parallel_reorder_strategy": (("auto", "dual_chunk_swap"),
                                          "load balance is the zig-zag (dual chunk swap) order"),
    "jax_cache_dir": (("~/jax_cache", ""), "set JAX_COMPILATION_CACHE_DIR in the environment instead"),
    "base_config": (("base.yml",), "configs/base.yml is always the first layer; put overrides in your YAML"),
    "grain_file_type": (("arrayrecord",), "grain files are ArrayRecord (scripts/prepare_data.py converts text)"),
    "hf_path": (("",), "the HuggingFace datasets pipeline is not supported; convert to ArrayRecord with "
                "scripts/prepare_data.py and use dataset_type=arrayrecord"),
    **{f"{group}_{axis}_parallelism": ((1,), _ONE_MESH) for group in ("ici", "dcn") for axis in (
        "pipeline", "sequence", "context_autoregressive", "tensor_transpose", "tensor_sequence",
        "expert", "autoregressive", "diloco")},
    "dcn_context_usp_ulysses_parallelism": ((1,), "the all-to-all part of usp stays inside a slice"),
    # Keys of MaxText's recipes (tpu-recipes, MaxText's benchmarks/): storage, logging, kernels.
    "enable_checkpoint_cloud_logger": ((False,), "checkpoint events are not sent to Cloud Logging; they are in the "
                                                 "run's log and metrics.jsonl"),
    "use_vertex_tensorboard": ((False,), "events are written to <run_dir>/tensorboard (gs:// too); upload them with "
                                         "`tb-gcp-uploader --logdir=...` for Vertex AI TensorBoard"),
    "vertex_tensorboard_project": (("",), "Vertex AI TensorBoard upload is not supported"),
    "vertex_tensorboard_region": (("",), "Vertex AI TensorBoard upload is not supported"),
    "allow_split_physical_axes": ((False,), "mesh axes are laid over whole physical axes of the slice"),
    # splash's operand layouts: where the kernel reads from, not what it computes
    **{f"sa_{t}_layout": (("HEAD_DIM_MINOR", "SEQ_MINOR"), "the layouts are HEAD_DIM_MINOR or SEQ_MINOR")
       for t in "qkv"},
    "profile_periodically_period": ((-1, 0), "one profile per run (profile_start_step, profile_steps)"),
    "mu_dtype": (("", "float32"), "AdamW's first moment is kept in float32"),
    "use_max_logit_estimate": ((-1,), "splash's max-logit estimate is not implemented"),
    # mixture-of-experts kernels: maxctx's models are dense (MaxText's MoE model names are refused), so no effect
    **{key: ((True, False), "") for key in ("sparse_matmul", "megablox", "use_custom_sort_vjp", "use_tokamax_gmm",
                                           "use_random_routing")},
}
# dataset_type values MaxText has and maxctx does not
_DATASETS = {"hf": "the HuggingFace datasets pipeline is not supported; convert to ArrayRecord with "
                   "scripts/prepare_data.py and use dataset_type=arrayrecord",
             "c4_mlperf": "the MLPerf C4 pipeline is not supported; use dataset_type=tfds or arrayrecord",
             "olmo_grain": "the OLMo pipeline is not supported; use dataset_type=arrayrecord"}


def unsupported(key: str, why: str) -> ConfigError:
    return ConfigError(f"MaxText's {key} is not supported by maxctx: {why}")


# MaxText's model families maxctx has no layers for (prefixes of its model_name values without a maxctx preset).
MOE_MODELS = ("mixtral", "deepseek", "qwen3-30b", "qwen3-235b", "qwen3-480b", "llama4", "gpt-oss", "kimi")
OTHER_MODELS = ("gemma", "gpt3", "qwen", "llama3.2-11b", "phi")


def check_model_name(name: str, presets) -> None:
    """A MaxText model_name without a maxctx preset: a one-line refusal naming why, for MaxText's known families."""
    why = ("mixture-of-experts layers are not implemented" if name.startswith(MOE_MODELS) else
           "its layers (attention or normalisation variants) are not implemented" if name.startswith(OTHER_MODELS)
           else "")
    if why:
        raise unsupported(f"model_name={name}", f"{why}; maxctx's presets are {', '.join(presets)}")


def _none(value: Any) -> bool:
    return value is None or isinstance(value, str) and value.strip().lower() == "none"


def translate(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """One config layer (a YAML file or the command line) with MaxText's key names and values turned into
    maxctx's. Keys that need the other layers (sentinels, derived sizes) pass through to `resolve`."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in MAXTEXT_ONLY:
            accepted, why = MAXTEXT_ONLY[key]
            if not _accepted(value, accepted):
                raise unsupported(f"{key}={value}", f"{why} (from {source})")
            continue
        key = RENAMED.get(key, key)
        if isinstance(value, str) and key == "context_parallel_strategy":
            value = value.lower()
        if key == "dataset_type" and value in _DATASETS:
            raise unsupported(f"dataset_type={value}", _DATASETS[value])
        if key in VALUES and _hashable(value) and value in VALUES[key]:
            value = VALUES[key][value]
        if key == "attention" and value in ("paged", "vllm_rpa"):
            raise unsupported(f"attention={value}", "paged attention is for inference; training uses auto/flash")
        out[key] = value
    return out


def _accepted(value: Any, accepted: tuple) -> bool:
    """`value` is one of `accepted`, also as YAML text ('False', 'adamw') or with another case."""
    spelled = {str(a).lower() for a in accepted}
    return (_hashable(value) and value in accepted and type(value) in {type(a) for a in accepted}
            or str(value).lower() in spelled)


def _hashable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def resolve(values: dict[str, Any], user_keys: set[str]) -> tuple[dict[str, Any], int]:
    """MaxText's sentinels and cross-key meanings over the merged layers (before coercion). `user_keys`: the keys
    a user's YAML or the command line set. Returns (values, global_parameter_scale)."""
    v = dict(values)
    if v.get("steps") == -1:
        schedule = v.get("learning_rate_schedule_steps", -1)
        if schedule in (-1, None):
            raise ConfigError("steps=-1 takes the learning_rate_schedule_steps value, which is -1 too; set one")
        v["steps"] = schedule
    if isinstance(v.get("eval_interval"), int) and v["eval_interval"] < 0:
        v["eval_interval"] = 0  # MaxText: <= 0 means no eval
    if isinstance(v.get("eval_per_device_batch_size"), (int, float)) and v["eval_per_device_batch_size"] < 0:
        v["eval_per_device_batch_size"] = 0  # MaxText: <= 0 means per_device_batch_size
    if _none(v.get("max_num_checkpoints_to_keep")):
        v["max_num_checkpoints_to_keep"] = 0  # keep them all
    if v.get("compile_topology_num_slices") == -1:
        v["compile_topology_num_slices"] = 1
    _profiler(v)
    _usp_split(v)
    _fsdp_transpose(v)
    if v.get("eval_dataset_name") not in (None, "", v.get("dataset_name")):
        raise unsupported(f"eval_dataset_name={v['eval_dataset_name']}", "eval reads eval_split of dataset_name")
    v.pop("eval_dataset_name", None)
    if str(v.get("tokenizer_path", "")).endswith(".tiktoken") and "tokenizer_type" not in user_keys:
        v["tokenizer_type"] = "tiktoken"  # as MaxText infers it
    if "dataset_type" not in user_keys:  # MaxText's default is TFDS: a command naming data never gets synthetic
        if "grain_train_files" in user_keys:
            v["dataset_type"] = "arrayrecord"
        elif user_keys & {"dataset_name", "tfds_data_dir"}:
            v["dataset_type"] = "tfds"
    return v, _scale(v.pop("global_parameter_scale", 1))


def _profiler(v: dict[str, Any]) -> None:
    profiler = v.pop("profiler", "")
    skip = v.pop("skip_first_n_steps_for_profiler", 1)
    if profiler in ("", None):
        return
    if profiler != "xplane":
        raise unsupported(f"profiler={profiler}", "the profiler is JAX's (xplane, in TensorBoard); use "
                          "profiler=xplane or profile_start_step")
    v["profile_start_step"] = skip


def _usp_split(v: dict[str, Any]) -> None:
    """MaxText's usp: ring degree ici_context_parallelism, all-to-all degree ici_context_usp_ulysses_parallelism;
    maxctx's: C = ici_context_parallelism in all, the all-to-all part context_parallel_a2a_degree."""
    ulysses = v.pop("ici_context_usp_ulysses_parallelism", 1)
    if ulysses in (1, None):
        return
    ring = v.get("ici_context_parallelism", 1)
    if v.get("context_parallel_strategy") != "usp" or not isinstance(ring, int) or ring < 1:
        raise ConfigError(f"ici_context_usp_ulysses_parallelism={ulysses} needs context_parallel_strategy=usp and "
                          f"an explicit ici_context_parallelism (the ring degree)")
    v["ici_context_parallelism"] = ring * ulysses
    v["context_parallel_a2a_degree"] = ulysses


def _fsdp_transpose(v: dict[str, Any]) -> None:
    """MaxText's fsdp_transpose axis is a second FSDP axis (weights sharded on their other dimension, the batch
    split over it too): maxctx folds it into fsdp, the same ZeRO-3 sharding and batch split over fsdp x transpose
    devices (the weights' usual dimension sharded)."""
    for group, default in (("ici", -1), ("dcn", 1)):
        transpose = v.pop(f"{group}_fsdp_transpose_parallelism", 1)
        if transpose in (1, None):
            continue
        fsdp = v.get(f"{group}_fsdp_parallelism", default)
        if not isinstance(transpose, int) or transpose < -1 or transpose == 0 or not isinstance(fsdp, int):
            raise ConfigError(f"{group}_fsdp_transpose_parallelism={transpose} must be a positive integer or -1")
        if transpose == -1 and fsdp == -1:
            raise ConfigError(f"{group}_fsdp_parallelism and {group}_fsdp_transpose_parallelism are both -1; at "
                              f"most one axis per group fills the rest")
        v[f"{group}_fsdp_parallelism"] = -1 if -1 in (fsdp, transpose) else fsdp * transpose


def _scale(scale: Any) -> int:
    if not isinstance(scale, int) or scale < 1 or 2 ** int(math.log2(scale)) != scale:
        raise ConfigError(f"global_parameter_scale={scale} must be a power of 2 (1, 2, 4, ...)")
    return scale


def scale_model(values: dict[str, Any], scale: int) -> dict[str, Any]:
    """MaxText's global_parameter_scale: doubling in turn the heads and MLP, the width, the layers."""
    if scale == 1:
        return values
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = 2 ** (base + (rem > 0))
    out = dict(values)
    out["base_emb_dim"] = values["base_emb_dim"] * 2 ** (base + (rem > 1))
    out["base_num_query_heads"] = values["base_num_query_heads"] * heads
    out["base_num_kv_heads"] = values["base_num_kv_heads"] * heads
    out["base_mlp_dim"] = values["base_mlp_dim"] * heads
    out["base_num_decoder_layers"] = values["base_num_decoder_layers"] * 2 ** base
    return out
