"""maxctx.plan.program: what the compiled step runs, read from its HLO, on a small step compiled for a v5p-8 topology
(libtpu, no TPU; a subprocess each, two at a time): the attention forward runs twice per layer when the
backward recomputes it (remat_policy=custom context=remat) and once when the attention's outputs are kept
(context=device, or offloaded); host transfers are what the offloaded tensors' shapes say, and none when nothing
is offloaded; with the layers in runs of 2 (decoder_layer_input_stride=2) a run's offloaded tensors come back and
attention still runs once."""

from __future__ import annotations

import pytest

from maxctx.plan.program import Program
from tests.support.tpu_compile import finish, needs_libtpu, start_compile

LAYERS, TOKENS, DIM, HEADS, HEAD_DIM = 2, 1024, 256, 4, 128  # tokens per device: 4096 over a ring of 4
SMALL = ("compile_topology=v5p-8", "model_name=tiny", f"base_num_decoder_layers={LAYERS}", f"base_emb_dim={DIM}",
         f"base_num_query_heads={HEADS}", "base_num_kv_heads=2", f"head_dim={HEAD_DIM}", "base_mlp_dim=512",
         "vocab_size=512", "max_target_length=4096", "ici_context_parallelism=4", "ici_fsdp_parallelism=1",
         "per_device_batch_size=0.25", "attention=splash", "context_parallel_strategy=p2p", "remat_policy=custom")
CASES = {"remat": ("context=remat", "decoder_layer_input=offload"), "device": ("context=device",),
         "offload": ("context=offload",),
         # 4 layers in runs of 2: libtpu refused (UNIMPLEMENTED: "Async slice only supports slicing in 1 dimension")
         # to bring back tensors offloaded inside a run while the run's layers were a scan (maxctx.model.decoder).
         "strided": ("context=offload", "decoder_layer_input=offload", "decoder_layer_input_stride=2",
                     "base_num_decoder_layers=4")}


@pytest.fixture(scope="module")
def reports():
    needs_libtpu()
    out, names = {}, list(CASES)
    for pair in (names[:2], names[2:]):  # two compiles at a time: each is mostly single-threaded
        procs = {name: start_compile(*SMALL, *CASES[name]) for name in pair}
        for name, proc in procs.items():
            rc, text, report = finish(proc, timeout=900)
            assert rc == 0, text
            out[name] = (report, text)
    return out


def test_recomputed_attention_runs_its_forward_twice(reports):
    report, text = reports["remat"]
    assert report["attention_forwards_per_layer"] == pytest.approx(2)
    assert "attention forward 2 per layer (recomputed in the backward)" in text


def test_kept_attention_runs_its_forward_once(reports):
    for name in ("device", "offload"):
        assert reports[name][0]["attention_forwards_per_layer"] == pytest.approx(1), name
    assert "attention forward 1 per layer (kept for the backward)" in reports["device"][1]


def test_host_bytes_are_the_offloaded_tensors(reports):
    layer_input = LAYERS * TOKENS * DIM * 2  # bf16 [B, S/C, D] per layer, to the host and back
    remat = reports["remat"][0]
    assert remat["device_to_host_bytes"] == remat["host_to_device_bytes"] == layer_input
    device = reports["device"][0]
    assert device["device_to_host_bytes"] == device["host_to_device_bytes"] == 0
    # context=offload: the attention output (bf16 [S/C, H, D]) and its log-sum-exp (fp32 [H, S/C]) per layer.
    offload = reports["offload"][0]
    context = LAYERS * (TOKENS * HEADS * HEAD_DIM * 2 + HEADS * TOKENS * 4)
    assert offload["device_to_host_bytes"] == offload["host_to_device_bytes"] == context
    # Runs of 2 layers: every layer's attention output, and the input of each run only (2 of 4 layers).
    strided = reports["strided"][0]
    assert strided["device_to_host_bytes"] == strided["host_to_device_bytes"] == 2 * context + layer_input
    assert strided["attention_forwards_per_layer"] == pytest.approx(1)


def test_collectives_and_flops_are_counted(reports):
    from maxctx.attention.cp import strategies
    from maxctx.attention.cp.cost import AttentionShape

    remat, device = reports["remat"][0], reports["device"][0]
    # The ring's K/V permutes, p2p's formula exactly (bf16; an async permute's output counted, not its operand):
    # the recompute runs the forward ring again.
    shape = AttentionShape(batch=1, seq=4 * TOKENS, heads=HEADS, kv_heads=2, head_dim=HEAD_DIM, itemsize=2, cp=4)
    fwd, bwd = (sum(c.bytes for c in ops) for ops in strategies.get("p2p").comm_volume(shape))
    for report, forwards in ((remat, 2), (device, 1)):
        assert report["collective_bytes"]["collective-permute"] == LAYERS * (forwards * fwd + bwd), forwards
    assert remat["uncounted_loops"] == 0 and remat["pallas_calls_uncounted"] == 0
    for report in (remat, device):
        assert report["executed_pallas_flops"] > 0 and report["executed_dot_flops"] > 0
        assert report["executed_flops"] > report["analytic_flops_per_device"]
    assert remat["executed_pallas_flops"] > device["executed_pallas_flops"]


def test_loops_count_their_trips_and_branches_average():
    hlo = """HloModule m

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %x = f32[8]{0} parameter(1)
  %ag = f32[32]{0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[]) tuple(%i)
}

%a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1}}
}

%b (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %zero = s32[] constant(1)
  %t = (s32[]) tuple(%zero)
  %w = (s32[]) while(%t), condition=%cond, body=%body
  %k = s32[] constant(0)
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} conditional(%k, %x, %x), branch_computations={%a, %b}
}
"""
    program = Program(hlo)
    # 5 - 1 = 4 trips of a 128-byte gather; the conditional's skipping branch is left out of the average.
    assert program.collective_bytes() == {"all-gather": 4 * 128, "collective-permute": 32}
    assert program.uncounted_loops == []


def test_blockwise_forward_counted_once_or_twice_on_cpu():
    # The blockwise kernel's forward (its `attention_forward` scope), differentiated as is and under remat.
    import jax
    import jax.numpy as jnp

    from maxctx.attention.kernels.flash import flash_attention

    q, kv = jnp.ones((1, 256, 2, 32)), jnp.ones((1, 256, 1, 32))
    pos, seg = jnp.arange(256)[None], jnp.ones((1, 256), jnp.int32)

    def loss(q, k, v):
        return flash_attention(q, k, v, pos, seg, pos, seg, 64, 64)[0].sum()

    for fn, forwards in ((loss, 1), (jax.checkpoint(loss), 2)):
        hlo = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
        total, forward = Program(hlo).attention_forwards()
        assert forward > 0 and total / forward == forwards
