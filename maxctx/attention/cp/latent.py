"""latent_all_gather context parallelism, for multi-head latent attention (MLA, maxctx.model.deepseek): gather the
latent and the shared RoPE key over the context axes instead of per-head K and V, and rebuild K and V from them on
every device.

Legend (per device): B batch per device, S the whole sequence, C the CP degree, H heads per tensor shard, Q = N + P
the q/k head dim (N without RoPE, P the shared RoPE key), V the value head dim, R the latent rank (kv_lora_rank),
L = R + P, b bytes per activation element. Positions and segment ids are int32.

MLA's K and V are functions of one [B, S, L] array: k = [c wkv_b[:, :, :N], k_rope broadcast over the heads],
v = c wkv_b[:, :, N:], c the RMSNormed latent, k_rope the rotated key. all_gather moves H (Q + V) numbers per token
(40,960 at DeepSeek-V2/V3's H = 128); this strategy moves L (576), H (Q + V) / L times fewer bytes, and pays with
the rebuild: 2 S R H (N + V) FLOPs per layer forward, where the model's own projection does S / C tokens
(`rebuild_flops`; the planner weighs them at the matmul rate against the bytes saved, maxctx.plan.step_time).

The attention is a custom VJP (`_latent_attention`) over the gathered latent that rebuilds K and V one key block
of S / C tokens at a time (block (r - t) mod C at step t, the block a ring's hop t would hold, so splash's per-hop
masks serve; steps no query can see are skipped as the ring's are) and merges the blocks' (out, lse) as the ring
does: K and V are never whole on a device (O(S/C H (Q + V)) at a time), and the backward keeps the latent, q, out
and lse, not K and V, and rebuilds each block again before the kernel's block backward. d latent leaves the VJP,
so the gather's autodiff is a reduce-scatter of d latent (B S L b), not of dK and dV. d latent is summed over the
tensor shards' heads inside the shard_map (an all-reduce of B (S/C) L b over the tensor axis: the sum the model's
own wkv_b projection has under tensor parallelism whatever the strategy, not counted here). The weight wkv_b
[R, H, N + V] enters the shard_map split over heads like q; its gradient is reduced over the other axes as every
weight's is.

Any token order and load balance (zig-zag, documents) and packing: masks come from the gathered positions and
segment ids (splash: the ring's per-hop masks, per call under documents). A layer that hands this strategy per-head
K and V (none does: `check_model` refuses a model without MLA) is run as all_gather (the inherited `attend`), and a
shape without the latent is priced so.
"""

from __future__ import annotations

import dataclasses
import functools

from maxctx.attention.cp.all_gather import AllGather
from maxctx.attention.cp.base import CommVolume
from maxctx.attention.cp.cost import AttentionShape, Collective
from maxctx.config import Config, ConfigError
from maxctx.parallelism import mesh_context_degree


@dataclasses.dataclass(frozen=True)
class LatentAllGather(AllGather):
    name: str = "latent_all_gather"
    local_by_halo: bool = False  # MLA has no sliding-window layers
    moves: str = "latent"

    def check_model(self, config: Config, latent_rank: int) -> None:
        """Only a model with MLA has a latent to move."""
        if not latent_rank:
            raise ConfigError(f"context_parallel_strategy={self.name} moves multi-head latent attention's latent, "
                              f"which decoder_block={config.decoder_block} does not have; use "
                              f"context_parallel_strategy=all_gather (which gathers K and V) or auto")

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        """forward: all-gather of the latent and RoPE key (B S L b) and of positions, segment ids (2 B S 4);
        backward: reduce-scatter of d latent (B S L b). Groups of C devices."""
        if not s.latent_width:
            return super().global_comm_volume(s)
        latent = s.batch * s.seq * s.latent_width * s.itemsize
        return ([Collective("all-gather", latent + 2 * s.batch * s.seq * 4, s.cp)],
                [Collective("reduce-scatter", latent, s.cp)])

    def activation_bytes(self, s: AttentionShape) -> float:
        """Saved for the backward: q and out B (S/C) H (Q + V) b, the gathered latent B S L b (O(S), L wide) with
        its positions and segment ids 2 B S 4, lse B H (S/C) 4."""
        if not s.latent_width:
            return super().activation_bytes(s)
        rows = s.seq / s.cp
        return (s.batch * rows * s.heads * s.kv_width * s.itemsize
                + s.batch * s.seq * (s.latent_width * s.itemsize + 2 * 4) + s.batch * s.heads * rows * 4)

    def transient_bytes(self, s: AttentionShape) -> float:
        """The backward's one key block: K, V rebuilt B (S/C) H (Q + V) b and their fp32 gradients
        B (S/C) H (Q + V) 4; d latent B S L b; the dq accumulator B (S/C) H Q 4. O(S) only in L."""
        if not s.latent_width:
            return super().transient_bytes(s)
        rows = s.seq / s.cp
        return s.batch * (rows * s.heads * s.kv_width * (s.itemsize + 4) + s.seq * s.latent_width * s.itemsize
                          + rows * s.heads * s.head_dim * 4)

    def rebuild_flops(self, s: AttentionShape) -> tuple[float, float]:
        """K and V for all S keys, 2 B S R H (N + V) per pass, less what the model's own projection does for its
        S / C tokens: forward once (S - S/C); backward the rebuild again, d latent and d wkv_b (3 S - 2 S/C)."""
        if not s.latent_width:
            return 0.0, 0.0
        per_token = 2 * s.batch * s.latent_rank * s.heads * (s.head_dim - s.rope_dim + s.v_dim)
        rows = s.seq / s.cp
        return per_token * (s.seq - rows), per_token * (3 * s.seq - 2 * rows)

    def attend_latent(self, q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS, mesh, spec):
        """out[B, S, H, V] of MLA given q (rotated), the latent [c normed, k_rope rotated] and wkv_b [R, H, N + V]
        (U = N + V; N is Q - P, P = L - R)."""
        from jax.sharding import PartitionSpec as P

        from maxctx.attention.cp.sharded import BATCH, CONTEXT, TENSOR_AXIS, shard_map

        cp = mesh_context_degree(mesh.shape)
        local = local_kernel(spec, mesh, q_BSHQ.shape[1], self.name)
        nope = q_BSHQ.shape[-1] - (latent_BSL.shape[-1] - wkv_b_RHU.shape[0])

        def body(q, latent, w, pos, seg):
            import jax

            lat_all, pos_all, seg_all = (jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
                                         for x in (latent, pos, seg))
            return _latent_attention(local, nope, cp, q, lat_all, w, pos, seg, pos_all, seg_all)

        q_spec = P(BATCH, CONTEXT, TENSOR_AXIS, None)
        specs = (q_spec, P(BATCH, CONTEXT, None), P(None, TENSOR_AXIS, None), P(BATCH, CONTEXT), P(BATCH, CONTEXT))
        return shard_map(body, mesh, specs, q_spec)(q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS)


def local_kernel(spec, mesh, seq: int, strategy: str):
    """The kernels of a ring over C key blocks (each block attended as the ring hop that holds it would), for a
    strategy that rebuilds K and V from the latent block by block."""
    from maxctx.attention.cp.load_balance import stored_order
    from maxctx.attention.cp.ring import check_ring_local
    from maxctx.attention.cp.sharded import CONTEXT
    from maxctx.attention.kernels.local import make_local

    cp = mesh_context_degree(mesh.shape)
    local = make_local(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh,
                       order=stored_order(seq, cp, spec.load_balance), q_shards=cp, kv_blocks=cp,
                       q_axes=CONTEXT, ring=True, window=spec.window, splash_blocks=spec.splash_blocks,
                       documents=spec.load_balance == "documents" and cp > 1, softcap=spec.logit_softcap)
    check_ring_local(local, strategy)
    return local


def rebuild(latent_BSL, wkv_b_RHU, nope: int):
    """(k[B, S, H, N + P], v[B, S, H, V]) from the latent (module doc)."""
    import jax.numpy as jnp

    rank = wkv_b_RHU.shape[0]
    kv = jnp.einsum("BSR,RHU->BSHU", latent_BSL[..., :rank], wkv_b_RHU)
    k_rope = latent_BSL[:, :, None, rank:]
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, (*kv.shape[:-1], k_rope.shape[-1]))], axis=-1)
    return k, kv[..., nope:]


def _block(cp: int, hop, *gathered):
    """The key block that ring hop `hop` would hold on this device, (r - hop) mod C, of each gathered array, and
    where it starts: the layout the kernels' per-hop masks were built for (make_local with kv_blocks = C)."""
    import jax

    from maxctx.attention.cp.sharded import CONTEXT

    n = gathered[0].shape[1] // cp
    start = (jax.lax.axis_index(CONTEXT) - hop) % cp * n
    return [jax.lax.dynamic_slice_in_dim(x, start, n, axis=1) for x in gathered], start


def _forward(local, nope, cp, q, latent, w, q_pos, q_seg, kv_pos, kv_seg):
    import jax
    import jax.numpy as jnp

    from maxctx.attention.cp.ring import _maybe, _merge, _tie

    q, latent, q_pos, q_seg, kv_pos, kv_seg = _tie(q, latent, q_pos, q_seg, kv_pos, kv_seg)  # as the ring's
    b, s, h, _ = q.shape

    def hop(t, carry):
        (lat, kp, ks), _ = _block(cp, t, latent, kv_pos, kv_seg)

        def compute(q, lat, w, kp, ks):
            return local.block_forward(t, q, *rebuild(lat, w, nope), q_pos, q_seg, kp, ks)

        empty = (jnp.zeros_like(carry[0]), jnp.full_like(carry[1], -jnp.inf))
        return _merge(*carry, *_maybe(local.window, q_pos, q_seg, kp, ks, empty, compute, q, lat, w, kp, ks))

    init = (jnp.zeros((b, s, h, w.shape[-1] - nope), jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32))
    out, lse = jax.lax.fori_loop(0, cp, hop, init)
    out = out.astype(q.dtype)
    return out, (q, latent, w, q_pos, q_seg, kv_pos, kv_seg, out, lse)


def _backward(local, nope, cp, res, dout):
    import jax
    import jax.numpy as jnp

    from maxctx.attention.cp.ring import _maybe

    q, latent, w, q_pos, q_seg, kv_pos, kv_seg, out, lse = res

    def hop(t, carry):
        dq, dlatent, dw = carry
        (lat, kp, ks), start = _block(cp, t, latent, kv_pos, kv_seg)

        def compute(q, lat, w, kp, ks):
            (k, v), pullback = jax.vjp(functools.partial(rebuild, nope=nope), lat, w)
            dq_hop, dk, dv = local.block_backward(t, q, k, v, q_pos, q_seg, kp, ks, out, lse, dout)
            dlat, dw_hop = pullback((dk.astype(k.dtype), dv.astype(v.dtype)))
            return dq_hop, dlat, dw_hop.astype(jnp.float32)

        zeros = (jnp.zeros_like(dq), jnp.zeros_like(lat), jnp.zeros_like(dw))
        dq_hop, dlat, dw_hop = _maybe(local.window, q_pos, q_seg, kp, ks, zeros, compute, q, lat, w, kp, ks)
        return dq + dq_hop, jax.lax.dynamic_update_slice_in_dim(dlatent, dlat, start, axis=1), dw + dw_hop

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(latent), jnp.zeros(w.shape, jnp.float32))
    dq, dlatent, dw = jax.lax.fori_loop(0, cp, hop, init)
    return dq.astype(q.dtype), dlatent, dw.astype(w.dtype), None, None, None, None


def _make_vjp():
    import jax

    attention = jax.custom_vjp(lambda local, nope, cp, *args: _forward(local, nope, cp, *args)[0],
                               nondiff_argnums=(0, 1, 2))
    attention.defvjp(_forward, _backward)
    return attention


def _latent_attention(local, nope, cp, q, latent, w, q_pos, q_seg, kv_pos, kv_seg):
    """MLA's attention of local q against K and V rebuilt from the gathered latent one key block of S / C at a
    time, saving the latent, not K and V."""
    return _vjp()(local, nope, cp, q, latent, w, q_pos, q_seg, kv_pos, kv_seg)


_vjp = functools.cache(_make_vjp)  # built at first use: the strategy imports JAX only inside its calls

STRATEGY = LatentAllGather()
