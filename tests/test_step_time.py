"""maxctx.plan.step_time against MaxText's measured v5p-128 rows (benchmarks/step_time_model.py): the fitted rows
are met, the rows not fitted are predicted within 15%, and the terms follow the policy and the program's counts."""

from __future__ import annotations

import importlib.util

import pytest

from maxctx.parallelism import MeshPlan
from maxctx.plan import step_time
from tests.support.processes import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_time_model", ROOT / "benchmarks" / "step_time_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_predicts_maxtext_rows_within_15_percent(bench):
    for row in bench.ROWS:
        error = bench.predict(row).step_s / row[7] - 1
        assert abs(error) < (0.01 if row[0] in bench.FITTED.values() else 0.15), (row[0], error)


def test_each_row_held_out_is_predicted_within_1_percent(bench):
    lines = bench.leave_one_out()[2:]
    assert len(lines) == len(bench.ROWS)
    for line in lines:
        error = float(line.split("|")[4].strip().rstrip("%")) / 100
        assert abs(error) < 0.01, line
    assert (step_time.XLA_MATMUL_EFFICIENCY, step_time.RECOMPUTE_ATTENTION) == (0.875, 2.80)  # restored


def test_the_constants_are_the_fit(bench):
    from maxctx.plan import step_time

    kept = (step_time.XLA_MATMUL_EFFICIENCY, dict(step_time.SPLASH_EFFICIENCY), step_time.RECOMPUTE_ATTENTION)
    try:
        fitted = bench.fit()
    finally:
        step_time.XLA_MATMUL_EFFICIENCY, step_time.SPLASH_EFFICIENCY, step_time.RECOMPUTE_ATTENTION = kept
    assert fitted["XLA_MATMUL_EFFICIENCY"] == pytest.approx(kept[0], abs=0.005)
    assert fitted["SPLASH_EFFICIENCY"] == pytest.approx(kept[1][1024], abs=0.005)
    assert fitted["RECOMPUTE_ATTENTION"] == pytest.approx(kept[2], abs=0.01)


def test_kept_attention_output_removes_the_recompute(bench):
    row = bench.ROWS[5]  # 10M, remat_policy=full: the attention forward runs again in the backward
    full = bench.predict(row)
    offloaded = bench.predict((*row[:4], "custom", "offload", "offload"))
    assert full.forwards_per_layer == 2 and offloaded.forwards_per_layer == 1
    assert offloaded.step_s < 0.6 * full.step_s
    # to the host and back: the attention output (bf16) and its fp32 log-sum-exp, and the layer input, per layer
    t, layers = 10485760 // 64, 32
    assert offloaded.host_bytes == pytest.approx(2 * layers * t * ((16 * 256 + 2 * 16) * 2 + 4096 * 2))


def test_a_strided_layer_input_halves_its_host_bytes_and_recomputes_the_layers(bench):
    """decoder_layer_input_stride=2 at MaxText's 14M shape: the input of every other layer goes to the host, every
    projection runs once more; attention still runs once with `context` offloaded (the program compiled for
    v5p-128 counts 1 and 84.44 GiB of host memory per chip: docs/long_context.md), 3 times when recomputed."""
    from maxctx.loader import load_config
    from maxctx.plan import step_time

    keys = ["configs/base.yml", *bench.VARIANT, "max_target_length=14680064", "ici_context_parallelism=64",
            "ici_fsdp_parallelism=1", "per_device_batch_size=0.015625", "remat_policy=custom",
            "decoder_layer_input=offload"]
    mesh = {"data": 1, "fsdp": 1, "context": 64, "context_a2a": 1, "tensor": 1}

    def estimate(*more):
        config = load_config([*keys, *more])
        return step_time.estimate(config, MeshPlan.one_slice(mesh), 1, step_time.hardware(config, bench.DEVICES))

    whole, strided = estimate("context=offload"), estimate("context=offload", "decoder_layer_input_stride=2")
    t, layers = 14680064 // 64, 32
    assert whole.host_bytes - strided.host_bytes == pytest.approx(2 * layers // 2 * t * 4096 * 2)
    assert strided.forwards_per_layer == 1 and strided.recompute_s > whole.recompute_s
    assert strided.host_bytes / 2 / 2**30 == pytest.approx(84.44, abs=0.01)  # the compiled program's host bytes
    assert estimate("context=remat", "decoder_layer_input_stride=2").forwards_per_layer == 3


def test_splash_block_is_the_most_efficient_calibrated_one_that_fits(monkeypatch):
    from maxctx.loader import load_config
    from maxctx.plan import step_time

    config = load_config(["configs/base.yml", "model_name=llama3-8b", "head_dim=256"])
    vmem = 65472 * 1024  # v5p's scoped VMEM (maxctx.plan.topology)
    assert step_time.splash_block(config, vmem) == 1024  # the one calibrated block
    monkeypatch.setattr(step_time, "SPLASH_EFFICIENCY", {1024: 0.71, 2048: 0.75})
    assert step_time.splash_block(config, vmem) == 2048
    assert step_time.attention_efficiency(load_config(["configs/base.yml", "attention=splash", "flash_block_q=2048",
                                                       "flash_block_kv=2048"])) == 0.75
    # 2048's windows (22.5 MiB double-buffered at head_dim 256) need more than half of 32 MiB
    assert step_time.splash_block(config, 32 * 2 ** 20) == 1024


def test_planner_counts_what_the_policy_keeps_on_the_device():
    from maxctx.loader import load_config
    from maxctx.plan import memory, planner

    base = ["configs/base.yml", "compile_topology=v5p-128", "model_name=llama3.1-8b", "head_dim=256",
            "base_num_query_heads=16", "base_num_kv_heads=4", "max_target_length=1048576",
            "ici_context_parallelism=64", "ici_fsdp_parallelism=1", "per_device_batch_size=0.03125",
            "context_parallel_strategy=p2p", "remat_policy=custom", "decoder_layer_input=offload"]

    def p2p(where):
        return next(c for c in planner.plan(load_config([*base, f"context={where}"])).ranked if c.label == "p2p")

    device, offload = p2p("device"), p2p("offload")
    # the attention output (bf16) and the ring's fp32 log-sum-exp, per layer and token: 32 layers x 32,768 tokens,
    # at what XLA holds per kept byte (memory.KEPT_ON_DEVICE); offloaded, they are held in host memory instead
    kept = 32 * 32768 * (16 * 256 * 2 + 16 * 4)
    assert device.memory_bytes - offload.memory_bytes == pytest.approx(memory.KEPT_ON_DEVICE * kept)
    assert (device.host_bytes, offload.host_bytes) == (32 * 32768 * 4096 * 2, 32 * 32768 * 4096 * 2 + kept)
    assert device.step_s == pytest.approx(offload.step_s)  # both keep it: one attention forward
    assert p2p("remat").step_s > 1.5 * device.step_s


def test_documents_per_row_count_their_own_attention_and_the_busiest_rank():
    """planner_document_lengths: the attention term counts the documents' own pairs times the busiest rank's share
    (zig-zag vs the documents placement); MFU's model FLOPs keep the causal count; bad specs are refused."""
    from maxctx.config import ConfigError
    from maxctx.loader import load_config
    from maxctx.plan import documents, step_time

    keys = [str(ROOT / "configs" / "base.yml"), "model_name=llama3-8b", "compile_topology=v5p-128",
            "max_target_length=1048576", "ici_context_parallelism=64", "ici_fsdp_parallelism=1",
            "per_device_batch_size=0.015625", "attention=splash", "context_parallel_strategy=p2p"]
    mesh = {"data": 1, "fsdp": 1, "context": 64, "context_a2a": 1, "tensor": 1}

    def estimate(*extra):
        config = load_config([*keys, *extra])
        return step_time.estimate(config, MeshPlan.one_slice(mesh), 1, step_time.hardware(config, 64)), config

    whole, _ = estimate()
    eight, config = estimate("planner_document_lengths=8192")
    assert eight.model_flops == whole.model_flops  # MFU keeps MaxText's causal count
    assert eight.attention_s / whole.attention_s == pytest.approx(8193 / 1048576, rel=1e-3)
    assert "documents 8192" in documents.attention_counted(config, 64)
    mixture = "planner_document_lengths=524288,262144,2048x128"
    zigzag, _ = estimate(mixture)
    placed, _ = estimate(mixture, "context_parallel_load_balance=documents")
    assert placed.attention_s < zigzag.attention_s / 1.5 and placed.step_s < zigzag.step_s
    for bad in ("8k", "2048x", "0"):
        with pytest.raises(ConfigError, match="planner_document_lengths"):
            load_config([*keys, f"planner_document_lengths={bad}"])
