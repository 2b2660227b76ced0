"""use_tokamax_splash=true: tokamax's splash kernel (the test extra installs tokamax) behind maxctx's masks equals
the dense fp32 reference and maxctx's splash on out and dQ/dK/dV, in Pallas interpret mode on CPU: per-shard calls
(all_gather, a2a) causal and with a sliding window, the halo exchange's band kernel, and a p2p ring whose hops merge
lse and run tokamax's fused backward on the merged out and lse. Without tokamax, splash runs as maxctx's own and
says how to get tokamax's; MaxText's key loads."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import restore_order, zigzag_permutation
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels import tokamax_splash
from maxctx.attention.kernels.dot_product import dot_product_attention
from maxctx.loader import load_config
from tests.support.meshes import make_mesh

S, H, K, D = 512, 2, 1, 128


def run_attention(strategy: str, ring: int, a2a: int, window: int, tokamax: bool, kernel: str = "splash"):
    """[out, dq, dk, dv] in original token order for one packed and one unpacked row, zig-zag over C = ring x a2a."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, S, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(2, S, K, D)).astype(np.float32) for _ in range(2))
    lengths = [100, 250, S - 350]
    seg = np.stack([np.ones(S), np.repeat(np.arange(1, 4), lengths)]).astype(np.int32)
    pos = np.stack([np.arange(S), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    dout = rng.normal(size=q.shape).astype(np.float32)

    def grads(fn, q, k, v, pos, seg, dout):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
        return [out, *pullback(dout)]

    if kernel == "dot_product":
        return grads(lambda *a: dot_product_attention(*a, a[3], a[4], window)[0], q, k, v, pos, seg, dout)
    mesh, cp = make_mesh(ring, a2a), ring * a2a
    spec = AttentionSpec(kernel=kernel, strategy=strategy, load_balance=True, block_q=128, block_kv=128,
                         window=window, tokamax=tokamax)
    perm = zigzag_permutation(S, cp)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = [jax.device_put(x[:, perm], sharding) for x in (q, k, v, pos, seg, dout)]
    got = jax.jit(lambda *a: grads(lambda *b: attend(*b, spec, mesh), *a))(*args)
    return [restore_order(np.asarray(g), cp) for g in got]


def assert_close(got, want, what: str, tolerance: float = 1e-5):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < tolerance, f"{what} {name}: relative error {err:.2e}"


def require_tokamax():
    assert tokamax_splash.installed(), ("tokamax is not installed; the test extra has it: pip install -c "
                                        ".ci/constraints.txt -e '.[test]'")


@pytest.mark.parametrize("strategy,ring,a2a,window", [
    ("all_gather", 2, 1, 0),  # per-shard call (all_gather's gathered zig-zag keys), causal; against splash too
    ("a2a", 1, 2, 100),  # a2a's whole-sequence call with a sliding window
    ("all_gather", 2, 1, 128),  # a local layer's band kernel (halo exchange)
    ("p2p", 2, 1, 0)])  # ring hops: lse merge and tokamax's fused backward from the merged out and lse
def test_tokamax_matches_reference(strategy, ring, a2a, window, monkeypatch):
    from maxctx.attention.kernels import flash

    require_tokamax()
    monkeypatch.setattr(flash, "flash_backward", None)  # no hop may take the blockwise backward
    got = run_attention(strategy, ring, a2a, window, tokamax=True)
    assert_close(got, run_attention(strategy, ring, a2a, window, False, "dot_product"), f"tokamax {strategy}")
    if strategy == "all_gather" and not window:
        assert_close(got, run_attention(strategy, ring, a2a, window, tokamax=False), "tokamax against splash")


def test_resolve_picks_tokamax_only_for_splash():
    require_tokamax()
    assert tokamax_splash.resolve("splash", True) == tokamax_splash.NAME
    assert tokamax_splash.resolve("splash", False) == "splash"
    assert tokamax_splash.resolve("blockwise", True) == "blockwise"  # MaxText's meaning: which splash runs


def test_without_tokamax_splash_is_maxctxs_and_says_how_to_install(monkeypatch, caplog):
    monkeypatch.setattr(tokamax_splash, "installed", lambda: False)
    tokamax_splash._fallback_notice.cache_clear()
    with caplog.at_level(logging.WARNING, logger=tokamax_splash.__name__):
        assert tokamax_splash.resolve("splash", True) == "splash"
        assert tokamax_splash.resolve("splash", True) == "splash"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install maxctx[tokamax]" in lines[0], lines
    tokamax_splash._fallback_notice.cache_clear()


def test_maxtext_key_loads():
    config = load_config(["configs/base.yml", "use_tokamax_splash=true", "attention=splash"])
    assert config.use_tokamax_splash and AttentionSpec.from_config(config).tokamax
    assert not AttentionSpec.from_config(load_config(["configs/base.yml"])).tokamax
