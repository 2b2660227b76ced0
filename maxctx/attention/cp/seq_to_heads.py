"""All-to-all attention (Ulysses): sequence shards become head shards over the mesh axis `context_a2a`, the
inner attention runs on whole sequences (or ring blocks, for usp) of H/U heads, and the output goes back (the
machinery of the a2a and usp strategies; call inside shard_map).

Legend (per device): B batch, S sequence, H and K heads, U the A2A degree, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxctx.attention.cp.cost import replicated_kv_heads
from maxctx.parallelism import A2A_AXIS


def seq_to_heads(x_BSHD, axis=A2A_AXIS):
    """[B, S/U, H, D] -> [B, S, H/U, D] over `axis`."""
    return jax.lax.all_to_all(x_BSHD, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BSHD, axis=A2A_AXIS):
    """[B, S, H/U, D] -> [B, S/U, H, D] over `axis`."""
    return jax.lax.all_to_all(x_BSHD, axis, split_axis=1, concat_axis=2, tiled=True)


def repeat_kv(x_BSKD, degree: int):
    kv_heads = x_BSKD.shape[2]
    reps = replicated_kv_heads(kv_heads, degree) // kv_heads
    return jnp.repeat(x_BSKD, reps, axis=2) if reps > 1 else x_BSKD


def a2a_attention(q, k, v, pos, seg, degree: int, inner, sinks_H=None):
    """Sequence-to-heads over A2A_AXIS, then inner(q, k, v, pos, seg, sinks) on [B, S_block, heads/U, D], with
    `sinks_H` (attention sinks [H], or None) cut to the device's heads/U."""
    heads = q.shape[2] // degree
    if sinks_H is not None:  # seq_to_heads gives device i of the axis heads [i H/U, (i + 1) H/U)
        sinks_H = jax.lax.dynamic_slice_in_dim(sinks_H, jax.lax.axis_index(A2A_AXIS) * heads, heads)
    k, v = repeat_kv(k, degree), repeat_kv(v, degree)
    q, k, v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
    pos, seg = (jax.lax.all_gather(x, A2A_AXIS, axis=1, tiled=True) for x in (pos, seg))
    return heads_to_seq(inner(q, k, v, pos, seg, sinks_H))
