"""Documents per row in the step-time model (planner_document_lengths): the attention pairs the rows' documents
need, and how unevenly the context ranks share them under each context_parallel_load_balance
(maxctx.attention.cp.load_balance), for maxctx.plan.step_time's attention term and the planner's header.
"""

from __future__ import annotations

import functools

from maxctx.config import Config, ConfigError, layer_windows


def causal_keys(seq: int, window: int) -> float:
    """Keys a query attends to on average (causal): S / 2, or about W in a local layer (MaxText's count)."""
    return min(window, seq / 2) if window else seq / 2


def document_lengths(spec: str, seq: int) -> list[int]:
    """planner_document_lengths: comma-separated document lengths, `NxM` for M documents of N tokens, repeated
    until the row of `seq` tokens is full (the last one cut); ConfigError naming the fix."""
    lengths = []
    for part in spec.replace(" ", "").split(","):
        size, times, count = part.partition("x")
        if not size.isdigit() or int(size) < 1 or (times and (not count.isdigit() or int(count) < 1)):
            raise ConfigError(f"planner_document_lengths='{spec}': '{part}' is not a length or LENGTHxCOUNT; give "
                              f"e.g. 8192 (8K-token documents) or 524288,262144,2048x128")
        lengths += [int(size)] * int(count or 1)
    row, filled = [], 0
    while filled < seq:
        for n in lengths:
            row.append(min(n, seq - filled))
            filled += row[-1]
            if filled == seq:
                break
    return row


@functools.lru_cache(maxsize=64)
def document_work(spec: str, seq: int, cp: int, load_balance, window: int, groups: int = 0) -> tuple[float, float]:
    """(mean keys a query sees, the busiest query partition's attention work over the mean) for rows of the
    documents `spec` describes (document_lengths) in a layer of `window` (0: global), stored as
    context_parallel_load_balance stores them over `cp` ranks, whose queries `groups` partitions of consecutive
    ranks attend to (the ring degree: C for all_gather and p2p, C / U for usp, 1 for a2a, whose devices each
    attend to every query for their heads; 0: cp)."""
    import numpy as np

    from maxctx.attention.cp.load_balance import document_permutation, zigzag_permutation

    lengths = document_lengths(spec, seq)
    pos = np.concatenate([np.arange(n) for n in lengths])
    seen = np.minimum(pos + 1, window) if window else pos + 1
    if cp <= 1 or load_balance is False:
        order = np.arange(seq)
    elif load_balance == "documents":
        seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)
        order = document_permutation(pos, seg, cp)
    else:
        order = zigzag_permutation(seq, cp)
    by_group = seen[order].reshape(max(groups or cp, 1), -1).sum(1)
    return float(seen.mean()), float(by_group.max() / by_group.mean())


def attention_pairs_per_token(config: Config, window: int, cp: int, groups: int) -> tuple[float, float]:
    """(keys per query the model FLOPs count, keys per query the busiest rank's kernels run) in a layer of
    `window`: both S / 2 (or about W) for one document per row; with planner_document_lengths, the documents'
    own pairs times the busiest query partition's share (document_work; `groups`: the ring degree)."""
    seq = config.max_target_length
    causal = causal_keys(seq, window)
    if not config.planner_document_lengths:
        return causal, causal
    mean, busiest = document_work(config.planner_document_lengths, seq, cp, config.context_parallel_load_balance,
                                  window, groups)
    return causal, mean * busiest


def attention_counted(config: Config, cp: int) -> str:
    """Which attention pairs the estimate counts, in words (the planner's header, maxctx.compile's report)."""
    if not config.planner_document_lengths:
        return "causal S^2/2 per row"
    works = [document_work(config.planner_document_lengths, config.max_target_length, cp,
                           config.context_parallel_load_balance, w, cp) for w in layer_windows(config)]
    share = sum(mean for mean, _ in works) / len(works) / causal_keys(config.max_target_length, 0)
    return (f"documents {config.planner_document_lengths} ({share:.3g} of causal S^2/2), busiest rank "
            f"{max(b for _, b in works):.3f}x the mean (ranks of C={cp}) under context_parallel_load_balance="
            f"{str(config.context_parallel_load_balance).lower()}")


