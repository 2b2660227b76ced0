"""Zig-zag load balancing for causal context parallelism.

The sequence is cut into 2C chunks; CP rank i holds chunks i and 2C-1-i, so every rank gets the same causal work.
The reorder is applied where the batch is built (host numpy), to every [B, S] array alike (inputs, targets,
positions, segment ids, weights), after targets are shifted on whole sequences.
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


def reorder_batch(batch: dict[str, np.ndarray], cp: int) -> dict[str, np.ndarray]:
    """Applies the zig-zag order to every [B, S] array of a batch."""
    if cp <= 1:
        return batch
    perm = zigzag_permutation(next(iter(batch.values())).shape[1], cp)
    return {name: value[:, perm] for name, value in batch.items()}


def restore_order(x: np.ndarray, cp: int, axis: int = 1) -> np.ndarray:
    """Inverse of the zig-zag order along `axis` (for tests and for reading per-token outputs)."""
    perm = zigzag_permutation(x.shape[axis], cp)
    return np.take(x, np.argsort(perm), axis=axis)
