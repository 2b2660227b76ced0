"""maxctx.plan.planner (context_parallel_strategy=auto): its attention memory against the compiled program on 8 CPU
devices, what auto resolves to, the ranking, and the candidates it drops (with the rule's message)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import AttentionShape, Collective
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.config import ConfigError
from maxctx.loader import load, load_config, parse_config
from maxctx.plan import memory, planner, remat, step_time
from tests.support.meshes import FAST_COMPILE, make_mesh

SMALL = ["configs/base.yml", "cpu_devices=8", "ici_context_parallelism=8", "ici_fsdp_parallelism=1",
         "per_device_batch_size=0.125", "max_target_length=4096", "base_num_query_heads=8", "base_num_kv_heads=2",
         "head_dim=64", "base_emb_dim=512", "dtype=bfloat16", "attention=flash"]


def compiled_saved_bytes(strategy: str, ring: int, a2a: int, seq: int, heads: int, kv_heads: int, dim: int) -> int:
    """Per device bytes one attention layer keeps for its backward: the residuals of jax.vjp, as the outputs of
    a compiled program (memory_analysis), bf16, one sequence."""
    mesh = make_mesh(ring, a2a)
    spec = AttentionSpec(kernel="flash", strategy=strategy, block_q=512, block_kv=512)
    ids = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    acts = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a"), "tensor", None))
    sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16, sharding=acts)
    args = [sd((1, seq, heads, dim)), sd((1, seq, kv_heads, dim)), sd((1, seq, kv_heads, dim)),
            jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=ids),
            jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=ids)]

    def residuals(q, k, v, pos, seg):
        return jax.vjp(lambda q, k, v: attend(q, k, v, pos, seg, spec, mesh), q, k, v)[1]

    return jax.jit(residuals).lower(*args).compile(FAST_COMPILE).memory_analysis().output_size_in_bytes


def test_attention_memory_estimate_matches_the_compiled_program():
    config = load_config(SMALL + ["context_parallel_strategy=auto"])
    plan = planner.plan(config)
    valid = [c for c in plan.ranked if not c.dropped]
    assert {c.label for c in valid} == {"all_gather", "p2p", "a2a", "usp 4x2", "usp 2x4"}
    for c in valid:
        got = compiled_saved_bytes(c.strategy, c.cp // c.a2a, c.a2a, 4096, 8, 2, 64)
        assert abs(c.saved_bytes - got) <= 0.15 * got, f"{c.label}: estimate {c.saved_bytes:.0f}, compiled {got}"
        assert c.attention_bytes >= c.saved_bytes


def test_auto_resolves_to_a_valid_strategy_and_the_table_ranks():
    config, plan = load(SMALL + ["context_parallel_strategy=auto"])  # the planner's table comes with the config
    assert plan is not None and config.context_parallel_strategy in strategies.STRATEGIES
    best = plan.choice
    assert (best.strategy, best.a2a if best.strategy == "usp" else 0) == (config.context_parallel_strategy,
                                                                          config.context_parallel_a2a_degree)
    fitting = [c for c in plan.ranked if c.fits]
    assert fitting[0] is best and best.step_s <= min(c.step_s for c in fitting) * (1 + planner.TIE)
    assert [c.step_s for c in fitting[1:]] == sorted(c.step_s for c in fitting[1:])
    assert all(c.dropped for c in plan.ranked[len(fitting):])
    # a hand-written config keeps its strategy and no table
    assert load(SMALL + ["context_parallel_strategy=p2p"]).plan is None


def test_invalid_candidates_are_dropped_with_the_rule():
    plan = planner.plan(load_config(SMALL + ["base_num_query_heads=6", "base_num_kv_heads=2",
                                             "context_parallel_strategy=auto"]))
    dropped = {c.label: c.dropped for c in plan.ranked if c.dropped}
    assert "not divisible by the A2A degree 8" in dropped["a2a"]
    assert "not divisible by the A2A degree 4" in dropped["usp 2x4"]
    assert "usp 4x2" not in dropped and plan.choice.label not in dropped
    assert plan.ranked[-2:] == tuple(c for c in plan.ranked if c.label in ("a2a", "usp 2x4"))


def test_across_slices_only_ring_traffic_crosses_dcn():
    # 2 slices of v5p-8 (C = 4 x 2): the all-to-all must stay in a slice, so a2a (U = C = 8) is dropped and usp
    # keeps U | 4; p2p's ring now waits for DCN on every hop, the same ring on one v5p-16 slice does not.
    common = ["configs/base.yml", "model_name=llama3-8b", "max_target_length=131072", "ici_fsdp_parallelism=1",
              "per_device_batch_size=0.125", "context_parallel_strategy=auto", "attention=splash"]
    config = load_config(common + ["compile_topology=v5p-8", "compile_topology_num_slices=2",
                                   "ici_context_parallelism=4", "dcn_context_parallelism=2", "dcn_data_parallelism=1"])
    plan = planner.plan(config)
    by = {c.label: c for c in plan.ranked}
    assert "all-to-all runs inside a slice" in by["a2a"].dropped
    assert {c.label for c in plan.ranked if not c.dropped} == {"all_gather", "p2p", "usp 4x2", "usp 2x4"}
    one_slice = planner.plan(load_config(common + ["compile_topology=v5p-16", "ici_context_parallelism=8"]))
    assert by["p2p"].exposed_s > 2 * {c.label: c for c in one_slice.ranked}["p2p"].exposed_s
    assert config.context_parallel_strategy in strategies.STRATEGIES


def test_compile_plan_prints_the_table(capsys):
    from maxctx.compile import main

    assert main(SMALL + ["context_parallel_strategy=auto", "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("context_parallel_strategy=auto over C=8")
    assert out[2].lstrip().startswith("->")
    rows = json.loads(out[-1])["plan"]
    assert len(rows) == 5 and rows[0]["fits"]
    assert out[-2].startswith(f"  -> marked: {rows[0]['label']}, ") and "the fastest that fits" in out[-2], out[-2]


def test_the_marked_row_says_which_rule_chose_it():
    """A row within TIE of the fastest wins by the tie-break, and the line under the table says so."""
    hw = planner.Hardware("t", 1e12, 64 * planner.GIB, 1e12, 1e9, (8,))
    row = functools.partial(planner.Candidate, cp=8, fits=True, memory_bytes=planner.GIB)
    fast, tied = row("p2p", 1, compute_s=1.0, headroom=0.9), row("usp", 2, compute_s=1.005, headroom=0.5)
    over = row("all_gather", 1, compute_s=0.5, fits=False, memory_bytes=80 * planner.GIB)
    line = planner.why_chosen(planner.Plan(hw, 8, (tied, fast, over)))
    assert line.startswith(f"  -> marked: {tied.label}, 1.005 s, within 1% of the fastest that fits (p2p, 1 s)")
    assert "the most memory headroom decides" in line and "1 faster row(s) need more memory" in line, line
    assert "the fastest that fits" in planner.why_chosen(planner.Plan(hw, 8, (fast, tied)))
    assert "none fits" in planner.why_chosen(planner.Plan(hw, 8, (over,)))


def maxtext_plan(model: str, length: int, cp: int, fsdp: int
                 ) -> tuple[planner.Candidate, dict[str, planner.Candidate]]:
    """(auto's choice, the valid candidates by label) on the shape of MaxText's v5p-128 measurements (2M tokens per
    step, splash; docs/choosing_a_strategy.md), the ring backward costed overlapped as MaxText's program runs it
    (ring strategies replaced by their overlapped_backward variants)."""
    with strategies.replaced(overlapped_backward=True):
        plan = planner.plan(load_config([
            "configs/base.yml", "compile_topology=v5p-128", f"model_name={model}", f"max_target_length={length}",
            f"ici_context_parallelism={cp}", f"ici_fsdp_parallelism={fsdp}",
            f"per_device_batch_size={2 ** 21 / 64 / length}", "remat_policy=full", "attention=splash",
            "context_parallel_strategy=auto"]))
    return plan.choice, {c.label: c for c in plan.ranked if c.valid}


def test_ring_is_last_at_32k_as_maxtext_measured():
    # PR #4687, llama2-7b at 32K over C = 16: all_gather 8.83 s, Ulysses 8.90 s, ring 16.38 s (1.86x all_gather).
    _, by = maxtext_plan("llama2-7b", 32768, 16, 4)
    assert max(by.values(), key=lambda c: c.step_s).label == "p2p"
    assert 1.5 < by["p2p"].step_s / by["all_gather"].step_s < 3
    assert 1.5 < by["p2p"].step_s / by["a2a"].step_s


@pytest.mark.parametrize("length,expected", [(65536, None), (262144, "usp 8x8")])
def test_llama3_8b_on_v5p_128_prefers_usp_as_maxtext_measured(length, expected):
    # PRs #4836 / #4893 (as issue 17 summarises them): USP ahead of ring and all-gather at 64K and 256K, usp 8x8
    # fastest at 256K.
    choice, by = maxtext_plan("llama3-8b", length, 64, 1)
    assert choice.strategy == "usp"
    for label, c in by.items():
        if c.strategy == "usp" and c.a2a >= 4:
            assert c.step_s < min(by["all_gather"].step_s, by["p2p"].step_s), label
    if expected:
        assert choice.label == expected


@pytest.mark.xfail(strict=True, reason="known disagreements with MaxText (docs/choosing_a_strategy.md): the model "
                                        "ranks usp 16x4 behind larger A2A degrees at 64K, and a2a 17% ahead of "
                                        "all_gather at 32K; a pass means the doc's table must be updated")
@pytest.mark.parametrize("case", ["64K usp 16x4 first", "32K all_gather ties a2a"])
def test_known_disagreements_with_maxtext(case):
    if case.startswith("64K"):
        assert maxtext_plan("llama3-8b", 65536, 64, 1)[0].label == "usp 16x4"
    else:
        _, by = maxtext_plan("llama2-7b", 32768, 16, 4)
        assert by["all_gather"].step_s <= by["a2a"].step_s * (1 + planner.TIE)


def _plan_with_overlap(config, overlapped: bool) -> planner.Plan:
    with strategies.replaced(overlapped_backward=overlapped):
        return planner.plan(config)


def _exposed_with_overlap(shape, hw, overlapped: bool) -> float:
    with strategies.replaced(overlapped_backward=overlapped):
        return planner.exposed_per_layer("p2p", shape, hw, 16, 1, 2)


def test_ring_backward_overlap_costs_a_dkv_block_and_its_absence_exposes_the_sends():
    # The overlapped ring backward holds one more fp32 dK/dV block per device; without it (the program) the backward's
    # sends follow each hop's kernel (the compiled TPU program's schedule, tests/test_attention_tpu_compile.py) and
    # wait in full, which the ranking charges (docs/choosing_a_strategy.md).
    argv = ["configs/base.yml", "compile_topology=v5p-128", "model_name=llama2-7b", "max_target_length=32768",
            "ici_context_parallelism=16", "ici_fsdp_parallelism=4", "per_device_batch_size=1", "attention=splash",
            "context_parallel_strategy=auto"]
    off, on = ({c.label: c for c in _plan_with_overlap(load_config(argv), v).ranked} for v in (False, True))
    block = 2 * 16 * 2048 * 32 * 128 * 4  # fp32 dK and dV of a p2p hop: B (S/R) K D 4 each
    assert on["p2p"].attention_bytes - off["p2p"].attention_bytes == pytest.approx(block)
    assert on["all_gather"].attention_bytes == off["all_gather"].attention_bytes
    config = load_config(argv[:-1] + ["context_parallel_strategy=p2p"])
    shape = planner._shape(config, 16, 1, 1)
    # the hops hide behind the attention at its calibrated rate, its exps included (maxctx.plan.step_time)
    flops, hw = 12 * 128 * 1e9, planner.hardware(config, 64)
    hw = dataclasses.replace(hw, peak_flops=flops / step_time.attention_seconds(config, flops, 1e9, hw)[0])
    waits, hidden = (_exposed_with_overlap(shape, hw, overlap) for overlap in (False, True))
    # Overlapped, each backward hop hides its kernel's time behind its sends (here the sends take longer: MHA at 2K
    # tokens per device); waiting, it hides nothing.
    backward = 2 * 4 * 16 * 2048 * 16384 * 32 * 128 / hw.peak_flops  # 2 x the forward's 4 B (S/C) (S/2) H D FLOPs
    assert waits - hidden == pytest.approx(backward)
    # plan costs what each setting's program does: 32 layers of those waits, only on the ring candidates
    layers = config.base_num_decoder_layers
    assert off["p2p"].exposed_s - on["p2p"].exposed_s == pytest.approx(layers * (waits - hidden))
    assert off["all_gather"].exposed_s == on["all_gather"].exposed_s and off["a2a"].exposed_s == on["a2a"].exposed_s


def test_all_to_all_is_bisection_bound_per_torus_dimension():
    # A dimension the group fills is a wraparound ring (bytes x e / 8 per link), a part of one is a line (e / 4);
    # the slowest dimension sets the time. 8 devices of a 4x4x4 torus: a ring of 4 and a line of 2, both 1/2.
    def a2a(torus: tuple[int, ...], group: int) -> float:
        hw = planner.Hardware("t", 1e12, 1e9, 1e9, 1.0, torus)
        return planner._collective_s(Collective("all-to-all", 8.0, group), hw, 64) - planner.ICI_LATENCY_S

    assert [a2a((4, 4, 4), u) for u in (2, 4, 8, 16, 32, 64)] == pytest.approx([4.0] * 6)
    assert [a2a((8, 4), u) for u in (2, 4, 8, 16, 32)] == pytest.approx([4.0, 8.0, 8.0, 8.0, 8.0])


def test_train_prints_the_table_and_records_it(tmp_path):
    from tests.support.processes import metrics, run, train_command

    result = run(train_command(f"base_output_directory={tmp_path}", "run_name=auto", "cpu_devices=4",
                               "ici_context_parallelism=4", "ici_fsdp_parallelism=1", "per_device_batch_size=0.25",
                               "max_target_length=128", "base_num_query_heads=4", "base_num_kv_heads=2", "steps=1",
                               "base_num_decoder_layers=1", "attention=dot_product",
                               "context_parallel_strategy=auto", "enable_checkpointing=false",
                               "enable_tensorboard=false"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "context_parallel_strategy=auto over C=4" in result.stdout
    record = metrics(tmp_path / "auto")[0]
    assert record["event"] == "compile"
    plan = record["context_parallel_plan"]
    assert plan[0]["fits"] and {r["label"] for r in plan} >= {"all_gather", "p2p", "a2a", "usp 2x2"}


def test_local_layers_are_costed_by_their_halo():
    # Mistral 7B v0.1 (every layer a 4,096-token window) at 128K over C = 16: all_gather, p2p and usp exchange only
    # the band (maxctx.attention.cp.halo) and cost the same; a2a still moves every token's q, k, v and out.
    plan = planner.plan(load_config(["configs/base.yml", "compile_topology=v5p-128", "model_name=mistral-7b-v0.1",
                                     "max_target_length=131072", "ici_context_parallelism=16",
                                     "ici_fsdp_parallelism=4", "per_device_batch_size=0.25", "attention=splash",
                                     "context_parallel_strategy=auto"]))
    by = {c.label: c for c in plan.ranked}
    assert by["all_gather"].exposed_s == pytest.approx(by["p2p"].exposed_s) == pytest.approx(by["usp 4x4"].exposed_s)
    assert by["a2a"].exposed_s > 2 * by["p2p"].exposed_s
    assert plan.choice.label == "p2p"  # the least attention memory among the tied


def test_roofline_counts_what_crosses_slices():
    from maxctx.parallelism import split_context
    from maxctx.plan.roofline import cp_bytes_per_layer, cp_dcn_bytes_per_layer, traffic

    base = ["configs/base.yml", "model_name=llama3-8b", "max_target_length=131072", "ici_fsdp_parallelism=1",
            "per_device_batch_size=0.125", "attention=splash", "compile_topology=v5p-8",
            "compile_topology_num_slices=2", "ici_context_parallelism=4", "dcn_context_parallelism=2",
            "dcn_data_parallelism=1"]
    t = 131072 / 8
    for strategy, a2a in (("p2p", 1), ("usp", 4), ("all_gather", 1)):
        config = load_config(base + [f"context_parallel_strategy={strategy}", f"context_parallel_a2a_degree={a2a}"])
        mesh = split_context(config, 8, a2a)
        on_wire, crossing = cp_bytes_per_layer(config, mesh, t, 2), cp_dcn_bytes_per_layer(config, mesh, t, 2, 2)
        fwd, _ = strategies.get(strategy).comm_volume(AttentionShape(1, 131072, 32, 8, 128, 2, 8, a2a))
        ring = sum(c.sent_bytes for c in fwd if c.kind == "collective-permute")
        if strategy == "all_gather":  # half of the gathered K/V comes from the other slice
            assert crossing[0] == pytest.approx(fwd[0].bytes / 2)
        else:  # every ring hop, none of usp's all-to-all
            assert crossing[0] == pytest.approx(ring) and (strategy == "p2p") == (crossing[0] == on_wire[0])
        assert traffic(config, mesh, 1, 2)["dcn"] > 0
    one_slice = load_config(base[:6] + ["compile_topology=v5p-16", "ici_context_parallelism=8",
                                        "context_parallel_strategy=p2p"])
    assert traffic(one_slice, split_context(one_slice, 8, 1), 1, 2)["dcn"] == 0


def test_roofline_prices_the_layer_pattern_as_the_planner_does():
    # One AttentionShape constructor (roofline.attention_shape): the roofline's CP bytes take the windows of the
    # layer pattern (a local layer's halo) and the load balance, as the planner's and the time model's shapes do.
    from maxctx.plan.roofline import attention_shape, cp_bytes_per_layer

    base = ["configs/base.yml", "cpu_devices=8", "ici_context_parallelism=8", "ici_fsdp_parallelism=1",
            "context_parallel_strategy=p2p", "max_target_length=8192", "per_device_batch_size=0.125"]
    mesh = {"data": 1, "fsdp": 1, "context": 8, "context_a2a": 1, "tensor": 1}
    full = cp_bytes_per_layer(load_config(base), mesh, 1024, 2)
    local = cp_bytes_per_layer(load_config(base + ["sliding_window_size=256"]), mesh, 1024, 2)
    mixed = cp_bytes_per_layer(load_config(base + ["sliding_window_size=256", "attention_layer_pattern=LG"]),
                               mesh, 1024, 2)
    assert local[0] < full[0] and mixed[0] == pytest.approx((local[0] + full[0]) / 2)
    shape = attention_shape(load_config(base + ["context_parallel_load_balance=false"]), mesh, 1.0, 256)
    assert (shape.window, shape.load_balance, shape.cp, shape.a2a) == (256, False, 8, 1)
    assert planner._shape(load_config(base), 8, 1, 1) == attention_shape(load_config(base), mesh, 1.0)


def test_memory_estimate_against_the_fit_tables_compiles():
    # The working-set constants (planner.LAYER_WORK_BYTES*, one per place of the layer inputs) were calibrated on the
    # llama3-8b p2p and usp compiles for v5p-128 (benchmarks/fit_table.jsonl: XLA's memory for the TPU topology).
    # There the estimate (with memory.XLA_HEAP, fitted on these and the single compiles' v5p rows) must stay within
    # 6.5% of the compiled memory, and within 13% on the v6e-256 rows without offload, which were not used to fit
    # and which it overestimates (docs/choosing_a_strategy.md has every group, all_gather's under-estimate and the
    # v6e offload rows XLA packs below a linear model).
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_table", "benchmarks/fit_table.py")
    fit_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_table)
    checked = {"calibrated": 0, "held out": 0}
    for (model, topo, strategy, offload, seq, kernel), probe in fit_table.load_results().items():
        report = probe.get("report") or {}
        if strategy not in ("p2p", "usp") or "total_size_in_bytes" not in report:
            continue
        if (model, topo) == ("llama3-8b", "v5p-128") and kernel != "splash":
            group, tolerance = "calibrated", 0.065
        elif topo == "v6e-256" and not offload:
            group, tolerance = "held out", 0.13
        else:
            continue
        argv = fit_table.command(model, topo, strategy, offload, seq)[3:]
        plan = planner.plan(load_config([a.replace(f"={strategy}", "=auto") for a in argv]))
        est = next(c for c in plan.ranked if c.strategy == strategy and c.a2a == max(1, report["mesh"]["context_a2a"]))
        ratio = est.memory_bytes / report["total_size_in_bytes"]
        assert abs(ratio - 1) <= tolerance, f"{model} {topo} {strategy} offload={offload} {seq}: {ratio:.3f}"
        checked[group] += 1
    assert checked == {"calibrated": 18, "held out": 14}


RECIPE = ["configs/base.yml", "compile_topology=v5p-128", "model_name=llama3.1-8b", "head_dim=256",
          "base_num_query_heads=16", "base_num_kv_heads=4", "ici_context_parallelism=64", "ici_fsdp_parallelism=1",
          "per_device_batch_size=0.015625", "attention=splash", "flash_block_q=1024", "flash_block_kv=1024"]


def test_remat_auto_keeps_attention_at_10m_within_hbm_and_host():
    # MaxText's 10M row (v5p-128, remat_policy=full: 8,056 s measured) recomputes attention; auto keeps its output
    # on the host with the layer input, within 90% of HBM and of the host DRAM per chip (448 GB per 4-chip VM).
    argv = RECIPE + ["max_target_length=10485760", "num_vocab_tiling=40", "mlp_sequence_chunks=10"]
    config, plan = load(argv + ["context_parallel_strategy=auto", "remat_policy=auto"])
    best = plan.choice
    assert best.fits and best.forwards_per_layer == 1 and best.recomputed == "qkv, out_proj, mlpwi, mlpwo"
    assert (config.remat_policy, config.context, config.decoder_layer_input) == ("custom", "offload", "offload")
    assert config.context_parallel_strategy == best.strategy in ("p2p", "usp")
    assert best.host_bytes <= memory.HOST_FRACTION * 112e9 and best.memory_bytes <= 0.9 * 95 * planner.GIB
    # usp keeps two attention outputs (its ring's and the layer's): 120.31 GiB per chip in the compiled program
    # with both offloaded, over the host budget, so usp keeps attention only past a budget
    tokens = 32 * 163840
    for c in (c for c in plan.ranked if c.strategy == "usp" and c.forwards_per_layer == 1):
        assert c.dropped
        if c.placed == "input=offload context=offload":
            assert c.host_bytes == tokens * (2 * 4096 * 2 + 16 * 4 + 4096 * 2) and "of host memory" in c.dropped
    assert best.host_bytes == tokens * (4096 * 2 + 16 * 4 + 4096 * 2)
    recipe = next(c for c in planner.plan(load_config(argv + ["context_parallel_strategy=p2p"])).ranked
                  if c.label == "p2p")
    assert recipe.forwards_per_layer == 2 and recipe.recomputed.startswith("attention")
    assert recipe.step_s > 1.8 * best.step_s
    # kept in HBM instead, the output does not fit (XLA needed 102.54 GiB: docs/long_context.md)
    device = planner.plan(load_config(argv + ["context_parallel_strategy=p2p", "remat_policy=custom",
                                              "context=device", "decoder_layer_input=offload"]))
    assert not next(c for c in device.ranked if c.label == "p2p").fits


def test_remat_auto_at_16m_recomputes_when_the_host_is_short():
    # 2^24 tokens: the layer input and attention's output together need 128.5 GiB of host memory per chip, over
    # the 104.3 GiB a chip has; the table shows that placement and why it is dropped.
    argv = RECIPE + ["max_target_length=16777216", "num_vocab_tiling=64", "mlp_sequence_chunks=16",
                     "context_parallel_strategy=p2p", "remat_policy=auto"]
    config, plan = load(argv)
    assert plan.keys == "remat_policy=auto" and {c.label for c in plan.ranked} == {"p2p"}
    assert plan.choice.forwards_per_layer == 2 and config.decoder_layer_input == "offload"
    both = load_config([*argv[:-1], "remat_policy=custom", "context=offload", "decoder_layer_input=offload"])
    assert memory.held_host_bytes(both, 1) == 32 * 262144 * (4096 * 2 + 4128 * 2)  # 128.5 GiB
    # the table shows the nearest to fitting of the faster placements: every other layer's input on the host,
    # 96.5 GiB, still over 90% of the chip's 104.3
    kept = next(c for c in plan.ranked if c.forwards_per_layer == 1)
    assert "stride=2" in kept.placed and "of host memory per device" in kept.dropped
    assert kept.host_bytes == 16 * 262144 * 4096 * 2 + 32 * 262144 * 4128 * 2
    assert kept.step_s < 0.6 * plan.choice.step_s


def test_remat_auto_at_14m_keeps_attention_with_every_other_layer_input_on_the_host():
    """MaxText's 14,680,064-token shape: the layer input and attention's output need 112.4 GiB of host memory per
    chip; with decoder_layer_input_stride=2, 84.4 (the compiled program's figure: docs/long_context.md), and
    attention's forward runs once."""
    argv = RECIPE + ["max_target_length=14680064", "num_vocab_tiling=56", "mlp_sequence_chunks=14",
                     "context_parallel_strategy=p2p", "remat_policy=auto"]
    config, plan = load(argv)
    assert (config.context, config.decoder_layer_input, config.decoder_layer_input_stride) == ("offload", "offload", 2)
    assert plan.choice.forwards_per_layer == 1
    assert plan.choice.host_bytes / 2**30 == pytest.approx(84.44, abs=0.01)
    # --verify builds each candidate from the resolved config: one without a stride gets stride 1 back
    unstrided = next(c for c in plan.ranked if "stride" not in c.placed and c.valid)
    assert planner.candidate_config(config, "p2p", 1, dict(unstrided.placement)).decoder_layer_input_stride == 1


def test_a_stride_counts_runs_of_the_layer_pattern():
    """With a pattern of 2 layers (local, global) and stride 2, a run is 4 layers: 8 of 32 inputs go to the host."""
    from maxctx.plan import step_time

    config = load_config(RECIPE + ["max_target_length=1048576", "sliding_window_size=4096",
                                   "attention_layer_pattern=LG", "remat_policy=custom",
                                   "decoder_layer_input=offload", "decoder_layer_input_stride=2"])
    assert step_time.offloading_layers(config, "decoder_layer_input") == 8
    assert step_time.offloading_layers(config, "context") == 32


def test_remat_auto_chooses_every_tensor_and_offloads_only_to_a_known_host():
    with pytest.raises(ConfigError, match="remat_policy=auto chooses each tensor's placement itself, but "
                                          "context=device is given"):
        load(SMALL + ["remat_policy=auto", "context=device"])
    assert memory.host_budget_per_device(load_config(RECIPE + ["max_target_length=1048576"])) == 0.9 * 448e9 / 4
    assert memory.host_budget_per_device(load_config(SMALL)) == 0  # local devices: no host figure, no offload
    config, plan = load(SMALL + ["context_parallel_strategy=p2p", "remat_policy=auto"])
    assert config.remat_policy == "custom" and config.context_parallel_strategy == "p2p"
    assert all("offload" not in dict(c.placement).values() for c in plan.ranked)
    # the layer input on the device or offloaded, and offloaded in runs of 2 layers; the rest remat/device/offload
    assert len(remat.placements(parse_config(RECIPE + ["remat_policy=auto"]))) == 3 * 3 ** 5


def test_verify_prints_the_programs_counts_beside_the_estimate(capsys):
    from maxctx.compile import verify_plan

    config, plan = load(SMALL + ["base_num_decoder_layers=1", "max_target_length=1024", "base_emb_dim=128",
                                 "vocab_size=128", "context_parallel_strategy=p2p", "remat_policy=auto"])
    assert planner.format_plan(plan)[0].startswith("remat_policy=auto over C=8")
    row = verify_plan(plan, config, 1)[0]
    assert row["attention_forwards_per_layer"] == row["estimate_forwards_per_layer"] == 1
    assert row["device_to_host_bytes"] == row["estimate_host_bytes"] == 0
    assert row["compiled_estimate_step_s"] is None  # local devices: no step-time estimate from the compile
    assert "attention forwards per layer estimate 1, compiled 1" in capsys.readouterr().out


def test_auto_takes_the_next_candidate_when_the_first_aborts_while_compiling(capsys):
    # auto's choice is compiled in a process of its own (maxctx.compile.compile_first_that_works): a libtpu abort
    # (SIGABRT) kills only that process, and the next candidate is compiled; a candidate that compiles too big is
    # passed over the same way.
    import signal

    from maxctx.compile import NOT_FITTING, compile_first_that_works
    argv = ["configs/base.yml", "compile_topology=v5p-128", "model_name=llama3-8b", "max_target_length=131072",
            "ici_context_parallelism=16", "ici_fsdp_parallelism=4", "per_device_batch_size=0.25",
            "context_parallel_strategy=auto"]
    config, plan = load(argv)
    first, second, third = [c for c in plan.ranked if c.fits][:3]
    calls = []

    def run(args):
        calls.append(args)
        return [-signal.SIGABRT, NOT_FITTING, 0][len(calls) - 1]

    assert compile_first_that_works(argv, config, plan, run) == 0
    for call, cand in zip(calls, (first, second, third)):
        assert f"context_parallel_strategy={cand.strategy}" in call and "context_parallel_strategy=auto" not in call
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"auto: candidate {first.label} ({first.placed}) aborted while compiling (SIGABRT); taking the "
                   f"next, {second.label}",
                   f"auto: candidate {second.label} ({second.placed}) compiled but does not fit; taking the next, "
                   f"{third.label}"]


def test_verify_takes_the_next_candidate_when_one_aborts_while_compiling(capsys):
    # `--plan --verify=N` for a TPU topology compiles each candidate in a process of its own (as auto does): an
    # abort is a row and a line, and the next candidate takes its place among the N.
    import json
    import signal

    from maxctx.compile import verify_plan
    argv = ["configs/base.yml", "compile_topology=v5p-128", "model_name=llama3-8b", "max_target_length=131072",
            "ici_context_parallelism=16", "ici_fsdp_parallelism=4", "per_device_batch_size=0.25",
            "context_parallel_strategy=auto"]
    config, plan = load(argv)
    first, second = [c for c in plan.ranked if c.fits][:2]
    report = {"total_size_in_bytes": 40 * 2**30, "fits": True, "attention_forwards_per_layer": 2,
              "device_to_host_bytes": 0, "compile_time_s": 12.0}
    answers = [(-signal.SIGABRT, "", "libtpu: ...\n"), (0, "plan lines\n" + json.dumps(report) + "\n", ""),
               (2, "", "config error: something named\n")]
    calls = []

    def run(args):
        calls.append(args)
        return answers[len(calls) - 1]

    rows = verify_plan(plan, config, 1, argv, run)
    assert [r["label"] for r in rows] == [first.label, second.label] and len(calls) == 2
    assert rows[0]["aborted"] == "aborted while compiling (SIGABRT)"
    assert rows[1]["compiled_bytes"] == 40 * 2**30 and rows[1]["fits"] is True
    assert f"context_parallel_strategy={second.strategy}" in calls[1]
    assert "context_parallel_strategy=auto" not in calls[1]
    out = capsys.readouterr().out
    assert f"verify {first.label} ({first.placed}): aborted while compiling (SIGABRT); taking the next" in out
    calls.clear()
    answers[:2] = [answers[2], answers[1]]  # a child that fails names its error
    rows = verify_plan(plan, config, 1, argv, run)
    assert rows[0]["aborted"] == "failed (exit status 2: config error: something named)"
    assert rows[1]["label"] == second.label
