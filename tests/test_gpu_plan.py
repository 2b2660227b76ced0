"""GPU clusters in the planner (maxctx.plan.topology's h100-N, h200-N, b200-N; maxctx.plan.hardware): `--plan`
ranks the strategies on NVLink nodes and InfiniBand between them; compiling ahead of time is refused in one line."""

from __future__ import annotations

import pytest

from maxctx.attention.cp.cost import Collective
from maxctx.compile import main as compile_main
from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.plan import hardware, planner, topology

LLAMA = ["configs/base.yml", "model_name=llama3-8b", "max_target_length=131072", "context_parallel_strategy=auto"]


@pytest.mark.parametrize("name,cp,nodes", [("h100-8", 8, 1), ("h200-64", 64, 8), ("b200-16", 16, 2)])
def test_plan_ranks_strategies_on_a_gpu_cluster(capsys, name, cp, nodes):
    args = [*LLAMA, f"compile_topology={name}", f"ici_context_parallelism={cp}", "ici_fsdp_parallelism=-1",
            f"per_device_batch_size={1 / cp}", "--plan"]
    assert compile_main(args) == 0
    out = capsys.readouterr().out
    chip = topology.GPUS[name.split("-")[0]]
    assert f"on {name} ({nodes} x {min(cp, 8)} {chip.name})" in out and "-> marked:" in out
    plan = planner.plan(load_config(args[:-1]))
    assert plan.choice.fits and plan.hardware.hbm_bytes == chip.hbm_bytes and plan.hardware.switch == 8


def test_nvlink_inside_a_node_and_the_nics_across_nodes():
    one, two = (hardware.hardware(load_config([*LLAMA, f"compile_topology={n}"]), None) for n in ("h100-8", "h100-16"))
    gib = 2.0 ** 30
    # an all-to-all of 8 inside a node: each GPU sends 7/8 of its bytes at NVLink's 450 GB/s one way
    inside = hardware._collective_s(Collective("all-to-all", gib, 8), one, 8)
    assert inside == pytest.approx(gib * 7 / 8 / 450e9 + hardware.ICI_LATENCY_S)
    # 16 over two nodes: the same inside each node, then half the bytes over the 50 GB/s NIC
    across = hardware._collective_s(Collective("all-to-all", gib, 16), two, 16)
    assert across == pytest.approx(inside + gib / 2 / 50e9 + hardware.DCN_LATENCY_S)
    assert one.ici_bytes_per_s == 450e9 and two.ici_bytes_per_s == 50e9  # weights' gathers cross the NICs


@pytest.mark.parametrize("name", ["h100-12", "h200-3", "b200-0"])
def test_a_gpu_count_that_is_not_whole_nodes_is_refused(name):
    with pytest.raises(ConfigError, match="whole nodes of 8"):
        topology.parse(name)


def test_compiling_for_a_gpu_cluster_is_refused_in_one_line(capsys):
    assert compile_main([*LLAMA[:-1], "compile_topology=h100-8", "ici_context_parallelism=8",
                         "context_parallel_strategy=p2p"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a GPU cluster" in err[0] and "--plan" in err[0], err
