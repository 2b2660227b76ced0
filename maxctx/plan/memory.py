"""The memory estimates per device, HBM and host: what the planner's memory column, its fit verdict and
remat_policy=auto's host budget read (no JAX).

    HBM   `device_bytes`: the optimizer state and gathered weights, the layer inputs and the tensors the remat
          policy keeps on the device (at KEPT_ON_DEVICE x their bytes), the layer's working set (the family's
          LayerWork) and the loss / MLP tiles; the strategy's attention memory is the planner's to add
    host  `held_host_bytes`: what the offloaded tensors hold in pinned host memory, against
          `host_budget_per_device` (HOST_FRACTION of the host DRAM per device)

The named tensors' bytes per token and where the policy puts them are maxctx.plan.step_time's (`per_token`,
`placement`, `offloading_layers`), the model's shape its family's.
"""

from __future__ import annotations

from maxctx.config import Config, ConfigError
from maxctx.model import families
from maxctx.plan import step_time, topology

# Of the host DRAM per device: the rest for the OS, the training process, the input pipeline and checkpoint
# staging (an assumption).
HOST_FRACTION = 0.9
# HBM that a tensor kept on the device for the backward takes, per byte of the tensor (the layer input has its own
# calibration, the family's LayerWork.on_device): fitted on the one compile that measured it, llama3.1-8b
# (head_dim=256) at 10,485,760 tokens on v5p-128, p2p, context=device decoder_layer_input=offload: XLA needed
# 102.54 GiB where the planner without this factor estimated 76.25 GiB for 40.31 GiB of kept `context`
# (docs/long_context.md), 1 + 26.29 / 40.31 = 1.65.
KEPT_ON_DEVICE = 1.65


def host_budget_per_device(config: Config) -> float:
    """Bytes of host DRAM one device may fill with offloaded tensors (module doc); 0 when not known."""
    try:
        topo = topology.parse(config.compile_topology) if config.compile_topology else None
    except ConfigError:
        topo = None
    if topo is None:
        return 0.0
    return HOST_FRACTION * topo.chip.host_bytes / topo.chip.devices_per_chip


def held_host_bytes(config: Config, tp: int) -> float:
    """Bytes per device the offloaded tensors hold in host memory: each offloading layer's (every layer, but the
    layer input of every decoder_layer_input_stride-th), tokens per device x bytes."""
    per = step_time.per_token(config, tp)["bytes"]
    tokens = config.per_device_batch_size * tp * config.max_target_length
    where = step_time.placement(config)
    return tokens * sum(per[n] * step_time.offloading_layers(config, n) for n, w in where.items() if w == "offload")


def device_bytes(config: Config, tp: int, shards: int) -> tuple[float, float]:
    """(HBM per device besides attention, the loss / MLP tiles' bytes): the optimizer state and a layer's
    gathered weights, the layer inputs and tensors the policy keeps on the device, the layer's working set."""
    family = families.for_config(config)
    shape = family.shape(config)
    seq, layers, b, dim = config.max_target_length, shape.num_layers, shape.itemsize, shape.emb_dim
    params, wb = shape.num_params, shape.weight_itemsize
    tokens = config.per_device_batch_size * tp * seq  # tokens one device holds (B S / C over the context shards)
    offloaded = config.remat_policy == "custom" and config.decoder_layer_input == "offload"
    saved_inputs = 0 if offloaded else step_time.kept_layer_inputs(config) * tokens * dim * b
    work = (family.work.offloaded if offloaded else family.work.on_device) * tokens * dim
    # a strided run's recomputed inputs, held through its backward
    work += (config.decoder_layer_input_stride - 1) * tokens * dim * b
    # What else the policy keeps in HBM for the backward (the attention output under context=device, ...)
    kept = step_time.per_token(config, tp)["bytes"]
    saved_inputs += KEPT_ON_DEVICE * layers * tokens * sum(
        kept[name] for name, where in step_time.placement(config).items()
        if where == "device" and name != "decoder_layer_input")
    state = params * (wb + 12) / shards + params / layers * wb / max(1, tp)
    tiles = max(2 * tokens / config.num_vocab_tiling * shape.vocab_size / tp * 4,
                tokens / config.mlp_sequence_chunks * family.tile(shape, tp))
    return state + saved_inputs + work, tiles
