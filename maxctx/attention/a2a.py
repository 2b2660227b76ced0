"""a2a (Ulysses) context parallelism: all-to-all turns sequence shards into head shards, attend, and back.

Legend (per device): B batch per device, S the whole sequence, C the CP degree (= A2A degree U for a2a), H and K
heads per tensor shard, D head dim, b bytes per activation element; positions and segment ids are int32.

q[B, S/U, H, D] -> [B, S, H/U, D] and the same for K and V; positions and segment ids are all-gathered. With
fewer kv heads than U (or K not divisible by U), kv heads are first repeated to K' = lcm(K, U) (it divides H), so
every device gets the kv heads of its query heads; autodiff of the repeat sums their gradients back. Only H not
divisible by U is refused (maxctx.validate, before compile).

Collective bytes per layer (all-to-all operands on one device; the wire carries (U-1)/U of them):
    forward   all-to-all  q, k, v in and out back:   (2 H + 2 K') B (S/U) D b
              all-gather  positions, segment ids:    2 B S 4
    backward  all-to-all  dout in, dq, dk, dv back:  (2 H + 2 K') B (S/U) D b
Attention activation memory per device: saved q, out (2 H/U) B S D b, k, v (2 K'/U) B S D b, lse B (H/U) S 4
= the same O(S/U) bytes as the sharded inputs; the kernel's temp on top (flash: one score block).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from maxctx.attention.collectives import context_shard_map
from maxctx.attention.kernels import make_local, stored_order

A2A_AXIS = "context_a2a"


def seq_to_heads(x_BSHD, axis=A2A_AXIS):
    """[B, S/U, H, D] -> [B, S, H/U, D] over `axis`."""
    return jax.lax.all_to_all(x_BSHD, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BSHD, axis=A2A_AXIS):
    """[B, S, H/U, D] -> [B, S/U, H, D] over `axis`."""
    return jax.lax.all_to_all(x_BSHD, axis, split_axis=1, concat_axis=2, tiled=True)


def replicated_kv_heads(kv_heads: int, degree: int) -> int:
    """K' = lcm(K, U): kv heads after repetition, so that U divides them."""
    return math.lcm(kv_heads, degree)


def repeat_kv(x_BSKD, degree: int):
    kv_heads = x_BSKD.shape[2]
    reps = replicated_kv_heads(kv_heads, degree) // kv_heads
    return jnp.repeat(x_BSKD, reps, axis=2) if reps > 1 else x_BSKD


def a2a_attention(q, k, v, pos, seg, degree: int, inner):
    """Sequence-to-heads over A2A_AXIS, then inner(q, k, v, pos, seg) on [B, S_block, heads/U, D]."""
    k, v = repeat_kv(k, degree), repeat_kv(v, degree)
    q, k, v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
    pos, seg = (jax.lax.all_gather(x, A2A_AXIS, axis=1, tiled=True) for x in (pos, seg))
    return heads_to_seq(inner(q, k, v, pos, seg))


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *, kernel: str, mesh: Mesh, load_balance: bool,
           block_q: int, block_kv: int):
    if mesh.shape["context"] > 1:  # a ring part as well: that is usp
        from maxctx.attention import usp
        return usp.attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, kernel=kernel, mesh=mesh,
                          load_balance=load_balance, block_q=block_q, block_kv=block_kv)
    u = mesh.shape[A2A_AXIS]
    seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
    group = h // replicated_kv_heads(kv_heads, u)
    local = make_local(kernel, block_q, block_kv, mesh=mesh, order=stored_order(seq, u, load_balance),
                       group=group)

    def inner(q, k, v, pos, seg):
        return local.attend(0, q, k, v, pos, seg, pos, seg)[0]

    def body(q, k, v, pos, seg):
        return a2a_attention(q, k, v, pos, seg, u, inner)

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS)
