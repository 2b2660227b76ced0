"""p2p (ring) context parallelism: K/V blocks travel around the ring while each device attends to the one it holds.

Legend (per device): B batch per device, S the whole sequence, C the CP degree (ring size R = C for p2p), H and K
heads per tensor shard, D head dim of q and k, Dv of v and out (D without MLA), b bytes per activation element;
positions and segment ids are int32.

The ring itself (hops, merging, the custom backward, skipping) is maxctx.attention.cp.ring.

Cost (the formulas below): R - 1 hops of the local K/V block and ids in the forward, the same again plus the
travelling fp32 dK/dV accumulators in the backward; memory O(S/C). During a hop the fp32 out accumulator B s H D 4
and two K/V blocks in flight 4 B s K D b (s = S / C) come on top. Any head count works (the default `check`).
"""

from __future__ import annotations

import dataclasses

from maxctx.attention.cp.base import CommVolume, Strategy
from maxctx.attention.cp.cost import AttentionShape, Collective, replicated_kv_heads
from maxctx.parallelism import mesh_context_degree


def ring_comm_volume(batch: float, rows: float, kv_heads: int, kv_width: int, itemsize: int, ring: int
                     ) -> CommVolume:
    """A ring of R devices, each holding `rows` tokens of K/V (K heads, kv_width = D + Dv numbers each):
    collective-permute operands
    forward   (R - 1) x (B rows K (D + Dv) b + 2 B rows 4)                          K, V, positions, segment ids
    backward  (R - 1) x (B rows K (D + Dv) b + 2 B rows 4)                          re-sent K/V
              + (R - 1) x B rows K (D + Dv) 4 + B rows K (D + Dv) b                dK/dV: fp32 from hop to hop,
                                                                                   the last shift home in b."""
    hop = batch * rows * kv_heads * kv_width * itemsize + 2 * batch * rows * 4
    grads = batch * rows * kv_heads * kv_width * ((ring - 1) * 4 + itemsize)
    return ([Collective("collective-permute", (ring - 1) * hop, ring)],
            [Collective("collective-permute", (ring - 1) * hop + grads, ring)])


def ring_transient_bytes(s: AttentionShape, overlapped: bool) -> float:
    """The ring part R = C / U of a backward's buffers, rows = S / R: the fp32 accumulator B rows (H/U) Dv 4, two K/V
    blocks in flight 2 B rows (K'/U) (D + Dv) b and the travelling fp32 dK/dV 2 B rows (K'/U) (D + Dv) 4,
    3 B rows (K'/U) (D + Dv) 4 with an overlapped backward (one more block in flight); none without a ring
    (R = 1)."""
    if s.ring <= 1:
        return 0.0
    rows, kv = s.seq / s.ring, replicated_kv_heads(s.kv_heads, s.a2a)
    return s.batch * rows * (s.heads / s.a2a * s.v_dim * 4
                             + kv / s.a2a * s.kv_width * (2 * s.itemsize + 8 + 4 * overlapped))


@dataclasses.dataclass(frozen=True)
class P2P(Strategy):
    name: str = "p2p"
    aliases: tuple[str, ...] = ("ring",)
    local_by_halo: bool = True  # local layers: maxctx.attention.cp.halo, where it moves less
    ring: bool = True

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        """The ring over all C devices, S / C tokens each (`ring_comm_volume`). A local layer: the halo's where it
        applies (with zig-zag, W <= S / 2C and C > 2, two rounds of W rows, so forward 2 W (2 B K D b + 2 B 4),
        backward 2 W 2 B K D b, whatever C)."""
        return ring_comm_volume(s.batch, s.seq / s.cp, s.kv_heads, s.kv_width, s.itemsize, s.cp)

    def activation_bytes(self, s: AttentionShape) -> float:
        """Saved for the backward: q, k, v, out (H + K) (D + Dv) B s b and lse B H s 4, s = S / C."""
        rows = s.seq / s.cp
        return ((s.heads + s.kv_heads) * s.kv_width * s.batch * rows * s.itemsize
                + s.batch * s.heads * rows * 4)

    def transient_bytes(self, s: AttentionShape) -> float:
        return ring_transient_bytes(s, self.overlapped_backward)

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        from maxctx.attention.cp.load_balance import stored_order
        from maxctx.attention.cp.ring import check_ring_local, ring_attention
        from maxctx.attention.cp.sharded import CONTEXT, context_shard_map
        from maxctx.attention.kernels.local import make_local

        cp = mesh_context_degree(mesh.shape)
        seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
        local = make_local(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh,
                           order=stored_order(seq, cp, spec.load_balance), q_shards=cp, kv_blocks=cp,
                           q_axes=CONTEXT, group=h // kv_heads, ring=True, window=spec.window,
                           splash_blocks=spec.splash_blocks,
                           documents=spec.load_balance == "documents" and cp > 1, softcap=spec.logit_softcap)

        check_ring_local(local, self.name)

        def body(q, k, v, pos, seg, sinks):
            return ring_attention(local, CONTEXT, cp, spec.ring_backward_overlap, q, k, v, pos, seg, pos, seg, sinks)

        return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, sinks_H)


STRATEGY = P2P()
