"""The ring's hops are one loop: the compiled program does not grow with the CP degree, and splash builds a few
kernels for the whole ring, not a set per hop. (p2p against the single-device reference at C = 2, 4, 8:
tests/test_context_parallel.py; collective bytes with the loop's trip count: tests/test_attention_comm.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import stored_order
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels import index_runs
from maxctx.attention.kernels.local import make_local
from tests.support.meshes import FAST_COMPILE, make_mesh


def p2p_fwd_bwd_hlo(cp: int) -> str:
    mesh = make_mesh(cp, 1)
    spec = AttentionSpec(kernel="flash", strategy="p2p", block_q=8, block_kv=8)
    seq, heads, kv_heads, dim = 16 * cp, 4, 2, 8
    qs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a"), "tensor", None))
    bs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32, sharding=qs)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=bs)
    args = [sd((1, seq, heads, dim)), sd((1, seq, kv_heads, dim)), sd((1, seq, kv_heads, dim)), ids, ids]

    def loss(q, k, v, pos, seg):
        return attend(q, k, v, pos, seg, spec, mesh).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(*args).compile(FAST_COMPILE).as_text()


def test_collective_permutes_in_the_program_do_not_grow_with_c():
    counts, lines = {}, {}
    for cp in (2, 4, 8):
        hlo = p2p_fwd_bwd_hlo(cp).splitlines()
        counts[cp] = sum(f" {op}(" in line for line in hlo for op in ("collective-permute", "collective-permute-start"))
        lines[cp] = len(hlo)
    # Forward: K/V and ids in the loop body; backward: K/V, ids and dK/dV in the body, dK/dV of the peeled hop.
    # (Unrolled hops gave 6, 16 and 36.)
    assert counts[2] > 0 and len(set(counts.values())) == 1, f"collective-permutes in the HLO text by C: {counts}"
    assert lines[8] <= 1.05 * lines[4], f"HLO lines by C: {lines}"  # at C = 2 XLA inlines the one-trip loop


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp,seq", [(8, 2048), (64, 2 ** 16)])
def test_splash_ring_builds_three_kernels_whatever_c(cp, seq, load_balance):
    # The masks of (query shard, key block) pairs come in three kinds (diagonal, key block before, after), the
    # same at every hop: one kernel each, picked by a [hop, query shard] table.
    local = make_local("splash", 512, 512, order=stored_order(seq, cp, load_balance), q_shards=cp, kv_blocks=cp,
                       q_axes="context", ring=True)
    assert len(local.splash_kernels) == 3
    table = np.asarray(local.splash_table)
    assert table.shape == (cp, cp)
    diagonal = table[0, 0]  # hop 0: every shard against its own block
    assert (table[0] == diagonal).all() and (table[1:] != diagonal).all(), table


@pytest.mark.parametrize("order", ["zigzag", "natural", "random"])
def test_rank_runs_equal_the_dense_ranks(order):
    # The O(runs) key of a (query shard, key block) pair is its dense ranks in the union, as runs.
    seq, cp = 96, 4
    perm = {"zigzag": stored_order(seq, cp, True), "natural": np.arange(seq),
            "random": np.random.default_rng(0).permutation(seq)}[order]
    n = seq // cp
    for r in range(cp):
        for b in range(cp):
            q_orig, kv_orig = perm[r * n:(r + 1) * n], perm[b * n:(b + 1) * n]
            union = np.unique(np.concatenate([q_orig, kv_orig]))
            q_key, kv_key = index_runs.ranked(index_runs.runs(q_orig), index_runs.runs(kv_orig))
            np.testing.assert_array_equal(index_runs.expand(q_key), np.searchsorted(union, q_orig))
            np.testing.assert_array_equal(index_runs.expand(kv_key), np.searchsorted(union, kv_orig))
            for key in (q_key, kv_key):  # maximal runs: the key is canonical
                assert all(a + la != c for (a, la), (c, _) in zip(key, key[1:])), key
