"""Load balancing for causal context parallelism: the order tokens are stored in, so that each of the C context
ranks (which hold S / C consecutive stored tokens) gets the same attention work.

context_parallel_load_balance=true, the zig-zag: the sequence is cut into 2C chunks; rank i holds chunks i and
2C-1-i, so every rank gets the same causal work when the row is one document. The order is static.

context_parallel_load_balance=documents: documents, not fixed chunks, are placed on the ranks, per row of each
batch (`document_permutation`). Work is counted per query token: a query at position p of its document sees p + 1
keys, so a rank's work is the sum of p + 1 over its tokens, wherever the keys live. Documents longer than half a
rank's share are cut head-tail (rank i gets the i-th piece from the document's start and the i-th from its end, as
the zig-zag does for the whole row, the pair sizes rounded so that no rank gets more than one token over an even
split); the rest are placed whole, longest-work first, on the rank with the least work that has room (LPT), and a
document that fits no rank whole fills the ranks with the most room, in contiguous pieces. Every rank then holds
exactly S / C tokens, stored in their original order. Whole short documents keep their attention inside one rank
and one block run (few partial blocks); the head-tail cut balances the long ones, whose work grows with the square
of their length. Sliding windows are not weighed (a windowed layer's work is nearly even already).

Either reorder is applied where the batch is built (host numpy), to every [B, S] array alike (inputs, targets,
positions, segment ids, weights), after targets are shifted on whole sequences; positions and segment ids travel
with the tokens, so the loss does not change.
"""

from __future__ import annotations

import numpy as np


def zigzag_permutation(seq_len: int, cp: int) -> np.ndarray:
    """Indices `perm` such that `x[:, perm]` is the load-balanced order for CP degree `cp`."""
    if cp <= 1:
        return np.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallelism = {2 * cp}")
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return chunks[order].reshape(-1)


def stored_order(seq_len: int, cp: int, load_balance) -> np.ndarray:
    """Original index of every stored token (the zig-zag permutation, or the identity; with documents, which
    changes per batch, the identity: only its length is read, maxctx.attention.kernels.local.make_local's
    `documents`)."""
    return zigzag_permutation(seq_len, cp) if load_balance is True and cp > 1 else np.arange(seq_len)


def reorder_batch(batch: dict[str, np.ndarray], cp: int, mode=True) -> dict[str, np.ndarray]:
    """Applies the zig-zag order (`mode` true) or the documents' placement (`mode` 'documents') to every [B, S]
    array of a batch."""
    if cp <= 1 or mode is False:
        return batch
    if mode == "documents":
        return document_batch(batch, cp)
    perm = zigzag_permutation(next(iter(batch.values())).shape[1], cp)
    return {name: value[:, perm] for name, value in batch.items()}


def restore_order(x: np.ndarray, cp: int, axis: int = 1) -> np.ndarray:
    """Inverse of the zig-zag order along `axis` (for tests and for reading per-token outputs)."""
    perm = zigzag_permutation(x.shape[axis], cp)
    return np.take(x, np.argsort(perm), axis=axis)


# Splash's and the blockwise kernel's default block (flash_block_q / flash_block_kv).
GRANULE = 512


def document_runs(segment_ids_S: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of equal segment ids: the row's documents (padding, id 0, is one too)."""
    cuts = np.flatnonzero(np.diff(segment_ids_S) != 0) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    return list(zip(starts.tolist(), np.diff(np.concatenate([starts, [len(segment_ids_S)]])).tolist()))


def token_work(positions_S: np.ndarray) -> np.ndarray:
    """Visible keys of each query token under causal document masking: its position + 1."""
    return positions_S.astype(np.int64) + 1


def document_permutation(positions_S: np.ndarray, segment_ids_S: np.ndarray, cp: int,
                         granule: int = GRANULE) -> np.ndarray:
    """Indices `perm` of one row such that `row[perm]` stores documents placed on `cp` ranks (module doc): rank r
    holds perm[r S/C : (r + 1) S/C], each rank's tokens in their original order. `granule`: the smallest piece a
    cut document is cut into where it is long enough (a smaller piece still costs its kernel whole blocks)."""
    seq = len(segment_ids_S)
    if cp <= 1:
        return np.arange(seq)
    if seq % cp:
        raise ValueError(f"sequence length {seq} is not divisible by context parallelism = {cp}")
    runs = _ordered_documents(segment_ids_S)
    ranks = _Ranks(cp, seq // cp, np.concatenate([[0], np.cumsum(token_work(positions_S))]))
    long = [run for run in runs if run[1] > ranks.share // 2]
    short = [run for run in runs if run[1] <= ranks.share // 2]
    for start, length in sorted(long, key=lambda run: -run[1]):
        if not ranks.head_tail(start, length, granule):
            short.append((start, length))  # no ranks with room for its pieces: cut as a short one
    short.sort(key=lambda run: -ranks.work_of(*run))
    for start, length in short:
        ranks.whole_or_cut(start, length)
    if ranks.room.any():  # the rounding in head_tail never overfills a rank
        raise AssertionError(f"document placement left ranks with {ranks.room.tolist()} tokens of room")
    return np.concatenate([np.concatenate([np.arange(a, a + n) for a, n in sorted(p)]) for p in ranks.pieces])


def _ordered_documents(segment_ids_S: np.ndarray) -> list[tuple[int, int]]:
    """document_runs, checked to be numbered in order (what splash's per-call masks rely on: document_blocks)."""
    runs = document_runs(segment_ids_S)
    ids = [int(segment_ids_S[start]) for start, _ in runs]
    real = [i for i in ids if i != 0]
    if any(b <= a for a, b in zip(real, real[1:])) or 0 in ids[:len(real)]:
        raise ValueError(f"context_parallel_load_balance=documents needs each row's documents numbered in order "
                         f"(segment ids increasing along the row, padding 0 only at its end), as maxctx's packing "
                         f"writes them; this row's documents have ids {ids[:12]}{' ...' if len(ids) > 12 else ''}")
    return runs


class _Ranks:
    """The C ranks being filled: each one's pieces (start, length) of original tokens, room and work."""

    def __init__(self, cp: int, share: int, cumulative_work: np.ndarray):
        self.cp, self.share, self.cumulative = cp, share, cumulative_work
        self.pieces: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
        self.room = np.full(cp, share, np.int64)
        self.work = np.zeros(cp, np.int64)

    def work_of(self, start: int, length: int) -> int:
        return int(self.cumulative[start + length] - self.cumulative[start])

    def place(self, rank: int, start: int, length: int) -> None:
        if length:
            self.pieces[rank].append((start, length))
            self.room[rank] -= length
            self.work[rank] += self.work_of(start, length)

    def head_tail(self, start: int, length: int, granule: int) -> bool:
        """Cuts a long document head-tail over every rank where its 2C pieces are at least `granule` tokens, else
        over as many as pieces of `granule` allow, and at least as many as hold it and as keep each one's part of
        its work within the mean per rank: the ranks with the least work that have room; False where no such
        ranks have room."""
        m = min(self.cp, max(-(-length // self.share), length // (2 * granule),
                             -(-self.work_of(start, length) * self.cp // max(int(self.cumulative[-1]), 1))))
        while True:
            fit = [r for r in np.argsort(self.work, kind="stable") if self.room[r] >= -(-length // m)]
            if len(fit) >= m or m == self.cp:
                break
            m += 1
        if len(fit) < m:
            return False
        ranks = np.asarray(fit[:m])
        # Pair sizes: length // m each, one more for the (length % m) of them with the most room left.
        pair = np.full(m, length // m, np.int64)
        pair[np.argsort(-self.room[ranks], kind="stable")[:length % m]] += 1
        head = pair // 2
        head_at = start + np.concatenate([[0], np.cumsum(head)[:-1]])
        tail_end = start + length - np.concatenate([[0], np.cumsum(pair - head)[:-1]])
        for i, rank in enumerate(ranks):
            self.place(int(rank), int(head_at[i]), int(head[i]))
            self.place(int(rank), int(tail_end[i] - (pair[i] - head[i])), int(pair[i] - head[i]))
        return True

    def whole_or_cut(self, start: int, length: int) -> None:
        """A short document whole on the rank with the least work that has room (LPT), else cut across the ranks
        with the most room, in contiguous pieces."""
        fits = np.flatnonzero(self.room >= length)
        if len(fits):
            self.place(int(fits[np.argmin(self.work[fits])]), start, length)
            return
        for rank in np.argsort(-self.room, kind="stable"):
            take = int(min(self.room[rank], length))
            self.place(int(rank), start, take)
            start, length = start + take, length - take
            if not length:
                return


def rank_work(positions_S: np.ndarray, cp: int) -> np.ndarray:
    """Attention work (visible query-key pairs) of each of `cp` ranks for a row in stored order."""
    return token_work(positions_S).reshape(cp, -1).sum(1)


def document_batch(batch: dict[str, np.ndarray], cp: int) -> dict[str, np.ndarray]:
    """`document_permutation` of each row, applied to every [B, S] array of a batch."""
    if cp <= 1:
        return batch
    perms = np.stack([document_permutation(p, s, cp) for p, s in zip(batch["positions"], batch["segment_ids"])])
    return {name: np.take_along_axis(value, perms, axis=1) for name, value in batch.items()}
