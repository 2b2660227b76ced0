"""maxctx.compile and plan.topology: TPU topology names, the memory/FLOPs/roofline report, and the real train step
compiled for abstract TPU devices (libtpu, no TPU) in subprocesses that do not force the CPU platform.

Without libtpu the TPU tests skip, naming the reason, or fail when MAXCTX_REQUIRE_LIBTPU=1 (CI sets it).
The four strategies compile a small Llama-shaped model (GQA, 2 layers) on a full v5p-64 mesh, concurrently (one
process each): what they check (every strategy's program compiles for 32 TPU devices with splash, the mesh, the
report's arithmetic) does not depend on the model's size, and a small model compiles in a fraction of the time.
Full-size memory figures come from the compiled programs of benchmarks/fit_table.py (benchmarks/fit_table.md).
"""

from __future__ import annotations

import math

import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.metrics import training_flops_per_device
from maxctx.model.shape import ModelShape
from maxctx.parallelism import MeshPlan
from maxctx.plan import step_time
from maxctx.plan.out_of_memory import fit, xla_out_of_memory
from maxctx.plan.roofline import cp_bytes_per_layer
from maxctx.plan.topology import CHIPS, parse, standard_shape
from tests.support.processes import python, tpu_env
from tests.support.strategies import names as strategy_names
from tests.support.tpu_compile import finish, needs_libtpu, start_compile

GIB = 1024 ** 3
STRATEGIES = tuple(strategy_names())
# llama3-8b's attention layout (GQA, 8 kv heads: one per device under a2a's degree 8) at small width and depth.
SMALL_LLAMA = ("model_name=llama3-8b", "base_num_decoder_layers=2", "base_emb_dim=512", "base_mlp_dim=1024",
               "base_num_query_heads=16", "head_dim=64", "vocab_size=1024", "max_target_length=4096")
SMALL_V5P_64 = ("compile_topology=v5p-64", *SMALL_LLAMA, "ici_context_parallelism=8", "ici_fsdp_parallelism=-1",
                "per_device_batch_size=0.125")


# ---- names and the hardware table (no compile) -----------------------------------------------------------------

@pytest.mark.parametrize("name, libtpu_name, devices", [
    ("v4-8", "v4:2x2x1", 4), ("v4-128", "v4:4x4x4", 64), ("v5p-8", "v5p:2x2x1", 4), ("v5p-64", "v5p:2x4x4", 32),
    ("v5p-128", "v5p:4x4x4", 64), ("v5p-256", "v5p:4x4x8", 128), ("v5e-8", "v5e:2x4", 8),
    ("v5litepod-16", "v5e:4x4", 16), ("v5e-256", "v5e:16x16", 256), ("v6e-1", "v6e:1x1", 1),
    ("v6e-256", "v6e:16x16", 256), ("tpu7x-8", "tpu7x:2x2x1", 8), ("tpu7x-128", "tpu7x:4x4x4", 128),
    ("v5p:4x4x12", "v5p:4x4x12", 192),
])
def test_topology_names(name, libtpu_name, devices):
    topology = parse(name)
    assert topology.libtpu_name == libtpu_name
    assert topology.num_devices == devices


@pytest.mark.parametrize("name", ["v5p-7", "v5p-96", "v5e-512", "v9-8", "h100-12", "v5e:2x2x2", ""])
def test_bad_topology_names_say_what_to_write(name):
    with pytest.raises(ConfigError, match="compile_topology"):
        parse(name)


def test_standard_shapes_double_one_axis_at_a_time():
    assert [standard_shape(2 ** k, 3) for k in range(2, 8)] == [(2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4),
                                                                  (4, 4, 4), (4, 4, 8)]
    assert [standard_shape(2 ** k, 2) for k in range(2, 9)] == [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16),
                                                                  (16, 16)]
    assert standard_shape(48, 3) is None


def test_every_chip_has_a_peak_and_a_source():
    from maxctx.metrics import lookup_peak

    for chip in CHIPS.values():
        entry = lookup_peak(chip.device_kind)
        assert entry is not None and entry.devices_per_chip == chip.devices_per_chip, chip.name
        assert chip.source.startswith("https://") and chip.hbm_bytes > 0 and chip.ici_bytes_per_s > 0


# ---- the report's arithmetic (no compile) ----------------------------------------------------------------------

def test_xla_out_of_memory_message_is_parsed():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (21.83G) "
           "exceeds available HBM (15.75G).")
    out = xla_out_of_memory(msg)
    assert out["xla_required_bytes"] == int(21.83 * GIB) and out["xla_available_bytes"] == int(15.75 * GIB)
    # XLA stopped at the temporaries: the state's shards come on top; its limit is 0.25 GiB under the chip's 16.
    verdict = fit({**out, "argument_bytes_from_shardings": 2 * GIB}, CHIPS["v5e"])
    assert not verdict["fits"]
    assert verdict["headroom_bytes"] == pytest.approx(-(21.83 + 2 - 15.75) * GIB, rel=1e-6)
    out = xla_out_of_memory("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                            "hbm. Used 99.5G of 95.74G hbm. Exceeded hbm capacity by 3.76G.")
    assert not out["xla_required_is_temporaries_only"]
    assert fit(out, CHIPS["v5p"])["headroom_bytes"] == pytest.approx(-(99.5 - 95.74) * GIB, rel=1e-6)
    # On-chip scalar memory (splash's block tables at 1M tokens with 512-token blocks): not an HBM verdict.
    out = xla_out_of_memory("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                            "smem. Used 1.00M of 1.00M smem. Exceeded smem capacity by 1.2K.")
    assert out["xla_memory_space"] == "smem" and "xla_required_bytes" not in out
    assert fit(out, CHIPS["v5p"]) == {"fits": False, "hbm_bytes_per_device": 95 * GIB}


def test_fit_compares_total_bytes_with_device_hbm():
    chip = CHIPS["tpu7x"]  # two devices per chip: each has half the HBM
    assert fit({"total_size_in_bytes": 90 * GIB}, chip) == {"fits": True, "hbm_bytes_per_device": 96 * GIB,
                                                             "headroom_bytes": 6 * GIB}
    assert not fit({"total_size_in_bytes": 97 * GIB}, chip)["fits"]


def test_step_time_terms():
    config = load_config(["configs/base.yml", "model_name=llama3-8b", "max_target_length=32768",
                          "ici_context_parallelism=8", "context_parallel_strategy=p2p", "compile_topology=v5p-64"])
    mesh = {"data": 1, "fsdp": 4, "context": 8, "context_a2a": 1, "tensor": 1}
    hw = step_time.hardware(config, 32)
    est = step_time.estimate(config, MeshPlan.one_slice(mesh), 4, hw)
    flops = training_flops_per_device(config, 4, 32768, 32)
    assert est.model_flops == pytest.approx(flops)
    # full remat: every projection's forward again, and the attention forward (context is not kept)
    assert est.forwards_per_layer == 2
    assert est.matmul_s == pytest.approx(ModelShape.from_config(config).matmul_flops(4096)
                                         / (459e12 * step_time.XLA_MATMUL_EFFICIENCY))
    assert est.recompute_s > est.matmul_s / 3
    assert est.step_s == pytest.approx(est.compute_s + est.exposed_collective_s + est.exposed_host_s)
    report = step_time.report(est, hw, 4 * 32768)
    assert report["estimate_mfu"] == pytest.approx(flops / 459e12 / est.step_s)
    assert 0 < report["estimate_mfu"] < step_time.SPLASH_EFFICIENCY[1024]
    # the compiled program's count replaces the policy's: one forward, no attention recompute
    once = step_time.estimate(config, MeshPlan.one_slice(mesh), 4, hw, forwards_per_layer=1)
    assert once.step_s < est.step_s and once.host_bytes == 0
    # p2p per layer: (C-1) hops of K/V (8 kv heads x 128, bf16) + ids forward; backward adds dK/dV: fp32 over the
    # C-1 hops, and the last shift home in K's dtype (bf16)
    t = 4096
    fwd, bwd = cp_bytes_per_layer(config, mesh, t, 2)
    assert fwd == 7 * (2 * t * 8 * 128 * 2 + 8 * t)
    assert bwd == fwd + 2 * t * 8 * 128 * (7 * 4 + 2)


def test_a2a_moves_all_heads_and_all_gather_only_kv():
    base = ["configs/base.yml", "model_name=llama3-8b", "max_target_length=32768", "ici_context_parallelism=8"]
    mesh = {"data": 1, "fsdp": 4, "context": 1, "context_a2a": 8, "tensor": 1}
    a2a = cp_bytes_per_layer(load_config([*base, "context_parallel_strategy=a2a"]), mesh, 4096, 2)
    mesh = {**mesh, "context": 8, "context_a2a": 1}
    gather = cp_bytes_per_layer(load_config([*base, "context_parallel_strategy=all_gather"]), mesh, 4096, 2)
    assert a2a[1] == pytest.approx(7 / 8 * (2 * 32 + 2 * 8) * 4096 * 128 * 2)
    assert gather[1] == 7 * 2 * 4096 * 8 * 128 * 2


# ---- compiles for abstract TPU devices (subprocesses, libtpu) ---------------------------------------------------

def test_topology_devices_for_every_generation():
    needs_libtpu()
    code = ("from maxctx.plan.topology import parse, topology_devices\n"
            "for name in ['v4-8', 'v5e-8', 'v5p-8', 'v6e-8', 'tpu7x-8']:\n"
            "    t = parse(name); d = topology_devices(t)\n"
            "    print(name, len(d), d[0].device_kind, d[0].platform)\n"
            "d = topology_devices(parse('v5e-8'), num_slices=2)\n"
            "print('slices', len(d), sorted({x.slice_index for x in d}))\n"
            # an ICI mesh JAX cannot lay over the slice's physical axes (128 of 8 x 8 x 8 after fsdp took one 8)
            "from maxctx.config import ConfigError\n"
            "from maxctx.loader import load_config\n"
            "from maxctx.mesh import create_mesh\n"
            "keys = ['configs/base.yml', 'compile_topology=v5p-1024', 'ici_fsdp_parallelism=4',\n"
            "        'ici_context_parallelism=128', 'per_device_batch_size=0.0078125', 'max_target_length=65536']\n"
            "try:\n"
            "    create_mesh(load_config(keys), topology_devices(parse('v5p-1024')))\n"
            "except ConfigError as e:\n"
            "    print('layout', e)\n")
    proc = python("-c", code, env=tpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    kinds = {line[0]: (int(line[1]), " ".join(line[2:-1]), line[-1]) for line in lines[:-2]}
    for name, (count, kind, platform) in kinds.items():
        topology = parse(name)
        assert count == topology.num_devices and kind == topology.chip.device_kind and platform == "tpu", name
    assert lines[-2] == ["slices", "16", "[0,", "1]"]
    assert " ".join(lines[-1]).startswith(
        "layout the ICI mesh (fsdp 4 x context 128) cannot be laid over this slice's physical axes (8 x 8 x 8): JAX "
        "gives each mesh axis whole physical axes, so each ici_*_parallelism above 1 must be one of 8, 64, 512")
    # libtpu's start-up on a host without a TPU logs nothing (it was E0000 INVALID_ARGUMENT lines about
    # TPU_WORKER_HOSTNAMES and a metadata-server warning before every compile; topology_devices sets them)
    assert "INVALID_ARGUMENT" not in proc.stderr and "host bounds" not in proc.stderr, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def small_v5p_64():
    """Every registered CP strategy's compile, started together (one process each) so they overlap on many cores."""
    needs_libtpu()
    procs = {s: start_compile(*SMALL_V5P_64, f"context_parallel_strategy={s}") for s in STRATEGIES}
    return {s: finish(p, timeout=1800) for s, p in procs.items()}


def test_tiny_model_compiles_for_v5e_8():
    needs_libtpu()
    rc, out, report = finish(start_compile("compile_topology=v5e-8", "per_device_batch_size=1"), timeout=600)
    assert rc == 0, out
    assert report["platform"] == "tpu" and report["device_kind"] == "TPU v5 lite" and report["num_devices"] == 8
    assert report["attention"] == "splash" and report["fits"]
    assert 0 < report["total_size_in_bytes"] < report["hbm_bytes_per_device"]
    assert report["headroom_bytes"] == report["hbm_bytes_per_device"] - report["total_size_in_bytes"]
    assert "FITS in 16.00 GiB HBM per chip" in out
    assert math.isfinite(report["estimate_mfu"]) and "step-time ESTIMATE" in out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_compiles_for_v5p_64(small_v5p_64, strategy):
    rc, out, report = small_v5p_64[strategy]
    assert rc == 0, out
    assert report["num_devices"] == 32 and report["mesh"]["fsdp"] == 4
    assert report["context_parallel_strategy"] == strategy
    assert report["mesh"]["context"] * report["mesh"]["context_a2a"] == 8
    # Parameters + AdamW moments (fp32), sharded over all 32 devices, are part of the arguments.
    assert report["argument_size_in_bytes"] >= 12 * report["num_params"] / 32
    assert report["fits"] and 0 < report["total_size_in_bytes"] < 95 * GIB
    assert report["analytic_flops_per_device"] == pytest.approx(
        training_flops_per_device(load_config(["configs/base.yml", *SMALL_LLAMA]), 4, 4096, 32))
    assert f"{report['total_size_in_bytes'] / GIB:.2f} GiB" in out
    print(f"\n{strategy}: {report['total_size_in_bytes'] / GIB:.2f} GiB per chip of 95, compiled in "
          f"{report['compile_time_s']:.0f} s")
