"""Index sets as runs of consecutive integers, and canonical forms of (query, key) index pairs whose causal masks
are equal: how the splash kernels of a layout are deduplicated (kernels.py, splash.py) without comparing tokens."""

from __future__ import annotations

import bisect

import numpy as np


def runs(indices: np.ndarray) -> tuple[tuple[int, int], ...]:
    """`indices` as maximal runs (start, length) of consecutive integers (two per shard under zig-zag)."""
    cuts = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [len(indices)]]))
    return tuple(zip(indices[starts].tolist(), lengths.tolist()))


def ranked(q_runs, kv_runs) -> tuple[tuple, tuple]:
    """The runs with every index replaced by its rank in the union of both sets, re-merged into maximal runs: a
    canonical form, so two (q, kv) pairs get equal results iff their rank arrays are equal, and then their causal
    masks are equal (the masks only compare indices). O(runs), not O(tokens): a ring at C = 128 has C^2 pairs."""
    union: list[list[int]] = []  # disjoint, sorted [start, stop) covering both sets
    for start, length in sorted(q_runs + kv_runs):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], start + length)
        else:
            union.append([start, start + length])
    starts = [lo for lo, _ in union]
    before = np.cumsum([0] + [hi - lo for lo, hi in union]).tolist()

    def rank(runs):
        out: list[tuple[int, int]] = []
        for start, length in runs:
            i = bisect.bisect_right(starts, start) - 1
            r = start - starts[i] + before[i]
            if out and out[-1][0] + out[-1][1] == r:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((r, length))
        return tuple(out)

    return rank(q_runs), rank(kv_runs)


def shifted(q_runs, kv_runs) -> tuple[tuple, tuple]:
    """The runs moved so that the smallest index is 0: equal iff the masks are equal for any index distance."""
    low = min(start for start, _ in q_runs + kv_runs)
    return (tuple((start - low, n) for start, n in q_runs), tuple((start - low, n) for start, n in kv_runs))


def expand(runs) -> np.ndarray:
    return np.concatenate([np.arange(start, start + length) for start, length in runs])
