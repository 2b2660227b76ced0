"""Ring attention: K/V blocks travel around a ring of devices while each attends to the one it holds (the machinery
of the p2p and usp strategies; call inside shard_map).

Legend (per device): B batch, s rows of the local block, H and K heads, D head dim, R ring size. K and V travel
as one block (sharded.join_kv: stacked [2, B, s, K, D], or [B, s, K, Dk + Dv] for MLA's 192 and 128), so one
permute moves both.

Forward: R hops; at hop t the device holds the K/V block of ring rank (r - t) mod R, sends it on with ppermute
(issued before the hop's compute, so XLA can overlap them) and merges the hop's (out, lse) into fp32 accumulators
with a stable log-add-exp (a logit soft-cap is applied in each hop's kernel, before its max and lse, so the merge of
capped hops is the capped attention; attention sinks are merged once, after the last hop: kernels/sinks.py).
Backward (custom VJP): the same hops in the same order, each computing the hop's
(dq, dk, dv) from the *merged* out and lse; dq stays home, dK/dV accumulators (fp32) travel with their block and
reach its owner after the last hop, so nothing of size O(S) is saved or held. A hop adds its dK/dV and sends them
on, so the backward's sends wait for its kernel, where every forward K/V send overlaps its hop's attention. With
`overlap` (AttentionSpec.ring_backward_overlap; no config key, docs/long_context.md) the backward is
software-pipelined: a hop sends on the dK/dV the previous hop finished, not its own, and its sends overlap its
kernel as the forward's do (tests/test_attention_tpu_compile.py checks it in the program compiled for TPU), for one
more fp32 dK/dV block in flight per device. What that does to a
compiled TPU program's schedule and memory: docs/choosing_a_strategy.md, "Ring sends". The hops are one loop
(`lax.fori_loop`; the last hop peeled off, which has nothing to send on, and with `overlap` the first too), so the
program and its compile time do not grow with R; splash picks its hop's kernel by the traced hop index.

Skipping: a hop is skipped whole (`lax.cond`) when no key can be seen by any row: all keys come after the rows'
last position (causal), all lie a sliding window or more before their first position, or the segment ids of keys
and rows span disjoint ranges (packed documents that do not meet in this hop). Inside a hop the flash and splash
kernels skip every (query block, key block) pair the mask hides. With zig-zag load balance each
off-diagonal hop keeps exactly half of the block pairs (one query chunk against both key chunks, or both query
chunks against one key chunk), so every hop does equal work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxctx.attention.cp.sharded import join_kv, ring_shift, split_kv
from maxctx.attention.kernels.local import LocalKernel
from maxctx.attention.kernels.sinks import merge as merge_sink, sink_grad
from maxctx.config import ConfigError


def check_ring_local(local: LocalKernel, strategy: str) -> None:
    """ConfigError for what a ring's hops cannot run: splash under context_parallel_load_balance=documents with a
    sliding window (a hop holds a document's head and tail pieces, which its window mask cannot tell apart)."""
    if local.documents and local.window:
        raise ConfigError(f"a sliding window (layer window {local.window}) with context_parallel_load_balance="
                          f"documents and splash cannot run on {strategy}'s ring: a hop holds a document's head "
                          f"and tail pieces, which splash's window mask cannot tell apart; use "
                          f"context_parallel_strategy=all_gather or a2a, attention=blockwise, or "
                          f"context_parallel_load_balance=true")


def _merge(out_BSHD, lse_BHS, o_BSHD, l_BHS):
    new = jnp.logaddexp(lse_BHS, l_BHS)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w_old = jnp.exp(lse_BHS - safe).transpose(0, 2, 1)[..., None]
    w_new = jnp.exp(l_BHS - safe).transpose(0, 2, 1)[..., None]
    return out_BSHD * w_old + o_BSHD * w_new, new


def _tie(*arrays):
    """Ties the ids to the activations. Inside the model's differentiated, rematerialised layer scan, partial
    evaluation otherwise computes everything that depends on the ids alone (each hop's skip test, the skipped
    branch's fp32 zeros, the kernels' mask set-up) once for all layers and keeps it alive through the step:
    (R - 1) fp32 outputs of B s H D 4 bytes, more than the rest of attention at long context."""
    return jax.lax.optimization_barrier(arrays)


def _maybe(window: int, q_pos, q_seg, kv_pos, kv_seg, skipped, compute, *operands):
    """compute(*operands), or `skipped` for a hop none of whose keys a row can see: every key after every query
    (causal), W or more tokens before every query (sliding window W > 0), or key and query segment ids in disjoint
    ranges (no shared document). Conservative: the kernels' own block skipping does the rest."""
    seen = (kv_pos.min() <= q_pos.max()) & (kv_seg.min() <= q_seg.max()) & (kv_seg.max() >= q_seg.min())
    if window > 0:
        seen &= q_pos.min() - kv_pos.max() < window
    return jax.lax.cond(seen, compute, lambda *_: skipped, *operands)


def _ring_forward(local: LocalKernel, axis, size: int, q, k, v, qp, qs, kp, ks, sinks):
    q, k, v, qp, qs, kp, ks = _tie(q, k, v, qp, qs, kp, ks)
    b, s, h, _ = q.shape
    dk, dv = k.shape[-1], v.shape[-1]

    def compute(hop, out, lse, kv, ids):
        empty = (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
        o_hop, lse_hop = _maybe(local.window, qp, qs, ids[0], ids[1], empty,
                                functools.partial(local.block_forward, hop),
                                q, *split_kv(kv, dk, dv), qp, qs, ids[0], ids[1])
        return _merge(out, lse, o_hop, lse_hop)

    def hop_with_send(hop, carry):
        out, lse, kv, ids = carry
        following = ring_shift((kv, ids), axis, size)  # no data dependence on the compute: XLA overlaps them
        return (*compute(hop, out, lse, kv, ids), *following)

    init = (jnp.zeros((b, s, h, v.shape[-1]), jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32),
            join_kv(k, v), jnp.stack([kp, ks]))  # one permute each for K/V and for the ids
    out, lse, kv, ids = jax.lax.fori_loop(0, size - 1, hop_with_send, init)
    out, lse = compute(size - 1, out, lse, kv, ids)
    if sinks is not None:  # once, after every hop (a sink merged per hop would count R times)
        out, lse = merge_sink(out, lse, sinks)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def ring_attention(local: LocalKernel, axis, size: int, overlap: bool, q, k, v, qp, qs, kp, ks, sinks=None):
    """Ring attention of local q against the K/V blocks of all `size` ranks of `axis`; call inside shard_map.
    `overlap`: the software-pipelined backward (module doc; AttentionSpec.ring_backward_overlap). `sinks`: the
    local heads' sink logits [H] (maxctx.attention.kernels.sinks), or None."""
    return _ring_forward(local, axis, size, q, k, v, qp, qs, kp, ks, sinks)[0]


def _ring_fwd(local, axis, size, overlap, q, k, v, qp, qs, kp, ks, sinks):
    out, lse = _ring_forward(local, axis, size, q, k, v, qp, qs, kp, ks, sinks)
    # The backward's residuals beside q, k, v: named as the layer's attention output, so a remat policy that keeps
    # `context` (on the device or the host) keeps them too and the backward need not run the ring forward again.
    out, lse = checkpoint_name(out, "context"), checkpoint_name(lse, "context")
    return out, (q, k, v, qp, qs, kp, ks, sinks, out, lse)


def _ring_bwd(local, axis, size, overlap, res, dout):
    # With sinks, out and lse are the sink-merged ones: each hop's backward against them is exact (sinks.py).
    q, k, v, qp, qs, kp, ks, sinks, out, lse = res
    dk, dv = k.shape[-1], v.shape[-1]  # dK/dV travel joined like K/V (join_kv), V's part first like vk's

    def compute(hop, dq, dkv, vk, ids):
        dv_part, dk_part = split_kv(dkv, dv, dk)
        zeros = (jnp.zeros_like(dq), jnp.zeros_like(dk_part), jnp.zeros_like(dv_part))
        v_blk, k_blk = split_kv(vk, dv, dk)
        dq_h, dk_h, dv_h = _maybe(local.window, qp, qs, ids[1], ids[0], zeros,
                                  functools.partial(local.block_backward, hop),
                                  q, k_blk, v_blk, qp, qs, ids[1], ids[0], out, lse, dout)
        return dq + dq_h, dkv + join_kv(dv_h, dk_h)

    # The blocks are joined in the other order than in the forward: XLA would otherwise merge the backward's
    # permutes with the forward's (CSE) and keep every rotated K/V block alive until the backward, O(S) memory.
    vk, ids = join_kv(v, k), jnp.stack([ks, kp])
    zeros = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(vk.shape, jnp.float32))
    if not overlap or size == 1:  # one rank: nothing to pipeline (its one hop would run twice below)
        # A hop adds its dK/dV and sends them on at once: the sends wait for the hop's kernel (and XLA's schedule
        # on TPU starts the K/V send there too), but no more than one fp32 dK/dV block is in flight.
        def hop_with_send(hop, carry):
            dq, dkv, vk, ids = carry
            following = ring_shift((vk, ids), axis, size)
            dq, dkv = compute(hop, dq, dkv, vk, ids)
            return dq, ring_shift(dkv, axis, size), *following

        dq, dkv, vk, ids = jax.lax.fori_loop(0, size - 1, hop_with_send, (*zeros, vk, ids))
        dq, dkv = compute(size - 1, dq, dkv, vk, ids)
    else:
        # Software-pipelined: a hop sends on the dK/dV the previous hop finished (they are added to only after its
        # kernel) and the K/V block, so neither send waits for its kernel. Hop 0 (peeled) starts each block's
        # dK/dV; hops 1 .. R - 2 (the loop) receive the dK/dV of the block they hold from the rank that held it
        # before and add theirs; the last hop (peeled) sends no K/V on. R - 1 K/V and R dK/dV shifts either way.
        def hop_with_send(hop, carry):
            dq, dkv_done, vk, ids = carry
            following, arriving = ring_shift(((vk, ids), dkv_done), axis, size)
            return (*compute(hop, dq, arriving, vk, ids), *following)

        # Tied to dout, the first send cannot start before the attention's backward does: hoisted above the
        # layer's MLP backward, its buffers would add to that part's peak memory.
        vk, ids, dout = _tie(vk, ids, dout)
        following = ring_shift((vk, ids), axis, size)
        dq, dkv = compute(0, *zeros, vk, ids)
        dq, dkv, vk, ids = jax.lax.fori_loop(1, size - 1, hop_with_send, (dq, dkv, *following))
        dq, dkv = compute(size - 1, dq, ring_shift(dkv, axis, size), vk, ids)
    dkv = ring_shift(dkv.astype(k.dtype), axis, size)  # after R shifts: at the owner, in K's dtype
    dv_all, dk_all = split_kv(dkv, dv, dk)
    dsinks = None if sinks is None else sink_grad(out, lse, dout, sinks)
    return dq.astype(q.dtype), dk_all.astype(k.dtype), dv_all.astype(v.dtype), None, None, None, None, dsinks


ring_attention.defvjp(_ring_fwd, _ring_bwd)
