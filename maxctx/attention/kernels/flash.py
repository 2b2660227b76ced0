"""Blockwise (flash) attention in pure JAX: online softmax over key/value blocks, a custom VJP, and the lse.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, G = H // K, D head dim of q and k
(v's, and out's, may differ: MLA), Q = block_q, C = block_kv (inside this file only).

Memory: never S x T. The forward holds one [B, K, G, Q, C] fp32 score block per step plus the running
(max, sum, accumulator) of one query block; the backward one score block plus dq[B, S, H, D] fp32 and the
dk/dv accumulators of one key block. Saved residuals: q, k, v, out and lse[B, H, S] fp32.

Masks come from positions and segment ids (query i sees key j iff same segment and pos[j] <= pos[i]), so any
token order works. A (query block, key block) pair that can hold no visible entry is skipped by `lax.cond` on the
blocks' id ranges (`_may_see`: segment ranges that meet, causal by position, the window), before its mask is
built: under zig-zag load balancing or a causal ring that is about half of all blocks, on packed rows every pair
of blocks with no shared document; with a sliding window W (`window` > 0, query i sees key j iff
0 <= pos[i] - pos[j] < W) every pair outside the band, so the work is O(S W), not O(S T).

A logit soft-cap c > 0 (`softcap`, Gemma 2) makes each score block c tanh(s / c) before the mask, so the running
max, the lse and a ring's merges all see capped scores; the backward multiplies dS by the tanh's derivative
1 - (capped s / c)^2, recomputed from the block's capped scores (nothing more is saved).

`flash_forward` / `flash_backward` are the raw halves; the ring strategy calls them with the *global* out and
lse of its merged result, which is exactly the gradient of the whole row (FlashAttention-2, eq. for dS).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxctx.attention.kernels.document_blocks import block_ranges, pair_visible
from maxctx.attention.kernels.dot_product import mask_from_positions, soft_cap
from maxctx.attention.kernels.scopes import ATTENTION_FORWARD_SCOPE


def block_size(n: int, want: int) -> int:
    """Largest block <= want that divides n."""
    b = max(1, min(want, n))
    while n % b:
        b -= 1
    return b


def _blocks(x, n_blocks: int):
    """[B, N, ...] -> [n_blocks, B, N / n_blocks, ...]."""
    b, n = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, n_blocks, n // n_blocks, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """[n_blocks, B, M, ...] -> [B, n_blocks * M, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(q_BQKGD, k_BCKD, mask_BQC, scale, softcap):
    s = soft_cap(jnp.einsum("BQKGD,BCKD->BKGQC", q_BQKGD, k_BCKD, preferred_element_type=jnp.float32) * scale,
                 softcap)
    return jnp.where(mask_BQC[:, None, None], s, -jnp.inf)


def _may_see(q_range, k_range, window: int):
    """Whether any query of a block may see any key of another (any batch row): their segment ranges meet, the
    first key is at or before the last query, and within the window: document_blocks.pair_visible, a superset of
    the mask, decided before the [B, Q, C] mask is built, so a pair of blocks with no shared document costs O(B),
    not O(B Q C)."""
    one_block = lambda ranges: tuple(x[:, None] for x in ranges)  # noqa: E731 ([B] -> [B, 1 block])
    return pair_visible(one_block(q_range), one_block(k_range), window, jnp).any()


def _tie(*arrays):
    """Ties positions and segment ids to q, k, v. When the kernel runs inside a differentiated lax.scan (the
    model's layers), partial evaluation otherwise hoists everything computable from the ids alone, i.e. every
    block's mask, out of the loops and saves it as a residual: O(S x T) memory."""
    return jax.lax.optimization_barrier(arrays)


def _dims(q_BSHD, k_BTKD, block_q: int, block_kv: int) -> tuple[int, ...]:
    """(B, S, H, D, T, K, query heads per kv head, query blocks, key blocks)."""
    b, s, h, d = q_BSHD.shape
    t, k = k_BTKD.shape[1], k_BTKD.shape[2]
    return b, s, h, d, t, k, h // k, s // block_size(s, block_q), t // block_size(t, block_kv)


def flash_forward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, block_q=512, block_kv=512, window=0,
                  softcap=0.0):
    """Returns (out[B, S, H, D] fp32, lse[B, H, S] fp32); rows with no visible key give out 0, lse -inf. Under the
    `attention_forward` scope, by which maxctx.plan.program counts how often the program runs it."""
    with jax.named_scope(ATTENTION_FORWARD_SCOPE):
        return _forward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, block_q, block_kv, window, softcap)


def _forward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, block_q, block_kv, window, softcap):
    q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg = _tie(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg)
    b, s, h, d, t, k, g, nq, nk = _dims(q_BSHD, k_BTKD, block_q, block_kv)
    scale = d ** -0.5
    q_blocks = _blocks(q_BSHD.reshape(b, s, k, g, d), nq)
    qp_blocks, qs_blocks = _blocks(q_pos, nq), _blocks(q_seg, nq)
    kp_blocks, ks_blocks = _blocks(kv_pos, nk), _blocks(kv_seg, nk)
    kv_blocks = (_blocks(k_BTKD, nk), _blocks(v_BTKD, nk), kp_blocks, ks_blocks, block_ranges(kp_blocks, ks_blocks))

    def one_q_block(args):
        q_BQKGD, qp, qs = args
        bq = q_BQKGD.shape[1]
        q_range = block_ranges(qp, qs)

        def step(carry, kv):
            k_BCKD, v_BCKD, kp, ks, k_range = kv

            def compute(carry):
                mask = mask_from_positions(qp, qs, kp, ks, window)
                m, l_sum, acc = carry
                s_ = _scores(q_BQKGD, k_BCKD, mask, scale, softcap)
                m_new = jnp.maximum(m, s_.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s_ - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l_sum = l_sum * alpha + p.sum(-1)
                pv = jnp.einsum("BKGQC,BCKD->BKGQD", p.astype(v_BCKD.dtype), v_BCKD,
                                preferred_element_type=jnp.float32)
                return m_new, l_sum, acc * alpha[..., None] + pv

            return jax.lax.cond(_may_see(q_range, k_range, window), compute, lambda c: c, carry), None

        init = (jnp.full((b, k, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, k, g, bq), jnp.float32),
                jnp.zeros((b, k, g, bq, v_BTKD.shape[-1]), jnp.float32))
        (m, l_sum, acc), _ = jax.lax.scan(step, init, kv_blocks)
        seen = l_sum > 0
        denom = jnp.where(seen, l_sum, 1.0)
        out = jnp.where(seen[..., None], acc / denom[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(denom), -jnp.inf)
        return jnp.einsum("BKGQD->BQKGD", out), lse

    out_blocks, lse_blocks = jax.lax.map(one_q_block, (q_blocks, qp_blocks, qs_blocks))
    out = _unblocks(out_blocks).reshape(b, s, h, v_BTKD.shape[-1])
    lse = jnp.moveaxis(lse_blocks, 0, 3).reshape(b, h, s)  # [nq, B, K, G, Q] -> [B, K, G, nq, Q]
    return out, lse


def flash_backward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, out_BSHD, lse_BHS, dout_BSHD,
                   dlse_BHS=None, block_q=512, block_kv=512, window=0, softcap=0.0):
    """Gradients (dq, dk, dv) in fp32 of the rows' attention given their final out and lse.

    dS = P * (dP - rowsum(dO * O) + dlse), P = exp(S - lse): with a ring's merged out/lse this is the exact
    gradient of one key/value block's contribution.
    """
    q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg = _tie(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg)
    b, s, h, d, t, k, g, nq, nk = _dims(q_BSHD, k_BTKD, block_q, block_kv)
    scale = d ** -0.5
    delta = jnp.einsum("BSHD,BSHD->BHS", dout_BSHD.astype(jnp.float32), out_BSHD.astype(jnp.float32))
    if dlse_BHS is not None:
        delta = delta - dlse_BHS.astype(jnp.float32)
    lse = jnp.where(jnp.isfinite(lse_BHS), lse_BHS, jnp.inf)  # rows that see nothing give p = 0

    def by_q(x_BHS):  # [B, H, S] -> [nq, B, K, G, Q]
        return jnp.moveaxis(x_BHS.reshape(b, k, g, nq, s // nq), 3, 0)

    qp_blocks, qs_blocks = _blocks(q_pos, nq), _blocks(q_seg, nq)
    dv = dout_BSHD.shape[-1]  # v's head dim (MLA: below q's); no -1 in the reshape, which a size-0 array refuses
    q_side = (_blocks(q_BSHD.reshape(b, s, k, g, d), nq), _blocks(dout_BSHD.reshape(b, s, k, g, dv), nq),
              by_q(lse), by_q(delta), qp_blocks, qs_blocks, block_ranges(qp_blocks, qs_blocks), jnp.arange(nq))
    kp_blocks, ks_blocks = _blocks(kv_pos, nk), _blocks(kv_seg, nk)
    kv_side = (_blocks(k_BTKD, nk), _blocks(v_BTKD, nk), kp_blocks, ks_blocks, block_ranges(kp_blocks, ks_blocks))

    def kv_step(dq, kv):
        k_BCKD, v_BCKD, kp, ks, k_range = kv

        def q_step(carry, qb):
            dq, dk, dv = carry
            q_BQKGD, do_BQKGD, lse_q, delta_q, qp, qs, q_range, i = qb

            def compute(carry):
                mask = mask_from_positions(qp, qs, kp, ks, window)
                dq, dk, dv = carry
                s_ = _scores(q_BQKGD, k_BCKD, mask, scale, softcap)
                p = jnp.exp(s_ - lse_q[..., None])
                dv = dv + jnp.einsum("BKGQC,BQKGD->BCKD", p, do_BQKGD, preferred_element_type=jnp.float32)
                dp = jnp.einsum("BQKGD,BCKD->BKGQC", do_BQKGD, v_BCKD, preferred_element_type=jnp.float32)
                ds = p * (dp - delta_q[..., None]) * scale
                if softcap:  # through c tanh(s / c); hidden entries (p = 0) get 0, not 0 * inf
                    ds = ds * (1 - jnp.square(jnp.where(jnp.isfinite(s_), s_, 0.0) / softcap))
                dk = dk + jnp.einsum("BKGQC,BQKGD->BCKD", ds, q_BQKGD, preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("BKGQC,BCKD->BQKGD", ds, k_BCKD, preferred_element_type=jnp.float32)
                return dq.at[i].add(dq_i), dk, dv

            return jax.lax.cond(_may_see(q_range, k_range, window), compute, lambda c: c, carry), None

        zeros = (jnp.zeros(k_BCKD.shape, jnp.float32), jnp.zeros(v_BCKD.shape, jnp.float32))
        (dq, dk, dv), _ = jax.lax.scan(q_step, (dq, *zeros), q_side)
        return dq, (dk, dv)

    dq0 = jnp.zeros((nq, b, s // nq, k, g, d), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(kv_step, dq0, kv_side)
    return _unblocks(dq).reshape(b, s, h, d), _unblocks(dk), _unblocks(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def flash_attention(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, block_q=512, block_kv=512, window=0,
                    softcap=0.0):
    """Causal, document-masked attention; returns (out[B, S, H, D] in q's dtype, lse[B, H, S] fp32)."""
    out, lse = flash_forward(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, block_q, block_kv, window,
                             softcap)
    return out.astype(q_BSHD.dtype), lse


def _flash_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, block_q, block_kv, window, softcap):
    out, lse = flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, block_q, block_kv, window, softcap)
    return (out, lse), (q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse)


def _flash_bwd(block_q, block_kv, window, softcap, res, cotangents):
    q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse = res
    dout, dlse = cotangents
    dq, dk, dv = flash_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout, dlse, block_q, block_kv,
                                window, softcap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


flash_attention.defvjp(_flash_fwd, _flash_bwd)
