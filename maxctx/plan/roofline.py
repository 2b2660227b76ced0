"""The bytes a training step moves per device, by where they go: maxctx.plan.step_time's memory-bound and
collective terms read them (`traffic`), and the CP strategies' per-layer bytes (from the registered strategy's
`comm_volume` formulas).

    HBM      weights read once per pass (forward, remat forward, backward) and the gradient written; AdamW reading
             p, g, m, v and writing p, m, v (fp32); every matmul operand and result of every layer written and read
             once per pass (backward counted as two forward passes); logits and their gradient. Attention kernels'
             K/V re-reads are left out (flash blocks make them small next to the FLOPs).
    ICI      FSDP all-gathers of the weights (forward, and backward with its recompute) and the reduce-scatter of
             fp32 gradients over the devices a weight is sharded across, except a mixture of experts' router and
             routed experts, which move as the expert strategy's formulas say (maxctx.model.moe.experts: gathered
             in the compute dtype once per forward pass, their gradient reduce-scattered in it; GPT-OSS's expert
             biases, under 0.1% of its experts, priced with the other weights); data-parallel all-reduce;
             tensor-parallel activation all-reduces. The CP strategy's collectives are timed per layer by step_time (its
             `comm_volume` formulas: `cp_bytes_per_layer`).
    DCN      (several slices) bytes that cross slices: the cross-slice share (d - 1) / d of the weights' gathers
             and gradients' reductions sharded over dcn_fsdp x dcn_context = d slices and of the data-parallel
             all-reduce over dcn_data; of the CP collectives, every ring hop (the hop at a slice boundary paces the
             ring) and the cross-slice share of a gather over the whole context axis (the all-to-all stays inside a
             slice).
"""

from __future__ import annotations

import math

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import AttentionShape, Collective
from maxctx.config import Config, layer_windows
from maxctx.model import families
from maxctx.model.moe import experts
from maxctx.parallelism import (
    A2A_AXIS,
    DATA_AXIS,
    FSDP_AXIS,
    RING_AXIS,
    TENSOR_AXIS,
    mesh_context_degree,
    mesh_sizes,
    num_slices,
)


def attention_shape(config: Config, mesh: dict[str, int], batch: float, window: int = 0,
                    itemsize: int | None = None) -> AttentionShape:
    """The one AttentionShape the planner, the time model and the roofline build: one attention layer of
    `config` on one device of `mesh` (sizes by mesh axis; the context and tensor ones are read), `batch` rows per
    device, a layer of sliding `window` (0: global), the config's load balance."""
    model, tp = families.shape(config), mesh[TENSOR_AXIS]
    return AttentionShape(batch=batch, seq=config.max_target_length, heads=model.num_heads // tp,
                          kv_heads=max(1, model.num_kv_heads // tp), head_dim=model.head_dim,
                          itemsize=model.itemsize if itemsize is None else itemsize, cp=mesh_context_degree(mesh),
                          a2a=mesh[A2A_AXIS], window=window, load_balance=config.context_parallel_load_balance,
                          value_head_dim=getattr(model, "v_head_dim", 0),  # MLA's (maxctx.model.deepseek)
                          latent_rank=getattr(model, "kv_lora_rank", 0), rope_dim=getattr(model, "rope_dim", 0))


def _cp_comm_volume(config: Config, mesh: dict[str, int], t: float, b: int
                    ) -> list[tuple[list[Collective], list[Collective]]]:
    """(forward, backward) collectives of each layer of the layer pattern (a local layer's halo where it applies)."""
    c = mesh_context_degree(mesh)
    if c == 1:
        return [([], [])]
    strategy = strategies.for_config(config)
    return [strategy.comm_volume(attention_shape(config, mesh, t * c / config.max_target_length, w, b))
            for w in layer_windows(config)]


def cp_bytes_per_layer(config: Config, mesh: dict[str, int], t: float, b: int) -> tuple[float, float]:
    """(forward, backward) bytes one device sends for attention per layer, averaged over the layer pattern,
    t = tokens per device (B S / C): the strategy's `comm_volume` formulas (maxctx.attention.cp.base), counted on
    the wire."""
    layers = _cp_comm_volume(config, mesh, t, b)
    return (sum(x.sent_bytes for fwd, _ in layers for x in fwd) / len(layers),
            sum(x.sent_bytes for _, bwd in layers for x in bwd) / len(layers))


def cp_dcn_bytes_per_layer(config: Config, mesh: dict[str, int], t: float, b: int, dcn_context: int
                           ) -> tuple[float, float]:
    """(forward, backward) attention bytes per layer that cross slices (module doc), of `cp_bytes_per_layer`'s."""
    if dcn_context == 1:
        return 0.0, 0.0
    cp = mesh_context_degree(mesh)

    def crossing(ops: list[Collective]) -> float:
        return sum(x.sent_bytes if x.kind == "collective-permute" else
                   x.bytes * (dcn_context - 1) / dcn_context if x.group == cp else 0.0 for x in ops)

    layers = _cp_comm_volume(config, mesh, t, b)
    return (sum(crossing(fwd) for fwd, _ in layers) / len(layers),
            sum(crossing(bwd) for _, bwd in layers) / len(layers))


def expert_traffic(model, mesh: dict[str, int], forward_passes: int, degree: int = 1) -> tuple[float, float]:
    """(parameters, wire bytes per step and device) of a mixture of experts' routers and routed experts, over its
    MoE layers: maxctx.model.moe.experts.comm_volume's collectives (under expert parallelism of `degree`, each rank
    gathers its experts only), each counted on the wire; (0, 0) for a shape with no experts."""
    layers = _moe_layers(model)
    if not layers:
        return 0.0, 0.0
    x, d, m = model.num_experts, model.emb_dim, model.moe_mlp_dim
    forward, backward = experts.comm_volume(experts.routed_params(x, d, m, model.itemsize), mesh, forward_passes,
                                            degree)
    return layers * (d * x + 3 * x * d * m), layers * sum(c.sent_bytes for c in forward + backward)


def dispatch_exchanges(config: Config, model, tokens: float, forward_passes: int) -> list[Collective]:
    """Expert parallelism's token exchanges per step and device for `tokens` per device (experts.dispatch_volume
    of each MoE layer, ragged on the accelerators unless expert_dispatch=padded): [] without it."""
    layers, degree = _moe_layers(model), config.expert_parallelism
    if degree == 1 or not layers:
        return []
    how = "padded" if config.expert_dispatch == "padded" else "ragged"
    chunks = config.mlp_sequence_chunks
    passes = 2 if chunks > 1 else forward_passes  # a chunk's forward runs again (maxctx.model.tiling)
    there, back = experts.dispatch_volume(round(tokens * model.top_k), model.emb_dim, model.itemsize,
                                          model.num_experts, degree, how, chunks, passes)
    return (there + back) * layers


def _moe_layers(model) -> int:
    return getattr(model, "moe_layers", 0) if getattr(model, "num_experts", 1) > 1 else 0


def traffic(config: Config, mesh: dict[str, int], global_batch: float, forward_passes: int) -> dict[str, float]:
    """Bytes one device moves per step (module doc): `hbm` through HBM, `ici` over ICI for the weights, gradients
    and tensor parallelism (the CP strategy's own traffic is timed per layer by maxctx.plan.step_time), `dcn`
    across slices (CP included). `forward_passes`: 2 when the layer's forward runs again in the backward."""
    n = math.prod(mesh.values())
    family = families.for_config(config)
    model = family.shape(config)
    num_params = model.num_params
    b, wb = model.itemsize, model.weight_itemsize
    layers, dim, tp, dp = model.num_layers, model.emb_dim, mesh[TENSOR_AXIS], mesh[DATA_AXIS]
    t = global_batch * config.max_target_length / n  # tokens per device per step

    expert_params, expert_bytes = expert_traffic(model, mesh, forward_passes, config.expert_parallelism)
    weights = num_params / tp  # a device's slice of every weight, once gathered
    shards = max(1, n // (dp * tp))  # devices each weight is sharded across (fsdp and context axes)
    layer_act = family.activation(model, tp)  # per token, one forward
    hbm_bytes = ((forward_passes + 1) * weights * wb + weights * 4 + 7 * 4 * num_params / (shards * tp)
                 + (forward_passes + 2) * layers * t * layer_act + 2 * t * model.vocab_size / tp * (b + 8))

    fsdp = (shards - 1) / shards * (2 * wb + 4) * (num_params - expert_params) / tp + expert_bytes
    data = 2 * (dp - 1) / dp * num_params / (shards * tp) * 4
    tensor = (2 * forward_passes + 2) * layers * 2 * (tp - 1) / tp * t * dim * b
    dcn_bytes = 0.0
    if num_slices(config) > 1:
        dcn = mesh_sizes(config, n)[1]
        across = dcn[FSDP_AXIS] * dcn[RING_AXIS]  # slices a weight is sharded across
        dcn_fwd, dcn_bwd = cp_dcn_bytes_per_layer(config, mesh, t, b, dcn[RING_AXIS])
        grads = num_params / (shards * tp) * 4
        dcn_bytes = (fsdp * (across - 1) / across + 2 * (dcn[DATA_AXIS] - 1) / dcn[DATA_AXIS] * grads
                     + layers * (forward_passes * dcn_fwd + dcn_bwd))
    return {"hbm": hbm_bytes, "ici": fsdp + data + tensor, "dcn": dcn_bytes}
