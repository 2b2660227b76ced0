"""Every CP strategy against the single-device reference: outputs and dQ/dK/dV, fp32, 1e-5 relative.

The matrix: strategy x load balance x {MHA, GQA with K < C} x {packed, unpacked} x C in {2, 4, 8} (usp: 2x2, 2x4,
4x2). To compile little: row 0 of the batch is one document and row 1 is packed (so one call covers both), and
both token orders go through the same compiled function (with position masks the program does not depend on the
order; only splash's static masks do, and tests/test_attention_tpu_compile.py covers those).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import restore_order, zigzag_permutation
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import dot_product_attention
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.support.strategies import splits

SEQ, DIM, HEADS = 32, 8, 8


def inputs(kv_heads: int, seed: int = 0, lengths: tuple[int, ...] = (5, 11, 9, 7)):
    """Two sequences of sum(lengths) tokens: row 0 one document, row 1 packed (documents of `lengths` tokens)."""
    seq = sum(lengths)
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, seq, HEADS, DIM)).astype(np.float32)
    k = rng.normal(size=(2, seq, kv_heads, DIM)).astype(np.float32)
    v = rng.normal(size=(2, seq, kv_heads, DIM)).astype(np.float32)
    dout = rng.normal(size=(2, seq, HEADS, DIM)).astype(np.float32)
    seg = np.stack([np.ones(seq, np.int32), np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)])
    pos = np.stack([np.arange(seq), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    return q, k, v, pos, seg, dout


def vjp_of(fn, q, k, v, pos, seg, dout):
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
    return (out, *pullback(dout))


@functools.cache
def reference(kv_heads: int):
    q, k, v, pos, seg, dout = inputs(kv_heads)
    fn = lambda q, k, v, p, s: dot_product_attention(q, k, v, p, s, p, s)[0]  # noqa: E731
    return [np.asarray(x) for x in jax.jit(functools.partial(vjp_of, fn))(q, k, v, pos, seg, dout)]


def assert_close(got, want, what):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


def run_strategy(strategy: str, ring: int, a2a: int, kv_heads: int, kernel: str = "flash",
                 orders: tuple[bool, ...] = (False, True), tensor: int = 1, ring_backward_overlap: bool = False):
    mesh = make_mesh(ring, a2a, tensor)
    cp = ring * a2a
    spec = AttentionSpec(kernel=kernel, strategy=strategy, block_q=8, block_kv=4,
                         ring_backward_overlap=ring_backward_overlap)
    fn = jax.jit(functools.partial(vjp_of, functools.partial(attend, spec=spec, mesh=mesh)))
    q, k, v, pos, seg, dout = inputs(kv_heads)
    want = reference(kv_heads)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    fn = fn.lower(*[jax.device_put(x, sharding) for x in (q, k, v, pos, seg, dout)]).compile(FAST_COMPILE)
    for load_balance in orders:
        perm = zigzag_permutation(SEQ, cp) if load_balance else np.arange(SEQ)
        args = [jax.device_put(x[:, perm], sharding) for x in (q, k, v, pos, seg, dout)]  # heads: jit reshards
        got = fn(*args)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            g = np.asarray(g)
            if load_balance:
                g = restore_order(g, cp)
            assert_close(g, w, f"{strategy} C={cp} ({ring}x{a2a}) K={kv_heads} load_balance={load_balance} {name}")


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("strategy,ring,a2a", splits((2, 4, 8)), ids=lambda x: str(x))
def test_strategy_matches_reference(strategy, ring, a2a, heads):
    # GQA with fewer kv heads than C (and than the A2A degree): K = 1 for C = 2, else K = 2.
    kv_heads = HEADS if heads == "mha" else (1 if ring * a2a == 2 else 2)
    run_strategy(strategy, ring, a2a, kv_heads)


@pytest.mark.parametrize("strategy,ring,a2a", [("p2p", 2, 1), ("p2p", 8, 1), ("usp", 4, 2), ("usp", 1, 4)])
def test_ring_backward_overlap_matches_reference(strategy, ring, a2a):
    # The software-pipelined backward (ring_backward_overlap): R = 2 (no loop trips), R = 8, and a ring of one rank
    # (usp with U = C: nothing to pipeline); GQA.
    run_strategy(strategy, ring, a2a, kv_heads=2 if ring * a2a > 2 else 1, ring_backward_overlap=True)


@pytest.mark.parametrize("strategy", ["p2p", "all_gather", "a2a"])
def test_dot_product_kernel_under_cp(strategy):
    ring, a2a = (1, 4) if strategy == "a2a" else (4, 1)
    run_strategy(strategy, ring, a2a, kv_heads=2, kernel="dot_product", orders=(True,))


@pytest.mark.parametrize("strategy,ring,a2a,kv_heads", [("p2p", 2, 1, 1), ("usp", 2, 2, 2), ("a2a", 1, 2, 1)])
def test_with_tensor_parallel_heads(strategy, ring, a2a, kv_heads):
    # Heads sharded over tensor = 2; with one kv head it is replicated and each device keeps the one it needs.
    run_strategy(strategy, ring, a2a, kv_heads, orders=(True,), tensor=2)


def test_aliases_and_single_device():
    mesh = make_mesh(1, 1)
    q, k, v, pos, seg, _ = inputs(2)
    want = dot_product_attention(q, k, v, pos, seg, pos, seg)[0]
    for strategy in ("ring", "ulysses"):
        got = attend(q, k, v, pos, seg, AttentionSpec(kernel="flash", strategy=strategy), mesh)
        assert_close(np.asarray(got), np.asarray(want), strategy)
    got = attend(q, k, v, pos, seg, AttentionSpec(kernel="flash"), None)
    assert_close(np.asarray(got), np.asarray(want), "no mesh")
