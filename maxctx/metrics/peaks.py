"""Peak dense bf16 FLOP/s per device, for MFU: a cited table per device kind, the config, or a measured matmul.

Lookup order in `peak_flops_per_device`:
1. `peak_tflops_per_device > 0` in the config: the user's number wins (e.g. a power-capped part).
2. The table below, matched on jax's `device.device_kind` (e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3').
3. CPU, or an unknown kind (with a warning): a jitted matmul benchmark, run once on every local device at
   the same time, so simulated CPU devices that share the host's cores each get their share.
Vendor numbers are the dense (no 2:4 sparsity) bf16 tensor-core / MXU peaks; NVIDIA's pages print the sparse
figure with a footnote that dense is half.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxctx.config import Config


@dataclasses.dataclass(frozen=True)
class PeakEntry:
    name: str
    kind_pattern: str  # regex, matched (search, case-insensitive) against device.device_kind
    tflops: float  # dense bf16, per chip (TPU) or per GPU, as the vendor prints it
    source: str
    devices_per_chip: int = 1  # JAX devices one chip appears as (TPU7x: one per TensorCore, two per chip)

    @property
    def tflops_per_device(self) -> float:
        """The peak of one JAX device: MFU is computed per device, so a half-chip device gets half the chip."""
        return self.tflops / self.devices_per_chip


# First match wins, so the specific variants come before their family.
PEAK_TABLE: tuple[PeakEntry, ...] = (
    PeakEntry("TPU v4", r"^tpu v4$", 275.0, "https://cloud.google.com/tpu/docs/v4 (peak compute per chip, bf16)"),
    PeakEntry("TPU v5e", r"^tpu v5( lite|e)$", 197.0,
              "https://cloud.google.com/tpu/docs/v5e (peak compute per chip, bf16)"),
    PeakEntry("TPU v5p", r"^tpu v5p?$", 459.0, "https://cloud.google.com/tpu/docs/v5p (peak compute per chip, bf16)"),
    PeakEntry("TPU v6e", r"^tpu v6( lite|e)$", 918.0,
              "https://cloud.google.com/tpu/docs/v6e (peak compute per chip, bf16)"),
    PeakEntry("TPU7x (Ironwood)", r"^tpu ?v?7x?$", 2307.0,
              "https://cloud.google.com/tpu/docs/tpu7x (peak compute per chip, bf16; each TensorCore is a JAX device)",
              devices_per_chip=2),
    PeakEntry("NVIDIA A100", r"a100", 312.0,
              "https://www.nvidia.com/en-us/data-center/a100/ (BF16 tensor core 312 TFLOPS dense)"),
    PeakEntry("NVIDIA H100 PCIe", r"h100.*pcie", 756.5,
              "https://www.nvidia.com/en-us/data-center/h100/ (BF16 1,513 TFLOPS with sparsity, half dense)"),
    PeakEntry("NVIDIA H100 NVL", r"h100 nvl", 835.5,
              "https://www.nvidia.com/en-us/data-center/h100/ (BF16 1,671 TFLOPS with sparsity, half dense)"),
    PeakEntry("NVIDIA H100 SXM", r"h100", 989.5,
              "https://www.nvidia.com/en-us/data-center/h100/ (BF16 1,979 TFLOPS with sparsity, half dense)"),
    PeakEntry("NVIDIA H200 NVL", r"h200 nvl", 835.5,
              "https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,671 TFLOPS with sparsity, half dense)"),
    PeakEntry("NVIDIA H200 SXM", r"h200", 989.5,
              "https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,979 TFLOPS with sparsity, half dense)"),
    PeakEntry("NVIDIA B200", r"b200", 2250.0,
              "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: BF16 4.5 PFLOPS per GPU with sparsity, "
              "half dense)"),
)


def lookup_peak(device_kind: str) -> PeakEntry | None:
    """The table entry for a `device.device_kind` string, or None when the kind is not in the table."""
    kind = device_kind.strip().lower()
    for entry in PEAK_TABLE:
        if re.search(entry.kind_pattern, kind):
            return entry
    return None


def measure_matmul_flops(devices: list[jax.Device], dtypes: tuple[str, ...] = ("float32",), *, size: int = 512,
                         chain: int = 4, min_repeats: int = 3, min_seconds: float = 0.3) -> float:
    """Best matmul FLOP/s per device, with every device in `devices` multiplying at once.

    One [size, size] matmul per device per call (a batch sharded over the devices), `chain` dependent calls
    timed together; the best of at least `min_repeats` timings and `min_seconds` of them, so a burst of load from
    other processes does not set the peak; for each dtype, returning the best.
    """
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
    # y <- tanh(y @ x): dependent calls, values kept bounded so bf16 stays finite.
    step = jax.jit(lambda x, y: jnp.tanh(y @ x), out_shardings=sharding)
    shape = (len(devices), size, size)
    best = 0.0
    for dtype in dtypes:
        x = jax.device_put(jnp.full(shape, 1.0 / size, dtype), sharding)
        y = jax.device_put(jnp.ones(shape, dtype), sharding)
        jax.block_until_ready(step(x, y))  # compile
        repeats, spent = 0, 0.0
        while repeats < min_repeats or spent < min_seconds:
            start = time.perf_counter()
            out = y
            for _ in range(chain):
                out = step(x, out)
            jax.block_until_ready(out)
            seconds = time.perf_counter() - start
            best = max(best, 2.0 * size**3 * chain / seconds)
            repeats, spent = repeats + 1, spent + seconds
    return best


def peak_flops_per_device(device: jax.Device, config: Config) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number comes from (see the module doc for the order).

    Call once at start: on CPU and unknown kinds it runs a short benchmark on all local devices of the
    platform (pass any one of them). NaN (MFU then reads NaN) only for an unknown kind with no local device.
    """
    if config.peak_tflops_per_device > 0:
        return config.peak_tflops_per_device * 1e12, f"config peak_tflops_per_device={config.peak_tflops_per_device}"
    entry = lookup_peak(device.device_kind)
    if entry is not None:
        per_device = entry.tflops_per_device
        share = "" if entry.devices_per_chip == 1 else f" (1/{entry.devices_per_chip} of {entry.tflops:g} per chip)"
        return per_device * 1e12, f"{entry.name}, {per_device:g} TFLOP/s per device{share}: {entry.source}"
    if device.platform != "cpu":
        warnings.warn(f"no peak FLOP/s known for device kind '{device.device_kind}'; measuring a matmul instead. "
                      f"Set peak_tflops_per_device=<dense bf16 TFLOP/s of one device> for a trustworthy MFU.",
                      stacklevel=2)
    local = [d for d in jax.local_devices() if d.platform == device.platform]
    if not local:  # e.g. an abstract device of a compile-only topology: nothing to run a benchmark on
        return math.nan, f"unknown: no local {device.platform} device to measure; set peak_tflops_per_device"
    dtypes = tuple(dict.fromkeys(("float32", config.dtype)))
    size = 1024 if len(local) <= 2 else 512  # bigger matmuls run closer to peak; keep the total work small
    flops = measure_matmul_flops(local, dtypes, size=size)
    return flops, (f"measured: best of {'/'.join(dtypes)} {size}x{size} matmuls on {len(local)} {device.platform} "
                   f"device(s) at once, {flops / 1e9:.1f} GFLOP/s each")
