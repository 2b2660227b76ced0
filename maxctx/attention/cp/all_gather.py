"""all_gather context parallelism: gather K and V over the context axes, attend local queries to all of them.

Legend (per device): B batch per device (global / (data x fsdp)), S the whole sequence, C the CP degree
(context x context_a2a), H and K query and kv heads per tensor shard, D head dim, b bytes per activation element.
Positions and segment ids are int32.

Cost (the formulas below): the K/V gather and its reduce-scatter in the backward are O(S) per device, and so are the
saved, gathered K and V: the price of this strategy. The kernel's temp comes on top (flash: one
[B, H, block_q, block_kv] fp32 score block; dot_product: B H (S/C) S 4). Works with any token order: masks come from
the gathered positions and segment ids. Any head count works (the default `check`).
"""

from __future__ import annotations

import dataclasses

from maxctx.attention.cp.base import CommVolume, Strategy
from maxctx.attention.cp.cost import AttentionShape, Collective
from maxctx.parallelism import mesh_context_degree


@dataclasses.dataclass(frozen=True)
class AllGather(Strategy):
    name: str = "all_gather"
    local_by_halo: bool = True  # local layers: maxctx.attention.cp.halo, where it moves less

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        """forward: all-gather of K, V (B S K (D + Dv) b) and of positions, segment ids (2 B S 4); backward:
        reduce-scatter of dK, dV, the autodiff of the gather (B S K (D + Dv) b). Groups of C devices."""
        kv = s.batch * s.seq * s.kv_heads * s.kv_width * s.itemsize
        return ([Collective("all-gather", kv + 2 * s.batch * s.seq * 4, s.cp)],
                [Collective("reduce-scatter", kv, s.cp)])

    def activation_bytes(self, s: AttentionShape) -> float:
        """Saved for the backward: q and out B (S/C) H (D + Dv) b, the gathered K and V B S K (D + Dv) b (O(S)),
        lse B H (S/C) 4."""
        rows = s.seq / s.cp
        return (s.batch * rows * s.heads * s.kv_width * s.itemsize
                + s.batch * s.seq * s.kv_heads * s.kv_width * s.itemsize + s.batch * s.heads * rows * 4)

    def transient_bytes(self, s: AttentionShape) -> float:
        """The backward's gathered dK, dV B S K (D + Dv) b and its dq accumulator B (S/C) H D 4."""
        return s.batch * (s.seq * s.kv_heads * s.kv_width * s.itemsize + s.seq / s.cp * s.heads * s.head_dim * 4)

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        import jax

        from maxctx.attention.cp.load_balance import stored_order
        from maxctx.attention.cp.sharded import CONTEXT, context_shard_map
        from maxctx.attention.kernels.local import make_local
        from maxctx.attention.kernels.sinks import attend as sink_attend

        cp = mesh_context_degree(mesh.shape)
        seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
        local = make_local(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh,
                           order=stored_order(seq, cp, spec.load_balance), q_shards=cp, q_axes=CONTEXT,
                           group=h // kv_heads, window=spec.window, splash_blocks=spec.splash_blocks,
                           documents=spec.load_balance == "documents" and cp > 1, sort_keys=True,
                           softcap=spec.logit_softcap, ring=sinks_H is not None)

        def body(q, k, v, pos, seg, sinks):
            k_all, v_all, pos_all, seg_all = (jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
                                              for x in (k, v, pos, seg))
            return sink_attend(local, 0, q, k_all, v_all, pos, seg, pos_all, seg_all, sinks)

        return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, sinks_H)


STRATEGY = AllGather()
