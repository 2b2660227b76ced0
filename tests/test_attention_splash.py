"""Splash's index-based masks under zig-zag ring hops, checked on CPU in Pallas interpret mode (slow: one case).

p2p over C = 2 with load balance: each device runs the hop kernels it picks by mesh index (diagonal, and the
off-diagonal mask of its zig-zag chunks), with a packed row whose segment ids cut documents across chunks. The
forward output must equal the single-device reference (the ring's backward hops use the flash backward, covered
by tests/test_context_parallel.py).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.dot_product import dot_product_attention
from maxctx.attention.load_balance import restore_order, zigzag_permutation
from tests.test_context_parallel import make_mesh

S, H, K, D = 512, 2, 1, 128


def test_splash_p2p_zigzag_matches_reference():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, S, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(2, S, K, D)).astype(np.float32) for _ in range(2))
    lengths = [100, 250, 162]
    seg = np.stack([np.ones(S), np.repeat(np.arange(1, 4), lengths)]).astype(np.int32)
    pos = np.stack([np.arange(S), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    want = np.asarray(dot_product_attention(q, k, v, pos, seg, pos, seg)[0])

    mesh = make_mesh(2, 1)
    spec = AttentionSpec(kernel="splash", strategy="p2p", load_balance=True, block_q=128, block_kv=128)
    perm = zigzag_permutation(S, 2)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = [jax.device_put(x[:, perm], sharding) for x in (q, k, v, pos, seg)]
    got = restore_order(np.asarray(jax.jit(lambda *a: attend(*a, spec, mesh))(*args)), 2)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, f"splash p2p zig-zag: relative error {err:.2e}"
