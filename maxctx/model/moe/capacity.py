"""The MoE layer's capacity factor (capacity_factor > 0; 0, the default, is dropless and runs the program without
any of this): which (token, slot) pairs each expert takes.

Legend: B sequences, S tokens of a sequence, k slots (experts) per token, X experts, f the capacity factor.

The rule. Each expert takes at most c = ceil(f S k / X) pairs of each sequence: a sequence's pairs in token-major
order (earlier tokens first, then a token's slots in top-k order, its likelier expert first), as Switch Transformer
and MaxText order them, the first c of each expert kept and the rest dropped: a dropped pair's output is 0, so the
token gets the other slots' outputs, their weights as routed, not renormalised (or none: the residual carries
it on). Padding (segment id 0) takes no capacity, is never dropped (computed as dropless: its output reaches no
loss) and is not counted. The share of real pairs dropped is logged every step (`moe_dropped_fraction`, over every
MoE layer, beside moe_max_load_ratio).
A dropped pair's router weight is set to 0, so the grouped matmuls keep their dropless B S k rows: with f >= 1 an
expert's capacity is at least its balanced share (X c >= S k), so a capacity would bound no buffer below them.

Refused, each in one line (maxctx.model.moe.family.check_keys, from maxctx.validate), where it drops tokens
by design:
    f < 1              below a balanced router's share (S k / X pairs an expert) every step drops tokens even
                       when the router is perfectly balanced;
    a split sequence   the capacity counts whole sequences; under context parallelism (C > 1) or
                       mlp_sequence_chunks (N > 1) a device's chunk holds 1 / (C N) of each sequence, and counting
                       per chunk would drop tokens by where the mesh cuts the sequence (C = 1 and C = 4 would train
                       different models). So a capacity runs at lengths one device holds whole (C N = 1); longer
                       sequences, the ones that need CP, run dropless. Per sequence rather than per device for
                       the same reason: a device's share of the batch depends on the data and fsdp degrees.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxctx.model.moe.family import capacity_per_sequence


def keep(experts_BSK, real_BS, limit: int, num_experts: int):
    """keep[B, S, k] bool: the pairs within their expert's first `limit` of their sequence, token-major (the
    module's rule); padding (real_BS False) kept, as dropless, and taking no capacity. Integer ranks: exact."""
    b, s, k = experts_BSK.shape
    flat = jnp.where(real_BS[..., None], experts_BSK, num_experts).reshape(b, s * k)  # padding: a bin of its own
    order = jnp.argsort(flat, axis=1, stable=True)  # by expert, each expert's pairs in token-major order
    rows = jnp.arange(b)[:, None]
    counts = jnp.zeros((b, num_experts + 1), jnp.int32).at[rows, flat].add(1)
    starts = jnp.cumsum(counts, axis=1) - counts  # where each expert's pairs begin in the sorted row
    rank_sorted = jnp.arange(s * k)[None] - jnp.take_along_axis(starts, jnp.take_along_axis(flat, order, 1), 1)
    rank = jnp.zeros_like(rank_sorted).at[rows, order].set(rank_sorted)
    return ((rank < limit) | (flat == num_experts)).reshape(b, s, k)


def kept_and_dropped(experts_BSK, segment_ids_BS, factor: float, num_experts: int):
    """(keep[B, S, k], each token's dropped pairs [B, S] fp32, 0 for padding) at capacity ceil(f S k / X)."""
    real = segment_ids_BS != 0
    c = capacity_per_sequence(factor, experts_BSK.shape[1], experts_BSK.shape[2], num_experts)
    kept = keep(experts_BSK, real, c, num_experts)
    return kept, jnp.sum(real[..., None] & ~kept, axis=-1).astype(jnp.float32)
