"""Process set-up that must happen before JAX picks its devices: simulated CPU devices and jax.distributed.

`cpu_devices=N` makes JAX use N CPU devices (per process), whatever accelerators the machine has.
Multi-host: TPU pods initialise automatically; elsewhere the coordinator comes from `jax_coordinator_address`
or the environment variable JAX_COORDINATOR_ADDRESS (which JAX itself reads), the process count and id from
`jax_num_processes` / `jax_process_id` or JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

from maxctx.config import Config, ConfigError
from maxctx.parallelism import num_processes


def configure_devices(config: Config) -> None:
    """Must run before the first JAX computation or device query."""
    if config.cpu_devices > 0 or config.hardware == "cpu" or _cpu_only_machine(config):
        jax.config.update("jax_platforms", "cpu")
    if config.cpu_devices > 0:
        if "jax_num_cpu_devices" in jax.config.values:
            jax.config.update("jax_num_cpu_devices", config.cpu_devices)
        else:
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={config.cpu_devices}"
    if config.dtype == "float32":
        # fp32 runs mean exact fp32 matmuls on every backend (TPU and GPU default to bf16 passes for fp32 dots).
        jax.config.update("jax_default_matmul_precision", "highest")


def _cpu_only_machine(config: Config) -> bool:
    """No TPU (no /dev/accel* or /dev/vfio device files), no GPU plugin and no platform chosen: JAX would otherwise
    try libtpu (installed with the test extra) and log its failure to find a TPU before falling back to the CPU."""
    if os.environ.get("JAX_PLATFORMS") or config.compile_topology:
        return False
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return False
    return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                                                          "jax_rocm7_plugin"))


def distributed_settings(config: Config) -> dict | None:
    """Arguments for jax.distributed.initialize, or None for a single-process run."""
    address = config.jax_coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    num = num_processes(config)
    pid = config.jax_process_id if config.jax_process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
    workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if config.cpu_devices == 0 and not address and "," in workers and not any(c.isspace() for c in workers):
        return {}  # a multi-host TPU slice: JAX finds the coordinator and ids by itself
    if not address and num <= 1:
        return None
    if not address or num <= 1 or pid < 0:
        raise ConfigError(f"a multi-process run needs a coordinator address, a process count > 1 and a process id; "
                          f"got jax_coordinator_address='{address}', jax_num_processes={num}, "
                          f"jax_process_id={pid} (set them or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
                          f"JAX_PROCESS_ID)")
    if pid >= num:
        raise ConfigError(f"jax_process_id={pid} must be below jax_num_processes={num}")
    kwargs = {"coordinator_address": address, "num_processes": num, "process_id": pid,
              "heartbeat_timeout_seconds": config.jax_heartbeat_timeout_seconds}
    if config.cpu_devices > 0:
        kwargs["local_device_ids"] = list(range(config.cpu_devices))
    return kwargs


def initialize(config: Config) -> None:
    """Devices, then (for multi-process runs) jax.distributed, with CPU collectives over gloo."""
    configure_devices(config)
    settings = distributed_settings(config)
    if settings is not None:
        if config.cpu_devices > 0 and "jax_cpu_collectives_implementation" in jax.config.values:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**settings)
    check_hardware(config)


def check_hardware(config: Config) -> None:
    """MaxText's `hardware` key: the devices JAX found must be that kind (not checked for an AOT compile, whose
    devices come from compile_topology)."""
    if not config.hardware or config.compile_topology:
        return
    want = "gpu" if config.hardware.startswith("gpu") else config.hardware
    found = jax.devices()[0].platform
    if found != want:
        raise ConfigError(f"hardware={config.hardware}, but JAX found {found} devices; drop hardware or run on "
                          f"{want} (cpu_devices=N gives simulated CPU devices)")


def is_primary() -> bool:
    return jax.process_index() == 0
