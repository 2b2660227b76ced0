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
    assert (step_time.XLA_MATMUL_EFFICIENCY, step_time.RECOMPUTE_ATTENTION) == (0.875, 2.70)  # restored


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
    # at what XLA holds per kept byte (memory.KEPT_ON_DEVICE, a temporary: x memory.XLA_HEAP); offloaded, they are
    # held in host memory instead
    kept = 32 * 32768 * (16 * 256 * 2 + 16 * 4)
    assert device.memory_bytes - offload.memory_bytes == pytest.approx(memory.XLA_HEAP * memory.KEPT_ON_DEVICE * kept)
    assert (device.host_bytes, offload.host_bytes) == (32 * 32768 * 4096 * 2, 32 * 32768 * 4096 * 2 + kept)
    assert device.step_s == pytest.approx(offload.step_s)  # both keep it: one attention forward
    assert p2p("remat").step_s > 1.5 * device.step_s


def test_kept_layer_inputs_are_charged_their_relayout_copy_where_xla_makes_one():
    """topology.Chip.stack_relayouts: on v6e and TPU7x XLA copies the stack of kept layer inputs whole before the
    backward (two 32 GiB stacks at TPU7x's 16M peak) when the custom policy names them; on v5p it does not, nor
    under remat_policy=full. Offloaded inputs are not charged it."""
    from maxctx.loader import load_config
    from maxctx.plan import memory, planner, topology

    assert [topology.CHIPS[g].stack_relayouts for g in ("v5p", "v6e", "tpu7x")] == [0, 1, 1]
    keys = ["configs/base.yml", "model_name=llama3.1-8b-hd256", "max_target_length=262144",
            "ici_context_parallelism=8", "ici_fsdp_parallelism=1", "per_device_batch_size=0.125",
            "context_parallel_strategy=usp", "context_parallel_a2a_degree=4", "remat_policy=custom",
            "context=offload"]

    def memory_bytes(topo, where):
        config = load_config([*keys, f"compile_topology={topo}", f"decoder_layer_input={where}"])
        return next(c for c in planner.plan(config).ranked if c.label == "usp 2x4").memory_bytes

    stack = 32 * 32768 * 4096 * 2  # 32 layers' inputs, 32,768 tokens per device, bf16
    for topo, copies in (("v5p-16", 0), ("tpu7x-8", 1)):
        kept = memory_bytes(topo, "device") - memory_bytes(topo, "offload")
        assert kept == pytest.approx(memory.XLA_HEAP * (memory.KEPT_ON_DEVICE + copies) * stack)
    full_keys = [k for k in keys if k not in ("remat_policy=custom", "context=offload")] + ["remat_policy=full"]
    full = {topo: memory.device_bytes(load_config([*full_keys, f"compile_topology={topo}"]), 8, 8, 0.0).always
            for topo in ("v5p-16", "tpu7x-8")}
    assert full["tpu7x-8"] == pytest.approx(full["v5p-16"])


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


def test_a_chips_devices_share_its_host_link_and_vector_units():
    """TPU7x's two devices (TensorCores) per chip: each gets half the chip's host link and exp rate; v5p's one
    megacore device all of them. The exp rates are libtpu's cost model's (maxctx.plan.topology.EUP_SOURCE)."""
    from maxctx.loader import load_config
    from maxctx.plan import topology

    def hw(name):
        return step_time.hardware(load_config(["configs/base.yml", f"compile_topology={name}"]), None)

    v5p, tpu7x = hw("v5p-128"), hw("tpu7x-128")
    assert (v5p.host_bytes_per_s, tpu7x.host_bytes_per_s) == (step_time.HOST_BYTES_PER_S,
                                                              step_time.HOST_BYTES_PER_S / 2)
    assert tpu7x.transcendentals_per_s == topology.CHIPS["tpu7x"].transcendentals_per_s / 2 == 1.9456e12
    assert v5p.transcendentals_per_s == 3.072e12
    # MXU FLOPs per exp: the MXU peak grew about 4x more than the exp rate from v5p to TPU7x
    assert v5p.peak_flops / v5p.transcendentals_per_s == pytest.approx(149.4, abs=0.1)
    assert tpu7x.peak_flops / tpu7x.transcendentals_per_s == pytest.approx(592.9, abs=0.1)


def test_splash_exps_are_priced_at_the_chips_rate_after_its_matmuls(bench):
    """Splash's attention term: its FLOPs at SPLASH_EFFICIENCY of the peak, then one exp per visible (query head,
    key) pair in the forward and one per backward kernel (2 split, 1 fused) at the device's transcendental rate;
    none on a GPU (cuDNN's efficiency is an assumption that covers it)."""
    from maxctx.loader import load_config

    keys = ["configs/base.yml", *[k for k in bench.VARIANT if not k.startswith(("compile_topology", "peak", "splash"))],
            "max_target_length=1048576", "ici_context_parallelism=128", "ici_fsdp_parallelism=1",
            "per_device_batch_size=0.0078125", "remat_policy=custom", "context=offload"]
    mesh = MeshPlan.one_slice({"data": 1, "fsdp": 1, "context": 128, "context_a2a": 1, "tensor": 1})

    def estimate(*more):
        config = load_config([*keys, *more])
        hw = step_time.hardware(config, 128)
        return step_time.estimate(config, mesh, 1, hw), hw

    (split, hw), (fused, _) = estimate("compile_topology=tpu7x-128"), estimate("compile_topology=tpu7x-128",
                                                                               "splash_fused_backward=true")
    t = 1048576 / 128
    head_pairs = 32 * t * (1048576 + 1) / 2 * 16  # layers x tokens x causal keys per token x query heads
    flops = 12 * 256 * head_pairs
    mxu = flops / (hw.peak_flops * step_time.SPLASH_EFFICIENCY[1024])
    assert split.attention_s == pytest.approx(mxu + 3 * head_pairs / 1.9456e12, rel=1e-6)
    assert fused.attention_s == pytest.approx(mxu + 2 * head_pairs / 1.9456e12, rel=1e-6)
    # on TPU7x the exps are a fifth of the fused kernels' time; on a GPU none are added
    assert 0.2 < 1 - mxu / fused.attention_s < 0.25
    gpu, gpu_hw = estimate("compile_topology=h100-128", "attention=cudnn")
    assert gpu.attention_s == pytest.approx(flops / (gpu_hw.peak_flops * step_time.CUDNN_EFFICIENCY), rel=1e-6)
