"""Peak FLOP/s: table lookups for jax's device_kind strings, the config override, unknown kinds.
(The CPU measurement is checked with the MFU test in test_metrics_flops.py.)"""

import dataclasses
import math
import warnings

import pytest

from maxctx.config import Config
from maxctx.metrics import PEAK_TABLE, lookup_peak, peak_flops_per_device

# device_kind strings as jax reports them (TPU ones checked with jax.experimental.topologies and libtpu).
KINDS = {
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v5p": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0, "TPU7x": 2307.0, "TPU v7x": 2307.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA H100 80GB HBM3": 989.5, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.5, "NVIDIA H200 NVL": 835.5, "NVIDIA B200": 2250.0,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_table_matches_device_kinds(kind):
    entry = lookup_peak(kind)
    assert entry is not None and entry.tflops == KINDS[kind]


def test_every_entry_cites_a_source():
    for entry in PEAK_TABLE:
        assert entry.source.startswith("https://"), entry.name
    assert lookup_peak("TPU v3") is None and lookup_peak("cpu") is None


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


def test_config_value_wins_and_known_kinds_use_the_table():
    flops, source = peak_flops_per_device(FakeDevice("NVIDIA H100 80GB HBM3"), Config())
    assert flops == 989.5e12 and "h100" in source.lower() and "nvidia.com" in source
    flops, source = peak_flops_per_device(FakeDevice("NVIDIA H100 80GB HBM3"), Config(peak_tflops_per_device=700))
    assert flops == 700e12 and "config" in source


def test_half_chip_devices_get_half_the_chip_peak():
    # TPU7x shows each TensorCore as a JAX device: MFU per device is against half the chip's 2307 TFLOP/s.
    flops, source = peak_flops_per_device(FakeDevice("TPU7x", "tpu"), Config())
    assert flops == 1153.5e12 and "1/2 of 2307" in source
    assert lookup_peak("TPU v5p").tflops_per_device == 459.0  # megacore: one device per chip


def test_unknown_kind_warns_and_uses_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flops, source = peak_flops_per_device(FakeDevice("Mystery Accelerator 9000"), Config(peak_tflops_per_device=5))
    assert flops == 5e12 and "config" in source
    # Not in the table, no config value, and no such local device to measure: warns, MFU reads NaN.
    with pytest.warns(UserWarning, match="peak_tflops_per_device"):
        flops, source = peak_flops_per_device(FakeDevice("Mystery Accelerator 9000"), Config())
    assert math.isnan(flops) and "peak_tflops_per_device" in source
