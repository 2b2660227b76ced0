"""Process set-up that must happen before JAX picks its devices: simulated CPU devices and jax.distributed.

`cpu_devices=N` makes JAX use N CPU devices (per process), whatever accelerators the machine has.
Multi-host: TPU pods initialise automatically; elsewhere the coordinator comes from `jax_coordinator_address`
or the environment variable JAX_COORDINATOR_ADDRESS (which JAX itself reads), the process count and id from
`jax_num_processes` / `jax_process_id` or JAX_NUM_PROCESSES / JAX_PROCESS_ID.

Peers that never arrive. `jax.distributed.initialize` waits for every process to register with the coordinator,
and when its deadline passes XLA aborts the process with a fatal log (exit 134). A watchdog thread ends the wait
first, after `jax_distributed_initialization_timeout` seconds (JAX's own deadline is set later than that), with one
line naming the coordinator and the missing process ids, and exit status 2. A process other than 0 probes the
coordinator's port meanwhile, so it can tell "process 0 is not there" from "some other process is missing".

A process that dies later: every other process says which one and how to resume in one line before JAX aborts
it (`watch_peers`, maxctx.peers).

Once JAX knows the devices, the config's device checks (maxctx.validate.check_devices) run for their count, unless
loading already ran them for that count (cpu_devices, or compile_topology whose devices are not these).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import socket
import sys
import threading
import time

import jax

from maxctx.config import Config, ConfigError
from maxctx.parallelism import num_processes
from maxctx.peers import PeerLink
from maxctx.plan.topology import num_devices
from maxctx.validate import check_devices


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
    cluster = None if address or num > 1 else detect_cluster()
    if cluster is not None:
        if config.cpu_devices == 0:
            return {}  # a GKE TPU pod or SLURM GPU job: JAX's own detection, as below, at initialize
        address, num, pid = cluster["coordinator_address"], cluster["num_processes"], cluster["process_id"]
        print(f"cluster: {cluster['name']}: process {pid} of {num}, slice {cluster['slice_id']} of "
              f"{cluster['num_slices']}, coordinator {address}", flush=True)
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
              "heartbeat_timeout_seconds": config.jax_heartbeat_timeout_seconds,
              # JAX's deadline aborts the process; the watchdog (PeerWatchdog) reports and exits 2 before it.
              "initialization_timeout": config.jax_distributed_initialization_timeout + _JAX_DEADLINE_MARGIN_S}
    if config.cpu_devices > 0:
        kwargs["local_device_ids"] = list(range(config.cpu_devices))
    return kwargs


def detect_cluster() -> dict | None:
    """The job's processes as JAX's own cluster detection reads them (jax._src.clusters), for the environments
    maxctx launches on: a GKE TPU pod (TPU_WORKER_ID and TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES set by GKE's
    TPU webhook; MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and MEGASCALE_COORDINATOR_ADDRESS set by the JobSet for
    multi-slice) or a SLURM step (SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_STEP_NODELIST). None elsewhere,
    or for one process. On TPUs and GPUs JAX itself then initialises from the same variables; with simulated CPU
    devices (JAX detects no cluster there) maxctx passes these values, so a CPU job sees what a pod would.
    A port in MEGASCALE_COORDINATOR_ADDRESS (host:port) is kept; otherwise JAX's default port is used."""
    from jax._src.clusters.cloud_tpu_cluster import GkeTpuCluster
    from jax._src.clusters.slurm_cluster import SlurmCluster

    if os.environ.get("TPU_WORKER_ID") is not None and GkeTpuCluster._get_worker_host_names_env_var() is not None:
        name, cls = "GKE TPU pod", GkeTpuCluster
        given = os.environ.get("MEGASCALE_COORDINATOR_ADDRESS", "")
        port = given.rpartition(":")[2] if ":" in given else None
        slices, slice_id = GkeTpuCluster._get_num_slices(), GkeTpuCluster._get_slice_id()
    elif SlurmCluster.is_env_present():
        name, cls, port, slices, slice_id = "SLURM", SlurmCluster, None, 1, 0
    else:
        return None
    count = cls.get_process_count()
    if count <= 1:
        return None
    return {"name": name, "coordinator_address": cls.get_coordinator_address(60, port), "num_processes": count,
            "process_id": cls.get_process_id(), "num_slices": slices, "slice_id": slice_id}


def initialize(config: Config) -> None:
    """Devices, then (for multi-process runs) jax.distributed, with CPU collectives over gloo; then the checks that
    need the device count, for a count the config did not state."""
    configure_devices(config)
    settings = distributed_settings(config)
    if settings is not None:
        if config.cpu_devices > 0 and "jax_cpu_collectives_implementation" in jax.config.values:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        watchdog = PeerWatchdog(settings, config.jax_distributed_initialization_timeout) if settings else None
        jax.distributed.initialize(**settings)
        if watchdog is not None:
            watchdog.cancel()
    check_hardware(config)
    if not config.compile_topology and num_devices(config) != jax.device_count():
        check_devices(config, jax.device_count())


def watch_peers(config: Config, command: str) -> contextlib.AbstractContextManager:
    """Around training in a multi-process run: this process's watcher (maxctx.peers), which prints one line should
    another process die; `command` resumes the run. Nothing for one process, or without the coordination
    service's key-value store; a watcher that cannot start is reported and training goes on without it."""
    from jax._src import distributed  # global_state: the coordinator's client and address (getattr: private API)

    state = getattr(distributed, "global_state", None)
    client = getattr(state, "client", None)
    if jax.process_count() == 1 or client is None:
        return contextlib.nullcontext()
    host = (getattr(state, "coordinator_address", None) or "").rpartition(":")[0].strip("[]")
    local = (config.local_checkpoint_dir(jax.process_index(), jax.process_count())
             if config.enable_checkpointing and config.enable_emergency_checkpoint else "")  # its steps count too
    try:
        return PeerLink(jax.process_index(), jax.process_count(),
                        config.checkpoint_dir if config.enable_checkpointing else "", command,
                        publish=client.key_value_set, lookup=lambda key: client.blocking_key_value_get(key, 120_000),
                        hub_host=host, local_dir=local)
    except (OSError, ValueError, jax.errors.JaxRuntimeError) as e:
        print(f"warning: no peer watcher ({type(e).__name__}: {e}); should a process die, the others end with "
              f"JAX's own errors", file=sys.stderr, flush=True)
        return contextlib.nullcontext()


_JAX_DEADLINE_MARGIN_S = 60


class PeerWatchdog:
    """Ends a jax.distributed.initialize that waits longer than `timeout_s` for its peers: one line on stderr,
    exit 2 (see the module docstring)."""

    def __init__(self, settings: dict, timeout_s: int):
        self.address, self.timeout_s = settings["coordinator_address"], timeout_s
        self.num, self.pid = settings["num_processes"], settings["process_id"]
        self.reached_coordinator = self.pid == 0
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="peer_watchdog", daemon=True).start()

    def cancel(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        host, _, port = self.address.rpartition(":")
        while not self._done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self.reached_coordinator:
                try:
                    socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
                    self.reached_coordinator = True
                except (OSError, ValueError):
                    pass
            if time.monotonic() >= deadline:
                print(f"launch error: {self.message()}", file=sys.stderr, flush=True)
                os._exit(2)

    def message(self) -> str:
        others = [i for i in range(self.num) if i not in (0, self.pid)]
        if not self.reached_coordinator:
            missing = "0"
            why = f"could not reach the coordinator {self.address} (process 0's address) in {self.timeout_s} s"
        else:
            missing = (str(others[0]) if len(others) == 1 else
                       f"one or more of {others[0]}-{others[-1]}" if others == list(range(others[0], others[-1] + 1))
                       else f"one or more of {', '.join(map(str, others))}")
            where = "hosted by this process" if self.pid == 0 else "reached"
            why = f"waited {self.timeout_s} s at the coordinator {self.address} ({where}) for the other processes"
        return (f"jax.distributed: process {self.pid} of {self.num} {why}; missing process id {missing}; start "
                f"every process with JAX_COORDINATOR_ADDRESS={self.address} JAX_NUM_PROCESSES={self.num} and its own "
                f"JAX_PROCESS_ID (or raise jax_distributed_initialization_timeout)")


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
