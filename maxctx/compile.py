"""Compile the train step without training: `python -m maxctx.compile configs/base.yml key=value ...`.

Lowers and compiles the real step for the abstract state (no parameters are allocated) and reports per-device
memory and FLOPs, as text and as JSON on stdout's last line. The step compiles for the local devices, or, with
`compile_topology=v5p-128` (names in maxctx.topology), for that TPU slice (x compile_topology_num_slices) on any
machine with libtpu installed and no TPU. For a topology the report adds:

- memory per device (memory_analysis: arguments + outputs + temporaries - aliased) against the device's HBM: fits
  or not, and by how much (against Google's round capacity in maxctx.topology; XLA's own limit differs a little:
  15.75 GiB on v5e, 95.74 GiB on v5p). XLA sometimes refuses to compile a program that does not fit, reported with
  XLA's own figures
  (when XLA stops at its temporaries the real need is larger still); sometimes it compiles one that needs more
  than HBM (llama3.1-70b at 512K on v5p-128: 125 GiB), which the memory analysis catches.
  Exit status 0: compiled and fits; 3: does not fit; 2: bad config.
- FLOPs per step: analytic model FLOPs (maxctx.metrics, MaxText's convention) and XLA's cost analysis (which counts a
  scanned layer once and counts remat recompute, so it is far below the analytic figure with scan_layers=true).
- a roofline ESTIMATE of step time and MFU, not a measurement: step time = max(compute, HBM, ICI), each term the
  time at the chip's peak rate, assuming perfect overlap of the three:
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
             activation all-reduces; the CP strategy's collectives per layer, from the formulas in
             maxctx/attention/<strategy>.py (forward ones once per forward pass).
  DCN traffic between slices, latency, kernel efficiency and load imbalance are not modelled: real step times are
  longer and real MFU lower.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time

from maxctx.config import Config, ConfigError, load_config

GIB = 1024 ** 3
NOT_FITTING = 3


def compile_report(config: Config) -> dict:
    """Compiles the step for this config (local devices, or `compile_topology`) and returns its statistics."""
    import jax

    from maxctx import topology as topo
    from maxctx.attention.dispatch import resolve_kernel
    from maxctx.mesh import create_mesh
    from maxctx.metrics import compile_record, training_flops_per_device
    from maxctx.model.decoder import count_params
    from maxctx.train_step import compile_train_step, make_setup

    target = topo.parse(config.compile_topology) if config.compile_topology else None
    devices = topo.topology_devices(target, config.compile_topology_num_slices) if target else jax.devices()
    mesh = create_mesh(config, devices)
    setup = make_setup(config, mesh)
    num_devices = mesh.devices.size
    flops = training_flops_per_device(config, setup.global_batch, config.max_target_length, num_devices)
    report = {"model_name": config.model_name, "num_params": count_params(setup.abstract_state["params"]),
              "mesh": dict(mesh.shape), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
              "num_devices": num_devices, "global_batch": setup.global_batch, "seq_len": config.max_target_length,
              "context_parallel_strategy": config.cp_strategy,
              "attention": resolve_kernel(config.attention, platform=devices[0].platform, dtype=config.dtype)}
    start = time.perf_counter()
    try:
        compiled = compile_train_step(setup)
        report.update(compile_record(compiled, analytic_flops_per_device=flops))
    except jax.errors.JaxRuntimeError as e:
        if target is None or "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report.update(analytic_flops_per_device=flops, argument_bytes_from_shardings=_argument_bytes(setup),
                      **xla_out_of_memory(str(e)))
    report["compile_time_s"] = round(time.perf_counter() - start, 2)
    if target is not None:
        report.update(topology=target.name, libtpu_topology=target.libtpu_name,
                      num_slices=config.compile_topology_num_slices, devices_per_chip=target.chip.devices_per_chip,
                      **fit(report, target.chip),
                      **roofline(config, dict(mesh.shape), setup.global_batch, report["num_params"], target.chip))
    return report


def _argument_bytes(setup) -> int:
    """Bytes of one device's shards of the state and the batch (what memory_analysis calls arguments)."""
    import jax

    leaves = jax.tree.leaves((setup.abstract_state, setup.abstract_batch()))
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


_SIZE = r"([\d.]+)\s*([KMGT]i?B?)?"
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _bytes(number: str, unit: str | None) -> int:
    return int(float(number) * _UNITS[(unit or "")[:1]])


def xla_out_of_memory(message: str) -> dict:
    """XLA:TPU's refusal to compile a program larger than HBM: its required and available bytes when it says them
    ('... required for HLO temporaries (21.83G) exceeds available HBM (15.75G)' or 'Used 17.1G of 15.75G hbm')."""
    out = {"xla_error": message.strip().splitlines()[0][:500]}
    space = re.search(r"out of memory in memory space (\w+)", message, re.IGNORECASE)
    if space and space[1].lower() != "hbm":
        # On-chip scalar (SMEM) or vector (VMEM) memory: a kernel's tables or blocks, not the program's HBM.
        out["xla_memory_space"] = space[1].lower()
        return out
    m = (re.search(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)", message)
         or re.search(rf"Used {_SIZE} of {_SIZE} hbm", message, re.IGNORECASE))
    if m:
        out["xla_required_bytes"] = _bytes(m[1], m[2])
        out["xla_available_bytes"] = _bytes(m[3], m[4])
        out["xla_required_is_temporaries_only"] = "exceeds available" in m[0]
    return out


def onchip_advice(space: str, attention: str) -> str:
    """What to change when a kernel overflows on-chip memory: SMEM holds splash's block tables (one entry per query
    block x key block of a call), so larger blocks shrink them; VMEM holds the blocks themselves, so smaller ones."""
    if space == "smem":
        what = "splash's block tables" if attention == "splash" else "a kernel's scalar tables"
        return (f"{what} overflowed on-chip SMEM: raise flash_block_q and flash_block_kv (e.g. 1024 or 2048; they "
                f"set the splash blocks too) so a call has fewer blocks")
    return (f"a kernel's working blocks overflowed on-chip {space.upper()}: lower flash_block_q and flash_block_kv "
            f"(e.g. 256)")


def fit(report: dict, chip) -> dict:
    """fits, and headroom_bytes = device HBM - bytes the program needs (negative: over by that much)."""
    hbm = chip.hbm_bytes_per_device
    if "total_size_in_bytes" in report:
        need = report["total_size_in_bytes"]
    elif "xla_required_bytes" in report:  # XLA's figure, against its own (slightly smaller) limit
        need = report["xla_required_bytes"] + hbm - report["xla_available_bytes"]
        if report.get("xla_required_is_temporaries_only"):  # XLA stopped at the temporaries: add the arguments
            need += report.get("argument_bytes_from_shardings", 0)
    else:
        return {"fits": False, "hbm_bytes_per_device": hbm}
    fits = "xla_error" not in report and need <= hbm
    return {"fits": fits, "hbm_bytes_per_device": hbm, "headroom_bytes": int(hbm - need)}


def _cp_bytes_per_layer(config: Config, mesh: dict[str, int], t: float, b: int) -> tuple[float, float]:
    """(forward, backward) bytes one device sends for attention per layer: the formulas in maxctx/attention/*.py,
    with t = tokens per device (B S / C)."""
    c, u, r = mesh["context"] * mesh["context_a2a"], mesh["context_a2a"], mesh["context"]
    if c == 1:
        return 0.0, 0.0
    tp = mesh["tensor"]
    h, k, d = config.base_num_query_heads // tp, max(1, config.base_num_kv_heads // tp), config.head_dim
    kk = math.lcm(k, u)  # kv heads after the a2a strategies' repetition
    strategy = config.cp_strategy
    if strategy == "all_gather":
        return (c - 1) * (2 * t * k * d * b + 8 * t), (c - 1) * 2 * t * k * d * b
    if strategy == "p2p":
        hop = 2 * t * k * d * b + 8 * t
        return (c - 1) * hop, (c - 1) * hop + c * 2 * t * k * d * 4
    a2a = (u - 1) / u * (2 * h + 2 * kk) * t * d * b
    if strategy == "a2a":
        return a2a + (u - 1) * 8 * t, a2a
    hop = 2 * t * kk * d * b + 8 * t * u  # usp: ring over R blocks of S/R tokens with K'/U heads
    return a2a + (u - 1) * 8 * t + (r - 1) * hop, a2a + (r - 1) * hop + r * 2 * t * kk * d * 4


def roofline(config: Config, mesh: dict[str, int], global_batch: int, num_params: int, chip) -> dict:
    """The step-time / MFU estimate described in the module doc, per device."""
    from maxctx.metrics import lookup_peak, training_flops_per_device

    n = math.prod(mesh.values())
    per_chip = chip.devices_per_chip
    entry = lookup_peak(chip.device_kind)
    peak = (config.peak_tflops_per_device * 1e12 if config.peak_tflops_per_device > 0
            else entry.tflops_per_device * 1e12)
    hbm_bw, ici_bw = chip.hbm_bytes_per_s / per_chip, chip.ici_bytes_per_s / 2 / per_chip
    b = 2 if config.dtype in ("bfloat16", "float16") else 4
    wb = 4 if config.weight_dtype == "float32" else 2
    layers, dim, tp, dp = config.base_num_decoder_layers, config.base_emb_dim, mesh["tensor"], mesh["data"]
    heads, kv, hd, mlp = config.base_num_query_heads, config.base_num_kv_heads, config.head_dim, config.base_mlp_dim
    t = global_batch * config.max_target_length / n  # tokens per device per step
    # custom: counted as full (the layer is recomputed; what it keeps or offloads saves memory, not FLOPs)
    full = config.remat_policy in ("full", "custom")
    forward_passes = 2 if full else 1

    model_flops = training_flops_per_device(config, global_batch, config.max_target_length, n)
    # Tiling recomputes in the backward: the output projection once more, and (under a remat'd layer) the MLP.
    tiled = (2 * t * dim * config.vocab_size / tp * (config.num_vocab_tiling > 1)
             + 6 * layers * t * dim * mlp / tp * (config.mlp_sequence_chunks > 1 and full))
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
    cp_fwd, cp_bwd = _cp_bytes_per_layer(config, mesh, t, b)
    ici_bytes = fsdp + data + tensor + layers * (forward_passes * cp_fwd + cp_bwd)
    ici_s = ici_bytes / ici_bw

    terms = {"compute": compute_s, "hbm": hbm_s, "ici": ici_s}
    step = max(terms.values())
    return {"peak_flops_per_device": peak, "estimate_compute_s": compute_s, "estimate_hbm_s": hbm_s,
            "estimate_ici_s": ici_s, "estimate_hbm_bytes": hbm_bytes, "estimate_ici_bytes": ici_bytes,
            "estimate_step_time_s": step, "estimate_bound": max(terms, key=terms.get),
            "estimate_mfu": model_flops / (step * peak),
            "estimate_tokens_per_s": global_batch * config.max_target_length / step}


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def format_report(report: dict) -> list[str]:
    params = report["num_params"]
    lines = [f"{report['model_name']}: {params / 1e9:.2f}B parameters" if params >= 1e8 else
             f"{report['model_name']}: {params / 1e6:.2f}M parameters"]
    lines[0] += (f", mesh {report['mesh']}, batch {report['global_batch']} x {report['seq_len']}, "
                 f"{report['context_parallel_strategy']} with {report['attention']} attention, "
                 f"{report['num_devices']} x {report['device_kind']}")
    device = "device"
    if "topology" in report:
        slices = f" x {report['num_slices']} slices" if report["num_slices"] > 1 else ""
        lines[0] += f" ({report['topology']} = {report['libtpu_topology']} chips{slices})"
        device = "chip" if report["devices_per_chip"] == 1 else f"device (1/{report['devices_per_chip']} chip)"
    if "total_size_in_bytes" in report:
        lines.append(f"per {device}: {report['total_size_in_bytes'] / GIB:.2f} GiB (arguments "
                     f"{report['argument_size_in_bytes'] / GIB:.2f}, temp {report['temp_size_in_bytes'] / GIB:.2f})")
    if "xla_error" in report:
        lines.append(f"XLA: {report['xla_error']}")
    if "fits" in report:
        hbm, room = report["hbm_bytes_per_device"] / GIB, report.get("headroom_bytes")
        verdict = "FITS" if report["fits"] else "DOES NOT FIT"
        by = "" if room is None else f", {abs(room) / GIB:.2f} GiB {'free' if room >= 0 else 'over'}"
        if report.get("xla_memory_space"):
            lines.append(f"DOES NOT COMPILE: on-chip {report['xla_memory_space'].upper()} overflowed, not HBM "
                         f"({hbm:.2f} GiB per {device}, untested): "
                         f"{onchip_advice(report['xla_memory_space'], report['attention'])}")
        else:
            lines.append(f"{verdict} in {hbm:.2f} GiB HBM per {device}{by}")
    lines.append(f"FLOPs per device per step: {report['analytic_flops_per_device'] / 1e12:.4g} TFLOP (model, "
                 f"analytic); XLA cost analysis {report.get('xla_flops_per_device', math.nan) / 1e12:.4g} TFLOP "
                 f"(a scanned layer counted once, recompute included)")
    if "estimate_step_time_s" in report:
        lines.append(f"roofline estimate (not a measurement): step {_seconds(report['estimate_step_time_s'])}, "
                     f"{report['estimate_bound']}-bound (compute {_seconds(report['estimate_compute_s'])}, HBM "
                     f"{_seconds(report['estimate_hbm_s'])}, ICI {_seconds(report['estimate_ici_s'])}), MFU "
                     f"{report['estimate_mfu']:.1%}, {report['estimate_tokens_per_s']:,.0f} tokens/s")
    lines.append(f"compiled in {report['compile_time_s']:.1f} s")
    return lines


def main(argv: list[str]) -> int:
    try:
        config = load_config(argv)
        from maxctx import runtime

        runtime.initialize(config)
        report = compile_report(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_report(report)))
    print(json.dumps(report))
    return NOT_FITTING if report.get("fits") is False else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
