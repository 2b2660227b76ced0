"""The Gated DeltaNet's token mixing under context parallelism: the sequence stays sharded over the context axes,
and a rank needs from the others only the states they leave and the convolution's last W - 1 inputs.

Legend (per device): B batch, n = S / C tokens, N value heads, K key head dim, V value head dim, X convolution
channels, W kernel, C ranks on the context axes, b bytes per activation element.

A run of tokens maps the state M -> A M + U (maxctx.model.qwen35.gdn.transition, from the run's tokens alone). In
the natural order (context_parallel_load_balance=false) rank r holds run r: each rank takes the previous rank's
last W - 1 convolution inputs and segment ids (a collective-permute), computes its run's (A, U), and the ranks
combine them with an inclusive prefix scan (Hillis-Steele: at step d = 1, 2, 4, .. < C rank r composes its map
after that of rank r - d, a collective-permute each). The last step sends U only: no later step needs its A, and
a map reaching back to the sequence's start needs none (the start state is 0). One more shift gives each rank the
state the ranks before it leave, and the rank runs its chunks again from it.

Under the zig-zag (context_parallel_load_balance=true) rank r holds runs r and 2C - 1 - r, so the order of the
second halves runs backwards over the ranks: a forward scan over the first halves, whose total rank C - 1 holds,
then a backward scan (rank r after rank r + 1) over the second halves starting from that total; each half takes
its halo from the rank before it in the sequence (rank C - 1's second half from its own first). Twice the bytes.
Documents placed on the ranks (`documents`) are refused by maxctx.model.qwen35.family.

Bytes one rank receives per linear layer, forward (maxctx.model.qwen35.family.exchange_bytes, which the time model
reads; checked against the compiled HLO by tests/test_gdn.py), with h = 2 halves under the zig-zag, else 1:

    h [(W - 1) B (X b + 4)  +  4 B N ((steps - 1) (K K + K V) + 2 K V)],   steps = ceil(log2 C)

independent of the sequence length (a softmax layer's ring moves S / C tokens per hop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxctx.model.qwen35 import gdn
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES


def _shift(x, axis, cp: int, distance: int = 1):
    """x from rank r - distance (r + |distance| when negative); zeros where there is none."""
    if distance > 0:
        return jax.lax.ppermute(x, axis, [(i, i + distance) for i in range(cp - distance)])
    return jax.lax.ppermute(x, axis, [(i - distance, i) for i in range(cp + distance)])


def prefix_scan(a, u, axis, cp: int, direction: int = 1):
    """U of the composition of the maps of every rank up to this one (inclusive), the ranks ordered by rank
    (`direction` 1) or backwards (-1)."""
    me = jax.lax.axis_index(axis)
    d = 1
    while d < cp:
        late = me >= d if direction > 0 else me < cp - d
        u_before = _shift(u, axis, cp, direction * d)
        new_u = jnp.where(late, a @ u_before + u, u)
        if 2 * d < cp:
            a = jnp.where(late, a @ _shift(a, axis, cp, direction * d), a)
        u, d = new_u, 2 * d
    return u


def _inputs(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, halo, halo_ids, conv_XW, a_log_N, dt_bias_N, dims):
    """The delta rule's operands of a run of tokens (q, k, v, g, beta, document starts), its convolution's W - 1
    earlier inputs `halo` (ids -1 where there are none)."""
    key_heads, dk, dv = dims
    x = gdn.causal_conv(qkv_BSX, conv_XW, segment_ids_BS, halo, halo_ids)
    b, s, n = b_BSN.shape
    q, k, v = jnp.split(x, [key_heads * dk, 2 * key_heads * dk], axis=-1)
    q, k = (gdn.l2_normalize(t.reshape(b, s, key_heads, dk)) for t in (q, k))
    q, k = (jnp.repeat(t, n // key_heads, axis=2) for t in (q * dk**-0.5, k))  # value head j reads key head j // G
    beta = jax.nn.sigmoid(b_BSN.astype(jnp.float32))
    g = -jnp.exp(a_log_N.astype(jnp.float32)) * jax.nn.softplus(a_BSN.astype(jnp.float32) + dt_bias_N)
    return q, k, v.reshape(b, s, n, dv), g, beta, gdn.document_starts(segment_ids_BS, halo_ids[:, -1])


def _tails(qkv_BSX, segment_ids_BS, width: int):
    return qkv_BSX[:, -(width - 1):], segment_ids_BS[:, -(width - 1):]


def _from(tail, axis, cp: int, distance: int):
    """A run's last inputs and ids from another rank (ids -1 where none: sent + 1 over zeros)."""
    x, ids = tail
    return _shift(x, axis, cp, distance), _shift(ids + 1, axis, cp, distance) - 1


def mix(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims, axis=None, cp: int = 1,
        zigzag: bool = False):
    """The delta rule's outputs o[B, n, N, V] (fp32) of a rank's tokens, inside shard_map over `axis` (C = cp
    ranks) or on the whole sequence (cp = 1). qkv: the projections before the convolution, q | k | v along X;
    dims = (key heads, K, V)."""
    params = (conv_XW, a_log_N, dt_bias_N, dims)
    width = conv_XW.shape[1]
    if cp == 1:
        x, ids = _tails(qkv_BSX, segment_ids_BS, width)
        ops = _inputs(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, jnp.zeros_like(x), jnp.full_like(ids, -1), *params)
        return gdn.chunked(*ops)[0]
    if not zigzag:
        halo = _from(_tails(qkv_BSX, segment_ids_BS, width), axis, cp, 1)
        ops = _inputs(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, *halo, *params)
        state = _shift(prefix_scan(*gdn.transition(*ops), axis, cp), axis, cp)
        return gdn.chunked(*ops, state)[0]
    half = qkv_BSX.shape[1] // 2
    first, second = ([x[:, :half] for x in (qkv_BSX, b_BSN, a_BSN, segment_ids_BS)],
                     [x[:, half:] for x in (qkv_BSX, b_BSN, a_BSN, segment_ids_BS)])
    last = jax.lax.axis_index(axis) == cp - 1
    own = _tails(first[0], first[3], width)
    ops_a = _inputs(*first, *_from(own, axis, cp, 1), *params)
    halo_b = _from(_tails(second[0], second[3], width), axis, cp, -1)
    halo_b = [jnp.where(last, o, h) for o, h in zip(own, halo_b)]
    ops_b = _inputs(*second, *halo_b, *params)
    total = prefix_scan(*gdn.transition(*ops_a), axis, cp)  # rank r: after runs 0 .. r
    a_b, u_b = gdn.transition(*ops_b)
    after = prefix_scan(a_b, jnp.where(last, a_b @ total + u_b, u_b), axis, cp, -1)  # after run 2C - 1 - r
    state_a = _shift(total, axis, cp)
    state_b = jnp.where(last, total, _shift(after, axis, cp, -1))
    return jnp.concatenate([gdn.chunked(*ops_a, state_a)[0], gdn.chunked(*ops_b, state_b)[0]], axis=1)


def sharded_mix(mesh, qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims,
                zigzag: bool = False):
    """`mix` over the whole batch: x[B_(data,fsdp), S_(context,context_a2a), ...] in, o[B, S, N, V] out, laid out
    alike (heads and channels whole on every device); `zigzag`: the tokens are in the zig-zag order."""
    from maxctx.attention.cp.sharded import shard_map
    from maxctx.parallelism import mesh_context_degree

    if mesh is None:
        return mix(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N, dims)
    cp = mesh_context_degree(mesh.shape)

    def body(qkv, b, a, seg, conv, a_log, dt_bias):
        return mix(qkv, b, a, seg, conv, a_log, dt_bias, dims, CONTEXT_AXES, cp, zigzag)

    tokens = P(BATCH_AXES, CONTEXT_AXES, None)
    specs = (tokens, tokens, tokens, P(BATCH_AXES, CONTEXT_AXES), P(), P(), P())
    fn = shard_map(body, mesh, specs, P(BATCH_AXES, CONTEXT_AXES, None, None))
    return fn(qkv_BSX, b_BSN, a_BSN, segment_ids_BS, conv_XW, a_log_N, dt_bias_N)
