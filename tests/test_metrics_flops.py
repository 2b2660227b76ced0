"""FLOPs: the formula against a hand count, packed-document areas, XLA's cost analysis of a Llama-like train
step written here (unrolled layers, no remat; independent of maxctx.model, whose compiled step is checked in
test_metrics_xla.py), and the measured CPU peak (the best of several timings)."""

import dataclasses
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx.config import Config
from maxctx.metrics import (
    attention_pairs,
    measure_matmul_flops,
    peak_flops_per_device,
    peaks,
    throughput,
    training_flops_per_device,
    training_flops_per_step,
)
from maxctx.model.shape import ModelShape

TINY = Config()  # the defaults are the tiny preset: D=128, H=4, K=2, Dh=32, F=384, L=2, V=256


def test_matches_hand_count():
    b, s = 8, 128
    d, h, k, dh, f, v, layers = 128, 4, 2, 32, 384, 256, 2
    per_layer_weights = d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f  # wq, wk+wv, wo, mlp
    # Unembedding counted, embedding lookup not.
    assert ModelShape.from_config(TINY).matmul_params == layers * per_layer_weights + d * v
    forward = 2 * (layers * per_layer_weights + d * v) * b * s
    forward += layers * 4 * b * s * s * h * dh / 2  # QK^T and PV, causal half
    assert training_flops_per_step(TINY, b, s) == pytest.approx(3 * forward, rel=1e-12)
    assert training_flops_per_device(TINY, b, s, 8) == pytest.approx(3 * forward / 8, rel=1e-12)
    # Tied embeddings still do the unembedding matmul.
    tied = dataclasses.replace(TINY, logits_via_embedding=True)
    assert training_flops_per_step(tied, b, s) == training_flops_per_step(TINY, b, s)


def test_llama3_8b_is_near_6nd():
    cfg = dataclasses.replace(TINY, base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8, head_dim=128,
                              base_mlp_dim=14336, base_num_decoder_layers=32, vocab_size=128256)
    # 8.03B parameters, minus the 0.525B embedding table that only a gather touches.
    assert ModelShape.from_config(cfg).matmul_params == pytest.approx(8.03e9 - 4096 * 128256, rel=0.005)
    tokens = 4 * 8192
    ratio = training_flops_per_step(cfg, 4, 8192) / (6 * ModelShape.from_config(cfg).matmul_params * tokens)
    assert 1.0 < ratio < 1.3  # attention adds 12*L*H*Dh*S/2 per token on top of 6N


def test_packed_documents_use_their_true_area():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0],  # documents of 3 and 2 tokens, 3 padding
                    [1, 1, 1, 1, 1, 1, 1, 1]])
    assert attention_pairs(2, 8, segment_ids=seg) == (6 + 3) + 36
    assert attention_pairs(2, 8, segment_ids=seg, causal=False) == (9 + 4) + 64
    assert attention_pairs(2, 8) == 2 * 64 / 2
    # Token order does not matter (zig-zag load balancing reorders tokens).
    assert attention_pairs(2, 8, segment_ids=seg[:, ::-1]) == attention_pairs(2, 8, segment_ids=seg)
    rng = np.random.default_rng(0)
    many = np.sort(rng.integers(0, 6, size=(16, 64)), axis=1)
    naive = sum(n * (n + 1) / 2 for row in many for d in set(row) - {0} for n in [int(np.sum(row == d))])
    assert attention_pairs(16, 64, segment_ids=many) == naive
    packed = training_flops_per_step(TINY, 2, 8, segment_ids=seg)
    plain = training_flops_per_step(TINY, 2, 8)
    assert packed < plain
    assert plain - packed == pytest.approx(12 * 2 * 4 * 32 * (64 - 45), rel=1e-12)


def test_throughput_and_mfu_arithmetic():
    out = throughput(2.0, tokens_per_step=8000, flops_per_step=8e12, num_devices=4, peak_flops_per_device=1e12)
    assert out["tokens_per_s"] == 4000
    assert out["per_device_tokens_per_sec"] == 1000
    assert out["per_device_tflops_per_sec"] == 1.0
    assert out["mfu"] == 1.0


# ---- a Llama-like train step written out here, to check the formula against XLA -------------------------------

def _init(cfg: Config, key):
    d, h, k, dh, f, v = (cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim,
                         cfg.base_mlp_dim, cfg.vocab_size)
    shapes = {"wq": (d, h, dh), "wk": (d, k, dh), "wv": (d, k, dh), "wo": (h, dh, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d), "norm1": (d,), "norm2": (d,)}
    keys = iter(jax.random.split(key, 2 + len(shapes) * cfg.base_num_decoder_layers))
    layers = [{name: 0.02 * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}
              for _ in range(cfg.base_num_decoder_layers)]
    return {"embed": 0.02 * jax.random.normal(next(keys), (v, d)), "final_norm": jnp.ones((d,)),
            "unembed": 0.02 * jax.random.normal(next(keys), (d, v)), "layers": layers}


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def _rope(x_BSND, positions_BS):
    half = x_BSND.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angle = positions_BS[:, :, None, None] * freq
    a, b = x_BSND[..., :half], x_BSND[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1)


def _loss(params, tokens_BS, targets_BS):
    b, s = tokens_BS.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    x = params["embed"][tokens_BS]
    causal = jnp.tril(jnp.ones((s, s), bool))
    for lp in params["layers"]:
        y = _rms(x, lp["norm1"])
        q = _rope(jnp.einsum("BSD,DHK->BSHK", y, lp["wq"]), positions)
        k = _rope(jnp.einsum("BSD,DNK->BSNK", y, lp["wk"]), positions)
        v = jnp.einsum("BSD,DNK->BSNK", y, lp["wv"])
        kv_heads = k.shape[2]
        q = q.reshape(b, s, kv_heads, -1, q.shape[-1])  # [B, S, K, G, Dh]
        scores = jnp.einsum("BSNGK,BTNK->BNGST", q, k) / np.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        out = jnp.einsum("BNGST,BTNK->BSNGK", probs, v).reshape(b, s, -1, q.shape[-1])
        x = x + jnp.einsum("BSHK,HKD->BSD", out, lp["wo"])
        y = _rms(x, lp["norm2"])
        x = x + (jax.nn.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ lp["w_down"]
    logits = _rms(x, params["final_norm"]) @ params["unembed"]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets_BS[..., None], -1)[..., 0])


def _train_step(params, tokens, targets):
    loss, grads = jax.value_and_grad(_loss)(params, tokens, targets)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss


def test_formula_vs_xla_cost_analysis():
    cfg, batch, seq = TINY, 8, 128
    params = jax.eval_shape(lambda: _init(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    compiled = jax.jit(_train_step).lower(params, tokens, tokens).compile()
    xla = compiled.cost_analysis()["flops"]
    analytic = training_flops_per_step(cfg, batch, seq)
    # This reference attention computes the masked upper triangle too; the model FLOPs (MFU) exclude it.
    computed = analytic + 12 * cfg.base_num_decoder_layers * cfg.base_num_query_heads * cfg.head_dim * (
        attention_pairs(batch, seq, causal=False) - attention_pairs(batch, seq))
    print(f"xla {xla:.4g}, analytic {analytic:.4g} ({analytic / xla:.3f}), "
          f"with masked half {computed:.4g} ({computed / xla:.3f})")
    assert computed == pytest.approx(xla, rel=0.05)
    assert analytic == pytest.approx(xla, rel=0.10)


def test_cpu_peak_is_measured_on_every_device_and_labelled():
    # No bound on the number itself: it is a wall-clock timing on a host other processes share.
    devices = jax.devices()
    peak, source = peak_flops_per_device(devices[0], dataclasses.replace(TINY, dtype="float32"))
    assert np.isfinite(peak) and peak > 0
    assert source.startswith("measured: best of float32") and f"on {len(devices)} cpu device(s) at once" in source


def test_measured_peak_is_the_best_of_several_timings(monkeypatch):
    """Three timed runs of one 8x8 matmul taking 1, 0.5 and 2 s (a fake clock): the peak is the fastest run's."""
    ticks = iter([0.0, 1.0, 10.0, 10.5, 20.0, 22.0])
    monkeypatch.setattr(peaks, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))  # peaks' clock only
    flops = measure_matmul_flops(jax.devices()[:1], size=8, chain=1, min_repeats=3, min_seconds=0.0)
    assert flops == 2 * 8**3 / 0.5


def test_document_pairs_from_positions_equal_the_area_of_the_segment_ids():
    """The train step's `attention_pairs` (from positions, on the device) is the documents' own area that
    attention_pairs counts from segment ids: padding left out, each layer's window applied, any token order."""
    from maxctx.attention.cp.load_balance import document_permutation
    from maxctx.loader import load_config
    from maxctx.metrics.flops import document_pairs, needed_flops

    base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")

    lengths = [[300, 50, 7, 155], [512]]
    seg = np.stack([np.repeat(np.arange(1, len(n) + 1), n) for n in lengths]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(m) for m in n]) for n in lengths]).astype(np.int32)
    seg[0, -20:], pos[0, -20:] = 0, 0  # padding
    config = load_config([base, "sliding_window_size=64", "attention_layer_pattern=LLG", "base_num_decoder_layers=6"])
    want = 2 * sum(attention_pairs(2, 512, segment_ids=seg, window=w) for w in (64, 64, 0))
    perm = document_permutation(pos[1], seg[1], 4)
    assert document_pairs(pos, seg, config) == want
    assert float(document_pairs(jnp.asarray(pos[:, perm]), jnp.asarray(seg[:, perm]), config, jnp)) == want
    # One document per row without a window: the needed FLOPs are training_flops_per_step's (causal S^2/2 + S/2).
    whole = load_config([base])
    rows = np.broadcast_to(np.arange(512, dtype=np.int32), (2, 512))
    pairs = document_pairs(rows, np.ones_like(rows), whole)
    assert needed_flops(whole, 1024, pairs) == training_flops_per_step(whole, 2, 512, segment_ids=np.ones_like(rows))
