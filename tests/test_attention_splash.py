"""Splash's index-based masks under zig-zag orders, checked on CPU in Pallas interpret mode (slow: few cases).

Each device runs the kernels it picks by mesh index and hop (ring: the diagonal, or its zig-zag chunks against a
key block before or after them, by a [hop, shard] table; all_gather: its chunks against the whole gathered order),
with a packed row whose segment ids cut documents across chunks. Outputs and dQ/dK/dV must equal the single-device
reference: through splash's own backward, for ring hops too (splash_backward.hop_backward, from the merged out and lse),
hops in row chunks (RowLoop) included: no case takes the blockwise backward.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import restore_order, zigzag_permutation
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import dot_product_attention
from tests.support.meshes import make_mesh

S, H, K, D = 512, 2, 1, 128


@pytest.mark.parametrize("strategy,ring,a2a,max_table,window,overlap", [
    ("p2p", 2, 1, None, 0, False), ("usp", 2, 2, None, 0, False), ("all_gather", 2, 1, None, 0, False),
    # Four hops: the ring loop's traced hop index picks each device's kernel from the [hop, shard] table, in the
    # plain and the software-pipelined backward (ring_backward_overlap), whose hops must pick the same kernels.
    ("p2p", 4, 1, None, 0, False), ("p2p", 4, 1, None, 0, True),
    # Calls whose block table passes the limit run as several kernels over row chunks (a2a at 1M tokens): a2a in
    # 4 chunks with its backward, and ring hops in 2 chunks looped by one kernel per pass (RowLoop, GQA: 2 query
    # heads per kv head under p2p), one of which sees no key on the off-diagonal hop.
    ("a2a", 1, 2, 4, 0, False), ("p2p", 2, 1, 2, 0, False), ("usp", 2, 2, 2, 0, False),
    # Local layers: p2p's halo runs one band kernel per chunk (with dQ/dK/dV through splash's backward); a2a's
    # whole-sequence kernel takes the sliding-window mask; a window wider than a device's chunk takes p2p's ring,
    # whose hops' backward gets the windowed masks.
    ("p2p", 2, 1, None, 128, False), ("a2a", 1, 2, None, 100, False), ("p2p", 2, 1, None, 300, False)])
def test_splash_zigzag_matches_reference(strategy, ring, a2a, max_table, window, overlap, monkeypatch):
    from maxctx.attention.kernels import flash, splash

    if max_table is not None:
        monkeypatch.setattr(splash, "MAX_TABLE_ENTRIES", max_table)
    monkeypatch.setattr(flash, "flash_backward", None)  # every ring hop runs splash's backward, not the blockwise
    check_against_reference(strategy, ring, a2a, window, ring_backward_overlap=overlap)


# Rows of packed documents only, which cross shard, chunk and block boundaries: every call's tables are narrowed to
# the documents (document_blocks), so block pairs between documents are skipped in the forward, dQ and dK/dV.
DOCUMENTS = [[40, 130, 20, 200, 122], [256, 9, 119, 128]]


@pytest.mark.parametrize("strategy,ring,a2a,max_table,window", [
    ("p2p", 8, 1, None, 0), ("usp", 2, 2, None, 0), ("all_gather", 4, 1, None, 0), ("a2a", 1, 2, 4, 0),
    ("p2p", 2, 1, 2, 0), ("a2a", 1, 2, None, 100), ("usp", 2, 2, None, 256)])
def test_splash_document_tables_match_reference(strategy, ring, a2a, max_table, window, monkeypatch):
    from maxctx.attention.kernels import flash, splash

    if max_table is not None:
        monkeypatch.setattr(splash, "MAX_TABLE_ENTRIES", max_table)
    monkeypatch.setattr(flash, "flash_backward", None)
    scale = 2 if ring * a2a == 8 else 1  # 1024 tokens at C = 8: each device's 128 rows make one splash block
    check_against_reference(strategy, ring, a2a, window, seq=S * scale,
                            rows=[[n * scale for n in row] for row in DOCUMENTS])


@pytest.mark.parametrize("strategy,blocks", [
    # MaxText's sa_block_* (flash_block_*): dK/dV and dQ kernels on other blocks than the forward's 128 x 128.
    ("a2a", dict(q_dkv=256, kv_dkv=512, kv_dkv_compute=128, q_dq=512, kv_dq=256)),
    ("all_gather", dict(kv_compute=128, q_dkv=256, kv_dkv=256, fused_backward=True)),
    # Ring hops' backward through splash (hop_backward): its own blocks, and the fused kernel.
    ("p2p", dict(q_dkv=128, kv_dkv=256, kv_dkv_compute=128, q_dq=256, kv_dq=128)),
    ("p2p", dict(fused_backward=True))])
def test_splash_backward_blocks_match_reference(strategy, blocks):
    from maxctx.attention.kernels import splash

    check_against_reference(strategy, 1 if strategy == "a2a" else 2, 2 if strategy == "a2a" else 1, 0,
                            splash.Blocks(**blocks))


@pytest.mark.parametrize("strategy,ring,a2a,block,seq,head_dim,stored", [
    # The blocks TPU recipes run (MaxText's sa_block_* of 1024, and 2048 at head_dim 256): forward, dQ and dK/dV
    # at those blocks, partial blocks computed in the kernel (ring hops) or stored (a2a's gathered zig-zag keys).
    # At 2048 over 4,096 tokens each device's one block holds two zig-zag chunks, so every block is partial.
    ("p2p", 2, 1, 1024, 4096, 128, False), ("p2p", 2, 1, 2048, 4096, 256, False),
    ("usp", 2, 2, 1024, 4096, 128, False), ("a2a", 1, 2, 1024, 4096, 256, True)])
def test_splash_at_recipe_blocks_matches_reference(strategy, ring, a2a, block, seq, head_dim, stored, monkeypatch):
    from maxctx.attention.kernels import flash, splash

    monkeypatch.setattr(flash, "flash_backward", None)
    check_against_reference(strategy, ring, a2a, 0, splash.Blocks(stored_masks=stored), block=block, seq=seq,
                            head_dim=head_dim)


def packed_rows(S, rows):  # noqa: N803 (the legend's names)
    """(segment ids, positions) [2, S]: a one-document row and a packed one, or (rows=[lengths, lengths]) two packed
    rows with documents of these lengths (a row's tables then narrow to its documents: document_blocks)."""
    if rows is None:
        rows = [[S], [S * 100 // 512, S * 250 // 512, S - S * 350 // 512]]
    seg = np.stack([np.repeat(np.arange(1, len(n) + 1), n) for n in rows]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(m) for m in n]) for n in rows]).astype(np.int32)
    return seg, pos


def check_against_reference(strategy, ring, a2a, window, splash_blocks=None, ring_backward_overlap=False, block=128,
                            seq=S, head_dim=D, rows=None):
    S, D = seq, head_dim  # noqa: N806 (the legend's names)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, S, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(2, S, K, D)).astype(np.float32) for _ in range(2))
    seg, pos = packed_rows(S, rows)
    dout = rng.normal(size=q.shape).astype(np.float32)

    def run(fn, q, k, v, pos, seg, dout):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
        return [out, *pullback(dout)]

    want = run(lambda *a: dot_product_attention(*a, a[3], a[4], window)[0], q, k, v, pos, seg, dout)

    mesh = make_mesh(ring, a2a)
    cp = ring * a2a
    spec = AttentionSpec(kernel="splash", strategy=strategy, load_balance=True, block_q=block, block_kv=block,
                         window=window, ring_backward_overlap=ring_backward_overlap,
                         **({"splash_blocks": splash_blocks} if splash_blocks else {}))
    perm = zigzag_permutation(S, cp)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = [jax.device_put(x[:, perm], sharding) for x in (q, k, v, pos, seg, dout)]
    got = jax.jit(lambda *a: run(lambda *b: attend(*b, spec, mesh), *a))(*args)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g = restore_order(np.asarray(g), cp)
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-5, f"splash {strategy} zig-zag window={window} {name}: relative error {err:.2e}"


def test_ordered_causal_mask_blocks_equal_the_dense_mask():
    # Splash reads masks block by block; whole blocks answered from index ranges (a shared constant block) must
    # equal the dense comparison, for blocks that are all visible, all hidden and partial, and for other indexers.
    from maxctx.attention.kernels.splash_masks import ordered_causal_mask

    order = zigzag_permutation(1024, 4)
    q_orig, kv_orig = order[256:512], order
    mask = ordered_causal_mask(q_orig, kv_orig)
    dense = kv_orig[None, :] <= q_orig[:, None]
    kinds = set()
    for r in range(0, 256, 64):
        for c in range(0, 1024, 128):
            block = mask[slice(r, r + 64), slice(c, c + 128)]
            np.testing.assert_array_equal(block, dense[r:r + 64, c:c + 128])
            kind = "full" if block.all() else "empty" if not block.any() else "partial"
            assert block.flags.writeable == (kind == "partial"), kind  # whole blocks: the shared constant
            kinds.add(kind)
    assert kinds == {"full", "empty", "partial"}
    np.testing.assert_array_equal(mask[5, slice(0, 1024)], dense[5])
    np.testing.assert_array_equal(mask[slice(0, 256), 7], dense[:, 7])
    assert mask[3, 900] == dense[3, 900]


def test_windowed_mask_blocks_equal_the_dense_band():
    # With a sliding window, whole blocks answered from index ranges must still equal the dense band, including
    # blocks wholly behind the window (hidden) and wholly inside it (visible).
    from maxctx.attention.kernels.splash_masks import ordered_causal_mask

    order = zigzag_permutation(1024, 4)
    q_orig, kv_orig = order[256:512], order
    window = 200
    mask = ordered_causal_mask(q_orig, kv_orig, window)
    behind = q_orig[:, None] - kv_orig[None, :]
    dense = (behind >= 0) & (behind < window)
    kinds = set()
    for r in range(0, 256, 16):
        for c in range(0, 1024, 16):
            block = mask[slice(r, r + 16), slice(c, c + 16)]
            np.testing.assert_array_equal(block, dense[r:r + 16, c:c + 16])
            kinds.add("visible" if block.all() else "hidden" if not block.any() else "partial")
    assert kinds == {"visible", "hidden", "partial"}
    assert mask != ordered_causal_mask(q_orig, kv_orig)  # the window is part of the mask's identity



def test_whole_blocks_answer_any_and_all_without_reading_them():
    # Splash asks any() then all() of every block; whole blocks answer from their value (O(1)), so the tables of a
    # 2M x 2M ring hop (usp at 2**24 tokens) build in seconds; partial blocks are plain arrays.
    from maxctx.attention.kernels import splash_masks

    order = np.arange(4096)
    mask = splash_masks.ordered_causal_mask(order, order)
    visible, hidden, partial = (mask[slice(r, r + 512), slice(c, c + 512)] for r, c in ((1024, 0), (0, 1024), (0, 0)))
    assert isinstance(visible, splash_masks._ConstantBlock) and visible.any() and visible.all()
    assert isinstance(hidden, splash_masks._ConstantBlock) and not hidden.any() and not hidden.all()
    assert not isinstance(partial, splash_masks._ConstantBlock) and partial.any() and not partial.all()
    assert visible.any(axis=0).shape == (512,)  # with arguments: numpy's own answer


def test_ring_hops_loop_one_kernel_over_their_row_chunks(monkeypatch):
    # usp-like ring at small scale: 2 hops over blocks of 4,096 tokens, 32 x 32 blocks of 128 per hop, at most 64
    # table entries per call: 16 row chunks per hop, looped by one kernel per pass (RowLoop), equal chunks sharing
    # tables, and splash's backward on them (splash_backward).
    from maxctx.attention.cp.load_balance import stored_order
    from maxctx.attention.kernels import splash, splash_backward
    from maxctx.attention.kernels.local import make_local

    assert splash.backward_kernels_available()
    order = stored_order(8192, 4, True)
    whole = make_local("splash", 128, 128, order=order, q_shards=2, kv_blocks=2, group=2, ring=True)
    assert all(splash_backward.has_backward(k) for k in whole.splash_kernels)
    monkeypatch.setattr(splash, "MAX_TABLE_ENTRIES", 64)
    local = make_local("splash", 128, 128, order=order, q_shards=2, kv_blocks=2, group=2, ring=True)
    loops = [k for k in local.splash_kernels if isinstance(k, splash.RowLoop)]
    assert len(loops) == len(local.splash_kernels) == 3  # the diagonal, key block before, key block after
    assert all(splash_backward.has_backward(loop) for loop in loops)
    # Blocks(ring_backward=False): forward tables only, the blockwise backward.
    forward_only = make_local("splash", 128, 128, order=order, q_shards=2, kv_blocks=2, group=2, ring=True,
                              splash_blocks=splash.Blocks(ring_backward=False))
    assert not any(splash_backward.has_backward(k) for k in forward_only.splash_kernels)
    assert all(list(k.infos) == ["fwd_mask_info"] for k in forward_only.splash_kernels)
    assert all(loop.chunks == 16 and loop.rows == 256 for loop in loops)
    distinct = sorted(int(loop.index.max()) + 1 for loop in loops)
    assert distinct[0] <= 2 and distinct[1] <= 2 and distinct[2] == 16, distinct  # only the diagonal's all differ
    diagonal = next(loop for loop in loops if int(loop.index.max()) + 1 == 16)
    for info in diagonal.infos.values():  # partial blocks computed in the kernel, from each chunk's q_sequence
        assert info.partial_mask_blocks is None and info.mask_next is None and info.q_sequence.shape == (16, 256)
    stored = make_local("splash", 128, 128, order=order, q_shards=2, kv_blocks=2, group=2, ring=True,
                        splash_blocks=splash.Blocks(stored_masks=True))
    diagonal = next(loop for loop in stored.splash_kernels if int(loop.index.max()) + 1 == 16)
    for info in diagonal.infos.values():  # the same causal block on every chunk's diagonal, pooled once per pass
        assert len(info.partial_mask_blocks) == 1 and info.q_sequence is None
    for loop in loops:  # [chunk tables, 1, query blocks per chunk, width] (dK/dV: [..., 1, width, key blocks])
        for name, info in loop.infos.items():
            tables = [info.data_next, info.block_mask] + ([info.mask_next] if info.mask_next is not None else [])
            shape = (int(loop.index.max()) + 1, 1, 2, 32) if name == "dkv_mask_info" else \
                (int(loop.index.max()) + 1, 1, 2)
            assert all(t.shape[:len(shape)] == shape and t.dtype.itemsize <= 2 for t in tables), name


@pytest.mark.parametrize("fused,stored", [(False, False), (True, False), (False, True)])
def test_row_chunked_hop_backward_matches_reference(fused, stored):
    # One ring hop in 3 row chunks of 2 query blocks, GQA (2 query heads per kv head), checked against the dense
    # block backward: chunk 0 sees every key (one partial block, the diagonal), chunk 1 sees keys through its first
    # query block only (3 key blocks, 2 partial: the tables of every pass differ in width from chunk 0's, padded)
    # and chunk 2 sees none (all-zero tables). The gradients come from the hop's own out and lse, as a one-hop
    # ring's.
    import jax.numpy as jnp

    from maxctx.attention.kernels import splash, splash_backward
    from maxctx.attention.kernels.dot_product import dot_product_block_backward

    q_orig = np.concatenate([np.arange(1408, 1664), np.arange(700, 828), np.arange(0, 128), np.arange(128, 384)])
    kv_orig = np.arange(512, 1536)
    loop = splash.make_kernel(q_orig, kv_orig, 2, 128, 128, save_residuals=True, interpret=True,
                              max_table_entries=16, blocks=splash.Blocks(fused_backward=fused, stored_masks=stored))
    assert isinstance(loop, splash.RowLoop) and loop.chunks == 3 and splash_backward.has_backward(loop)
    assert loop.index.tolist() == [0, 1, 2]
    dkv = loop.infos["dkv_mask_info"]
    if not fused:  # splash shrinks the dK/dV tables' query axis (not under the fused kernel): 2, 1 and 0, padded
        assert dkv.block_mask.shape[2] == 2 and not dkv.block_mask[1, :, 1].any()
    assert loop.infos["fwd_mask_info"].block_mask.shape[-1] == 8
    assert len(dkv.partial_mask_blocks) == 3 if stored else dkv.partial_mask_blocks is None
    assert not dkv.block_mask[2].any()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, len(q_orig), 4, 128)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, len(kv_orig), 2, 128)), jnp.float32) for _ in range(2))
    dout = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    q_pos, kv_pos = jnp.asarray(q_orig[None], jnp.int32), jnp.asarray(kv_orig[None], jnp.int32)
    q_seg, kv_seg = jnp.ones_like(q_pos), jnp.ones_like(kv_pos)
    out, lse = jax.jit(lambda *a: splash.splash_call(loop, *a, save_residuals=True))(q, k, v, q_seg, kv_seg)
    want_out, want_lse = dot_product_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    got = jax.jit(lambda *a: splash_backward.hop_backward(loop, *a))(q, k, v, q_seg, kv_seg, out, lse, dout)
    want = dot_product_block_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, want_out, want_lse, dout)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = np.abs(np.asarray(g) - w).max() / np.abs(w).max()
        assert err < 1e-5, f"row-chunked hop backward {name}: relative error {err:.2e}"
    assert not np.asarray(got[0])[:, 384:].any()  # the hidden rows (chunk 1's second block, chunk 2) get none


def test_row_chunks_keep_the_backward_tables_within_the_limit_too():
    # Backward blocks smaller than the forward's (MaxText's sa_block_*_dkv/_dq) have larger tables: the chunking
    # must count them, or the dQ and dK/dV tables overflow SMEM where the forward's fits.
    from maxctx.attention.kernels import splash

    order = np.arange(2048)
    small = splash.Blocks(q_dkv=128, kv_dkv=128, q_dq=128, kv_dq=128)
    parts = splash.make_kernel(order, order, 1, 512, 512, save_residuals=False, interpret=True,
                               max_table_entries=16, blocks=small)
    assert len(parts) == 16  # 128-row chunks: each pass's table is 1 x 16 query x key blocks at most
    for _, _, kernel in parts:
        for info in (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info):
            assert np.prod(info.block_mask.shape[1:]) <= 16, info.block_mask.shape


def test_a_chunk_between_two_key_runs_and_out_of_the_window_is_hidden():
    # Queries 2048..2559 sit between keys 0..1023 and 3072..4095; with a 100-token window they see none of them.
    from maxctx.attention.kernels import splash, splash_masks
    from maxctx.attention.kernels.index_runs import runs

    kv = np.concatenate([np.arange(1024), np.arange(3072, 4096)])
    assert not splash_masks.sees_a_key(runs(np.arange(2048, 2560)), runs(kv), 100)
    assert splash_masks.sees_a_key(runs(np.arange(1024, 1536)), runs(kv), 100)  # 1024 sees 1023
    assert splash_masks.sees_a_key(runs(np.arange(2048, 2560)), runs(kv), 0)  # causal only: sees all of 0..1023
    parts = splash.make_kernel(np.arange(1024, 3072), kv, 1, 128, 128, save_residuals=True, interpret=True,
                               max_table_entries=16, window=100)
    assert isinstance(parts, splash.RowLoop) and parts.chunks == 16
    assert int(parts.index.max()) + 1 == 2  # the first chunk sees key 1023; every other chunk sees no key


def test_partial_blocks_are_computed_where_the_keys_form_few_runs():
    # A ring hop's keys (one device's zig-zag shard: two runs, one in rank), a natural-order call and a gathered
    # zig-zag order over 4 devices (8 runs: all_gather, a2a, usp's ring blocks) take the mask in the kernel
    # (q_sequence and a mask function, no stored block); keys in another order (reversed) keep stored blocks. The
    # computed functions equal the dense mask, windowed too.
    from maxctx.attention.kernels import splash, splash_masks

    order = zigzag_permutation(4096, 4)
    for q_orig, kv_orig, computed in ((order[1024:2048], order[:1024], True), (np.arange(2048), np.arange(2048), True),
                                      (order[1024:2048], order, True), (order[1024:2048], order[::-1].copy(), False)):
        kernel = splash.make_kernel(q_orig, kv_orig, 1, 256, 256, save_residuals=False, interpret=True)[0][2]
        for info in (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info):
            assert (info.q_sequence is not None) == computed and (info.partial_mask_blocks is None) == computed
        assert (kernel.kwargs["mask_function"] is not None) == computed
    for window in (0, 300):
        for kv in (order[2048:3072], order, order[:2048]):
            values, function = splash_masks.computed_mask(order[1024:2048], kv, window)
            assert isinstance(function, splash_masks.ZigZagKeys if len(kv) == 4096 else splash_masks.KeyRuns)
            got = np.asarray(function(values[:, None], np.arange(len(kv), dtype=np.int32)[None, :]))
            behind = order[1024:2048, None] - kv[None, :]
            np.testing.assert_array_equal(got, (behind >= 0) & ((behind < window) if window else True))
    assert splash_masks.computed_mask(order[1024:2048], order[::-1].copy()) is None


@pytest.mark.parametrize("strategy,ring,a2a,window,max_table,kernel", [
    ("p2p", 4, 1, 0, None, "splash"), ("usp", 2, 2, 0, None, "splash"), ("all_gather", 4, 1, 100, None, "splash"),
    ("a2a", 1, 2, 128, None, "splash"),
    ("p2p", 2, 1, 0, 2, "splash"),  # ring hops in row chunks (RowLoop): each chunk's q_sequence and tables
    # The blockwise kernel masks from the ids in any order (every strategy with windows, in whole runs:
    # tests/test_context_parallel_train.py).
    ("all_gather", 8, 1, 0, None, "blockwise")])
def test_splash_under_document_placement_matches_reference(strategy, ring, a2a, window, max_table, kernel,
                                                           monkeypatch):
    """context_parallel_load_balance=documents: each row stored in its own document placement, so each splash call
    derives its q_sequence and tables from the ids (document_blocks); ring hops through splash's own backward.
    The blockwise kernel under the same placement at C = 8."""
    from maxctx.attention.cp.load_balance import document_permutation
    from maxctx.attention.kernels import flash, splash

    if max_table is not None:
        monkeypatch.setattr(splash, "MAX_TABLE_ENTRIES", max_table)
    if kernel == "splash":
        monkeypatch.setattr(flash, "flash_backward", None)  # ring hops through splash's own backward
    cp = ring * a2a
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, S, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(2, S, K, D)).astype(np.float32) for _ in range(2))
    dout = rng.normal(size=q.shape).astype(np.float32)
    seg, pos = packed_rows(S, DOCUMENTS)

    def run(fn, q, k, v, pos, seg, dout):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
        return [out, *pullback(dout)]

    want = run(lambda *a: dot_product_attention(*a, a[3], a[4], window)[0], q, k, v, pos, seg, dout)
    perms = np.stack([document_permutation(p, s, cp) for p, s in zip(pos, seg)])
    assert not all(np.array_equal(p, np.arange(S)) for p in perms)
    mesh = make_mesh(ring, a2a)
    spec = AttentionSpec(kernel=kernel, strategy=strategy, load_balance="documents", block_q=128, block_kv=128,
                         window=window)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = [jax.device_put(np.take_along_axis(x, perms.reshape(2, S, *[1] * (x.ndim - 2)), 1), sharding)
            for x in (q, k, v, pos, seg, dout)]
    got = jax.jit(lambda *a: run(lambda *b: attend(*b, spec, mesh), *a))(*args)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g = np.stack([np.asarray(g)[b][np.argsort(perms[b])] for b in range(2)])
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-5, f"{kernel} {strategy} documents window={window} {name}: relative error {err:.2e}"
