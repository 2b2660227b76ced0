"""Packed documents: the attention work the documents need, the blocks splash computes with static tables and with
the tables narrowed to the batch's documents (maxctx.attention.kernels.document_blocks), per-rank work under the zig-zag
and under the documents placement (context_parallel_load_balance=documents), the host time of that placement,
and measured attention steps on 8 CPU devices.

    python3 benchmarks/packed_documents.py               # the tables (benchmarks/packed_documents.md)
    python3 benchmarks/packed_documents.py --no-measure  # the tables only (minutes instead of half an hour)
    python3 benchmarks/packed_documents.py --only-measure  # the CPU timing only

Rows of S = 128K, 1M and 16M tokens; mixes:
- one document per row;
- 8K-token documents;
- a long-context mixture: one document of S/2 and one of S/4, the rest a log-normal body of short documents
  (median 2,048 tokens, sigma 1.0, 64 to S/16 tokens), in random order. Long-context data mixes pair long
  documents (books, code repositories) with ordinary short-document data; the two long ones are longer than a
  rank's share at every C here, so they must be cut, and the body has to be spread by whole documents.

Blocks are splash's 512 x 512 pairs of the whole S x S causal matrix, natural order (the static tables of every
strategy partition the same pairs; a zig-zag chunk or a rank's share is whole blocks at these sizes). "Today" is
the static causal table; "narrowed" applies document_blocks.pair_visible, the test every splash call runs on the
device; "needed" counts pairs holding at least one visible (query, key) pair. Per-rank work is the visible pairs
of each rank's queries (load_balance.rank_work). The step-time column is maxctx.plan.step_time's estimate for
llama3.1-8b on v5p with C chips (p2p, splash, remat_policy=full), the denominator of the host-time share.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxctx.attention.cp.load_balance import document_permutation, rank_work, zigzag_permutation  # noqa: E402
from maxctx.attention.kernels.document_blocks import pair_visible, summaries  # noqa: E402
from maxctx.parallelism import MeshPlan  # noqa: E402

BLOCK = 512
SIZES = {"128K": 2 ** 17, "1M": 2 ** 20, "16M": 2 ** 24}
CPS = (8, 64, 128)


def mixture(seq: int, rng: np.random.Generator) -> list[int]:
    body, left = [], seq - seq // 2 - seq // 4
    while left:
        n = int(np.clip(rng.lognormal(np.log(2048), 1.0), 64, seq // 16))
        body.append(min(n, left))
        left -= body[-1]
    lengths = [seq // 2, seq // 4, *body]
    rng.shuffle(lengths)
    return lengths


def mixes(seq: int) -> dict[str, list[int]]:
    return {"one document": [seq], "8K documents": [8192] * (seq // 8192),
            "long-context mixture": mixture(seq, np.random.default_rng(0))}


def row(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    seg = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    return pos, seg


def block_counts(pos: np.ndarray, seg: np.ndarray) -> tuple[int, int, int]:
    """(static causal blocks, narrowed blocks, blocks holding a visible pair) over the S x S matrix."""
    nb = len(pos) // BLOCK
    causal = nb * (nb + 1) // 2
    sums = [x[0] for x in summaries(pos[None], seg[None], BLOCK, np)]
    narrowed = 0
    for lo in range(0, nb, 256):  # query blocks in slices: nb x nb booleans would not fit at 16M
        rows = slice(lo, min(nb, lo + 256))
        keep = pair_visible(tuple(x[None, rows] for x in sums), tuple(x[None] for x in sums), 0, np)[0]
        keep &= np.arange(nb)[None, :] <= np.arange(rows.start, rows.stop)[:, None]  # the static causal table
        narrowed += int(keep.sum())
    # Needed, exactly: query block i sees key blocks from the one holding its first token's document start.
    first = np.arange(nb) * BLOCK
    start_block = (first - pos[first]) // BLOCK
    needed = int(np.sum(np.arange(nb) - start_block + 1))
    return causal, narrowed, needed


def layout_blocks(pos: np.ndarray, seg: np.ndarray, perm: np.ndarray, static_causal: bool,
                  cp: int) -> tuple[int, int, float]:
    """(blocks splash runs, blocks holding a visible pair, the busiest rank's runs over the mean) over all
    (query block, key block) pairs of a stored order `perm` (every rank's queries against every rank's keys: all
    hops of the ring): the static table (causal on original index for the zig-zag; every pair for the documents
    placement, whose order is the batch's) narrowed by document_blocks.pair_visible; needed counted per document
    exactly (a pair needs a document with a key at or before one of its queries' positions)."""
    p, s = pos[perm], seg[perm]
    nb = len(p) // BLOCK
    sums = [x[0] for x in summaries(p[None], s[None], BLOCK, np)]
    orig = perm.reshape(nb, BLOCK)
    lo, hi = orig.min(1), orig.max(1)
    per_block = np.zeros(nb, np.int64)
    for start in range(0, nb, 256):
        rows = slice(start, min(nb, start + 256))
        keep = pair_visible(tuple(x[None, rows] for x in sums), tuple(x[None] for x in sums), 0, np)[0]
        if static_causal:
            keep &= lo[None, :] <= hi[rows, None]
        per_block[rows] = keep.sum(1)
    runs, by_rank = int(per_block.sum()), per_block.reshape(cp, -1).sum(1)
    block = np.arange(len(p)) // BLOCK
    key = block.astype(np.int64) * (int(s.max()) + 1) + s
    uniq, inverse = np.unique(key, return_inverse=True)
    minpos = np.full(len(uniq), np.iinfo(np.int64).max)
    maxpos = np.full(len(uniq), -1)
    np.minimum.at(minpos, inverse, p)
    np.maximum.at(maxpos, inverse, p)
    ub, us = uniq // (int(s.max()) + 1), uniq % (int(s.max()) + 1)
    pairs = []
    for d in np.unique(us):
        at = np.flatnonzero(us == d)
        ok = minpos[at][None, :] <= maxpos[at][:, None]  # [query block, key block] of document d
        qi, kj = np.nonzero(ok)
        pairs.append(ub[at][qi] * nb + ub[at][kj])
    needed = len(np.unique(np.concatenate(pairs)))
    return runs, needed, float(by_rank.max() / by_rank.mean())


def imbalance(work: np.ndarray) -> float:
    return float(work.max() / work.mean())


def step_seconds(seq: int, cp: int) -> float:
    from maxctx.loader import load_config
    from maxctx.plan import step_time

    config = load_config([os.path.join(ROOT, "configs/base.yml"), "model_name=llama3.1-8b",
                          f"max_target_length={seq}", f"ici_context_parallelism={cp}",
                          f"per_device_batch_size={1 / cp}", f"compile_topology=v5p-{2 * cp}", "attention=splash",
                          "context_parallel_strategy=p2p", "remat_policy=full"])
    mesh = MeshPlan.one_slice({"data": 1, "fsdp": 1, "context": cp, "context_a2a": 1, "tensor": 1})
    return step_time.estimate(config, mesh, 1, step_time.hardware(config, cp)).step_s


def layout_tables(size_names: list[str]) -> list[str]:
    lines = ["| S | mix | documents | visible pairs | causal pairs | blocks today | narrowed | needed | "
             "narrowed / needed |", "|---|---|---|---|---|---|---|---|---|"]
    balance = ["| S | mix | C | zig-zag max/mean | documents max/mean | tokens per rank | placement host ms | "
               "estimated step s | host share |", "|---|---|---|---|---|---|---|---|---|"]
    layouts = ["| S | mix | C | zig-zag: runs / needed | busiest rank's runs / mean | documents: runs / needed | "
               "busiest rank's runs / mean |", "|---|---|---|---|---|---|---|"]
    for name in size_names:
        seq = SIZES[name]
        for mix, lengths in mixes(seq).items():
            pos, seg = row(lengths)
            visible = sum(n * (n + 1) // 2 for n in lengths)
            today, narrowed, needed = block_counts(pos, seg)
            lines.append(f"| {name} | {mix} | {len(lengths)} | {visible:.3e} | {seq * (seq + 1) / 2:.3e} | "
                         f"{today:,} | {narrowed:,} | {needed:,} | {narrowed / needed:.3f} |")
            for cp in CPS:
                zig = imbalance(rank_work(pos[zigzag_permutation(seq, cp)], cp))
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    perm = document_permutation(pos, seg, cp)
                    times.append(time.perf_counter() - start)
                host = float(np.median(times))
                # A permutation of the row cut into C equal slices: every rank holds exactly S / C tokens.
                assert np.array_equal(np.sort(perm), np.arange(seq))
                step = step_seconds(seq, cp)
                if seq <= 2 ** 20 and cp == 64:
                    zz = layout_blocks(pos, seg, zigzag_permutation(seq, cp), True, cp)
                    dd = layout_blocks(pos, seg, perm, False, cp)
                    layouts.append(f"| {name} | {mix} | {cp} | {zz[0]:,} / {zz[1]:,} = {zz[0] / zz[1]:.3f} | "
                                   f"{zz[2]:.3f} | {dd[0]:,} / {dd[1]:,} = {dd[0] / dd[1]:.3f} | {dd[2]:.3f} |")
                balance.append(f"| {name} | {mix} | {cp} | {zig:.3f} | {imbalance(rank_work(pos[perm], cp)):.3f} | "
                               f"{seq // cp:,} | {host * 1e3:.1f} | {step:.1f} | {host / step:.2%} |")
    return ["## Blocks (512 x 512, the whole causal matrix)", "", *lines, "",
            "## Blocks in the stored orders (C = 64: every rank's queries against every rank's keys)", "", *layouts,
            "", "## Per-rank work and the placement's host time", "", *balance]


def measure(seq: int = 2 ** 17, cp: int = 8, repeats: int = 2) -> list[str]:
    """One attention layer's forward and backward at S = `seq`, blockwise kernel (blocks 512), per mix, under the
    zig-zag and the documents placement: on `cp` CPU devices with p2p (the devices share this machine's cores, so
    the wall time follows the total work, not the busiest rank's), and one rank at a time on one device (its
    queries against every key, in stored order: the busiest rank's time is the step's on devices of their own)."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cp}"
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxctx.attention.dispatch import AttentionSpec, attend
    from maxctx.attention.kernels.flash import flash_attention
    from tests.support.meshes import make_mesh

    mesh = make_mesh(cp, 1)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    rng = np.random.default_rng(0)
    heads, head_dim = 1, 16
    q, k, v = (rng.normal(size=(1, seq, heads, head_dim)).astype(np.float32) for _ in range(3))

    def timed(step, *args) -> float:
        jax.block_until_ready(step(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    def rank_loss(q, k, v, qp, qs, kp, ks):
        return flash_attention(q, k, v, qp, qs, kp, ks, 512, 512)[0].sum()

    one_rank = jax.jit(jax.grad(rank_loss, argnums=(0, 1, 2)))  # numpy inputs: on the first device
    lines = [f"## Measured: one attention layer, forward and backward, S = {seq:,}, blockwise (blocks 512), "
             f"{heads} head of dim {head_dim}, C = {cp}", "",
             "| mix | layout | p2p on 8 CPU devices, s | busiest rank alone, s | ranks alone, total s | "
             "busiest / mean |", "|---|---|---|---|---|---|"]
    for mix, lengths in mixes(seq).items():
        pos, seg = row(lengths)
        for mode in (True, "documents"):
            perm = zigzag_permutation(seq, cp) if mode is True else document_permutation(pos, seg, cp)
            spec = AttentionSpec(kernel="blockwise", strategy="p2p", load_balance=mode, block_q=512, block_kv=512)
            args = [jax.device_put(x[:, perm], sharding) for x in (q, k, v, pos[None], seg[None])]

            def loss(q, k, v, pos, seg, spec=spec):
                return attend(q, k, v, pos, seg, spec, mesh).sum()

            together = timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), *args)
            stored = [x[:, perm] for x in (q, k, v, pos[None], seg[None])]
            share = seq // cp
            alone = [timed(one_rank, stored[0][:, r * share:(r + 1) * share], stored[1], stored[2],
                           stored[3][:, r * share:(r + 1) * share], stored[4][:, r * share:(r + 1) * share],
                           stored[3], stored[4]) for r in range(cp)]
            name = "zig-zag" if mode is True else "documents"
            lines.append(f"| {mix} | {name} | {together:.2f} | {max(alone):.2f} | {sum(alone):.2f} | "
                         f"{max(alone) / np.mean(alone):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU timing")
    parser.add_argument("--only-measure", action="store_true", help="only the CPU timing")
    parser.add_argument("--sizes", default="128K,1M,16M")
    args = parser.parse_args()
    if not args.only_measure:
        print("\n".join(layout_tables(args.sizes.split(","))))
        print()
    if not args.no_measure:
        print("\n".join(measure()))


if __name__ == "__main__":
    main()
