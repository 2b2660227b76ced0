"""Attention sinks (GPT-OSS): the blockwise kernel on one device and every CP strategy at C = 4 equal a dense
reference written here, a softmax over [the masked scores, the head's sink] whose sink column carries no value:
forward, dQ/dK/dV and d sink (fp32, 1e-5 relative), and differ from attention without sinks. A sink merged once per
ring hop (or not at all, or with no gradient) fails the ring strategies' rows. Rows: one of one document and one
packed row, in natural, zig-zag and document-placement orders; global layers, and sliding-window layers zig-zag
(the halo exchange where a strategy takes it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import mask_from_positions
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.support.strategies import splits
from tests.test_softcap import inputs, orders

WINDOW = 6
SMALL = (32, 8, 2, 8, (5, 11, 9, 7))  # seq, heads, kv heads, head dim, row 1's documents


def sink_logits(heads: int) -> np.ndarray:
    # Around the rows' log-sum-exps (scores ~N(0, 9) over up to 32 keys), so the sink takes a real share of each row.
    return (2.0 + 1.5 * np.random.default_rng(1).normal(size=heads)).astype(np.float32)


def dense(q, k, v, pos, seg, sinks, window: int):
    """softmax over [masked q.k / sqrt(D), sink_h], the sink's column dropped before the product with V."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bshd,bthd->bhst", q, k) * q.shape[-1] ** -0.5
    scores = jnp.where(mask_from_positions(pos, seg, pos, seg, window)[:, None], scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhst,bthd->bshd", probs, v)


def grads(fn, q, k, v, pos, seg, sinks, dout):
    """[out, dq, dk, dv, dsinks] of fn(q, k, v, pos, seg, sinks) with cotangent dout."""
    out, pullback = jax.vjp(lambda q, k, v, s: fn(q, k, v, pos, seg, s), q, k, v, sinks)
    return [out, *pullback(dout)]


@functools.cache
def reference(shape, window: int, with_sinks: bool):
    q, k, v, pos, seg, dout = inputs(*shape)
    sinks = sink_logits(shape[1]) if with_sinks else np.full(shape[1], -np.inf, np.float32)
    fn = functools.partial(dense, window=window)
    return [np.asarray(x) for x in jax.jit(functools.partial(grads, fn))(q, k, v, pos, seg, sinks, dout)]


def assert_matches(got, shape, window: int, what: str):
    """got [out, dq, dk, dv, dsinks] equals the reference with sinks, and the one without is far from it."""
    want, plain = reference(shape, window, True), reference(shape, window, False)
    for name, g, w, u in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, plain):
        err = np.abs(np.asarray(g) - w).max() / np.abs(w).max()
        assert err < 1e-5, f"{what} {name}: relative error {err:.2e} against the dense reference with sinks"
        if name != "dsinks":  # without sinks there is no d sink to compare
            assert np.abs(u - w).max() / np.abs(w).max() > 0.05, f"{what} {name}: the sinks change nothing here"


def sinked(spec: AttentionSpec, mesh=None):
    return lambda q, k, v, pos, seg, sinks: attend(q, k, v, pos, seg, spec, mesh, sinks_H=sinks)


def test_blockwise_on_one_device():
    # Small blocks: the blockwise kernel's running max and its backward cross several key blocks per row; the
    # window leaves the first rows of each document few keys, where the sink's share is largest.
    q, k, v, pos, seg, dout = inputs(*SMALL)
    spec = AttentionSpec(kernel="blockwise", block_q=8, block_kv=4, window=WINDOW)
    got = jax.jit(functools.partial(grads, sinked(spec)))(q, k, v, pos, seg, sink_logits(SMALL[1]), dout)
    assert_matches(got, SMALL, WINDOW, f"blockwise window={WINDOW}")


def run_sharded(spec: AttentionSpec, ring: int, a2a: int, order_names, what: str, shape=SMALL):
    """attend with sinks under `spec` on a ring x a2a mesh, the batch stored in each of `order_names`, against the
    reference (one compile serves every order)."""
    mesh, cp = make_mesh(ring, a2a), ring * a2a
    q, k, v, pos, seg, dout = inputs(*shape)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    sinks = jax.device_put(sink_logits(shape[1]), NamedSharding(mesh, P()))
    fn = jax.jit(functools.partial(grads, sinked(spec, mesh)))
    put = [jax.device_put(x, sharding) for x in (q, k, v, pos, seg)]
    fn = fn.lower(*put, sinks, jax.device_put(dout, sharding)).compile(FAST_COMPILE)
    for name in order_names:
        perm = orders(shape[0], cp, pos, seg)[name]
        stored = [np.take_along_axis(x, perm.reshape(*perm.shape, *[1] * (x.ndim - 2)), 1)
                  for x in (q, k, v, pos, seg, dout)]
        out, dq, dk, dv, dsinks = fn(*[jax.device_put(x, sharding) for x in stored[:5]], sinks,
                                     jax.device_put(stored[5], sharding))
        back = [np.stack([np.asarray(g)[b][np.argsort(perm[b])] for b in range(2)]) for g in (out, dq, dk, dv)]
        assert_matches([*back, dsinks], shape, spec.window, f"{what} {name}")


@pytest.mark.parametrize("strategy,ring,a2a", splits((4,)), ids=str)
def test_strategies_with_load_balance_and_packing(strategy, ring, a2a):
    # Local layers zig-zag: the halo exchange where the strategy takes one (all_gather, p2p, usp; a2a's own path).
    base = AttentionSpec(kernel="blockwise", strategy=strategy, block_q=4, block_kv=4)
    run_sharded(base, ring, a2a, ("natural", "zigzag", "documents"), f"{strategy} global")
    spec = dataclasses.replace(base, window=WINDOW, load_balance=True)
    run_sharded(spec, ring, a2a, ("zigzag",), f"{strategy} window={WINDOW}")


def test_splash_keys_gathered_in_document_order():
    # all_gather under the documents placement: splash's keys, gathered from every rank, are sorted back into
    # document order before the sink's kernel call, and dK/dV put back after it (Pallas interpret mode on CPU).
    from maxctx.attention.kernels import splash

    spec = AttentionSpec(kernel="splash", strategy="all_gather", block_q=128, block_kv=128, load_balance="documents",
                         splash_blocks=splash.Blocks(ring_backward=False))
    run_sharded(spec, 2, 1, ("documents",), "splash all_gather", shape=(256, 2, 1, 128, (60, 120, 76)))
