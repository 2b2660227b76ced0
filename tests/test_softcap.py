"""attn_logits_soft_cap (Gemma 2): every kernel and every CP strategy equals a dense soft-capped reference written
here, forward and dQ/dK/dV (fp32, 1e-5 relative), and differs from the uncapped attention: a kernel, hop or
backward that drops the cap (or its tanh derivative) fails. cuDNN, which has no soft-cap, is refused in one line.

Scores are ~N(0, 9) and the cap is 2, so the cap changes every row. The strategy matrix runs at C = 4: one row of
one document and one packed row, in natural, zig-zag and document-placement orders, global and sliding-window layers
(the halo exchange where the strategy takes it); splash (and tokamax's splash) in Pallas interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import document_permutation, zigzag_permutation
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import mask_from_positions
from maxctx.attention.kernels.local import make_band, make_local
from maxctx.config import ConfigError
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.support.strategies import splits

CAP, WINDOW = 2.0, 6


def inputs(seq: int, heads: int, kv_heads: int, dim: int, lengths: tuple[int, ...]):
    """q, k, v, dout [2, seq, ...] fp32, positions and segment ids [2, seq]: row 0 one document, row 1 `lengths`."""
    rng = np.random.default_rng(0)
    q = 3 * rng.normal(size=(2, seq, heads, dim)).astype(np.float32)
    k, v = (rng.normal(size=(2, seq, kv_heads, dim)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=q.shape).astype(np.float32)
    seg = np.stack([np.ones(seq), np.repeat(np.arange(1, len(lengths) + 1), lengths)]).astype(np.int32)
    pos = np.stack([np.arange(seq), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    return q, k, v, pos, seg, dout


def dense(q, k, v, pos, seg, cap: float, window: int):
    """Soft-capped attention written out: softmax over masked cap * tanh(q.k / sqrt(D) / cap)."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bshd,bthd->bhst", q, k) * q.shape[-1] ** -0.5
    if cap:
        scores = cap * jnp.tanh(scores / cap)
    mask = mask_from_positions(pos, seg, pos, seg, window)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,bthd->bshd", probs, v)


def grads(fn, q, k, v, pos, seg, dout):
    """[out, dq, dk, dv] of fn(q, k, v, pos, seg) with cotangent dout."""
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
    return [out, *pullback(dout)]


@functools.cache
def reference(seq: int, heads: int, kv_heads: int, dim: int, lengths: tuple[int, ...], window: int, cap: float):
    args = inputs(seq, heads, kv_heads, dim, lengths)
    fn = functools.partial(dense, cap=cap, window=window)
    return [np.asarray(x) for x in jax.jit(functools.partial(grads, fn))(*args)]


def assert_matches(got, shape, window: int, what: str):
    """got [out, dq, dk, dv] equals the soft-capped reference, and the uncapped one is far from it."""
    want, uncapped = reference(*shape, window, CAP), reference(*shape, window, 0.0)
    for name, g, w, u in zip(("out", "dq", "dk", "dv"), got, want, uncapped):
        err = np.abs(np.asarray(g) - w).max() / np.abs(w).max()
        assert err < 1e-5, f"{what} {name}: relative error {err:.2e} against the soft-capped reference"
        assert np.abs(u - w).max() / np.abs(w).max() > 0.05, f"{what} {name}: the cap changes nothing here"


SMALL = (32, 8, 2, 8, (5, 11, 9, 7))  # seq, heads, kv heads, head dim, row 1's documents


@pytest.mark.parametrize("kernel", ["dot_product", "blockwise"])
def test_kernels_on_one_device(kernel):
    # Small blocks: the blockwise kernel's running max and its backward cross several key blocks per row.
    q, k, v, pos, seg, dout = inputs(*SMALL)
    for window in (0, WINDOW):
        spec = AttentionSpec(kernel=kernel, block_q=8, block_kv=4, window=window, logit_softcap=CAP)
        got = jax.jit(functools.partial(grads, functools.partial(attend, spec=spec)))(q, k, v, pos, seg, dout)
        assert_matches(got, SMALL, window, f"{kernel} window={window}")


def orders(seq: int, cp: int, pos, seg) -> dict:
    return {"natural": np.tile(np.arange(seq), (2, 1)), "zigzag": np.tile(zigzag_permutation(seq, cp), (2, 1)),
            "documents": np.stack([document_permutation(p, s, cp) for p, s in zip(pos, seg)])}


def run_sharded(spec: AttentionSpec, ring: int, a2a: int, shape, order_names, what: str):
    """Checks attend under `spec` on a ring x a2a mesh, the batch stored in each of `order_names`, against the
    reference (the blockwise kernel's program does not depend on the order: one compile serves them all)."""
    mesh, cp = make_mesh(ring, a2a), ring * a2a
    q, k, v, pos, seg, dout = inputs(*shape)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    fn = jax.jit(functools.partial(grads, functools.partial(attend, spec=spec, mesh=mesh)))
    fn = fn.lower(*[jax.device_put(x, sharding) for x in (q, k, v, pos, seg, dout)]).compile(FAST_COMPILE)
    for name in order_names:
        perm = orders(shape[0], cp, pos, seg)[name]
        stored = [np.take_along_axis(x, perm.reshape(*perm.shape, *[1] * (x.ndim - 2)), 1)
                  for x in (q, k, v, pos, seg, dout)]
        got = fn(*[jax.device_put(x, sharding) for x in stored])
        back = [np.stack([np.asarray(g)[b][np.argsort(perm[b])] for b in range(2)]) for g in got]
        assert_matches(back, shape, spec.window, f"{what} {name}")


@pytest.mark.parametrize("strategy,ring,a2a", splits((4,)), ids=str)
def test_strategies_with_load_balance_and_packing(strategy, ring, a2a):
    # Global layers in every order; local layers zig-zag (the halo exchange under all_gather, p2p and usp) and
    # under the documents placement (the strategy's own path, the window in the kernel's mask).
    base = AttentionSpec(kernel="blockwise", strategy=strategy, block_q=4, block_kv=4, logit_softcap=CAP)
    run_sharded(base, ring, a2a, SMALL, ("natural", "zigzag", "documents"), f"{strategy} global")
    for load_balance, order in ((True, "zigzag"), ("documents", "documents")):
        spec = dataclasses.replace(base, window=WINDOW, load_balance=load_balance)
        run_sharded(spec, ring, a2a, SMALL, (order,), f"{strategy} window={WINDOW}")


def test_reference_kernel_on_a_ring():
    # The reference kernel's ring hops: forward per hop, backward from the merged out and lse.
    spec = AttentionSpec(kernel="dot_product", strategy="p2p", logit_softcap=CAP)
    run_sharded(spec, 4, 1, SMALL, ("zigzag",), "dot_product p2p")


SPLASH = (512, 2, 1, 128, (100, 250, 162))


@pytest.mark.parametrize("strategy,ring,a2a,tokamax,window,order", [
    # Ring hops: splash's forward with residuals, its dQ/dK/dV from the merged out and lse.
    ("p2p", 2, 1, False, 0, "zigzag"),
    ("a2a", 1, 2, False, 0, "zigzag"),  # one call through splash's own custom VJP
    # The documents kernel (tables and q_sequence from each call's ids), its ring hops' backward blockwise
    # (Blocks.ring_backward=False: what a JAX without splash's backward kernels runs).
    ("p2p", 2, 1, False, 0, "documents"),
    ("all_gather", 2, 1, False, 128, "zigzag"),  # a local layer's band kernel (the halo exchange)
    ("p2p", 2, 1, True, 0, "zigzag")])  # tokamax's forward and fused backward on the ring's hops
def test_splash_kernels(strategy, ring, a2a, tokamax, window, order, monkeypatch):
    from maxctx.attention.kernels import flash, splash, tokamax_splash

    if tokamax:
        assert tokamax_splash.installed(), "tokamax is not installed; the test extra has it"
    documents = order == "documents"
    if not documents:
        monkeypatch.setattr(flash, "flash_backward", None)  # no hop may take the blockwise backward
    spec = AttentionSpec(kernel="splash", strategy=strategy, block_q=128, block_kv=128, logit_softcap=CAP,
                         tokamax=tokamax, window=window, load_balance="documents" if documents else True,
                         splash_blocks=splash.Blocks(ring_backward=not documents))
    run_sharded(spec, ring, a2a, SPLASH, (order,), f"{'tokamax' if tokamax else 'splash'} {strategy}")


def test_cudnn_is_refused_in_one_line():
    from maxctx.loader import load_config

    for build in (lambda: make_local("cudnn", 512, 512, softcap=CAP),
                  lambda: make_band("cudnn", 512, 512, chunk=8, halo=8, window=8, softcap=CAP)):
        with pytest.raises(ConfigError, match=r"^attn_logits_soft_cap=2.0 .*cudnn has no logit soft-cap") as e:
            build()
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^attn_logits_soft_cap=50.0 needs attention=auto, blockwise"):
        load_config(["configs/base.yml", "attention=cudnn", "dtype=bfloat16", "attn_logits_soft_cap=50"])
    with pytest.raises(ConfigError, match=r"^attn_logits_soft_cap=-1.0 must be >= 0"):
        load_config(["configs/base.yml", "attn_logits_soft_cap=-1"])
    config = load_config(["configs/base.yml", "attn_logits_soft_cap=50"])
    assert AttentionSpec.from_config(config).logit_softcap == 50.0
