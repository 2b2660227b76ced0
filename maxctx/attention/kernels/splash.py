"""TPU splash attention (Pallas, jax.experimental.pallas.ops.tpu.splash_attention) behind the position masks.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim.

Each call gets a static mask over original token indices (splash_masks.ordered_causal_mask): `q_orig` and `kv_orig`
map a device's local query rows and the key/value block it sees at this call (a ring hop, or the gathered
sequence) to original indices. Devices with equal masks share a kernel; kernels.make_local builds the distinct ones
and a device picks its own by its mesh index (under zig-zag a hop has at most two distinct masks). Blocks the mask
hides are skipped by the kernel's block sparsity (ring hops under zig-zag do equal work).

Block tables (query blocks x key blocks per call) live in on-chip SMEM, which overflows at long context; a call past
MAX_TABLE_ENTRIES runs over chunks of its query rows (make_kernel): as several kernels (calls with autodiff's
backward: a2a, all_gather), or, for ring hops, as one kernel per pass (forward, dQ, dK/dV) in a loop over the
chunks with each chunk's tables as data (RowLoop), so the program's size does not grow with the number of chunks.
Key blocks are computed COMPUTE_BLOCK keys at a time whatever the block size (the score tile stays bq x 512), and
partly visible blocks are computed in the kernel rather than loaded where the keys allow (splash_masks): a loaded
partial block is an s32[bq, bkv] window, double-buffered, which at 2048 x 2048 is half a v5p's VMEM. What a pass
still holds grows with bq x D (query, output and accumulator windows): docs/long_context.md, "Splash's blocks and
VMEM", has the measured limits. flash_block_q / flash_block_kv set every pass's blocks unless the
flash_block_*_dkv / *_dq / *_compute keys
(MaxText's sa_block_*) set the backward's apart (Blocks). Each kernel's tables cover the whole call on one device:
splash's q_seq_shards is not used (docs/long_context.md, "Splash at these lengths", says why).

Ring hops' backward: every hop, in row chunks or not, runs splash's own dQ and dK/dV kernels on the merged out and
lse of all hops (splash_backward; private functions of JAX's splash module, checked by signature). Without them
(backward_kernels_available), or with Blocks.ring_backward=False (no config key: benchmarks/compiled_schedule.py
compares the two; docs/long_context.md has the one row where it needed less memory), hops build forward tables
only and take the blockwise backward (maxctx.attention.kernels.flash: XLA fusions whose fp32 score tiles go through HBM,
which splash's kernels avoid; docs/choosing_a_strategy.md compares the two).

Segment ids go through `SegmentIds` (document separation); queries are pre-scaled by D**-0.5, so splash's
`attn_logits_soft_cap` (make_kernel's `softcap`; its dQ and dK/dV kernels apply the tanh's derivative) caps the
scaled scores as the other kernels do. GQA: an MQA kernel over the G query heads of each kv head, vmapped over K
and B.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.kernels import document_blocks
from maxctx.attention.kernels.flash import block_size as _divisor
from maxctx.attention.kernels.index_runs import expand, ranked, runs, shifted
from maxctx.attention.kernels.scopes import PALLAS_MACS_SCOPE
from maxctx.attention.kernels.splash_masks import ordered_causal_mask, sees_a_key

COMPUTE_BLOCK = 512
LANES = 128  # splash's blocks are whole multiples of the TPU's 128 lanes


def block_size(n: int, want: int) -> int:
    """Largest block <= want that divides n, a multiple of LANES where n is one (splash refuses others): a local
    layer's halo gives W + L keys per chunk, 128 + 8,192 = 8,320 for GPT-OSS at 1M, whose largest divisor up to 512
    is 416, the largest lane multiple 128."""
    if n % LANES:
        return _divisor(n, want)
    return LANES * _divisor(n // LANES, max(1, want // LANES))
# Block-table entries (query blocks x key blocks) one kernel call may have: the largest size that compiled within
# SMEM on both v5p and v6e (benchmarks/splash_masks.md).
MAX_TABLE_ENTRIES = 2 ** 16


def _lib():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )
    return kernel_lib, mask_lib


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Splash's block sizes besides block_q / block_kv (MaxText's sa_block_*; the flash_block_* keys). 0: derived
    from the forward's blocks, the compute blocks at most COMPUTE_BLOCK keys. Each size is cut to the largest one
    that divides what it tiles (the call's rows or keys, or its key block)."""
    kv_compute: int = 0
    q_dkv: int = 0
    kv_dkv: int = 0
    kv_dkv_compute: int = 0
    q_dq: int = 0
    kv_dq: int = 0
    fused_backward: bool = False  # one kernel for dQ, dK and dV (sa_use_fused_bwd_kernel)
    ring_backward: bool = True  # ring hops' backward through splash's kernels (False: benchmarks only)
    stored_masks: bool = False  # partial blocks loaded, never computed (splash_masks; benchmarks and tests only)

    @classmethod
    def from_config(cls, config) -> Blocks:
        return cls(config.flash_block_kv_compute, config.flash_block_q_dkv, config.flash_block_kv_dkv,
                   config.flash_block_kv_dkv_compute, config.flash_block_q_dq, config.flash_block_kv_dq,
                   config.splash_fused_backward)

    def passes(self, bq: int, bkv: int) -> list[tuple[int, int]]:
        """The (query block, key block) each kernel of a differentiable call asks for: forward, dK/dV, dQ."""
        out = [(bq, bkv), (self.q_dkv or bq, self.kv_dkv or bkv)]
        return out if self.fused_backward else [*out, (self.q_dq or bq, self.kv_dq or bkv)]

    def sizes(self, rows: int, keys: int, bq: int, bkv: int, backward: bool):
        """splash's BlockSizes for a call of `rows` queries and `keys` keys with forward blocks bq x bkv."""
        kernel_lib, _ = _lib()

        def compute(block: int, want: int) -> int:
            # The kernels step through a key block this many keys at a time: blocks larger than COMPUTE_BLOCK (long
            # context) then do not grow the working set in VMEM (MaxText's default compute blocks).
            return block_size(block, want) if want else math.gcd(block, COMPUTE_BLOCK) if block > COMPUTE_BLOCK \
                else block

        sizes = dict(block_q=bq, block_kv=bkv, block_kv_compute=compute(bkv, self.kv_compute))
        if backward:
            kv_dkv = block_size(keys, self.kv_dkv or bkv)
            sizes.update(block_q_dkv=block_size(rows, self.q_dkv or bq), block_kv_dkv=kv_dkv,
                         block_kv_dkv_compute=compute(kv_dkv, self.kv_dkv_compute),
                         use_fused_bwd_kernel=self.fused_backward)
            if not self.fused_backward:
                sizes.update(block_q_dq=block_size(rows, self.q_dq or bq),
                             block_kv_dq=block_size(keys, self.kv_dq or bkv))
        return kernel_lib.BlockSizes(**sizes)


def make_kernel(q_orig: np.ndarray, kv_orig: np.ndarray, group: int, block_q: int, block_kv: int,
                save_residuals: bool, interpret: bool = False, max_table_entries: int | None = None,
                window: int = 0, blocks: Blocks = Blocks(), softcap: float = 0.0):
    """Splash kernels over `group` query heads for one device's query rows and key/value block. One kernel unless
    the call's block table (query blocks x key blocks, in on-chip SMEM) would pass `max_table_entries`: then the rows
    are split into the fewest equal chunks that keep each chunk's tables within it, the backward's too; a chunk
    shorter than a block takes the largest block that divides it. Chunks with equal masks (compared on ranks,
    index_runs) share a kernel. Rows are chunked rather than blocks grown, since larger blocks overflow VMEM at
    long context (docs/long_context.md).
    Returns a tuple of (first row, last row + 1, kernel or None) chunks, None for a chunk that sees no key (splash
    refuses an all-hidden mask); for ring hops (`save_residuals`) with several chunks, a `RowLoop` instead: one
    kernel per pass in a loop over the chunks, whatever their number."""
    max_table_entries = MAX_TABLE_ENTRIES if max_table_entries is None else max_table_entries
    bq, bkv = block_size(len(q_orig), block_q), block_size(len(kv_orig), block_kv)
    n_q, n_kv = len(q_orig), len(kv_orig)

    def fewest_chunks(passes: list[tuple[int, int]]) -> int:
        def entries(rows: int) -> int:  # the largest block table of a chunk of `rows` queries, over the passes
            return max(rows // block_size(rows, q) * (n_kv // block_size(n_kv, kv)) for q, kv in passes)

        # Chunks of whole forward blocks first; smaller ones only when a backward block needs them (lazily: the
        # second range is as long as the call's rows).
        candidates = itertools.chain((n for n in range(1, n_q // bq + 1) if n_q // bq % n == 0),
                                     (n for n in range(n_q // bq + 1, n_q + 1) if n_q % n == 0))
        return next((n for n in candidates if entries(n_q // n) <= max_table_entries), n_q // bq)

    # (query block, key block) per pass: forward, dK/dV, dQ; a ring hop (save_residuals) builds only the forward's
    # with Blocks.ring_backward=False or where this JAX lacks the backward kernels splash_backward.hop_backward
    # calls (its backward is then blockwise).
    passes = blocks.passes(bq, bkv)
    backward = not save_residuals or (blocks.ring_backward and backward_kernels_available())
    chunks = fewest_chunks(passes if backward else passes[:1])
    rows = n_q // chunks
    bq = block_size(rows, bq)
    kv_runs, built, out = runs(kv_orig), {}, []
    for start in range(0, len(q_orig), rows):
        q_runs = runs(q_orig[start:start + rows])
        kernel = None
        if sees_a_key(q_runs, kv_runs, window):
            key = (shifted if window else ranked)(q_runs, kv_runs)
            if key not in built:
                built[key] = _make_one(expand(key[0]), expand(key[1]), group, bq, bkv, save_residuals, interpret,
                                       window, blocks, backward, softcap)
            kernel = built[key]
        out.append((start, start + rows, kernel))
    if save_residuals and len(out) > 1 and built:
        return RowLoop(out)
    return tuple(out)


# The arguments splash_backward.hop_backward passes to splash's dQ and dK/dV kernels (private functions of
# jax.experimental.pallas.ops.tpu.splash_attention, so checked against this JAX's signatures).
_BACKWARD_ARGS = ("q", "k", "v", "segment_ids", "logsumexp", "do", "di", "bq", "bkv", "is_mqa", "mask_info",
                  "mask_value", "attn_logits_soft_cap", "q_layout", "k_layout", "v_layout", "mask_function",
                  "interpret")


@functools.cache
def backward_kernels_available() -> bool:
    """Whether this JAX's splash has the dQ and dK/dV kernels with the arguments splash_backward.hop_backward
    passes; without them ring hops take the blockwise backward (kernels.LocalKernel.block_backward)."""
    import inspect

    kernel_lib, _ = _lib()
    try:
        dq = inspect.signature(kernel_lib._splash_attention_bwd_dq).parameters
        dkv = inspect.signature(kernel_lib._splash_attention_bwd_dkv).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return set(_BACKWARD_ARGS) <= set(dq) and set(_BACKWARD_ARGS) | {"bkv_compute", "use_fused_bwd_kernel"} <= set(dkv)


def _make_one(q_orig, kv_orig, group: int, bq: int, bkv: int, save_residuals: bool, interpret: bool, window: int,
              blocks: Blocks, backward: bool, softcap: float = 0.0):
    kernel_lib, mask_lib = _lib()
    mask = mask_lib.MultiHeadMask([ordered_causal_mask(q_orig, kv_orig, window, not blocks.stored_masks)] * group)
    sizes = blocks.sizes(len(q_orig), len(kv_orig), bq, bkv, backward=backward)
    # Concrete tables even when built under a trace (jit stages jnp.array otherwise): kernels are cached across
    # traces (kernels._splash_kernels), and RowLoop reads the tables on the host.
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                          save_residuals=save_residuals, interpret=interpret,
                                          attn_logits_soft_cap=softcap or None)


class RowLoop:
    """Splash kernels over equal row chunks, run as one kernel in a loop over the chunks (lax.map; the backward's
    in splash_backward), so the program holds one Pallas call per pass whatever the number of chunks (instead of
    three per chunk, unrolled: docs/long_context.md). Splash kernels are pytrees whose
    leaves are their block tables (MaskInfo), which splash passes to the Pallas call as operands. Per pass
    (forward, and dQ and dK/dV where the chunks' kernels have them), the distinct chunks' tables are stacked as
    `infos` (_stack); each loop step picks its chunk's by index (`pick`) and runs the kernel with them. A chunk
    that sees no key gets an all-zero block mask: its rows come out as the empty result (lse -inf, out 0) and
    add nothing to the backward."""

    # The axis of each pass's [1, query blocks, key blocks] tables that splash shrinks to the visited blocks, the
    # one the chunks' widths differ on: the key axis, but the query axis for dK/dV (whose data_next holds query
    # blocks and whose partial blocks are transposed: _process_mask(is_dkv=True)).
    PASSES = {"fwd_mask_info": 2, "dq_mask_info": 2, "dkv_mask_info": 1}

    def __init__(self, parts):
        distinct = list(dict.fromkeys(kernel for _, _, kernel in parts))  # by identity; None: sees no key
        self.index = np.asarray([distinct.index(kernel) for _, _, kernel in parts], np.int32)
        self.kernel = next(kernel for kernel in distinct if kernel is not None)
        self.infos = {name: _stack([None if kernel is None else getattr(kernel, name) for kernel in distinct], axis)
                      for name, axis in self.PASSES.items() if getattr(self.kernel, name) is not None}
        self.rows, self.chunks = parts[0][1] - parts[0][0], len(parts)

    def device_info(self, name: str):
        """Pass `name`'s stacked MaskInfo (`infos`) as device arrays, made once outside the loop that picks from it."""
        return jax.tree_util.tree_map(jnp.asarray, self.infos[name])

    def macs(self, heads: int, head_dim: int) -> int:
        """One loop step's visited query-key products x head dim over `heads` (batch x query heads; visited_macs),
        averaged over the chunks."""
        tables = self.infos["fwd_mask_info"].block_mask
        per = [visited_macs(tables[i], self.rows, self.kernel, head_dim) for i in self.index]
        return sum(per) * heads // self.chunks

    @staticmethod
    def pick(info, which):
        """One chunk's MaskInfo from a stacked one: table `which` (traced) of each stacked table."""
        return info._replace(**{name: jax.lax.dynamic_index_in_dim(getattr(info, name), which, keepdims=False)
                                for name in (*_TABLES, "q_sequence") if getattr(info, name) is not None})

    def __call__(self, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, ids=None):
        """`ids`: (query positions, key positions, window) to narrow each chunk's tables to the rows' documents
        (document_blocks), or None."""
        b, s, h, d = q_BSHD.shape
        info = self.device_info("fwd_mask_info")
        q_pos_BS = q_seg_BS if ids is None else ids[0]
        q_values_BS = q_seg_BS if ids is None or ids[3] is None else ids[3]

        def chunk(xs):
            q, seg, pos, values, which = xs
            values = None if ids is None or ids[3] is None else values
            picked = self.pick(info, which)
            if ids is not None:
                picked = document_blocks.call_infos(self.kernel, {"fwd_mask_info": picked}, pos, seg, ids[1],
                                                    kv_seg_BT, ids[2], values)["fwd_mask_info"]
            step = type(self.kernel)(picked, None, None, **self.kernel.kwargs)
            return _call_one(step, q, k_BTKD, v_BTKD, seg, kv_seg_BT, True, macs=self.macs(b * h, d))

        split = [jnp.moveaxis(x.reshape(b, self.chunks, self.rows, *x.shape[2:]), 1, 0)
                 for x in (q_BSHD, q_seg_BS, q_pos_BS, q_values_BS)]
        out, lse = jax.lax.map(chunk, (*split, jnp.asarray(self.index)))
        return jnp.moveaxis(out, 0, 1).reshape(b, s, h, d), jnp.moveaxis(lse, 0, 2).reshape(b, h, s)


_TABLES = ("data_next", "mask_next", "block_mask")


def _stack(infos: list, axis: int):
    """One pass's MaskInfo of each distinct chunk (None: sees no key) as one MaskInfo whose tables are stacked on a
    leading axis, padded along `axis` (the one splash shrinks) to one width the way splash pads its own sequence
    shards: block mask 0, data_next and mask_next edge-repeated, so no block is fetched twice. The partial (mixed)
    mask blocks of all chunks are pooled without repeats (the diagonal's), each chunk's mask_next mapped into the
    pool. A chunk that sees no key gets all-zero tables (block mask 0: nothing runs). As small an integer type as
    each table's values allow (they live in on-chip SMEM), as splash does."""
    infos = [None if info is None else jax.tree_util.tree_map(np.asarray, info) for info in infos]
    seen = [info for info in infos if info is not None]
    shape = list(seen[0].block_mask.shape)
    shape[axis] = max(info.block_mask.shape[axis] for info in seen)
    unique: dict[bytes, int] = {}
    blocks = []
    tables = {name: [] for name in _TABLES}
    for info in infos:
        if info is None:
            for name in _TABLES:
                tables[name].append(np.zeros(shape, np.int32))
            continue
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, shape[axis] - info.block_mask.shape[axis])
        tables["block_mask"].append(np.pad(info.block_mask, pad).astype(np.int32))
        tables["data_next"].append(np.pad(info.data_next, pad, mode="edge").astype(np.int32))
        mask_next = np.zeros(shape, np.int32)
        if info.mask_next is not None:
            ids = []
            for block in info.partial_mask_blocks:
                ids.append(unique.setdefault(block.tobytes(), len(unique)))
                if ids[-1] == len(blocks):
                    blocks.append(block)
            mask_next = np.asarray(ids, np.int32)[np.pad(info.mask_next, pad, mode="edge")]
        tables["mask_next"].append(mask_next)
    stacked = {name: _small(np.stack(arrays)) if blocks or name != "mask_next" else None
               for name, arrays in tables.items()}
    if seen[0].q_sequence is not None:  # masks computed in the kernel: each chunk's query indices (any, if unseen)
        stacked["q_sequence"] = np.stack([seen[0].q_sequence if info is None else info.q_sequence for info in infos])
    return seen[0]._replace(partial_mask_blocks=np.stack(blocks) if blocks else None, **stacked)


def _small(table: np.ndarray) -> np.ndarray:
    return table.astype(next(t for t in (np.int8, np.int16, np.int32) if table.max() <= np.iinfo(t).max))


def splash_call(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool, ids=None):
    """Runs the (local) splash kernels of `make_kernel` on their row chunks; returns (out[B, S, H, D], lse[B, H, S]
    fp32 or None). Chunks share the keys, so autodiff sums their dK/dV. `ids`: (query positions [B, S], key
    positions [B, T], window, query values [B, S] or None): every kernel's tables are narrowed to the rows'
    documents, and given the query values as q_sequence when there are (a documents call of one row:
    document_blocks)."""
    if isinstance(kernels, RowLoop):
        out, lse = kernels(q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, ids)
        return out, lse if save_residuals else None
    parts = []
    for start, stop, kernel in kernels:
        q, seg = q_BSHD[:, start:stop], q_seg_BS[:, start:stop]
        if kernel is None:
            b, s, h, _ = q.shape
            parts.append((jnp.zeros_like(q), jnp.full((b, h, s), -jnp.inf, jnp.float32) if save_residuals else None))
        else:
            macs = visited_macs(kernel.fwd_mask_info.block_mask, stop - start, kernel, q.shape[3]) * q.shape[0] \
                * q.shape[2]
            if ids is not None:
                infos = document_blocks.call_infos(
                    kernel, {name: getattr(kernel, name) for name in document_blocks.PASS_AXIS},
                    ids[0][:, start:stop], seg, ids[1], kv_seg_BT, ids[2],
                    None if ids[3] is None else ids[3][:, start:stop])
                kernel = type(kernel)(*(infos[name] for name in document_blocks.PASS_AXIS), **kernel.kwargs)
            parts.append(_call_one(kernel, q, k_BTKD, v_BTKD, seg, kv_seg_BT, save_residuals, macs=macs))
    if len(parts) == 1:
        return parts[0]
    out = jnp.concatenate([o for o, _ in parts], axis=1)
    return out, (jnp.concatenate([lse for _, lse in parts], axis=-1) if save_residuals else None)


def visited_macs(block_mask, rows: int, kernel, head_dim: int) -> int:
    """Query-key products x head dim that `kernel` computes per query head: the blocks its forward table visits
    (nonzero `block_mask` [1, query blocks, key blocks]; every block when splash keeps no table) x block_q x
    block_kv x head_dim. The FLOPs of each pass are a multiple of it (maxctx.plan.program reads
    it from the kernel's scope, `pallas_macs=`)."""
    sizes = kernel.kwargs["block_sizes"]
    if block_mask is None:
        return rows * sizes.block_kv * head_dim
    table = np.asarray(block_mask)
    return int(np.count_nonzero(table)) * (rows // table.shape[-2]) * sizes.block_kv * head_dim


def pallas_scope(macs: int):
    """The name scope that states a Pallas call's visited products x head dim in the program (maxctx.plan.program)."""
    return jax.named_scope(f"{PALLAS_MACS_SCOPE}{int(macs)}")


def _call_one(kernel, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool, macs: int | None = None):
    kernel_lib, _ = _lib()
    b, s, h, d = q_BSHD.shape
    kv_heads = k_BTKD.shape[2]
    if macs is None:
        macs = visited_macs(kernel.fwd_mask_info.block_mask, s, kernel, d) * b * h
    q_BKGSD = (q_BSHD * d ** -0.5).reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    segments = kernel_lib.SegmentIds(q=q_seg_BS.astype(jnp.int32), kv=kv_seg_BT.astype(jnp.int32))

    def one(q_GSD, k_TD, v_TD, seg):
        return kernel(q_GSD, k_TD, v_TD, segment_ids=seg)

    with pallas_scope(macs):
        result = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(q_BKGSD, k_BKTD, v_BKTD, segments)
    out, lse = (result[0], result[1][0]) if save_residuals else (result, None)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
    if lse is not None:
        lse = lse.reshape(b, h, s).astype(jnp.float32)
        # Rows with no visible key (a ring hop's hidden chunk): splash leaves lse at -inf (or near its mask value)
        # and out at 0/0; make them the empty result the merge expects.
        seen = lse > -1e30
        lse = jnp.where(seen, lse, -jnp.inf)
        out = jnp.where(seen.transpose(0, 2, 1)[..., None], out, 0)
    return out, lse
