"""maxctx.attention.kernels.cudnn off GPU: which call a layout takes (statically, and on the device from positions and
segment ids), the packed layout's offsets, lengths and residual index, and the three calls run through jax.nn's
XLA implementation (implementation='xla') against the reference kernel, outputs, lse and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxctx.attention.cp.load_balance import stored_order
from maxctx.attention.kernels import cudnn
from maxctx.attention.kernels.dot_product import dot_product_attention
from maxctx.attention.kernels.local import make_band, make_local

S = 32


def layout(*rows, seq: int = S):
    """(positions, segment ids)[B, seq] from each row's document starts (ids 1, 2, ... and positions from 0)."""
    pos, seg = np.zeros((len(rows), seq), np.int32), np.zeros((len(rows), seq), np.int32)
    for r, starts in enumerate(rows):
        for i, (a, e) in enumerate(zip(starts, [*starts[1:], seq])):
            seg[r, a:e], pos[r, a:e] = i + 1, np.arange(e - a)
    return jnp.asarray(pos), jnp.asarray(seg)


def path(pos, seg, kv_pos=None, kv_seg=None, max_documents=4, packed=True) -> str:
    kv_pos = pos if kv_pos is None else kv_pos
    kv_seg = seg if kv_seg is None else kv_seg
    return cudnn.PATHS[int(cudnn.choose_path(pos, seg, kv_pos, kv_seg, max_documents, packed))]


def test_packed_layout_offsets_and_lengths():
    _, seg = layout([0, 5, 20], [0])
    offsets, lengths = cudnn.packed_layout(seg, 4)
    assert offsets.tolist() == [[0, 5, 20, -1, -1], [0, -1, -1, -1, -1]]
    assert lengths.tolist() == [[5, 15, 12, -1], [32, -1, -1, -1]]
    assert offsets.dtype == lengths.dtype == jnp.int32
    # the residual index: documents numbered over the batch, tokens at their index in their document
    sequence, local = cudnn.packed_residual_index(seg, 4)
    assert sequence[0].tolist() == [0] * 5 + [1] * 15 + [2] * 12 and sequence[1].tolist() == [3] * S
    assert local[0].tolist() == [*range(5), *range(15), *range(12)] and local[1].tolist() == list(range(S))


def test_path_from_positions_and_segment_ids():
    assert path(*layout([0], [0])) == "causal"
    assert path(*layout([0], [0, 9])) == "packed"  # one row with two documents: the batch goes packed
    assert path(*layout([0, 3, 6, 9, 12], [0])) == "masked"  # 5 documents, over max_documents=4
    assert path(*layout([0], [0, 9]), packed=False) == "masked"  # no packed call on this machine
    pos, seg = layout([0, 20])
    assert path(pos.at[0, 20:].set(0), seg.at[0, 20:].set(0)) == "masked"  # the data pipeline's padding
    assert path(pos, seg.at[0, 25:].set(1)) == "masked"  # id 1 comes back after id 2
    assert path(pos.at[0, 10].set(11), seg) == "masked"  # positions skip inside a document
    order = stored_order(S, 2, True)  # zig-zag: positions jump inside a document
    assert path(pos[:, order], seg[:, order]) == "masked"
    assert path(pos, seg, kv_pos=pos + 1) == "masked"  # queries and keys are not the same tokens
    # a document may start at any position, and ids need not start at 1
    assert path(pos + 7, seg + 3) == "packed"


def test_path_per_layout():
    """Statically: only calls whose queries and keys are the whole sequence in natural order may take the fast
    calls (the device test then decides); CP shards, ring hops, zig-zag and halo bands compile the masked one."""
    natural = lambda **kw: make_local("cudnn", 128, 128, **kw).natural  # noqa: E731
    assert natural(order=np.arange(S))  # no mesh, all_gather at C = 1, a2a without load balance
    assert not natural(order=stored_order(S, 2, True))  # a2a with zig-zag
    assert not natural(order=stored_order(S, 2, False), q_shards=2)  # all_gather's query shards
    assert not natural(order=stored_order(S, 2, False), q_shards=2, kv_blocks=2, ring=True)  # p2p
    assert not natural()  # no order given
    assert not make_band("cudnn", 128, 128, chunk=16, halo=8, window=8).natural

    q = jnp.zeros((1, S, 2, 8))
    pos, seg = layout([0])

    def conds(natural: bool, kv_len: int = S) -> int:
        kv = jnp.zeros((1, kv_len, 2, 8))
        kv_pos, kv_seg = layout([0], seq=kv_len)
        jaxpr = jax.make_jaxpr(lambda *a: cudnn.cudnn_attention(*a, natural=natural, implementation="xla"))(
            q, kv, kv, pos, seg, kv_pos, kv_seg)
        return str(jaxpr).count("cond[")

    assert conds(True) == 1 and conds(False) == 0 and conds(True, kv_len=2 * S) == 0

    calls = lambda shape, **kw: tuple(cudnn.PATHS[c] for c in cudnn.compiled_calls(shape, shape[1], **kw))  # noqa
    assert calls((2, S, 4, 8), natural=True, implementation="xla") == ("masked", "causal", "packed")
    assert calls((2, S, 4, 8), natural=True) == ("masked", "causal")  # no cuDNN here: no packed call
    assert calls((2, S, 4, 8), natural=False, implementation="xla") == ("masked",)
    assert calls((2, S, 4, 8), natural=True, max_documents=1, implementation="xla") == ("masked", "causal")
    # JAX's packed offsets count elements in int32: B S H D must stay below 2^31
    assert calls((4, 2 ** 17, 32, 128), natural=True, implementation="xla") == ("masked", "causal")
    assert calls((2, 2 ** 17, 32, 128), natural=True, implementation="xla")[-1] == "packed"


CASES = {  # name: (rows' document starts, window, the path taken)
    "one document": (([0], [0]), 0, "causal"),
    "one document, window": (([0], [0]), 5, "causal"),
    "packed": (([0, 7, 19], [0, 30]), 0, "packed"),
    "packed, window": (([0, 7, 19], [0, 30]), 5, "packed"),
    "over max_documents": (([0, 2, 4, 6, 8, 10], [0]), 0, "masked"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_calls_match_the_reference(name):
    rows, window, expected = CASES[name]
    pos, seg = layout(*rows)
    rng = np.random.default_rng(0)
    q, k, v, cot = (jnp.asarray(rng.normal(size=(2, S, h, 16)), jnp.float32) for h in (4, 2, 2, 4))
    assert path(pos, seg) == expected

    def run(fn):
        def loss(q, k, v):
            out, _ = fn(q, k, v, False)
            return (out * cot).sum()

        _, lse = fn(q, k, v, True)
        return (fn(q, k, v, False)[0], lse, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    ref = run(lambda q, k, v, _: dot_product_attention(q, k, v, pos, seg, pos, seg, window))
    got = run(jax.jit(lambda q, k, v, lse: cudnn.cudnn_attention(q, k, v, pos, seg, pos, seg, lse, window, True, 4,
                                                                 "xla"), static_argnums=3))
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-5)


def test_masked_rows_without_keys():
    """The masked call keeps the convention: a query that sees no key gives out 0 and lse -inf."""
    pos, seg = layout([0])
    q = k = v = jnp.ones((1, S, 2, 8))
    out, lse = cudnn.cudnn_attention(q, k, v, pos, seg, pos, seg.at[0, :4].set(9), True, natural=True,
                                     implementation="xla")
    assert jnp.all(out[0, :4] == 0) and jnp.all(jnp.isneginf(lse[0, :, :4]))
    assert jnp.all(jnp.isfinite(lse[0, :, 4:]))


def test_private_api_guards():
    assert not cudnn.packed_supported("cudnn")  # no GPU here: the masked and causal calls only
    assert cudnn.packed_supported("xla")
    # answered by running JAX's own offset fix-up, also when first asked while tracing
    cudnn.kv_offsets_follow_kv_heads.cache_clear()
    jax.jit(lambda x: x + cudnn.kv_offsets_follow_kv_heads())(1)
    traced = cudnn.kv_offsets_follow_kv_heads()
    cudnn.kv_offsets_follow_kv_heads.cache_clear()
    assert isinstance(traced, bool) and traced == cudnn.kv_offsets_follow_kv_heads()
    if jax.__version_info__ < (0, 11):  # fixed in JAX 0.11 (jax-ml/jax PR 39521)
        assert not traced


@pytest.mark.parametrize("strategy,ring,a2a,load_balance,natural", [
    (None, 1, 1, False, True),  # no mesh
    ("all_gather", 1, 1, True, True),  # C = 1: every strategy runs all_gather, the tokens are the whole sequence
    ("a2a", 1, 2, False, True),  # after the all-to-all, whole sequences in natural order
    ("a2a", 1, 2, True, False),  # ... in zig-zag order
    ("all_gather", 2, 1, False, False),  # query shards against the gathered keys
    ("p2p", 2, 1, False, False),  # ring hops
])
def test_strategies_tell_the_kernel_their_order(strategy, ring, a2a, load_balance, natural, monkeypatch):
    from maxctx.attention.dispatch import AttentionSpec, attend
    from tests.support.meshes import make_mesh

    seen, original = [], cudnn.cudnn_attention

    def recording(*args, **kwargs):
        seen.append(kwargs["natural"])
        return original(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(cudnn, "cudnn_attention", recording)
    pos, seg = layout([0, 9], [0])
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, S, 4, 8)), jnp.float32)
    k = v = q[:, :, :2]
    spec = AttentionSpec(kernel="cudnn", strategy=strategy or "all_gather", load_balance=load_balance)
    mesh = None if strategy is None else make_mesh(ring, a2a)
    jax.eval_shape(lambda *a: attend(*a, spec=spec, mesh=mesh), q, k, v, pos, seg)
    assert seen and set(seen) == {natural}
    if strategy is None:
        want = dot_product_attention(q, k, v, pos, seg, pos, seg)[0]
        np.testing.assert_allclose(attend(q, k, v, pos, seg, spec), want, atol=2e-5, rtol=2e-5)
