"""Splash's block tables narrowed to the documents of the batch: a (query block, key block) pair that holds no
visible pair of the actual rows is never computed, in the forward or either backward pass.

Splash's tables are built on the host from a static mask over token order (splash_masks), so they know causality
and the window but not where documents begin: on a row of packed documents every causal block would run, and
segment ids would only mask inside it. Every splash call here also has its rows' positions and segment ids (they
travel with the tokens), so each call narrows its tables on the device before the kernel runs:

    keep (i, j)  iff  the static table runs it
                 and  the blocks' segment id ranges overlap            (a document in both)
                 and  min key position <= max query position            (causal inside a document)
                 and  min query position - max key position < W          (window W > 0)

Each condition holds for every visible pair, so the narrowed table is a superset of the visible blocks and the
kernel's own masks (segment ids, the static mask) stay exact. It is also tight for the layouts documents have
here: a block is a contiguous piece of the row (natural order, zig-zag chunks), so a document in both blocks of a
causal pair is one that crosses between them. The tables are splash's shrunk ones (one row of visited key blocks
per query block; the dK/dV pass transposed), so narrowing sets `block_mask` to 0 where a pair is dropped and points
its `data_next` at the nearest kept block of its row, so the pipeline fetches nothing for it. The batch's rows
share a kernel: a pair is kept when any row needs it (at long context a device holds one row).

`host_tables` is the same narrowing on numpy, for benchmarks/packed_documents.py and the tests' block counts.
"""

from __future__ import annotations

import numpy as np

# MaskInfo fields that are splash's shrunk tables, and the axis each pass's rows of visited blocks run along:
# forward and dQ list key blocks per query block (axis 2); dK/dV lists query blocks per key block (axis 1).
PASS_AXIS = {"fwd_mask_info": 2, "dq_mask_info": 2, "dkv_mask_info": 1}


def block_ranges(pos, seg):
    """(segment min, segment max, position min, position max) over the last axis (one block's tokens)."""
    return seg.min(-1), seg.max(-1), pos.min(-1), pos.max(-1)


def summaries(positions_BS, segment_ids_BS, block: int, xp):
    """Per block of `block` tokens: (segment min, segment max, position min, position max), each [B, blocks]."""
    b, s = positions_BS.shape
    return block_ranges(positions_BS.reshape(b, s // block, block), segment_ids_BS.reshape(b, s // block, block))


def pair_visible(q_sum, kv_sum, window: int, xp):
    """[B, query blocks, key blocks]: whether a block pair may hold a visible pair (module doc's conditions)."""
    q_seg_lo, q_seg_hi, q_pos_lo, q_pos_hi = (x[:, :, None] for x in q_sum)
    k_seg_lo, k_seg_hi, k_pos_lo, k_pos_hi = (x[:, None, :] for x in kv_sum)
    keep = (k_seg_lo <= q_seg_hi) & (k_seg_hi >= q_seg_lo) & (k_pos_lo <= q_pos_hi)
    if window:
        keep = keep & (q_pos_lo - k_pos_hi < window)
    return keep


def _take_flat(x, flat_index, xp):
    """x.reshape(-1)[flat_index] as a gather of rank 1 (libtpu's layout assignment rejects some rank-3 gathers of
    these small tables: tpu_layout_assignment.cc, num_window_dims)."""
    return xp.take(x.reshape(-1), flat_index.reshape(-1)).reshape(flat_index.shape)


def _refill(data_next, kept, axis: int, xp, cummax, cummin):
    """data_next with every dropped entry pointing at the nearest kept entry before it along `axis` (else the
    first after it; else unchanged): no block is fetched for a pair that does not run."""
    n = data_next.shape[axis]
    shape = [1, 1, 1]
    shape[axis] = n
    index = xp.broadcast_to(xp.arange(n).reshape(shape), data_next.shape)
    before = cummax(xp.where(kept, index, -1), axis)
    after = cummin(xp.where(kept, index, n), axis, reverse=True)
    source = xp.where(before >= 0, before, xp.where(after < n, after, index))
    heads, rows, width = data_next.shape
    h = xp.arange(heads).reshape(heads, 1, 1) * (rows * width)
    if axis == 2:
        flat = h + xp.arange(rows).reshape(1, rows, 1) * width + source
    else:
        flat = h + source * width + xp.arange(width).reshape(1, 1, width)
    return _take_flat(data_next, flat, xp)


def _narrow(info, axis: int, visible_BQK, xp, cummax, cummin):
    """One pass's MaskInfo with the pairs `visible_BQK` rules out dropped (union over the batch rows)."""
    if info is None or info.block_mask is None or info.data_next is None:
        return info
    block_mask, data_next = xp.asarray(info.block_mask), xp.asarray(info.data_next)
    listed = data_next.astype(xp.int32)  # the other axis' block each entry visits
    heads, rows, width = block_mask.shape
    if axis == 2:  # entry (i, w): query block i, key block listed[i, w]
        q_index = xp.broadcast_to(xp.arange(rows).reshape(1, rows, 1), listed.shape)
        k_index = listed
    else:  # entry (r, j): query block listed[r, j], key block j
        q_index = listed
        k_index = xp.broadcast_to(xp.arange(width).reshape(1, 1, width), listed.shape)
    visible = visible_BQK.any(0)
    keep = _take_flat(visible, q_index * visible.shape[1] + k_index, xp) & (block_mask != 0)
    return info._replace(block_mask=xp.where(keep, block_mask, xp.zeros_like(block_mask)),
                         data_next=_refill(data_next, keep, axis, xp, cummax, cummin))


def _pass_blocks(kernel, name: str) -> tuple[int, int]:
    sizes = kernel.kwargs["block_sizes"]
    return {"fwd_mask_info": (sizes.block_q, sizes.block_kv),
            "dq_mask_info": (sizes.block_q_dq, sizes.block_kv_dq),
            "dkv_mask_info": (sizes.block_q_dkv, sizes.block_kv_dkv)}[name]


def narrow_infos(kernel, infos: dict, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window: int) -> dict:
    """`infos` (pass name -> MaskInfo of `kernel`'s block sizes, for these query rows and keys) narrowed to the
    documents of the rows, on the device."""
    import jax
    import jax.numpy as jnp

    def cummax(x, axis, reverse=False):
        return jax.lax.cummax(x, axis=axis, reverse=reverse)

    def cummin(x, axis, reverse=False):
        return jax.lax.cummin(x, axis=axis, reverse=reverse)

    out = {}
    for name, info in infos.items():
        if info is None or info.block_mask is None:
            out[name] = info
            continue
        bq, bkv = _pass_blocks(kernel, name)
        visible = pair_visible(summaries(q_pos_BS, q_seg_BS, bq, jnp), summaries(kv_pos_BT, kv_seg_BT, bkv, jnp),
                               window, jnp)
        out[name] = _narrow(info, PASS_AXIS[name], visible, jnp, cummax, cummin)
    return out


def _np_cummax(x, axis, reverse=False):
    if reverse:
        return np.flip(np.maximum.accumulate(np.flip(x, axis), axis=axis), axis)
    return np.maximum.accumulate(x, axis=axis)


def _np_cummin(x, axis, reverse=False):
    if reverse:
        return np.flip(np.minimum.accumulate(np.flip(x, axis), axis=axis), axis)
    return np.minimum.accumulate(x, axis=axis)


def host_tables(info, name: str, bq: int, bkv: int, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window: int):
    """`narrow_infos` on numpy for one pass: the narrowed MaskInfo (benchmarks and tests count its blocks)."""
    visible = pair_visible(summaries(np.asarray(q_pos_BS), np.asarray(q_seg_BS), bq, np),
                           summaries(np.asarray(kv_pos_BT), np.asarray(kv_seg_BT), bkv, np), window, np)
    return _narrow(info, PASS_AXIS[name], visible, np, _np_cummax, _np_cummin)


def computed_blocks(info) -> int:
    """Block pairs a pass's table runs (nonzero block_mask entries)."""
    return int(np.count_nonzero(np.asarray(info.block_mask)))


# --- context_parallel_load_balance=documents: splash calls whose token order changes with every batch ---------------
#
# Under the documents placement (maxctx.attention.cp.load_balance) the stored order is the batch's, so no static mask
# over token order exists. A call's kernel then has a static all-visible table and the in-kernel mask
# `key place <= q_sequence[i]` (splash_masks.KeyRuns over one run: a key's value is its place), and each call
# derives from its ids: q_sequence[i] = the place of the last key of query i's document at or before its
# position, and the tables narrowed as above, per row. That is exact when each document's keys in the call are
# contiguous and in position order: a rank's tokens are stored in their original order (a ring hop's keys), and
# gathered keys are put back in that order (`sort_keys`). With a sliding window a document's keys must also have
# consecutive positions (the window compares places), which gathered keys do and a ring hop's head and tail
# pieces do not (maxctx.validate refuses that combination).

_LAST = 2 ** 31 - 1


def ordered_segments(segment_ids_BS):
    """Segment ids made non-decreasing along a row in original order: padding (0, last in a row) sorts last."""
    import jax.numpy as jnp

    return jnp.where(segment_ids_BS > 0, segment_ids_BS, _LAST)


def sort_keys(kv_pos_BT, kv_seg_BT, *arrays_BT):
    """Gathered keys back in original order (by document, then position; the row's own order among equals):
    (positions, segment ids, *arrays) each taken along axis 1 in that order."""
    import jax
    import jax.numpy as jnp

    b, t = kv_pos_BT.shape
    iota = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    order = jax.lax.sort((ordered_segments(kv_seg_BT), kv_pos_BT, iota), dimension=1, num_keys=2)[2]

    def take(x):
        return jnp.take_along_axis(x, order.reshape(b, t, *([1] * (x.ndim - 2))), axis=1)

    return take(kv_pos_BT), take(kv_seg_BT), *(take(x) for x in arrays_BT)


def query_values(q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT):
    """q_sequence [B, S] int32 for keys in document order (module note): the place of the last key of the
    query's document whose position is at or before the query's, or -1 (no such key: nothing visible)."""
    import jax
    import jax.numpy as jnp

    t = kv_pos_BT.shape[1]
    kseg, qseg = ordered_segments(kv_seg_BT), ordered_segments(q_seg_BS)
    lo = jax.vmap(lambda keys, q: jnp.searchsorted(keys, q, side="left"))(kseg, qseg).astype(jnp.int32)
    hi = jax.vmap(lambda keys, q: jnp.searchsorted(keys, q, side="right"))(kseg, qseg).astype(jnp.int32)

    def step(_, bounds):  # lower bound of position > q_pos inside [lo, hi): positions ascend within a document
        low, high = bounds
        mid = (low + high) // 2
        after = jnp.take_along_axis(kv_pos_BT, jnp.minimum(mid, t - 1), axis=1) > q_pos_BS
        active = low < high
        return jnp.where(active & ~after, mid + 1, low), jnp.where(active & after, mid, high)

    first_after, _ = jax.lax.fori_loop(0, max(1, t).bit_length(), step, (lo, hi))
    return first_after - 1


def call_infos(kernel, infos: dict, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window: int, q_values_BS=None) -> dict:
    """A call's MaskInfos narrowed to its rows' documents; with `q_values_BS` (a documents call, one row), each
    with that row's q_sequence as well."""
    narrowed = narrow_infos(kernel, infos, q_pos_BS, q_seg_BS, kv_pos_BT, kv_seg_BT, window)
    if q_values_BS is None:
        return narrowed
    return {name: None if info is None else info._replace(q_sequence=q_values_BS[0])
            for name, info in narrowed.items()}
