"""usp (unified sequence parallelism): all-to-all over the inner context part, ring over the outer part.

Legend (per device): B batch per device, S the whole sequence, C = U x R the CP degree (U = context_a2a, the
A2A degree, `a2a_degree` below; R = context, the ring degree), H and K heads per tensor shard,
K' = lcm(K, U) kv heads after repetition, D head dim, b bytes per activation element; ids are int32.

The sequence is sharded as shard = ring_rank * U + a2a_rank, so after the all-to-all over `context_a2a` each
device holds ring block r (S/R tokens, H/U heads); the ring then runs over `context` exactly as p2p does.

Cost (the formulas below): a2a's all-to-all over U plus p2p's ring over R blocks of S/R tokens with K'/U heads;
memory O(S/C), with the ring's fp32 accumulator and in-flight blocks on top, as in p2p.
"""

from __future__ import annotations

import dataclasses

from maxctx.attention.cp.a2a import a2a_activation_bytes, a2a_comm_volume, a2a_transient_bytes, check_heads
from maxctx.attention.cp.base import CommVolume, Strategy
from maxctx.attention.cp.cost import AttentionShape, replicated_kv_heads
from maxctx.attention.cp.p2p import ring_comm_volume, ring_transient_bytes
from maxctx.config import Config, ConfigError
from maxctx.parallelism import A2A_AXIS, RING_AXIS, balanced_a2a_degree


@dataclasses.dataclass(frozen=True)
class USP(Strategy):
    name: str = "usp"
    local_by_halo: bool = True  # local layers: maxctx.attention.cp.halo over all C devices, where it moves less
    ring: bool = True
    # The ring's output (heads split over the all-to-all) and the layer's output after the all-to-all back: two
    # arrays, both named `context`.
    output_copies: int = 2

    def a2a_degree(self, config: Config, cp: int) -> int:
        """context_parallel_a2a_degree when set (> 0). Default: across slices (dcn_context_parallelism > 1)
        U = ici_context_parallelism, so the all-to-all stays on ICI and the ring spans DCN; on one slice the largest
        divisor U of C with U x U <= C that divides the query heads (C=4 -> 2x2, C=8 -> 2x4), so both parts take
        part."""
        if config.context_parallel_a2a_degree > 0:
            return config.context_parallel_a2a_degree
        if config.dcn_context_parallelism > 1:
            return config.ici_context_parallelism
        return balanced_a2a_degree(cp, config.base_num_query_heads)

    def check(self, config: Config, cp: int, tensor: int) -> None:
        u = self.a2a_degree(config, cp)
        if cp % u:
            raise ConfigError(f"context_parallel_a2a_degree={u} does not divide the context parallelism {cp}; "
                              f"choose a divisor of {cp}")
        check_heads(config, u, tensor)

    def query_rows(self, seq: int, cp: int, a2a: int) -> int:
        return seq // (cp // a2a)

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        """a2a's collectives over U, then p2p's ring over R blocks of S/R tokens with K'/U kv heads each."""
        fwd, bwd = a2a_comm_volume(s)
        ring_fwd, ring_bwd = ring_comm_volume(s.batch, s.seq / s.ring, replicated_kv_heads(s.kv_heads, s.a2a) // s.a2a,
                                              s.kv_width, s.itemsize, s.ring)
        return fwd + ring_fwd, bwd + ring_bwd

    def activation_bytes(self, s: AttentionShape) -> float:
        """As a2a's with rows S / R: O(S/C)."""
        return a2a_activation_bytes(s)

    def transient_bytes(self, s: AttentionShape) -> float:
        """The ring's part (p2p's, over R) and the all-to-all's (a2a's, over U)."""
        return ring_transient_bytes(s, self.overlapped_backward) + a2a_transient_bytes(s)

    def planner_degrees(self, cp: int) -> tuple[int, ...]:
        """Every divisor 1 < U < C (U = 1 is p2p, U = C is a2a)."""
        return tuple(u for u in range(2, cp) if cp % u == 0)

    def label(self, cp: int, a2a: int) -> str:
        return f"usp {cp // a2a}x{a2a}"

    def candidate_config(self, config: Config, a2a: int) -> Config:
        return dataclasses.replace(config, context_parallel_strategy=self.name, context_parallel_a2a_degree=a2a)

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        from maxctx.attention.cp.load_balance import stored_order
        from maxctx.attention.cp.ring import check_ring_local, ring_attention
        from maxctx.attention.cp.seq_to_heads import a2a_attention
        from maxctx.attention.cp.sharded import context_shard_map
        from maxctx.attention.kernels.document_blocks import sort_keys
        from maxctx.attention.kernels.local import make_local

        u, r = mesh.shape[A2A_AXIS], mesh.shape[RING_AXIS]
        seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
        local = make_local(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh,
                           order=stored_order(seq, u * r, spec.load_balance), q_shards=r, kv_blocks=r,
                           q_axes=RING_AXIS, group=h // replicated_kv_heads(kv_heads, u), ring=True,
                           window=spec.window, splash_blocks=spec.splash_blocks,
                           documents=spec.load_balance == "documents" and u * r > 1, softcap=spec.logit_softcap)

        check_ring_local(local, self.name)

        def inner(q, k, v, pos, seg, sinks):
            kp, ks = pos, seg
            if local.documents:  # the a2a group's ranks, one after another: back in document order for the ring
                kp, ks, k, v = sort_keys(pos, seg, k, v)
            return ring_attention(local, RING_AXIS, r, spec.ring_backward_overlap, q, k, v, pos, seg, kp, ks, sinks)

        def body(q, k, v, pos, seg, sinks):
            return a2a_attention(q, k, v, pos, seg, u, inner, sinks)

        return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, sinks_H)


STRATEGY = USP()
