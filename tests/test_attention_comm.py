"""Collective bytes of one attention layer's forward and backward, from the compiled HLO, against each strategy
module's `collectives` formulas, the ones the roofline uses (within 10%). Per device; B batch per device, S
sequence, C CP degree, H/K heads, D head dim, b bytes per element, ids int32."""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import KINDS, AttentionShape, by_kind
from maxctx.attention.cp.sharded import shard_map
from maxctx.attention.dispatch import AttentionSpec, attend
from tests.support.hlo import collective_bytes
from tests.support.meshes import make_mesh

B, S, H, K, D, b = 2, 64, 8, 2, 16, 4
OPS = KINDS


def compiled_bytes(strategy: str, ring: int, a2a: int, backward: bool, window: int = 0, seq: int = S,
                   ring_backward_overlap: bool = False, dv: int = D) -> Counter:
    """Collective bytes per kind of one attention layer (forward, or forward + backward) from the compiled HLO."""
    mesh = make_mesh(ring, a2a)
    spec = AttentionSpec(kernel="flash", strategy=strategy, block_q=16, block_kv=16, window=window,
                         ring_backward_overlap=ring_backward_overlap)
    bs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    qs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a"), "tensor", None))
    sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = [sd((B, seq, H, D), sharding=qs), sd((B, seq, K, D), sharding=qs), sd((B, seq, K, dv), sharding=qs),
            jax.ShapeDtypeStruct((B, seq), jnp.int32, sharding=bs),
            jax.ShapeDtypeStruct((B, seq), jnp.int32, sharding=bs)]

    def fwd(q, k, v, pos, seg):
        return attend(q, k, v, pos, seg, spec, mesh)

    def fwd_bwd(q, k, v, pos, seg):
        out, pullback = jax.vjp(lambda q, k, v: fwd(q, k, v, pos, seg), q, k, v)
        return pullback(out)

    return collective_bytes(jax.jit(fwd_bwd if backward else fwd).lower(*args).compile().as_text())


def expected(strategy: str, ring: int, a2a: int, dv: int = D, window: int = 0) -> tuple[dict, dict]:
    """The strategy's own formulas (what the roofline uses): (forward, backward) bytes per collective kind."""
    shape = AttentionShape(batch=B, seq=S, heads=H, kv_heads=K, head_dim=D, itemsize=b, cp=ring * a2a, a2a=a2a,
                           value_head_dim=dv, window=window)
    fwd, bwd = strategies.get(strategy).comm_volume(shape)
    return by_kind(fwd), by_kind(bwd)


@pytest.mark.parametrize("strategy,ring,a2a,overlap", [
    ("all_gather", 4, 1, False), ("p2p", 4, 1, False), ("p2p", 8, 1, False), ("a2a", 1, 4, False),
    ("usp", 2, 4, False), ("usp", 4, 2, False),
    ("p2p", 8, 1, True), ("usp", 4, 2, True)])  # the pipelined ring backward sends as much
def test_collective_bytes_match_docstring(strategy, ring, a2a, overlap):
    want_fwd, want_bwd = expected(strategy, ring, a2a)
    got_fwd = compiled_bytes(strategy, ring, a2a, backward=False)
    got_all = compiled_bytes(strategy, ring, a2a, backward=True, ring_backward_overlap=overlap)
    for kind in OPS:
        f, bw = want_fwd.get(kind, 0), want_bwd.get(kind, 0)
        assert np.isclose(got_fwd[kind], f, rtol=0.1), f"{strategy} forward {kind}: HLO {got_fwd[kind]} vs {f}"
        assert np.isclose(got_all[kind], f + bw, rtol=0.1), (
            f"{strategy} forward+backward {kind}: HLO {got_all[kind]} vs {f + bw}")


@pytest.mark.parametrize("strategy,ring,a2a,window", [
    ("p2p", 4, 1, 0), ("a2a", 1, 4, 0), ("p2p", 4, 1, 8)])
def test_mla_value_head_dim(strategy, ring, a2a, window):
    # MLA's shape: V (and the output) narrower than q and k (128 against 192 as released; 6 against 16 here). The
    # formulas price K and V at their own widths (a window: the halo's pieces), as the program moves them; usp
    # sums a2a's and p2p's formulas, all_gather's are the ring's K/V without the hops.
    want_fwd, want_bwd = expected(strategy, ring, a2a, dv=6, window=window)
    got = compiled_bytes(strategy, ring, a2a, backward=True, dv=6, window=window)
    for kind in OPS:
        want = want_fwd.get(kind, 0) + want_bwd.get(kind, 0)
        assert np.isclose(got[kind], want, rtol=0.02), f"{strategy} forward+backward {kind}: HLO {got[kind]} vs {want}"


def test_collectives_in_a_loop_without_a_known_trip_count_raise():
    # The ring's hops are a while loop whose collectives count once per iteration; a loop XLA cannot count must
    # not be counted once silently.
    mesh = make_mesh(4, 1)

    def body(x, n):
        step = lambda c: (c[0] + 1, jax.lax.ppermute(c[1], "context", [(i, (i + 1) % 4) for i in range(4)]))  # noqa: E731
        return jax.lax.while_loop(lambda c: c[0] < n[0], step, (0, x))[1]

    fn = shard_map(body, mesh, (P("context"), P()), P("context"))
    hlo = jax.jit(fn).lower(jnp.zeros((8, 4)), jnp.ones((1,), jnp.int32)).compile().as_text()
    with pytest.raises(ValueError, match="trip count"):
        collective_bytes(hlo)
