"""latent_p2p (alias latent_ring) context parallelism, for multi-head latent attention (MLA, maxctx.model.deepseek):
p2p's ring with MLA's latent and shared RoPE key travelling around it in place of per-head K and V, each hop
rebuilding its block's K and V (latent_all_gather's rebuild, maxctx.attention.cp.latent) where it is used.

Legend (per device): B batch per device, S the whole sequence, C the CP degree (the ring), s = S / C rows, H heads
per tensor shard, Q = N + P the q/k head dim, V the value head dim, R the latent rank, L = R + P, b bytes per
activation element. Positions and segment ids are int32.

Forward: C hops; at hop t the device holds the latent block of ring rank (r - t) mod C [B, s, L] with its ids,
sends it on (issued before the hop's compute, so XLA can overlap them), rebuilds K [B, s, H, Q] and V [B, s, H, V]
from it and merges the hop's (out, lse) into fp32 accumulators as p2p's ring does (maxctx.attention.cp.ring: the
same per-hop kernels and masks, hops no query can see skipped). Backward (custom VJP): the same hops; each rebuilds
its block again, runs the kernel's block backward and pulls dK, dV back through the rebuild to d latent (fp32,
[B, s, L]), which travels with its block and reaches its owner after the last hop, as p2p's dK/dV do; d wkv_b
accumulates on the device. So nothing of size O(S) is saved or held: where latent_all_gather keeps the gathered
latent (B S L b a layer), this keeps the local block, and its sends overlap the hops' kernels. The price is the
ring's C - 1 sends each way in place of one collective, and the same rebuild FLOPs as latent_all_gather
(`rebuild_flops`). The out and log-sum-exp are named `context` as the ring's are, so a remat policy that keeps
`context` spares the backward the forward's rerun.

Any token order and load balance (zig-zag, documents) and packing, as p2p's ring. Per-head K and V handed to this
strategy (a model without MLA, which `check_model` refuses) would run as p2p.
"""

from __future__ import annotations

import dataclasses
import functools

from maxctx.attention.cp.base import CommVolume
from maxctx.attention.cp.cost import AttentionShape
from maxctx.attention.cp.latent import LatentAllGather, local_kernel, rebuild
from maxctx.attention.cp.p2p import P2P, ring_comm_volume
from maxctx.parallelism import mesh_context_degree


@dataclasses.dataclass(frozen=True)
class LatentP2P(LatentAllGather):
    name: str = "latent_p2p"
    aliases: tuple[str, ...] = ("latent_ring",)
    ring: bool = True  # out and lse are named `context` (Strategy.keeps_output_for_backward)

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        """p2p's ring (`ring_comm_volume`) with the latent as the travelling block, one 'kv head' L wide:
        forward (C - 1) (B s L b + 2 B s 4); backward the same plus d latent, (C - 1) B s L 4 in fp32 from hop to
        hop and B s L b home."""
        if not s.latent_width:
            return P2P().global_comm_volume(s)
        return ring_comm_volume(s.batch, s.seq / s.cp, 1, s.latent_width, s.itemsize, s.cp)

    def activation_bytes(self, s: AttentionShape) -> float:
        """Saved for the backward: q and out B s H (Q + V) b, the local latent block B s L b, lse B H s 4 (the ids
        are the layer's own, as p2p's)."""
        if not s.latent_width:
            return P2P().activation_bytes(s)
        rows = s.seq / s.cp
        return s.batch * rows * (s.heads * s.kv_width * s.itemsize + s.latent_width * s.itemsize + s.heads * 4)

    def transient_bytes(self, s: AttentionShape) -> float:
        """The backward's hop: K, V rebuilt B s H (Q + V) b and their fp32 gradients B s H (Q + V) 4; two latent
        blocks in flight 2 B s L b and the travelling fp32 d latent with the hop's own B s L 4 (x 2); the dq
        accumulator B s H Q 4."""
        if not s.latent_width:
            return P2P().transient_bytes(s)
        rows = s.seq / s.cp
        return s.batch * rows * (s.heads * s.kv_width * (s.itemsize + 4) + s.latent_width * (2 * s.itemsize + 8)
                                 + s.heads * s.head_dim * 4)

    def attend_latent(self, q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS, mesh, spec):
        """out[B, S, H, V] of MLA from q (rotated), the latent [c normed, k_rope rotated] and wkv_b [R, H, N + V],
        the latent passed around the ring."""
        from jax.sharding import PartitionSpec as P

        from maxctx.attention.cp.sharded import BATCH, CONTEXT, TENSOR_AXIS, shard_map

        cp = mesh_context_degree(mesh.shape)
        local = local_kernel(spec, mesh, q_BSHQ.shape[1], self.name)
        nope = q_BSHQ.shape[-1] - (latent_BSL.shape[-1] - wkv_b_RHU.shape[0])

        def body(q, latent, w, pos, seg):
            return _ring_latent(local, nope, cp, q, latent, w, pos, seg)

        q_spec = P(BATCH, CONTEXT, TENSOR_AXIS, None)
        specs = (q_spec, P(BATCH, CONTEXT, None), P(None, TENSOR_AXIS, None), P(BATCH, CONTEXT), P(BATCH, CONTEXT))
        return shard_map(body, mesh, specs, q_spec)(q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS)


def _hop_forward(local, nope, hop, q, w, qp, qs, carry, lat, ids):
    import jax.numpy as jnp

    from maxctx.attention.cp.ring import _maybe, _merge

    out, lse = carry
    empty = (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))

    def compute(q, lat, w, kp, ks):
        return local.block_forward(hop, q, *rebuild(lat, w, nope), qp, qs, kp, ks)

    return _merge(out, lse, *_maybe(local.window, qp, qs, ids[0], ids[1], empty, compute, q, lat, w, ids[0], ids[1]))


def _forward(local, nope, cp, q, latent, w, qp, qs):
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from maxctx.attention.cp.ring import _tie
    from maxctx.attention.cp.sharded import CONTEXT, ring_shift

    q, latent, qp, qs = _tie(q, latent, qp, qs)
    b, s, h, _ = q.shape
    hop = functools.partial(_hop_forward, local, nope)

    def hop_with_send(t, carry):
        out, lse, lat, ids = carry
        following = ring_shift((lat, ids), CONTEXT, cp)  # no data dependence on the compute: XLA overlaps them
        return (*hop(t, q, w, qp, qs, (out, lse), lat, ids), *following)

    init = (jnp.zeros((b, s, h, w.shape[-1] - nope), jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32),
            latent, jnp.stack([qp, qs]))
    out, lse, lat, ids = jax.lax.fori_loop(0, cp - 1, hop_with_send, init)
    out, lse = hop(cp - 1, q, w, qp, qs, (out, lse), lat, ids)
    out, lse = checkpoint_name(out.astype(q.dtype), "context"), checkpoint_name(lse, "context")
    return out, (q, latent, w, qp, qs, out, lse)


def _hop_backward(local, nope, hop, q, w, qp, qs, out, lse, dout, carry, lat, ids):
    import jax
    import jax.numpy as jnp

    from maxctx.attention.cp.ring import _maybe

    dq, dlat, dw = carry

    def compute(q, lat, w, kp, ks):
        (k, v), pullback = jax.vjp(functools.partial(rebuild, nope=nope), lat, w)
        dq_hop, dk, dv = local.block_backward(hop, q, k, v, qp, qs, kp, ks, out, lse, dout)
        dlat_hop, dw_hop = pullback((dk.astype(k.dtype), dv.astype(v.dtype)))
        return dq_hop, dlat_hop.astype(jnp.float32), dw_hop.astype(jnp.float32)

    zeros = (jnp.zeros_like(dq), jnp.zeros(lat.shape, jnp.float32), jnp.zeros_like(dw))
    dq_hop, dlat_hop, dw_hop = _maybe(local.window, qp, qs, ids[1], ids[0], zeros, compute, q, lat, w, ids[1],
                                      ids[0])
    return dq + dq_hop, dlat + dlat_hop, dw + dw_hop


def _backward(local, nope, cp, res, dout):
    import jax
    import jax.numpy as jnp

    from maxctx.attention.cp.sharded import CONTEXT, ring_shift

    q, latent, w, qp, qs, out, lse = res
    hop = functools.partial(_hop_backward, local, nope)
    # The ids are stacked in the other order than in the forward: XLA would otherwise merge the backward's permutes
    # with the forward's (CSE) and keep every rotated latent block alive until the backward, O(S) memory.
    ids = jnp.stack([qs, qp])

    def hop_with_send(t, carry):
        dq, dlat, dw, lat, ids = carry
        following = ring_shift((lat, ids), CONTEXT, cp)
        dq, dlat, dw = hop(t, q, w, qp, qs, out, lse, dout, (dq, dlat, dw), lat, ids)
        return dq, ring_shift(dlat, CONTEXT, cp), dw, *following

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(latent.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32),
            latent, ids)
    dq, dlat, dw, lat, ids = jax.lax.fori_loop(0, cp - 1, hop_with_send, init)
    dq, dlat, dw = hop(cp - 1, q, w, qp, qs, out, lse, dout, (dq, dlat, dw), lat, ids)
    dlat = ring_shift(dlat.astype(latent.dtype), CONTEXT, cp)  # after C shifts: at the owner, in its dtype
    return dq.astype(q.dtype), dlat, dw.astype(w.dtype), None, None


def _make_vjp():
    import jax

    attention = jax.custom_vjp(lambda local, nope, cp, *args: _forward(local, nope, cp, *args)[0],
                               nondiff_argnums=(0, 1, 2))
    attention.defvjp(_forward, _backward)
    return attention


_vjp = functools.cache(_make_vjp)  # built at first use: the strategy imports JAX only inside its calls


def _ring_latent(local, nope, cp, q, latent, w, qp, qs):
    """MLA's attention of local q against the latent blocks of every ring rank, K and V rebuilt per hop."""
    return _vjp()(local, nope, cp, q, latent, w, qp, qs)


STRATEGY = LatentP2P()
