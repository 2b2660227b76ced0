"""The device as the step-time model sees it (maxctx.plan.step_time): its peak, HBM, links and host link, built
from maxctx.plan.topology's chips (a TPU slice's torus, or a GPU cluster's NVLink nodes and NICs), and the time one
non-ring collective takes on it.
"""

from __future__ import annotations

import dataclasses
import os

from maxctx.attention.cp.cost import Collective
from maxctx.config import Config, ConfigError
from maxctx.parallelism import num_slices
from maxctx.plan import topology

GIB = 1024 ** 3
# Pinned host memory <-> HBM per chip, each way: an assumption (docs/step_time_model.md), not calibrated.
HOST_BYTES_PER_S = 16e9
# GPUs (maxctx.plan.topology.GPUS), assumptions until a measured GPU row calibrates them (docs/step_time_model.md):
# XLA's large bf16 matmuls at 70% of the dense peak, cuDNN's fused attention (forward and backward together) at
# 45%, and pinned host memory over PCIe Gen5 x16 (64 GB/s each way, its nominal rate).
GPU_MATMUL_EFFICIENCY, CUDNN_EFFICIENCY, GPU_HOST_BYTES_PER_S = 0.70, 0.45, 64e9

# DCN bandwidth per chip each way where maxctx.plan.topology has no figure from Google's pages (v4, v6e, tpu7x, and the
# generic device): an assumption, 100 Gb/s. Latency of one collective or ring hop: assumptions.
DCN_BYTES_PER_S = topology.DCN_DEFAULT_BYTES_PER_S
ICI_LATENCY_S, DCN_LATENCY_S = 5e-6, 50e-6

@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device as the model sees it; bandwidths in bytes/s, one direction."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # one ICI link
    torus: tuple[int, ...]  # devices per torus dimension of one slice
    dcn_bytes_per_s: float = DCN_BYTES_PER_S
    host_bytes_per_s: float = HOST_BYTES_PER_S  # to or from pinned host memory, each way
    # GPUs: devices per NVLink switch (a node; `torus` is then (GPUs per node, nodes), `link_bytes_per_s` a GPU's
    # NVLink egress and `dcn_bytes_per_s` its NIC's); 0 for a TPU torus
    switch: int = 0
    matmul_efficiency: float = 0.0  # of the peak; 0: step_time.XLA_MATMUL_EFFICIENCY (the v5p fit)
    transcendentals_per_s: float = 0.0  # exps per second (topology.Chip's per chip / devices); 0: not priced

    @property
    def ici_bytes_per_s(self) -> float:
        """Egress over all links (two per torus dimension); a GPU's NVLink, or its NIC when the job spans nodes."""
        if self.switch:
            return self.link_bytes_per_s if self.torus[-1] == 1 else min(self.link_bytes_per_s, self.dcn_bytes_per_s)
        return self.link_bytes_per_s * 2 * len(self.torus)


def hardware(config: Config, num_devices: int | None) -> Hardware:
    """The device of `compile_topology`, else of TPU_ACCELERATOR_TYPE (set on Cloud TPU VMs), else a generic
    device (CPU runs: the choice is then about validity, not speed)."""
    name = config.compile_topology or os.environ.get("TPU_ACCELERATOR_TYPE", "")
    try:
        topo = topology.parse(name) if name else None
    except ConfigError:
        topo = None
    if topo is None:
        peak = config.peak_tflops_per_device * 1e12 if config.peak_tflops_per_device > 0 else 1e12
        return Hardware(f"generic device ({peak / 1e12:g} TFLOP/s, 64 GiB, 100 GB/s memory, 10 GB/s links)", peak,
                        64 * GIB, 100e9, 10e9, (num_devices or 1,))
    chip, per_chip = topo.chip, topo.chip.devices_per_chip
    if config.peak_tflops_per_device > 0:
        peak = config.peak_tflops_per_device * 1e12
    else:
        from maxctx.metrics.peaks import lookup_peak  # imports JAX: only for a TPU's table entry

        peak = lookup_peak(chip.device_kind).tflops_per_device * 1e12
    if chip.switch:
        return Hardware(f"{topo.name} ({topo.shape[1]} x {topo.shape[0]} {chip.name})", peak, chip.hbm_bytes,
                        chip.hbm_bytes_per_s, chip.ici_bytes_per_s / 2, topo.shape, chip.dcn_bytes_per_s,
                        GPU_HOST_BYTES_PER_S, chip.switch, GPU_MATMUL_EFFICIENCY)
    links = 2 * chip.dims
    torus = topo.shape[:-1] + (topo.shape[-1] * per_chip,)
    slices = f"{num_slices(config)} x " if num_slices(config) > 1 else ""
    # The chip's devices share its HBM, links, DCN, host link and vector units.
    return Hardware(f"{slices}{topo.name} ({chip.name})", peak, chip.hbm_bytes_per_device,
                    chip.hbm_bytes_per_s / per_chip, chip.ici_bytes_per_s / 2 / links / per_chip, torus,
                    chip.dcn_bytes_per_s_or_default / per_chip, HOST_BYTES_PER_S / per_chip,
                    transcendentals_per_s=chip.transcendentals_per_s / per_chip)


def _spanned(hw: Hardware, group: int) -> list[tuple[int, int]]:
    """(devices the group spans, the torus side) per torus dimension it spans. A mesh axis's groups lie on
    adjacent devices (maxctx.mesh maps the unsplit context axis onto the torus and splits it afterwards), so a group
    fills the torus dimensions in order: 8 devices of a 4x4x4 torus span 4 along the first and 2 along the second."""
    out, left = [], group
    for side in hw.torus:
        if left <= 1:
            break
        extent = min(side, left)
        out.append((extent, side))
        left = -(-left // extent)
    return out or [(1, 1)]


def _collective_s(c: Collective, hw: Hardware, ici_cp: int) -> float:
    """Seconds one non-ring collective takes: its ICI part, then (a group beyond the slice) its DCN part. On GPUs
    the node is the slice: NVLink inside it (a switch: every GPU at its full bandwidth), the NICs across nodes."""
    if hw.switch:
        ici_cp = min(ici_cp, hw.switch)
    slices = max(1, c.group // ici_cp) if c.group > ici_cp else 1
    inside = c.group // slices
    if hw.switch:
        spread = inside - 1 if c.kind != "all-to-all" else (inside - 1) * c.group / inside
        ici = c.bytes * spread / c.group / hw.link_bytes_per_s + ICI_LATENCY_S if inside > 1 else 0.0
        dcn = c.bytes * (slices - 1) / slices / hw.dcn_bytes_per_s + DCN_LATENCY_S if slices > 1 else 0.0
        return ici + dcn
    spans = _spanned(hw, inside)
    if c.kind == "all-to-all":
        # Each device sends bytes / U to every member. Along one dimension of extent e the traffic is an
        # all-to-all among e devices: on a wraparound ring (e = the torus side) a message crosses e / 4 links on
        # average and each device has 2 links out, so e x bytes / 8 per link; on a line (a part of a dimension, no
        # wraparound) the middle link carries e x bytes / 4 each way. Dimensions carry their shares at once, so
        # the slowest dimension sets the time (bisection bound; docs/choosing_a_strategy.md has the source).
        ici = max(c.bytes * e / (8 if e == side > 2 else 4) for e, side in spans) / hw.link_bytes_per_s
    else:  # all-gather / reduce-scatter: rings in both directions of every spanned dimension
        ici = c.bytes * (inside - 1) / c.group / (2 * len(spans) * hw.link_bytes_per_s)
    ici = ici + ICI_LATENCY_S if inside > 1 else 0.0
    dcn = c.bytes * (slices - 1) / slices / hw.dcn_bytes_per_s + DCN_LATENCY_S if slices > 1 else 0.0
    return ici + dcn
