"""The typed, frozen run configuration: one schema, and the values derived from it.

Every key is documented in `configs/base.yml`, whose values are the defaults here (tests/test_config.py checks that
they agree). Fixed-choice keys are `Literal` types. maxctx.loader fills a Config from YAML files and `key=value`
overrides; maxctx.validate checks it. Nothing writes into a Config after loading: derived values are properties.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, get_args, get_type_hints

from maxctx.datasets import DATASETS
from maxctx.errors import ConfigError  # noqa: F401 (re-exported: the error of a bad config)

# flash (MaxText's meaning) and auto: the platform's fast kernel, splash on TPU, cuDNN on GPU (bf16/fp16), else the
# blockwise JAX kernel, which `blockwise` names on every platform.
AttentionKernel = Literal["auto", "flash", "dot_product", "blockwise", "splash", "cudnn"]
# The MoE experts' grouped matmul (maxctx.model.moe.kernels): auto, megablox on TPU, jax.lax.ragged_dot elsewhere.
MoeKernel = Literal["auto", "ragged_dot", "megablox"]
# How expert parallelism moves the tokens (maxctx.model.moe.dispatch): auto, ragged on TPU/GPU, padded on CPU.
ExpertDispatch = Literal["auto", "padded", "ragged"]
# MaxText's policies (NAMED_POLICIES says what each keeps), plus none: no remat at all, and auto: custom with each
# tensor placed by maxctx.plan.remat at load (maxctx.loader).
RematPolicy = Literal["full", "minimal", "minimal_with_context", "minimal_flash", "save_dot_with_context_except_mlp",
                      "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "qkv_proj_offloaded",
                      "minimal_offloaded", "save_out_proj", "custom", "none", "auto"]
RematPlace = Literal["remat", "device", "offload"]
DType = Literal["float32", "bfloat16", "float16"]
DatasetType = Literal[tuple(DATASETS)]  # maxctx.datasets: the one list of dataset types
Packing = Literal["first_fit", "concat", "none"]
# context_parallel_load_balance: true, the zig-zag; documents, documents placed on the context ranks per batch
# (maxctx.attention.cp.load_balance); false, the natural order.
LoadBalance = Literal[True, False, "documents"]
TokenizerType = Literal["sentencepiece", "tiktoken", "huggingface"]
Hardware = Literal["", "tpu", "gpu", "gpu_multiprocess", "cpu"]
# Hugging Face's rope_scaling types, with its rules (maxctx.model.rope).
RopeType = Literal["default", "linear", "llama3", "yarn"]
# What a failed checkpoint save (disk full, quota, I/O error) does: stop the run (exit 2), or train on and try again.
CheckpointFailurePolicy = Literal["exit", "continue"]
# How the learning-rate schedule goes on when a resume changes the global batch (maxctx.optimizer).
ScheduleOnBatchChange = Literal["steps", "tokens"]
# The tensors remat_policy=custom places (MaxText's names; maxctx.model.layers tags them with checkpoint_name).
REMAT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi",
               "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj")
_MATMULS = (*_QKV, "out_proj", "mlpwi", "mlpwo")
# MaxText's remat policies: the tensors (checkpoint_name tags, REMAT_NAMES) each keeps on the device
# and each moves to pinned host memory; every other tensor inside the layer is recomputed in the backward.
NAMED_POLICIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "full": ((), ()),  # only the layer's input is kept; the layer runs again in the backward
    "minimal": (_MATMULS, ()),  # every projection's output: the cheap elementwise rest is recomputed
    "minimal_with_context": ((*_MATMULS, "context"), ()),
    "minimal_flash": ((*_MATMULS, "context"), ()),  # MaxText's older name of minimal_with_context
    "save_dot_with_context_except_mlp": ((*_QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "qkv_proj_offloaded": ((), _QKV),
    "minimal_offloaded": ((), _MATMULS),
    "save_out_proj": (("out_proj",), ()),
}


@dataclasses.dataclass(frozen=True)
class Config:
    # Run.
    run_name: str = "default_run"
    base_output_directory: str = "outputs"
    model_name: str = "tiny"
    decoder_block: str = "llama2"  # the model family (maxctx.model.families): llama2, mistral, qwen2, qwen3, olmo2, ...
    seed: int = 0
    steps: int = 150
    cpu_devices: int = 0
    # Model shape (a preset from configs/models fills these).
    base_emb_dim: int = 128
    base_num_query_heads: int = 4
    base_num_kv_heads: int = 2
    base_mlp_dim: int = 384
    base_num_decoder_layers: int = 2
    head_dim: int = 32
    vocab_size: int = 256
    rope_max_timescale: float = 10000.0
    rope_type: RopeType = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_linear_scaling_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 0.0
    normalization_layer_epsilon: float = 1e-5
    logits_via_embedding: bool = False
    # Sliding-window (local) attention: a query sees the keys of its document at most W - 1 tokens back (0: off);
    # the pattern (of L local and G global layers) repeats over the layers, e.g. LLLLLG.
    sliding_window_size: int = 0
    attention_layer_pattern: str = ""
    # Family attention features (MaxText's keys): biases on the q, k, v projections (Qwen 2); RMSNorm of q and k
    # before RoPE, per head (qwen3) or over the whole projection (olmo2, olmo3).
    attention_bias: bool = False
    use_qk_norm: bool = False
    # Gemma (MaxText's keys): scores scaled by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2 (0: head_dim);
    # the local layers' RoPE theta (-1: rope_max_timescale); final logits -> cap * tanh(logits / cap) (0: off).
    query_pre_attn_scalar: float = 0.0
    local_rope_max_timescale: float = -1.0
    final_logits_soft_cap: float = 0.0
    # Gated DeltaNet (decoder_block qwen3_5, qwen3_next; transformers' keys): every full_attention_interval-th
    # layer is full attention, the others linear; their key / value heads and head dims, the short convolution's
    # kernel; the full layers rotate the first partial_rotary_factor of each head's dims.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 1.0
    # Mixture of experts (MaxText's keys; decoder_block mixtral, qwen3_moe, qwen3_next): experts per MoE layer,
    # experts per token, each expert's SwiGLU width (0: base_mlp_dim), the top-k weights renormalised to sum to 1,
    # the load-balancing loss's weight in the training loss (HF's router_aux_loss_coef), and the router z-loss's.
    num_experts: int = 1
    num_experts_per_tok: int = 1
    base_moe_mlp_dim: int = 0
    norm_topk_prob: bool = False
    load_balance_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.0
    # MoE layers among dense ones (mixtral, qwen3_moe): layer i is MoE when (i + 1) % interleave_moe_layer_step
    # == 0 (MaxText's key; HF's decoder_sparse_step) and i is not in mlp_only_layers (comma-separated layer
    # indices, transformers' key), else a dense SwiGLU of base_mlp_dim.
    interleave_moe_layer_step: int = 1
    mlp_only_layers: str = ""
    # Each MoE layer's capacity (mixtral, qwen3_moe): an expert takes at most ceil(capacity_factor x S x k / X)
    # (token, slot) pairs of a sequence, earlier tokens first, the rest dropped (maxctx.model.moe.capacity); 0:
    # dropless.
    capacity_factor: float = 0.0
    # DeepSeek (decoder_block deepseek; MaxText's keys): multi-head latent attention's query LoRA rank (0: a plain
    # query projection), KV LoRA rank, per-head dims without and with RoPE, value head dim, YaRN's softmax mscale
    # (transformers' mscale_all_dim; 0: none); the first first_num_dense_layers layers dense (base_mlp_dim), the
    # rest MoE with shared_experts always-on experts of base_moe_mlp_dim each and the routed weights times
    # routed_scaling_factor, top-k within topk_routing_group of n_routing_groups expert groups (-1: no groups).
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mscale: float = 0.0
    first_num_dense_layers: int = 0
    shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_routing_groups: int = -1
    topk_routing_group: int = -1
    # DeepSeek-V3's router (MaxText's keys): sigmoid scores (else softmax), and a per-expert correction bias added
    # to the scores for the choice only (not to the weights).
    routed_score_func: str = "softmax"
    routed_bias: bool = False
    # DeepSeek-V3's auxiliary-loss-free balancing (MaxText's key): after each step every MoE layer's correction
    # bias moves by this much against its load, b_x -= rate sign(load_x - mean load) (V3: 0.001); 0: fixed.
    routed_bias_update_rate: float = 0.0
    # DeepSeek-V3's sequence-wise balance loss's weight (its paper's alpha, eq. 17-20; 0.0001 there), over each
    # row's tokens, averaged over rows and MoE layers; 0: off, the step unchanged.
    sequence_balance_loss_weight: float = 0.0
    # Numerics and memory.
    dtype: DType = "bfloat16"
    weight_dtype: DType = "float32"
    remat_policy: RematPolicy = "full"
    scan_layers: bool = True
    use_iota_embed: bool = False
    # remat_policy=custom: where each of REMAT_NAMES goes.
    decoder_layer_input: RematPlace = "device"
    # With decoder_layer_input=offload: the first this many layers send their input to the host, the rest keep it
    # on the device (-1: every layer); for when the host cannot hold them all.
    decoder_layer_input_host_layers: int = -1
    # Keep (per decoder_layer_input) only every N-th layer's input; the backward recomputes the N - 1 between.
    decoder_layer_input_stride: int = 1
    query_proj: RematPlace = "remat"
    key_proj: RematPlace = "remat"
    value_proj: RematPlace = "remat"
    context: RematPlace = "remat"
    out_proj: RematPlace = "remat"
    mlpwi: RematPlace = "remat"
    mlpwo: RematPlace = "remat"
    # Token tiling of the loss and the MLP.
    num_vocab_tiling: int = 1
    mlp_sequence_chunks: int = 1
    # A layer's attention over this many groups of kv heads (with their query heads), one group at a time.
    attention_head_chunks: int = 1
    # Attention and context parallelism.
    attention: AttentionKernel = "auto"
    # Gemma 2's attention logit soft-cap: scores -> cap * tanh(scores / cap) before the mask and softmax (0: off).
    attn_logits_soft_cap: float = 0.0
    # The MoE layers' grouped matmul kernel (maxctx.model.moe.kernels).
    moe_kernel: MoeKernel = "auto"
    # Expert parallelism (maxctx.model.moe.dispatch): each of E devices keeps X / E whole experts and the tokens
    # travel to them by all-to-all; 1: every device gathers every expert per layer. E borrows the leading devices
    # of fsdp and the context axes.
    expert_parallelism: int = 1
    expert_dispatch: ExpertDispatch = "auto"
    # One of maxctx.attention.cp.strategies (or an alias), checked there: the registry is its one list of names.
    context_parallel_strategy: str = "all_gather"
    context_parallel_load_balance: LoadBalance = True
    # The planner's and step-time model's documents per row (maxctx.plan.documents.document_lengths): "" one
    # document per row (causal S^2/2); e.g. "8192" or "524288,262144,2048x128", repeated to fill the row.
    planner_document_lengths: str = ""
    context_parallel_a2a_degree: int = 0
    flash_block_q: int = 512
    flash_block_kv: int = 512
    # splash's other blocks (MaxText's sa_block_*); 0: from flash_block_q / flash_block_kv
    # (maxctx/attention/kernels/splash.py)
    flash_block_kv_compute: int = 0
    flash_block_q_dkv: int = 0
    flash_block_kv_dkv: int = 0
    flash_block_kv_dkv_compute: int = 0
    flash_block_q_dq: int = 0
    flash_block_kv_dq: int = 0
    splash_fused_backward: bool = False
    # splash runs as tokamax's kernel (pip install maxctx[tokamax]; without it maxctx's splash, and one logged line)
    use_tokamax_splash: bool = False
    # libtpu's scoped VMEM limit for kernels (--xla_tpu_scoped_vmem_limit_kib), given to the TPU compile of every
    # step: -1 the generation's default (maxctx.plan.topology), 0 libtpu's own, > 0 this many KiB.
    tpu_scoped_vmem_limit_kib: int = -1
    # TPU: let libtpu run gathers (the embedding lookup, splash's mask gathers) on the chip's SparseCores, its own
    # default. Off unless set: libtpu 0.0.42.1 aborts (SIGABRT in its SparseCore gather lowering) compiling usp
    # 32x4 at 16,777,216 tokens on tpu7x-128, which compiles with them on the TensorCores (docs/long_context.md).
    tpu_sparse_core_gathers: bool = False
    # Mesh.
    ici_data_parallelism: int = 1
    ici_fsdp_parallelism: int = -1
    ici_context_parallelism: int = 1
    ici_tensor_parallelism: int = 1
    dcn_data_parallelism: int = -1
    dcn_fsdp_parallelism: int = 1
    dcn_context_parallelism: int = 1
    dcn_tensor_parallelism: int = 1
    # Batch and sequence.
    per_device_batch_size: float = 4.0
    max_target_length: int = 128
    gradient_accumulation_steps: int = 1
    # Optimiser.
    learning_rate: float = 3e-3
    warmup_steps_fraction: float = 0.1
    learning_rate_schedule_steps: int = -1
    schedule_on_batch_change: ScheduleOnBatchChange = "steps"
    cosine_learning_rate_final_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.1
    gradient_clipping_threshold: float = 1.0
    # MaxText's keys: the optimizer state (Adam's moments) / the parameters (fp32 master weights) live in pinned
    # host memory between steps and are brought to the device for the step (maxctx.train_step).
    optimizer_memory_host_offload: bool = False
    parameter_memory_host_offload: bool = False
    skip_nonfinite_steps: bool = False
    # Data.
    dataset_type: DatasetType = "synthetic"
    dataset_name: str = "c4/en:3.0.1"
    dataset_split: str = "train"
    eval_split: str = "validation"
    tfds_data_dir: str = ""
    grain_train_files: str = ""
    grain_eval_files: str = ""
    text_field: str = "text"
    tokenizer_path: str = ""
    tokenizer_type: TokenizerType = "sentencepiece"
    add_bos: bool = True
    add_eos: bool = True
    packing: Packing = "first_fit"
    grain_worker_count: int = 0
    grain_prefetch_buffer_size: int = 16
    data_shuffle_seed: int = 0
    reuse_example_batch: int = 0
    enable_data_shuffling: bool = True
    eval_interval: int = 0
    eval_steps: int = 4  # -1: the whole eval split, every eval
    eval_per_device_batch_size: float = 0.0  # 0: per_device_batch_size
    synthetic_passkey_fraction: float = 0.0  # synthetic data: the share of passkey documents
    # The passkey eval (maxctx.evaluate.passkey): comma-separated lengths ("": off) and depths, examples per cell.
    passkey_lengths: str = ""
    passkey_depths: str = "0,0.25,0.5,0.75,1"
    passkey_examples: int = 4
    # Checkpointing.
    enable_checkpointing: bool = True
    async_checkpointing: bool = True
    checkpoint_period: int = 100
    max_num_checkpoints_to_keep: int = 3
    checkpoint_failure_policy: CheckpointFailurePolicy = "exit"
    # The local tier beside the persistent one (MaxText's keys): each host's copy of its own shards, on its own
    # fast disk, every local_checkpoint_period steps (maxctx.checkpoint.local_tier).
    enable_emergency_checkpoint: bool = False
    local_checkpoint_directory: str = ""
    local_checkpoint_period: int = 0
    # Orbax's storage of the state's arrays (MaxText's keys): TensorStore's OCDBT key-value store (one database per
    # item instead of a directory per array), and the zarr v3 chunk format instead of zarr v2.
    checkpoint_storage_use_ocdbt: bool = True
    checkpoint_storage_use_zarr3: bool = False
    load_parameters_path: str = ""
    load_full_state_path: str = ""
    # Metrics, logging and profiling.
    log_period: int = 10
    metrics_file: str = ""
    enable_tensorboard: bool = True
    peak_tflops_per_device: float = 0.0
    profile_start_step: int = -1
    profile_steps: int = 3
    # Multi-host and ahead-of-time compilation.
    jax_coordinator_address: str = ""
    jax_num_processes: int = 0
    jax_process_id: int = -1
    jax_heartbeat_timeout_seconds: int = 60
    jax_distributed_initialization_timeout: int = 300
    compile_topology: str = ""
    compile_topology_num_slices: int = 1
    compiled_trainstep_file: str = ""
    compiled_trainstep_file_trusted: bool = False
    hardware: Hardware = ""

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def schedule_steps(self) -> int:
        return self.learning_rate_schedule_steps if self.learning_rate_schedule_steps > 0 else self.steps

    @property
    def run_dir(self) -> str:
        """<base_output_directory>/<run_name>, absolute for local paths (Orbax needs absolute paths)."""
        base = self.base_output_directory
        return os.path.join(base if "://" in base else os.path.abspath(base), self.run_name)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def local_checkpoint_dir(self, process: int, num: int) -> str:
        """Process `process` of `num`'s local checkpoint tier (maxctx.checkpoint.local_tier)."""
        return os.path.join(self.local_checkpoint_directory, self.run_name, f"process_{process}-of-{num}")

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.run_dir, "tensorboard")

    def global_batch_size(self, num_devices: int) -> int:
        """Sequences per optimiser micro-step across all devices (MaxText: per_device_batch_size x devices)."""
        return int(round(self.per_device_batch_size * num_devices))

    def eval_batch_size(self, num_devices: int) -> int:
        """Sequences per eval batch (MaxText: eval_per_device_batch_size x devices, no gradient accumulation)."""
        return int(round((self.eval_per_device_batch_size or self.per_device_batch_size) * num_devices))

    @property
    def passkey_grid(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """(lengths, depths) of the passkey eval, parsed from their comma-separated keys (checked by validate)."""
        split = lambda text: [part.strip() for part in str(text).split(",") if part.strip()]  # noqa: E731
        return tuple(int(x) for x in split(self.passkey_lengths)), tuple(float(x) for x in split(self.passkey_depths))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def layer_windows(config: Config) -> tuple[int, ...]:
    """The attention window of each layer of one repeating group (0: global), shortest period first: every layer
    local (Mistral v0.1) is (W,), LLLLLG is (W, W, W, W, W, 0), no window is (0,)."""
    pattern = config.attention_layer_pattern or ("L" if config.sliding_window_size > 0 else "G")
    windows = tuple(config.sliding_window_size if c == "L" else 0 for c in pattern)
    period = next(p for p in range(1, len(windows) + 1)
                  if len(windows) % p == 0 and windows == windows[:p] * (len(windows) // p))
    return windows[:period]


MODEL_KEYS = (
    "decoder_block", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
    "base_num_decoder_layers",
    "head_dim", "vocab_size", "rope_max_timescale", "normalization_layer_epsilon", "logits_via_embedding",
    "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "original_max_position_embeddings",
    "rope_linear_scaling_factor", "beta_fast", "beta_slow", "rope_truncate", "rope_attention_factor",
    "sliding_window_size", "attention_layer_pattern", "attention_bias", "use_qk_norm",
    "query_pre_attn_scalar", "local_rope_max_timescale", "final_logits_soft_cap", "attn_logits_soft_cap",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "full_attention_interval", "partial_rotary_factor",
    "num_experts", "num_experts_per_tok", "base_moe_mlp_dim", "norm_topk_prob", "load_balance_loss_weight",
    "interleave_moe_layer_step", "mlp_only_layers",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale",
    "first_num_dense_layers", "shared_experts", "routed_scaling_factor", "n_routing_groups", "topk_routing_group",
    "routed_score_func", "routed_bias",
)
FIELD_TYPES = get_type_hints(Config)


def choices(key: str) -> tuple[str, ...]:
    """The values a fixed-choice (Literal) key takes."""
    return get_args(FIELD_TYPES[key])
