"""Sliding-window (local) attention: every strategy x load balance x C in {2, 4, 8} x window (within a chunk, and
spanning several) against the single-device dense reference with the band mask, outputs and dQ/dK/dV within 1e-5
(fp32); row 0 of the batch is one document, row 1 packed. The communication of a local layer from the compiled
HLO against the strategies' formulas (maxctx.attention.cp.halo), independent of C; the keys, the pattern and the
model's grouped scan.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp import halo, strategies
from maxctx.attention.cp.cost import AttentionShape, by_kind
from maxctx.attention.cp.load_balance import restore_order, zigzag_permutation
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import dot_product_attention
from maxctx.config import ConfigError, layer_windows
from maxctx.loader import load_config
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.support.processes import cpu_env, python
from tests.test_attention_comm import B, D, H, K, b, compiled_bytes
from tests.test_context_parallel import inputs as packed_inputs, vjp_of

SEQ, KV = 64, 2  # 5 + 23 + 9 + 27 tokens; heads and head dim as in tests/test_context_parallel.py
# 3: inside one chunk at every C here (S / 2C >= 4); 12: across up to three chunks (C = 8: chunks of 4 tokens).
WINDOWS = (3, 12)


def inputs():
    """Row 0 one document; row 1 packed (documents of 5, 23, 9 and 27 tokens, cut across chunks)."""
    return packed_inputs(KV, lengths=(5, 23, 9, 27))


@functools.cache
def reference(window: int):
    fn = lambda q, k, v, p, s: dot_product_attention(q, k, v, p, s, p, s, window)[0]  # noqa: E731
    return [np.asarray(x) for x in jax.jit(functools.partial(vjp_of, fn))(*inputs())]


def test_reference_is_the_band():
    """The reference itself: query i sees exactly keys i - W < j <= i of its document."""
    from maxctx.attention.kernels.dot_product import mask_from_positions

    pos = jnp.arange(8)[None]
    seg = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2]])
    mask = np.asarray(mask_from_positions(pos, seg, pos, seg, 3))[0]
    want = np.zeros((8, 8), bool)
    for i in range(8):
        for j in range(8):
            want[i, j] = seg[0, i] == seg[0, j] and 0 <= i - j < 3
    np.testing.assert_array_equal(mask, want)


CASES = ([(s, c, 1) for s in ("all_gather", "p2p") for c in (2, 4, 8)] + [("a2a", 1, c) for c in (2, 4, 8)]
         + [("usp", 1, 2), ("usp", 2, 2), ("usp", 2, 4), ("usp", 4, 2)])


@pytest.mark.parametrize("strategy,ring,a2a", CASES)
def test_every_strategy_matches_the_band_reference(strategy, ring, a2a):
    mesh, cp = make_mesh(ring, a2a), ring * a2a
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    data = inputs()
    for window in WINDOWS:
        want = reference(window)
        for load_balance in (False, True):
            spec = AttentionSpec(kernel="flash", strategy=strategy, block_q=4, block_kv=4, load_balance=load_balance,
                                 window=window)
            fn = jax.jit(functools.partial(vjp_of, functools.partial(attend, spec=spec, mesh=mesh)))
            perm = zigzag_permutation(SEQ, cp) if load_balance else np.arange(SEQ)
            args = [jax.device_put(x[:, perm], sharding) for x in data]
            got = fn.lower(*args).compile(FAST_COMPILE)(*args)
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                g = restore_order(np.asarray(g), cp) if load_balance else np.asarray(g)
                err = np.abs(g - w).max() / np.abs(w).max()
                assert err < 1e-5, (f"{strategy} C={cp} ({ring}x{a2a}) W={window} load_balance={load_balance} "
                                    f"{name}: relative error {err:.2e}")


def test_dot_product_kernel_under_a_ring_honours_the_window():
    """The ring path (a window too wide for a halo to pay) with the reference kernel's hop backward."""
    mesh = make_mesh(2, 1)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    window = 40
    assert halo.layout_plan(SEQ, 2, True, window) is None
    spec = AttentionSpec(kernel="dot_product", strategy="p2p", window=window)
    perm = zigzag_permutation(SEQ, 2)
    args = [jax.device_put(x[:, perm], sharding) for x in inputs()]
    got = jax.jit(functools.partial(vjp_of, functools.partial(attend, spec=spec, mesh=mesh)))(*args)
    for g, w in zip(got, reference(window)):
        assert np.abs(restore_order(np.asarray(g), 2) - w).max() / np.abs(w).max() < 1e-5


# ---- communication ----

S = 256  # B, H, K, D and b as in tests/test_attention_comm.py


def layer_bytes(strategy: str, ring: int, a2a: int, window: int, backward: bool) -> dict:
    return compiled_bytes(strategy, ring, a2a, backward, window=window, seq=S)


def formula(strategy: str, ring: int, a2a: int, window: int) -> tuple[dict, dict]:
    shape = AttentionShape(batch=B, seq=S, heads=H, kv_heads=K, head_dim=D, itemsize=b, cp=ring * a2a, a2a=a2a,
                           window=window)
    fwd, bwd = strategies.get(strategy).comm_volume(shape)
    return by_kind(fwd), by_kind(bwd)


@pytest.mark.parametrize("strategy,ring,a2a", [("p2p", 4, 1), ("p2p", 8, 1), ("all_gather", 8, 1), ("usp", 2, 4)])
def test_local_layer_moves_only_the_band(strategy, ring, a2a):
    """W = 16 <= S / 2C: two neighbours' last W rows, forward and back (dK/dV); no gather, no ring, no all-to-all."""
    window = 16
    want_fwd, want_bwd = formula(strategy, ring, a2a, window)
    assert set(want_fwd) == {"collective-permute"}
    rows = 2 * window  # the left and the right neighbour under zig-zag
    assert want_fwd["collective-permute"] == rows * (2 * B * K * D * b + 2 * B * 4)
    assert want_bwd["collective-permute"] == rows * 2 * B * K * D * b
    got_fwd = layer_bytes(strategy, ring, a2a, window, backward=False)
    got_all = layer_bytes(strategy, ring, a2a, window, backward=True)
    for kind in ("all-gather", "all-to-all", "reduce-scatter"):
        assert got_all[kind] == 0, f"{strategy} local layer has a {kind}: {got_all[kind]} bytes"
    assert got_fwd["collective-permute"] == want_fwd["collective-permute"]
    assert got_all["collective-permute"] == want_fwd["collective-permute"] + want_bwd["collective-permute"]
    # A global layer of the same strategy moves far more.
    glob_fwd, _ = formula(strategy, ring, a2a, 0)
    assert sum(glob_fwd.values()) > 2 * want_fwd["collective-permute"]


def test_local_layer_bytes_do_not_grow_with_c():
    """p2p's local layer at C = 4, 8 (here) and 16 (a 16-device subprocess): equal compiled bytes."""
    here = {c: layer_bytes("p2p", c, 1, 16, backward=True)["collective-permute"] for c in (4, 8)}
    script = ("import json, jax; from tests.test_sliding_window import layer_bytes; "
              "print(json.dumps(layer_bytes('p2p', 16, 1, 16, True)['collective-permute']))")
    done = python("-c", script, env=cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=16"))
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert here[4] == here[8] == there, f"collective-permute bytes by C: {here}, C=16: {there}"


def test_halo_plan_rounds():
    """Zig-zag with W <= L: two rounds (left and right neighbour); natural order: one; the first chunk has none."""
    p = halo.layout_plan(256, 8, True, 16)
    assert len(p.rounds) == 2 and p.moved_rows == 32 and p.pieces == (16,)
    pairs = [pair for r in p.rounds for pair in r.perm]
    assert sorted(pairs) == sorted([(i, i + 1) for i in range(7)] + [(i + 1, i) for i in range(7)])
    for r in p.rounds:  # a round is a matching: every device sends and receives at most once
        assert len({s for s, _ in r.perm}) == len({d for _, d in r.perm}) == len(r.perm)
    natural = halo.layout_plan(256, 8, False, 16)
    assert len(natural.rounds) == 1 and natural.rounds[0].perm == tuple((i, i + 1) for i in range(7))
    assert natural.source[0][0][0] == 2  # device 0: after 1 round and 1 own chunk, the last option: none
    assert halo.layout_plan(256, 8, True, 200) is None  # wider than what a halo saves: the strategy's own path


# ---- keys, pattern, model ----

def test_layer_windows_and_checks():
    base = ["configs/base.yml", "steps=1"]
    assert layer_windows(load_config([*base])) == (0,)
    assert layer_windows(load_config([*base, "sliding_window_size=8"])) == (8,)
    cfg = load_config([*base, "sliding_window_size=8", "attention_layer_pattern=LG"])
    assert layer_windows(cfg) == (8, 0)
    assert layer_windows(load_config([*base, "sliding_window_size=8", "attention_layer_pattern=LL"])) == (8,)
    with pytest.raises(ConfigError, match="only contain L"):
        load_config([*base, "sliding_window_size=8", "attention_layer_pattern=LX"])
    with pytest.raises(ConfigError, match="sliding_window_size=0"):
        load_config([*base, "attention_layer_pattern=LG"])
    # A pattern longer than the 2 layers (or not dividing them) ends part-way: LL here (maxctx.model.stacks).
    assert layer_windows(load_config([*base, "sliding_window_size=8", "attention_layer_pattern=LLG"])) == (8, 8, 0)
    with pytest.raises(ConfigError, match=">= 0"):
        load_config([*base, "sliding_window_size=-1"])
    mistral = load_config([*base, "model_name=mistral-7b-v0.1"])
    assert (mistral.sliding_window_size, layer_windows(mistral), mistral.vocab_size) == (4096, (4096,), 32000)


def test_grouped_scan_equals_unrolled_layers():
    """A period-2 pattern (LG) scanned over groups gives the unrolled model's loss and gradients."""
    from flax import nnx

    from maxctx.model.decoder import Decoder
    from maxctx.model.layers import ModelConfig

    cfg = load_config(["configs/base.yml", "sliding_window_size=4", "attention_layer_pattern=LG", "dtype=float32",
                       "base_num_decoder_layers=4", "attention=dot_product"])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(32), (2, 32))
    seg = jnp.ones((2, 32), jnp.int32)

    def loss_and_grads(scan: bool):
        import dataclasses

        mc = dataclasses.replace(ModelConfig.from_config(cfg), scan_layers=scan)
        model = Decoder(mc, nnx.Rngs(0))

        def loss(m):
            total, weight = m.loss_sums(tokens, pos, seg, tokens, jnp.ones_like(tokens))
            return total / weight

        value, grads = nnx.value_and_grad(loss)(model)
        return value, jax.tree.leaves(nnx.state(grads))

    (l1, g1), (l2, g2) = loss_and_grads(True), loss_and_grads(False)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, c in zip(g1, g2):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
    # And the window matters: the global-only model differs.
    cfg = dataclasses_replace(cfg, attention_layer_pattern="GG", sliding_window_size=0)
    glob = Decoder(ModelConfig.from_config(cfg), nnx.Rngs(0)).loss_sums(tokens, pos, seg, tokens,
                                                                        jnp.ones_like(tokens))
    assert abs(float(glob[0] / glob[1]) - float(l1)) > 1e-4


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_model_flops_count_the_band():
    """MFU's attention FLOPs: a local layer counts the band's pairs, brute-forced here, not S^2 / 2."""
    from maxctx.metrics.flops import attention_pairs, training_flops_per_step

    seg = np.asarray([[1] * 10 + [2] * 3 + [0] * 3])
    brute = sum(1 for i in range(16) for j in range(16)
                if seg[0, i] and seg[0, i] == seg[0, j] and 0 <= i - j < 4)
    assert attention_pairs(1, 16, segment_ids=seg, window=4) == brute
    assert attention_pairs(2, 1000, window=100) == 2 * (1000 * 100 - 100 * 100 / 2)
    assert attention_pairs(2, 1000, window=5000) == attention_pairs(2, 1000)
    base = ["configs/base.yml", "base_num_decoder_layers=4"]
    glob = training_flops_per_step(load_config(base), 8, 1024)
    local = training_flops_per_step(load_config([*base, "sliding_window_size=64"]), 8, 1024)
    mixed = training_flops_per_step(load_config([*base, "sliding_window_size=64", "attention_layer_pattern=LG"]),
                                    8, 1024)
    assert local < mixed < glob and np.isclose(mixed, (local + glob) / 2)
