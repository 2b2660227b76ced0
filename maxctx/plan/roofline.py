"""A roofline ESTIMATE of step time and MFU per device, not a measurement: the report `maxctx.compile` prints for a
TPU topology.

step time = max(compute, HBM, ICI, DCN), each term the time at the chip's peak rate, assuming perfect overlap:
    compute  (model FLOPs x recompute factor (4/3 with remat_policy=full or custom: the forward runs twice) + the
             recompute of tiling: one more output projection with num_vocab_tiling > 1, one more MLP forward with
             mlp_sequence_chunks > 1 under remat) / peak FLOP/s
    HBM      bytes every step must move / HBM bandwidth: weights read once per pass (forward, remat forward,
             backward) and the gradient written; AdamW reading p, g, m, v and writing p, m, v (fp32); every
             matmul operand and result of every layer written and read once per pass (backward counted as two
             forward passes); logits and their gradient. Attention kernels' K/V re-reads are left out (flash
             blocks make them small next to the FLOPs).
    ICI      bytes one device sends / its ICI egress (half the chip's bidirectional bandwidth, all links busy):
             FSDP all-gathers of the weights (forward, and backward with its recompute) and the reduce-scatter of
             fp32 gradients over the devices a weight is sharded across; data-parallel all-reduce; tensor-parallel
             activation all-reduces; the CP strategy's collectives per layer, from the registered strategy's
             `comm_volume` formulas (forward ones once per forward pass).
    DCN      (several slices) bytes that cross slices / the chip's DCN bandwidth (maxctx.plan.topology: Google's figure
             for v5p and v5e, else an assumed 100 Gb/s): the cross-slice share (d - 1) / d of the weights' gathers
             and gradients' reductions sharded over dcn_fsdp x dcn_context = d slices and of the data-parallel
             all-reduce over dcn_data; of
             the CP collectives, every ring hop (the hop at a slice boundary paces the ring) and the cross-slice
             share of a gather over the whole context axis (the all-to-all stays inside a slice).
Latency, kernel efficiency and load imbalance are not modelled: real step times are longer and real MFU lower.
"""

from __future__ import annotations

import math

from maxctx.attention import strategies
from maxctx.attention.cost import AttentionShape, Collective
from maxctx.config import Config
from maxctx.model.shape import ModelShape
from maxctx.parallelism import A2A_AXIS, mesh_context_degree, mesh_sizes, num_slices


def _cp_comm_volume(config: Config, mesh: dict[str, int], t: float, b: int
                    ) -> tuple[list[Collective], list[Collective]]:
    c = mesh_context_degree(mesh)
    if c == 1:
        return [], []
    tp, seq = mesh["tensor"], config.max_target_length
    shape = AttentionShape(batch=t * c / seq, seq=seq, heads=config.base_num_query_heads // tp,
                           kv_heads=max(1, config.base_num_kv_heads // tp), head_dim=config.head_dim, itemsize=b,
                           cp=c, a2a=mesh[A2A_AXIS])
    return strategies.for_config(config).comm_volume(shape)


def cp_bytes_per_layer(config: Config, mesh: dict[str, int], t: float, b: int) -> tuple[float, float]:
    """(forward, backward) bytes one device sends for attention per layer, t = tokens per device (B S / C): the
    strategy's `comm_volume` formulas (maxctx.attention.base), counted on the wire."""
    fwd, bwd = _cp_comm_volume(config, mesh, t, b)
    return sum(x.sent_bytes for x in fwd), sum(x.sent_bytes for x in bwd)


def cp_dcn_bytes_per_layer(config: Config, mesh: dict[str, int], t: float, b: int, dcn_context: int
                           ) -> tuple[float, float]:
    """(forward, backward) attention bytes per layer that cross slices (module doc), of `cp_bytes_per_layer`'s."""
    if dcn_context == 1:
        return 0.0, 0.0
    cp = mesh_context_degree(mesh)

    def crossing(ops: list[Collective]) -> float:
        return sum(x.sent_bytes if x.kind == "collective-permute" else
                   x.bytes * (dcn_context - 1) / dcn_context if x.group == cp else 0.0 for x in ops)

    fwd, bwd = _cp_comm_volume(config, mesh, t, b)
    return crossing(fwd), crossing(bwd)


def roofline(config: Config, mesh: dict[str, int], global_batch: int, num_params: int, chip) -> dict:
    """The step-time / MFU estimate described in the module doc, per device."""
    from maxctx.metrics import lookup_peak, training_flops_per_device

    n = math.prod(mesh.values())
    per_chip = chip.devices_per_chip
    entry = lookup_peak(chip.device_kind)
    peak = (config.peak_tflops_per_device * 1e12 if config.peak_tflops_per_device > 0
            else entry.tflops_per_device * 1e12)
    hbm_bw, ici_bw = chip.hbm_bytes_per_s / per_chip, chip.ici_bytes_per_s / 2 / per_chip
    model = ModelShape.from_config(config)
    b, wb = model.itemsize, model.weight_itemsize
    layers, dim, tp, dp = config.base_num_decoder_layers, config.base_emb_dim, mesh["tensor"], mesh["data"]
    heads, kv, hd, mlp = config.base_num_query_heads, config.base_num_kv_heads, config.head_dim, config.base_mlp_dim
    t = global_batch * config.max_target_length / n  # tokens per device per step
    # custom: counted as full (the layer is recomputed; what it keeps or offloads saves memory, not FLOPs)
    full = config.remat_policy in ("full", "custom")
    forward_passes = 2 if full else 1

    model_flops = training_flops_per_device(config, global_batch, config.max_target_length, n)
    # Tiling recomputes in the backward: the output projection once more, and (under a remat'd layer) the MLP.
    tiled = (2 * t * model.output_params / tp * (config.num_vocab_tiling > 1)
             + 2 * layers * t * model.mlp_params / tp * (config.mlp_sequence_chunks > 1 and full))
    compute_s = (model_flops * (4 / 3 if full else 1) + tiled) / peak

    weights = num_params / tp  # a device's slice of every weight, once gathered
    shards = n // (dp * tp)  # devices each weight is sharded across (fsdp and context axes)
    layer_act = 2 * b * (6 * dim + (2 * heads + 2 * kv) * hd / tp + 3 * mlp / tp)  # per token, one forward
    hbm_bytes = ((forward_passes + 1) * weights * wb + weights * 4 + 7 * 4 * num_params / (shards * tp)
                 + (forward_passes + 2) * layers * t * layer_act + 2 * t * config.vocab_size / tp * (b + 8))
    hbm_s = hbm_bytes / hbm_bw

    fsdp = (shards - 1) / shards * (2 * weights * wb + weights * 4)
    data = 2 * (dp - 1) / dp * num_params / (shards * tp) * 4
    tensor = (2 * forward_passes + 2) * layers * 2 * (tp - 1) / tp * t * dim * b
    cp_fwd, cp_bwd = cp_bytes_per_layer(config, mesh, t, b)
    ici_bytes = fsdp + data + tensor + layers * (forward_passes * cp_fwd + cp_bwd)
    ici_s = ici_bytes / ici_bw

    dcn_bytes = 0.0
    if num_slices(config) > 1:
        dcn = mesh_sizes(config, n)[1]
        across = dcn["fsdp"] * dcn["context"]  # slices a weight is sharded across
        dcn_fwd, dcn_bwd = cp_dcn_bytes_per_layer(config, mesh, t, b, dcn["context"])
        grads = num_params / (shards * tp) * 4
        dcn_bytes = (fsdp * (across - 1) / across + 2 * (dcn["data"] - 1) / dcn["data"] * grads
                     + layers * (forward_passes * dcn_fwd + dcn_bwd))
    dcn_s = dcn_bytes / (chip.dcn_bytes_per_s_or_default / per_chip)

    terms = {"compute": compute_s, "hbm": hbm_s, "ici": ici_s, "dcn": dcn_s}
    step = max(terms.values())
    return {"peak_flops_per_device": peak, "estimate_compute_s": compute_s, "estimate_hbm_s": hbm_s,
            "estimate_ici_s": ici_s, "estimate_hbm_bytes": hbm_bytes, "estimate_ici_bytes": ici_bytes,
            "estimate_dcn_s": dcn_s, "estimate_dcn_bytes": dcn_bytes,
            "estimate_step_time_s": step, "estimate_bound": max(terms, key=terms.get),
            "estimate_mfu": model_flops / (step * peak),
            "estimate_tokens_per_s": global_batch * config.max_target_length / step}
