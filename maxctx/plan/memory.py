"""The memory estimates per device, HBM and host: what the planner's memory column, its fit verdict and
remat_policy=auto's host budget read (no JAX).

    HBM   `device_bytes`: what the program holds at its peak (`Peak`), one of two moments of the step:
            always   the optimizer state and weights XLA takes as arguments (none of what is offloaded to the
                     host), the fp32 gradient they accumulate, and what the remat policy keeps for the backward:
                     the layer inputs and every other kept tensor (at KEPT_ON_DEVICE x their bytes), and on
                     chips whose backward reads the inputs' stack in another layout its copy (Chip.stack_relayouts;
                     remat_policy=custom)
            layer    the top layer's backward: its gathered weights (under expert parallelism E, X / E of the
                     experts) and their fp32 gradient, the residual
                     stream's working set (the family's LayerWork), a strided run's extra inputs, the offloaded
                     tensors brought back, and the larger of one head group's attention (the strategy's saved
                     and transient bytes with the projections' gradients, / attention_head_chunks) and the MLP
                     chunk's tile and its gradient (E times under expert parallelism: the dropless buffers)
            loss     the loss over one vocab tile: its fp32 logits and their bf16 copy, the gathered output
                     weights (twice when tiled) and their fp32 gradient
          what is live at the peak is `always` + the larger of `layer` and `loss`; XLA reports more than that
          (`total`: the arguments + XLA_HEAP x the rest)
    host  `held_host_bytes`: what the offloaded tensors hold in pinned host memory, against
          `host_budget_per_device` (HOST_FRACTION of the host DRAM per device)

The named tensors' bytes per token and where the policy puts them are maxctx.plan.step_time's (`per_token`,
`placement`, `offloading_layers`), the model's shape its family's. docs/choosing_a_strategy.md ("How good the
estimates are") has the estimate against every compiled row of the fit table (benchmarks/hbm_estimate.py).
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model import families
from maxctx.plan import step_time, topology

# Of the host DRAM per device: the rest for the OS, the training process, the input pipeline and checkpoint
# staging (an assumption).
HOST_FRACTION = 0.9
# HBM that a tensor kept on the device for the backward takes, per byte of the tensor (the layer inputs included):
# the forward scan writes it into its stacked [L, ...] output and the backward scan holds more of it than its
# bytes while it reads it back. 1.4 on the fit table's llama3-8b rows with the layer inputs in HBM (what their own
# working-set constant, 64 t D against 38, was before); gemma3-27b at 1,048,576 tokens grows by 1.36x the bytes a
# layer keeps per layer (62 and 12 layers compiled: 93.21 and 48.63 GiB); the one compile of a kept attention
# output, llama3.1-8b (head_dim=256) at 10,485,760 tokens, context=device, needed 1.65x (104 GiB, estimated 94).
KEPT_ON_DEVICE = 1.4
# XLA's temporaries per byte of the temporaries the estimate holds: the median over the v5p rows of both compiled
# tables, the fit table's single compiles (benchmarks/fit_table_keys.jsonl) and the searched llama3-8b rows the
# working-set constant was calibrated on (benchmarks/fit_table.jsonl): 1.033 of 43 rows; `python3
# benchmarks/hbm_estimate.py --leave-one-out` holds each row out of the fit. In the dumps read with
# benchmarks/peak_buffers.py the temporary allocation's heap is larger than what is live at its peak (its layout
# leaves gaps), and the temporaries XLA reports larger than the heap by what no dump file shows (llama3-8b, 2
# layers, 65,536 tokens on v5p-8 with the 1M plan's placement: 17.96 GiB live, an 18.82 GiB heap, 19.87 reported);
# the fitted constants (the working set, KEPT_ON_DEVICE) hold part of that already. The arguments are exact and
# not scaled.
XLA_HEAP = 1.033
# Bytes per (token, vocab entry) of one vocab tile in the loss: the fp32 logits and their fp32 gradient, and the
# bf16 copy the output projection writes (llama3-8b's 1,048,576-token step on v5p-128 untiled, XLA's buffers:
# f32[16384, 128256] twice, bf16[16384, 128256], the latter reusing the former's memory there).
LOGIT_BYTES = 10
# bf16 copies of the gathered output weights [D, V] the tiled loss's backward holds at once, beside their fp32
# gradient: the recomputed forward's and the transposed product's (XLA's buffers live at the peak, read with
# benchmarks/peak_buffers.py, of llama3-8b and qwen3.5-9b at 131,072 tokens on v5p-128 with num_vocab_tiling=16:
# bf16[4096, 128256] and bf16[4096, 248320] twice, f32 once; the loss is those compiles' peak).
GATHERED_OUTPUT_COPIES = 2
# [t, D] buffers held per extra layer of a strided run (decoder_layer_input_stride N): the run's scan stacks the
# inputs of its N layers for its backward, and the recomputed input and its gradient stay live (the fit table's
# 2^25-token llama3-8b row with stride 2: 84.40 GiB).
STRIDED_INPUTS = 4
# Copies in HBM of an offloaded tensor while a scan step's backward uses it: the one brought back from the host
# and its device copy (gemma3-27b's period of 6 layers: 12 bf16[16384, 21504] of mlpwi fetched and 12 more at
# the peak).
PREFETCHED = 2


@dataclasses.dataclass(frozen=True)
class Peak:
    """HBM per device at the step's peak (module doc), bytes."""

    always: float  # arguments, fp32 gradient, kept tensors and layer inputs
    layer: float  # the top layer's backward
    loss: float  # one vocab tile of the loss
    args: float  # of `always`: the arguments (weights and optimizer state on the device)

    @property
    def live(self) -> float:
        """What the estimate holds live at the peak."""
        return self.always + max(self.layer, self.loss)

    @property
    def total(self) -> float:
        """What XLA reports for the program: the arguments, and the temporaries at XLA_HEAP of what is live."""
        return self.args + XLA_HEAP * (self.live - self.args)


def _chip(config: Config) -> topology.Chip | None:
    """compile_topology's chip; None when it names none."""
    try:
        topo = topology.parse(config.compile_topology) if config.compile_topology else None
    except ConfigError:
        topo = None
    return topo.chip if topo is not None else None


def host_budget_per_device(config: Config) -> float:
    """Bytes of host DRAM one device may fill with offloaded tensors (module doc); 0 when not known."""
    chip = _chip(config)
    return HOST_FRACTION * chip.host_bytes / chip.devices_per_chip if chip is not None else 0.0


def held_host_bytes(config: Config, tp: int) -> float:
    """Bytes per device the offloaded tensors hold in host memory: each offloading layer's (every layer, but the
    layer input of every decoder_layer_input_stride-th), tokens per device x bytes."""
    per = step_time.per_token(config, tp)["bytes"]
    tokens = config.per_device_batch_size * tp * config.max_target_length
    where = step_time.placement(config)
    return tokens * sum(per[n] * step_time.offloading_layers(config, n) for n, w in where.items() if w == "offload")


def device_bytes(config: Config, tp: int, shards: int, attention_bytes: float) -> Peak:
    """HBM per device at the peak (module doc); `attention_bytes`: the strategy's saved and transient bytes of
    one layer's attention (all heads), `shards`: the devices the weights and optimizer state are sharded over."""
    family = families.for_config(config)
    shape = family.shape(config)
    layers, b, dim, params = shape.num_layers, shape.itemsize, shape.emb_dim, shape.num_params
    tokens = config.per_device_batch_size * tp * config.max_target_length  # B S / C over the context shards
    args = params * ((0 if config.parameter_memory_host_offload else shape.weight_itemsize)
                     + (0 if config.optimizer_memory_host_offload else 8)) / shards  # weights, fp32 m and v
    per = step_time.per_token(config, tp)["bytes"]
    where = step_time.placement(config)
    offloaded = config.remat_policy == "custom" and config.decoder_layer_input == "offload"
    inputs = 0 if offloaded else step_time.kept_layer_inputs(config) * tokens * dim * b
    kept = layers * tokens * sum(
        per[name] for name, w in where.items() if w == "device" and name != "decoder_layer_input")
    # the stack's copies: where the custom policy names the inputs (none under remat_policy=full: topology.CHIPS)
    chip = _chip(config)
    relayouts = chip.stack_relayouts if chip is not None and config.remat_policy == "custom" else 0
    always = args + 4 * params / shards + KEPT_ON_DEVICE * (inputs + kept) + relayouts * inputs
    output_params = shape.vocab_size * dim
    layer_params = (params - output_params * (1 if shape.tied_embedding else 2)) / layers
    if _expert_degree(config, shape) > 1:  # an EP rank gathers its X / E experts only (maxctx.model.moe.dispatch)
        experts = 3 * shape.num_experts * shape.emb_dim * shape.moe_mlp_dim * shape.moe_layers / layers
        layer_params -= experts * (1 - 1 / config.expert_parallelism)
    return Peak(always, _layer_bytes(config, family, shape, tp, tokens, attention_bytes, layer_params),
                _loss_bytes(config, shape, tp, tokens), args)


def _loss_bytes(config: Config, shape, tp: int, tokens: float) -> float:
    """One vocab tile of the loss (module doc). Tiled (num_vocab_tiling > 1), the loss is a scan that keeps its
    fp32 inputs [t, D] for the backward, holds a tile's logits, their gradient (fp32) and the bf16 copy at once,
    two bf16 copies of the gathered output weights (GATHERED_OUTPUT_COPIES), and accumulates their fp32 gradient
    over the tiles; untiled, the logits and their gradient (fp32) are the peak, and the weights' gradient comes
    after them."""
    head = shape.vocab_size * shape.emb_dim / tp
    if config.num_vocab_tiling == 1:
        return tokens * shape.vocab_size / tp * 8 + head * shape.itemsize
    tile = tokens / config.num_vocab_tiling * shape.vocab_size / tp
    return tile * LOGIT_BYTES + 4 * tokens * shape.emb_dim + head * (GATHERED_OUTPUT_COPIES * shape.itemsize + 4)


def _layer_bytes(config: Config, family, shape, tp: int, tokens: float, attention_bytes: float,
                 layer_params: float) -> float:
    """The top layer's backward (module doc)."""
    b, dim = shape.itemsize, shape.emb_dim
    per = step_time.per_token(config, tp)["bytes"]
    where = step_time.placement(config)
    offloaded = config.remat_policy == "custom" and config.decoder_layer_input == "offload"
    work = (family.work.offloaded if offloaded else family.work.on_device) * tokens * dim
    work += STRIDED_INPUTS * (config.decoder_layer_input_stride - 1) * tokens * dim * b
    # a scan step (a period of the layer pattern, or a strided run of them) brings back every offloaded tensor of
    # its layers for its backward
    step = len(layer_windows(config)) * config.decoder_layer_input_stride
    back = [name for name, w in where.items() if w == "offload" and name != "decoder_layer_input"]
    work += PREFETCHED * step * tokens * sum(per[name] for name in back)
    # a family whose layer kind is a period of layers (qwen3_5: 3 linear + 1 full) recomputes the whole period's
    # forward before its backward, holding the lower layers' recomputed tensors meanwhile (qwen3.5-9b at
    # 4,194,304 tokens: 4 layers' gate and up projections at once, docs/linear_attention.md)
    redone = [name for name, w in where.items() if w == "remat" and name != "decoder_layer_input"]
    work += (_period_layers(config, family, shape) - 1) * tokens * sum(per[name] for name in redone)
    # the projections' gradients: dq, dk, dv and the attention output's (q's width)
    grads = tokens * (2 * per["query_proj"] + per["key_proj"] + per["value_proj"])
    heads = (attention_bytes + grads) / config.attention_head_chunks
    # the tile and its gradient; under expert parallelism a rank's buffers hold E times its pairs (dropless)
    mlp = 2 * tokens / config.mlp_sequence_chunks * family.tile(shape, tp) * _expert_degree(config, shape)
    return layer_params / tp * (b + 4) + work + max(heads, mlp)


def _expert_degree(config: Config, shape) -> int:
    """Expert parallelism's E for a shape with experts, else 1."""
    return config.expert_parallelism if getattr(shape, "num_experts", 1) > 1 else 1


def _period_layers(config: Config, family, shape) -> int:
    """Layers one scan step of the family's stacks runs (a layer kind that is a period of layers: its length)."""
    steps = sum(stack.count for stack in family.stacks(config)) or shape.num_layers
    return max(1, round(shape.num_layers / steps))
