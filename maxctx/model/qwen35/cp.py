"""The Gated DeltaNet's token mixing under context parallelism: the sequence stays sharded over the context axes
in its natural order (context_parallel_load_balance=false; maxctx.model.qwen35.family refuses a reordered one), and
a rank needs from its predecessors only the state they leave and the convolution's last W - 1 inputs.

Legend (per device): B batch, n = S / C tokens, N value heads, K key head dim, V value head dim, X convolution
channels, W kernel, C ranks on the context axes, b bytes per activation element.

Each rank takes the previous rank's last W - 1 convolution inputs and segment ids (one collective-permute), computes
its tokens' state map M -> A M + U from a zero state (maxctx.model.qwen35.gdn.transition), and the ranks combine
the maps with an inclusive prefix scan (Hillis-Steele: at step d = 1, 2, 4, .. < C rank r composes its map after
the one of rank r - d, a collective-permute each). The last step sends U only: no later step needs its A, and the
map that reaches back to the sequence's start has no use for its A either (the start state is 0). One more shift
gives each rank the state its predecessors leave, and the rank runs its chunks again from it. Bytes one rank
receives per linear layer, forward (`comm_bytes`, checked against the compiled HLO by tests/test_gdn.py):

    (W - 1) B (X b + 4)  +  4 B N [(steps - 1) (K K + K V) + 2 K V],   steps = ceil(log2 C)

independent of the sequence length (a softmax layer's ring moves S / C tokens per hop).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxctx.model.qwen35 import gdn
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES


def comm_bytes(batch: int, heads: int, key_dim: int, value_dim: int, channels: int, width: int, itemsize: int,
               cp: int) -> int:
    """Bytes one rank receives by collective-permute in one linear layer's forward (module doc)."""
    if cp == 1:
        return 0
    steps = math.ceil(math.log2(cp))
    state = 4 * batch * heads * ((steps - 1) * (key_dim * key_dim + key_dim * value_dim) + 2 * key_dim * value_dim)
    return (width - 1) * batch * (channels * itemsize + 4) + state


def _shift(x, axis, cp: int, distance: int = 1):
    """x from rank r - distance (zeros on the first `distance` ranks)."""
    return jax.lax.ppermute(x, axis, [(i, i + distance) for i in range(cp - distance)])


def incoming_state(a, u, axis, cp: int):
    """The state the ranks before this one leave, from each rank's map (A, U) (module doc)."""
    me = jax.lax.axis_index(axis)
    d = 1
    while d < cp:
        late = me >= d
        u_before = _shift(u, axis, cp, d)
        if 2 * d < cp:
            a_before = _shift(a, axis, cp, d)
            u, a = jnp.where(late, a @ u_before + u, u), jnp.where(late, a @ a_before, a)
        else:
            u = jnp.where(late, a @ u_before + u, u)
        d *= 2
    return _shift(u, axis, cp)


def mix(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims, axis=None, cp: int = 1):
    """The delta rule's outputs o[B, n, N, V] (fp32) of a rank's tokens, inside shard_map over `axis` (C = cp
    ranks) or on the whole sequence (cp = 1). qkv: the projections before the convolution, q | k | v along X;
    dims = (key heads, K, V)."""
    key_heads, dk, dv = dims
    width = conv_XW.shape[1]
    tail, ids_tail = qkv_BSX[:, -(width - 1):], segment_ids_BS[:, -(width - 1):]
    if cp > 1:  # ids are sent + 1 so the first rank, which receives zeros, reads -1: no token before
        halo, halo_ids = _shift(tail, axis, cp), _shift(ids_tail + 1, axis, cp) - 1
    else:
        halo, halo_ids = jnp.zeros_like(tail), jnp.full_like(ids_tail, -1)
    x = gdn.causal_conv(qkv_BSX, conv_XW, segment_ids_BS, halo, halo_ids)
    b, s, n = b_BSN.shape
    q, k, v = jnp.split(x, [key_heads * dk, 2 * key_heads * dk], axis=-1)
    q, k = (gdn.l2_normalize(t.reshape(b, s, key_heads, dk)) for t in (q, k))
    q, k = (jnp.repeat(t, n // key_heads, axis=2) for t in (q * dk**-0.5, k))  # value head j reads key head j // G
    v = v.reshape(b, s, n, dv)
    beta = jax.nn.sigmoid(b_BSN.astype(jnp.float32))
    g = -jnp.exp(a_log_N.astype(jnp.float32)) * jax.nn.softplus(a_BSN.astype(jnp.float32) + dt_bias_N)
    starts = gdn.document_starts(segment_ids_BS, halo_ids[:, -1])
    state = None
    if cp > 1:
        state = incoming_state(*gdn.transition(q, k, v, g, beta, starts), axis, cp)
    return gdn.chunked(q, k, v, g, beta, starts, state)[0]


def sharded_mix(mesh, qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims):
    """`mix` over the whole batch: x[B_(data,fsdp), S_(context,context_a2a), ...] in, o[B, S, N, V] out, laid out
    alike (heads and channels whole on every device)."""
    from maxctx.attention.cp.sharded import shard_map
    from maxctx.parallelism import mesh_context_degree

    cp = 1 if mesh is None else mesh_context_degree(mesh.shape)
    if cp == 1 and mesh is None:
        return mix(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims)

    def body(qkv, b, a, seg, conv, a_log, dt_bias):
        return mix(qkv, b, a, seg, conv, a_log, dt_bias, dims, CONTEXT_AXES, cp)

    seq = P(BATCH_AXES, CONTEXT_AXES)
    specs = (P(BATCH_AXES, CONTEXT_AXES, None), P(BATCH_AXES, CONTEXT_AXES, None), P(BATCH_AXES, CONTEXT_AXES, None),
             seq, P(), P(), P())
    fn = shard_map(body, mesh, specs, P(BATCH_AXES, CONTEXT_AXES, None, None))
    return fn(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N)
