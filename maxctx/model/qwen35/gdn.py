"""The Gated DeltaNet's token mixing (Qwen3.5, Qwen3-Next), as pure functions: the short causal depthwise
convolution, and the gated delta rule in chunks (the WY / UT form, chunk 64) with the recurrent form it must equal.

Legend: B batch, S sequence, N value heads, K key head dim, V value head dim, L chunk, W convolution kernel,
X convolution channels. Per head the state M[K, V] (fp32) follows, token by token,

    M_t = exp(g_t) (I - beta_t k_t k_t^T) M_(t-1) + beta_t k_t v_t^T        o_t = M_t^T q_t

with q, k L2-normalised (q also scaled by K^-1/2). A token that starts a document (its segment id differs from the
token before it, or it is the first) sees M_(t-1) = 0, and the convolution sees no token of an earlier document.

Over a run of tokens the state is an affine map M -> A M + U (A[K, K], U[K, V] per head): `transition` gives the
run's (A, U) from its tokens alone, so context ranks combine their runs with a prefix scan (maxctx.model.qwen35.cp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CHUNK = 64
GROUP = 16  # chunks per group whose forward the backward runs again (_scan_chunks)


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, as transformers' and FLA's l2norm."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def document_starts(segment_ids_BS, previous_B):
    """[B, S] bool: the token starts a document; `previous_B` is the segment id of the token before the first (-1
    at the sequence's start)."""
    before = jnp.concatenate([previous_B[:, None], segment_ids_BS[:, :-1]], axis=1)
    return segment_ids_BS != before


def causal_conv(x_BSX, w_XW, segment_ids_BS, halo_BHX, halo_ids_BH):
    """silu(depthwise causal convolution) [B, S, X] in fp32: out_t = sum_j w[:, j] x_(t - W + 1 + j) over the
    tokens of t's document; `halo_*` are the W - 1 tokens (and segment ids) before the first, -1 where none."""
    width, seq = w_XW.shape[1], x_BSX.shape[1]
    xs = jnp.concatenate([halo_BHX, x_BSX], axis=1).astype(jnp.float32)
    ids = jnp.concatenate([halo_ids_BH, segment_ids_BS], axis=1)
    w = w_XW.astype(jnp.float32)
    out = jnp.zeros(x_BSX.shape, jnp.float32)
    for j in range(width):
        same = (ids[:, j:j + seq] == segment_ids_BS)[..., None]
        out = out + jnp.where(same, xs[:, j:j + seq], 0.0) * w[:, j]
    return jax.nn.silu(out)


def recurrent(q, k, v, g, beta, starts, state=None):
    """The reference: the rule token by token (lax.scan). q, k [B, S, N, K] (normalised), v [B, S, N, V], g, beta
    [B, S, N], starts [B, S] bool; returns (o [B, S, N, V] fp32, the final state [B, N, K, V])."""
    b, _, n, dk = k.shape
    state = jnp.zeros((b, n, dk, v.shape[-1]), jnp.float32) if state is None else state

    def step(m, xs):
        q_t, k_t, v_t, g_t, beta_t, start_t = xs
        m = m * (jnp.exp(g_t) * (1.0 - start_t[:, None]))[..., None, None]
        delta = (v_t - jnp.einsum("BNK,BNKV->BNV", k_t, m)) * beta_t[..., None]
        m = m + jnp.einsum("BNK,BNV->BNKV", k_t, delta)
        return m, jnp.einsum("BNK,BNKV->BNV", q_t, m)

    xs = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta, starts)]
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def _cut(x, chunk: int, chunks: int):
    """[B, S, N, ...] -> [C, B, N, L, ...] ([B, S] -> [C, B, L]), S padded to C L with tokens that change nothing
    (k = 0, g = 0, beta = 0, no document start)."""
    x = jnp.pad(x, [(0, 0), (0, chunks * chunk - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 3, 2) if x.ndim > 3 else x, 1, 0)


def _chunk_terms(q, k, v, g, beta, starts):
    """One chunk's terms of the WY / UT form: q, k [B, N, L, K], v [B, N, L, V], g, beta [B, N, L] fp32, starts
    [B, L]; returns (u, w, q_in, k_out, attn [B, N, L, L], carry [B, N])."""
    chunk = k.shape[-2]
    ends = jnp.cumsum(starts.astype(jnp.int32), axis=-1)[:, None]  # [B, 1, L]: starts so far
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = (ends[..., :, None] == ends[..., None, :]) & lower  # token j's writes reach token i
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    system = jnp.einsum("BNiK,BNjK->BNij", k_beta, k) * decay * (1.0 - jnp.eye(chunk)) + jnp.eye(chunk)

    def solve(rhs):
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    first = (ends == 0)[..., None]  # the incoming state reaches these tokens
    tail = (ends == ends[..., -1:])[..., None]  # these tokens' writes reach the chunk's end
    u = solve(v * beta[..., None])
    w = solve(k_beta * jnp.exp(cum)[..., None] * first)
    q_in = q * jnp.exp(cum)[..., None] * first
    k_out = k * jnp.exp(cum[..., -1:] - cum)[..., None] * tail
    attn = jnp.einsum("BNiK,BNjK->BNij", q, k) * decay
    carry = jnp.exp(cum[..., -1]) * (ends[..., -1] == 0)
    return u, w, q_in, k_out, attn, carry


def _scan_chunks(step, init, q, k, v, g, beta, starts, chunk: int):
    """lax.scan of step(carry, one chunk's terms) over the chunks, in groups of GROUP chunks whose forward the
    backward runs again (jax.checkpoint): it keeps the carry once per group, not every chunk's terms and carries,
    which for Qwen3.5-9B's layer were about 488 KiB per token. Returns (carry, the steps' outputs [C, ...])."""
    seq = k.shape[1]
    group = min(GROUP, -(-seq // chunk))
    chunks = -(-seq // (chunk * group)) * group
    xs = [_cut(x.astype(jnp.float32), chunk, chunks) for x in (q, k, v, g, beta)] + [_cut(starts, chunk, chunks)]
    xs = [x.reshape(chunks // group, group, *x.shape[1:]) for x in xs]

    def one(carry, xs_c):
        return step(carry, _chunk_terms(*xs_c))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def run(carry, xs_g):
        return jax.lax.scan(one, carry, xs_g)

    carry, ys = jax.lax.scan(run, init, xs)
    return carry, jax.tree.map(lambda y: y.reshape(chunks, *y.shape[2:]), ys)


def chunked(q, k, v, g, beta, starts, state=None, chunk: int = CHUNK):
    """`recurrent` in chunks of `chunk` tokens: within a chunk matmuls (a unit-triangular solve for the delta
    rule's corrections), across chunks a scan of the state. Same arguments and results."""
    b, seq, n, dk = k.shape
    state = jnp.zeros((b, n, dk, v.shape[-1]), jnp.float32) if state is None else state

    def step(m, terms):
        u_c, w_c, q_c, k_c, attn_c, carry_c = terms
        v_new = u_c - jnp.einsum("BNLK,BNKV->BNLV", w_c, m)
        o = jnp.einsum("BNLK,BNKV->BNLV", q_c, m) + jnp.einsum("BNij,BNjV->BNiV", attn_c, v_new)
        m = m * carry_c[..., None, None] + jnp.einsum("BNLK,BNLV->BNKV", k_c, v_new)
        return m, o

    state, o = _scan_chunks(step, state, q, k, v, g, beta, starts, chunk)  # o [C, B, N, L, V]
    o = jnp.moveaxis(o, 0, 2).reshape(b, n, -1, o.shape[-1])[:, :, :seq]
    return jnp.moveaxis(o, 1, 2), state


def transition(q, k, v, g, beta, starts, chunk: int = CHUNK):
    """The tokens' state map M -> A M + U as (A [B, N, K, K], U [B, N, K, V]) from the tokens alone; a document
    start among them makes A = 0 (nothing before it carries past)."""
    b, _, n, dk = k.shape

    def step(au, terms):
        a, m = au
        u_c, w_c, _, k_c, _, carry_c = terms
        a_c = carry_c[..., None, None] * jnp.eye(dk) - jnp.einsum("BNLK,BNLJ->BNKJ", k_c, w_c)
        u_c = jnp.einsum("BNLK,BNLV->BNKV", k_c, u_c)
        return (a_c @ a, a_c @ m + u_c), None

    init = (jnp.broadcast_to(jnp.eye(dk), (b, n, dk, dk)), jnp.zeros((b, n, dk, v.shape[-1]), jnp.float32))
    return _scan_chunks(step, init, q, k, v, g, beta, starts, chunk)[0]
