"""TPU topologies for ahead-of-time compilation: user-facing names -> abstract devices, and per-chip hardware;
GPU clusters for the planner.

Names (Google's accelerator types): `v4-N`, `v5p-N` and `tpu7x-N` count TensorCores (two per chip, so N/2 chips;
v4-8 and v5p-8 are 2x2x1 chips), `v5e-N` (alias `v5litepod-N`) and `v6e-N` count chips (one TensorCore each).
Power-of-two sizes get Google's standard slice shapes; any other shape is spelled the way libtpu names it, e.g.
`v5p:4x4x12` (chips, x by y by z). `jax.experimental.topologies.get_topology_desc` turns the shape into compile-only
devices, so the real step compiles for a pod on a machine that has libtpu and no TPU.

What one JAX device is: v4 and v5p run in megacore mode (one device per chip, both TensorCores); TPU7x exposes each
TensorCore as a device (two per chip, each with half the chip's HBM); v5e and v6e chips have one TensorCore.
Peak FLOP/s come from maxctx.metrics.peaks (not repeated here); HBM and ICI figures below cite Google's pages.

GPU clusters (`h100-N`, `h200-N`, `b200-N`: N GPUs, 1, 2, 4 or 8 in one node, else whole nodes of 8) are priced by
the planner and the time model (`--plan`) but not compiled ahead of time (that needs libtpu): 8 GPUs per node
behind one NVLink switch (every GPU reaches every other at its full NVLink bandwidth: `Chip.switch`), nodes joined
by one 400 Gb/s InfiniBand / RoCE NIC per GPU (DGX/HGX H100, H200, B200). Figures cite NVIDIA's pages.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import re

from maxctx.config import Config, ConfigError
from maxctx.parallelism import num_processes, num_slices


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation. Bandwidths in bytes/s, capacity in bytes, all per chip."""

    name: str
    libtpu_prefix: str  # the generation in libtpu topology names, e.g. 'v5p' in 'v5p:4x4x4'
    device_kind: str  # jax Device.device_kind of its devices
    dims: int  # 2 (2D torus) or 3 (3D torus)
    counts_cores: bool  # True: the N in '<gen>-N' counts TensorCores (2 per chip); False: chips
    devices_per_chip: int
    megacore: bool  # libtpu chip_config_name 'megacore' (one device for both TensorCores)
    hbm_bytes: int
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # bidirectional, all ICI links of one chip together
    source: str
    dcn_bytes_per_s: float = 0.0  # one direction, per chip, when Google's page gives it (0: the planner's default)
    # maxctx's default scoped VMEM limit for kernels (tpu_scoped_vmem_limit_kib=-1); 0: libtpu's own default
    scoped_vmem_kib: int = 0
    # host DRAM per chip: the TPU VM's memory / its chips (GB = 1e9 bytes, the lower reading); 0: no sourced figure
    host_bytes: int = 0
    # GPUs: the devices behind one NVLink switch (a node); 0 for a TPU (a torus of ICI links). A GPU's
    # ici_bytes_per_s is its NVLink bandwidth, both directions together, and dcn_bytes_per_s its NIC's, one way.
    switch: int = 0
    # Transcendentals (exp) per second per chip, as libtpu's cost model prices them (EUP_SOURCE); 0: not priced
    transcendentals_per_s: float = 0.0
    # Whole copies XLA makes of the stacked layer inputs kept in HBM before the backward reads them (see CHIPS)
    stack_relayouts: int = 0

    @property
    def dcn_bytes_per_s_or_default(self) -> float:
        return self.dcn_bytes_per_s or DCN_DEFAULT_BYTES_PER_S

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes // self.devices_per_chip


GIB = 1024 ** 3
# Where Chip.transcendentals_per_s comes from: libtpu's own cost model, compiled.cost_analysis()['optimal_seconds']
# of a chain of 512 elementwise exps on a [1024, 1024] fp32 array for one device of the generation (VMEM-resident,
# so neither HBM nor the MXU bounds it; benchmarks/step_time_model.py --eup compiles it), times the devices per chip.
# Per TensorCore every generation prices one (8, 128) vreg of exps per cycle at roughly its clock (v5e 1.5 GHz,
# v6e 1.75 GHz: 1024 per cycle; v4 512 per cycle at 1.05 GHz); the vector unit is 8 x 128 on all of them
# (jax.experimental.pallas.tpu's TpuInfo), while the MXUs grew from four 128 x 128 to 256 x 256 arrays.
EUP_SOURCE = "libtpu 0.0.42.1 cost model (benchmarks/step_time_model.py --eup), compiled 2026-12-06"
# DCN bandwidth per chip, one direction, where Google's page gives none (v4, v6e, tpu7x): an assumption, 100 Gb/s.
DCN_DEFAULT_BYTES_PER_S = 12.5e9
# Where Chip.stack_relayouts comes from: the dump (XLA_FLAGS=--xla_dump_to) of one compile per generation of the
# same program, llama3.1-8b-hd256 with 4 layers, 32,768 tokens per device, usp 4x2, remat_policy=custom
# decoder_layer_input=device context=offload (docs/choosing_a_strategy.md has the command). The forward scan writes
# the layer inputs' stack bf16[4, 1, 32768, 4096] in the layout {3,2,1,0}. On v6e and TPU7x the backward's first
# (peeled) iteration reads it with the sequence minor ({2,3,1,0}): XLA copies the whole stack into that layout
# before the loop, which holds the original too, so both are live at the top layer's backward (TPU7x at 16,777,216
# tokens, usp 32x4: two 32 GiB stacks at the program's peak); on v5p it reads {3,2,1,0}, no copy. Under
# remat_policy=full (the same shapes, 1024-token splash blocks) neither v6e nor TPU7x copies it. v4 and v5e were
# not compiled (0, as v5p: their MXUs are v5p's 128 x 128, v6e's and TPU7x's 256 x 256).
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", "v4", "TPU v4", 3, True, 1, True, 32 * GIB, 1200e9, 540e9,
               "https://cloud.google.com/tpu/docs/v4 (32 GiB, 1200 GBps HBM2); ICI: 6 links x 45 GB/s each way, "
               "https://jax-ml.github.io/scaling-book/tpus/; host memory of ct4p-hightpu-4t VMs: no figure found on "
               "Google's pages (host_bytes 0 = unknown)", transcendentals_per_s=1.0755e12),
    "v5e": Chip("TPU v5e", "v5e", "TPU v5 lite", 2, False, 1, False, 16 * GIB, 819e9, 400e9,
                "https://cloud.google.com/tpu/docs/v5e (16 GB, 819 GBps HBM2; 400 GBps bidirectional ICI; DCN: "
                "2 x 100 Gbps NICs per host of 8 chips, 25 Gbps per chip); host: ct5lp-hightpu-4t is 4 chips and "
                "192 GB (https://cloud.google.com/kubernetes-engine/docs/concepts/tpus#v5e)", 25e9 / 8,
                host_bytes=192 * 10**9 // 4, transcendentals_per_s=1.536e12),
    "v5p": Chip("TPU v5p", "v5p", "TPU v5", 3, True, 1, True, 95 * GIB, 2765e9, 1200e9,
                "https://cloud.google.com/tpu/docs/v5p (95 GiB, 2765 GBps HBM2e; 1200 GBps bidirectional ICI; DCN "
                "50 Gbps per chip); scoped VMEM: MaxText's v5p recipes' --xla_tpu_scoped_vmem_limit_kib=65472, the "
                "63.94M of VMEM libtpu reports; host: a ct5p-hightpu-4t VM is 4 chips and 448 GB RAM, "
                "https://cloud.google.com/tpu/docs/v5p and https://cloud.google.com/tpu/docs/tpu7x (4-chip VM table)",
                50e9 / 8, scoped_vmem_kib=65472, host_bytes=448 * 10**9 // 4, transcendentals_per_s=3.072e12),
    "v6e": Chip("TPU v6e", "v6e", "TPU v6 lite", 2, False, 1, False, 32 * GIB, 1640e9, 800e9,
                "https://cloud.google.com/tpu/docs/v6e (32 GB, 1640 GBps HBM; 800 GBps bidirectional ICI); host: "
                "ct6e-standard-4t is 4 chips and 720 GB RAM (https://cloud.google.com/tpu/docs/tpu7x 4-chip VM table; "
                "v6e page: 1536 GiB DRAM per 8-chip host)", host_bytes=720 * 10**9 // 4,
                transcendentals_per_s=1.792e12, stack_relayouts=1),
    "tpu7x": Chip("TPU7x (Ironwood)", "tpu7x", "TPU7x", 3, True, 2, False, 192 * GIB, 7380e9, 1200e9,
                  "https://cloud.google.com/tpu/docs/tpu7x (192 GiB, 7380 GBps HBM; 1200 GBps bidirectional ICI); "
                  "scoped VMEM: the 64.00M of VMEM per TensorCore libtpu 0.0.42.1 reports (docs/long_context.md; "
                  "its own limit is 32 MiB; 65472 KiB as on v5p); host: a 4-chip tpu7x VM has 960 GB RAM "
                  "(https://cloud.google.com/tpu/docs/tpu7x)", scoped_vmem_kib=65472, host_bytes=960 * 10**9 // 4,
                  transcendentals_per_s=2 * 1.9456e12, stack_relayouts=1),
}
ALIASES = {"v5litepod": "v5e", "v5": "v5p", "v7x": "tpu7x"}
_NIC = 400e9 / 8  # one ConnectX-7 400 Gb/s NIC per GPU in DGX H100 / H200 / B200, one way
GPUS: dict[str, Chip] = {
    "h100": Chip("NVIDIA H100 SXM", "h100", "NVIDIA H100 80GB HBM3", 1, False, 1, False, 80 * 10**9, 3.35e12, 900e9,
                 "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB, 3.35 TB/s HBM3, NVLink 900 GB/s); "
                 "DGX H100: 8 GPUs, 2 TB system memory, 8 x 400 Gb/s ConnectX-7 "
                 "(https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html)", _NIC,
                 host_bytes=2 * 10**12 // 8, switch=8),
    "h200": Chip("NVIDIA H200 SXM", "h200", "NVIDIA H200", 1, False, 1, False, 141 * 10**9, 4.8e12, 900e9,
                 "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB, 4.8 TB/s HBM3e, NVLink 900 GB/s); "
                 "DGX H200: 2 TB system memory, 8 x 400 Gb/s NICs as DGX H100", _NIC,
                 host_bytes=2 * 10**12 // 8, switch=8),
    "b200": Chip("NVIDIA B200", "b200", "NVIDIA B200", 1, False, 1, False, 180 * 10**9, 8e12, 1.8e12,
                 "https://www.nvidia.com/en-us/data-center/dgx-b200/ (DGX B200: 8 GPUs, 1,440 GB HBM3e at 64 TB/s "
                 "in all, NVLink 5 1.8 TB/s per GPU, 4 TB system memory, 8 x 400 Gb/s ConnectX-7)", _NIC,
                 host_bytes=4 * 10**12 // 8, switch=8),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as the user gave it
    chip: Chip
    shape: tuple[int, ...]  # chips per dimension

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def num_devices(self) -> int:
        return self.num_chips * self.chip.devices_per_chip

    @property
    def accelerator_type(self) -> str:
        """Cloud TPU's name of the slice ('v5p-128': TensorCores for v4/v5p, chips otherwise)."""
        count = self.num_chips * (2 if self.chip.counts_cores else 1)
        return f"{'v5litepod' if self.chip.libtpu_prefix == 'v5e' else self.chip.libtpu_prefix}-{count}"

    @property
    def libtpu_name(self) -> str:
        return f"{self.chip.libtpu_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Torus wrap-around links: 3D slices of whole 4x4x4 cubes, and full 16-chip rows of 2D pods."""
        if self.chip.dims == 3:
            return (all(d % 4 == 0 for d in self.shape),) * 3
        return (*(d == 16 for d in self.shape), False)


def standard_shape(num_chips: int, dims: int) -> tuple[int, ...] | None:
    """Google's slice shape for a power-of-two chip count: 3D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
    (doubling z, y, x in turn); 2D 2x2, 2x4, 4x4, 4x8, ..., 16x16 (doubling y, x in turn). None otherwise."""
    if num_chips < 1 or num_chips & (num_chips - 1):
        return None
    if num_chips == 1:
        return (1,) * dims
    if num_chips == 2:
        return (1, 2) if dims == 2 else (1, 2, 1)
    if num_chips == 4:
        return (2, 2) if dims == 2 else (2, 2, 1)
    shape = [2, 2] if dims == 2 else [2, 2, 2]
    axis = len(shape) - 1
    while math.prod(shape) < num_chips:
        shape[axis] *= 2
        axis = axis - 1 if axis > 0 else len(shape) - 1
    if dims == 2 and max(shape) > 16:
        return None  # a v5e / v6e pod is 16x16
    return tuple(shape)


def parse(name: str) -> Topology:
    """'v5p-128' (accelerator type) or 'v5p:4x4x4' (libtpu shape) -> Topology, or a GPU cluster 'h100-64' (module
    doc); ConfigError naming the fix."""
    key = f"compile_topology='{name}'"
    choices = ", ".join(f"{g}-N" for g in (*CHIPS, *GPUS))
    if (m := re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())) and m[1] in GPUS:
        return _gpu_cluster(name, GPUS[m[1]], int(m[2]))
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", name.strip().lower()):
        gen, shape = ALIASES.get(m[1], m[1]), tuple(int(d) for d in m[2].split("x"))
        if gen not in CHIPS:
            raise ConfigError(f"{key}: unknown TPU generation '{m[1]}'; use one of {', '.join(CHIPS)}")
        chip = CHIPS[gen]
        if len(shape) != chip.dims or min(shape) < 1:
            raise ConfigError(f"{key}: {chip.name} slices have {chip.dims} dimensions, e.g. "
                              f"{gen}:{'x'.join(['2'] * chip.dims)}")
        return Topology(name, chip, shape)
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    if not m or ALIASES.get(m[1], m[1]) not in CHIPS:
        raise ConfigError(f"{key} is not a TPU topology; use {choices} (e.g. v5p-128, v6e-256) or a libtpu shape "
                          f"such as v5p:4x4x8")
    chip = CHIPS[ALIASES.get(m[1], m[1])]
    n = int(m[2])
    if chip.counts_cores and n % 2:
        raise ConfigError(f"{key}: the number in {m[1]}-N counts TensorCores (two per chip), so it must be even")
    chips = n // 2 if chip.counts_cores else n
    shape = standard_shape(chips, chip.dims)
    if shape is None:
        raise ConfigError(f"{key}: {chips} chips is not a standard {chip.name} slice; give the shape instead, e.g. "
                          f"{chip.libtpu_prefix}:{'x'.join(['4'] * chip.dims)}")
    return Topology(name, chip, shape)


def _gpu_cluster(name: str, chip: Chip, gpus: int) -> Topology:
    """N GPUs: nodes of `chip.switch`, or a power-of-two part of one node; shape (GPUs per node, nodes)."""
    per_node = chip.switch
    if gpus < 1 or (gpus < per_node and per_node % gpus) or (gpus > per_node and gpus % per_node):
        raise ConfigError(f"compile_topology='{name}': {gpus} {chip.name} GPUs is not 1, 2, 4 or {per_node} in one "
                          f"node, or whole nodes of {per_node} (e.g. {chip.libtpu_prefix}-{per_node}, "
                          f"{chip.libtpu_prefix}-{4 * per_node})")
    return Topology(name, chip, (min(gpus, per_node), max(1, gpus // per_node)))


def require_compilable(topology: Topology) -> None:
    """Ahead-of-time compilation is for TPU topologies (libtpu); a GPU cluster is priced by --plan only."""
    if topology.chip.switch:
        raise ConfigError(f"compile_topology='{topology.name}' is a GPU cluster: `python -m maxctx.compile ... --plan` "
                          f"prices it, but compiling ahead of time needs a TPU topology; compile on the GPU nodes "
                          f"themselves (without compile_topology)")


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        import jax

        raise ConfigError(f"compile_topology needs libtpu to compile for TPU without one; install it with "
                          f"pip install 'jax[tpu]=={jax.__version__}'")


def topology_devices(topology: Topology, num_slices: int = 1) -> list:
    """Compile-only devices of `num_slices` slices of `topology` (no TPU needed, only libtpu)."""
    require_compilable(topology)
    require_libtpu()
    # Compile-only use of libtpu: another process on this machine may hold libtpu's lock file (e.g. a JAX
    # program that probed for a TPU); the lock only guards a real chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
        # No TPU here: without these, libtpu's start-up asks the TPU VM's metadata server and logs E0000
        # INVALID_ARGUMENT lines about TPU_WORKER_HOSTNAMES before a compile that then succeeds. They only describe
        # this host, not the slice compiled for (that is get_topology_desc's), so a real TPU VM's are left alone.
        for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", topology.accelerator_type),
                           ("TPU_WORKER_HOSTNAMES", "localhost")):
            os.environ.setdefault(key, value)
    from jax.experimental.topologies import get_topology_desc

    chip = topology.chip
    host = tuple(min(b, d) for b, d in zip((2, 2, 1), (*topology.shape, 1, 1)))
    devices = get_topology_desc(topology.libtpu_name, "tpu", chip_config_name="megacore" if chip.megacore else
                                "default", chips_per_host_bounds=host, num_slices=num_slices,
                                wrap=topology.wrap).devices
    expected = topology.num_devices * num_slices
    if len(devices) != expected:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {topology.libtpu_name} x {num_slices} slices, "
                           f"expected {expected}")
    return list(devices)


def num_devices(config: Config) -> int | None:
    """Devices the config says it runs on before JAX starts, or None when only JAX can tell."""
    if config.cpu_devices:
        return config.cpu_devices * max(1, num_processes(config))
    if config.compile_topology:
        return parse(config.compile_topology).num_devices * num_slices(config)
    return None
