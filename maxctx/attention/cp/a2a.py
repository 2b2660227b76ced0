"""a2a (Ulysses) context parallelism: all-to-all turns sequence shards into head shards, attend, and back.

Legend (per device): B batch per device, S the whole sequence, C the CP degree (= A2A degree U for a2a), H and K
heads per tensor shard, D head dim, b bytes per activation element; positions and segment ids are int32.

q[B, S/U, H, D] -> [B, S, H/U, D] and the same for K and V; positions and segment ids are all-gathered. With
fewer kv heads than U (or K not divisible by U), kv heads are first repeated to K' = lcm(K, U) (it divides H), so
every device gets the kv heads of its query heads; autodiff of the repeat sums their gradients back. Only H not
divisible by U is refused (`check`, before compile).

Cost (the formulas below, shared with usp): q, K, V there and the output back, the same in the backward; memory
O(S/U), the same bytes as the sharded inputs; the kernel's temp on top (flash: one score block). A local layer runs
whole sequences after the all-to-all, where the kernel skips the blocks outside the band: no halo.
"""

from __future__ import annotations

import dataclasses

from maxctx.attention.cp.base import CommVolume, Strategy
from maxctx.attention.cp.cost import AttentionShape, Collective, replicated_kv_heads
from maxctx.config import Config, ConfigError
from maxctx.parallelism import A2A_AXIS, RING_AXIS


def check_heads(config: Config, a2a: int, tensor: int) -> None:
    """Every device gets H / U whole query heads (kv heads are repeated as needed)."""
    if (config.base_num_query_heads // tensor) % a2a:
        raise ConfigError(f"base_num_query_heads={config.base_num_query_heads} / tensor {tensor} is not divisible "
                          f"by the A2A degree {a2a} (context_parallel_strategy={config.context_parallel_strategy}); "
                          f"use a head count divisible by {a2a}, or context_parallel_strategy=p2p or all_gather")


def a2a_comm_volume(s: AttentionShape) -> CommVolume:
    """The all-to-all part over U devices, K' = lcm(K, U): all-to-all of q, k (D wide), v (Dv) in and out (Dv)
    back, (H + K') (D + Dv) B (S/C) b, in the forward and again in the backward (dout in; dq, dk, dv back);
    all-gather of positions and segment ids 2 B (S/R) 4 in the forward."""
    kv = replicated_kv_heads(s.kv_heads, s.a2a)
    moved = (s.heads + kv) * s.kv_width * s.batch * (s.seq / s.cp) * s.itemsize
    return ([Collective("all-to-all", moved, s.a2a), Collective("all-gather", 2 * s.batch * s.seq / s.ring * 4,
                                                                 s.a2a)],
            [Collective("all-to-all", moved, s.a2a)])


def a2a_activation_bytes(s: AttentionShape) -> float:
    """Saved for the backward, rows = S / R (S for a2a), heads / U: q, out B rows (H/U) (D + Dv) b, k, v
    B rows (K'/U) (D + Dv) b, lse B (H/U) rows 4."""
    rows, kv = s.seq / s.ring, replicated_kv_heads(s.kv_heads, s.a2a)
    return (s.batch * rows * (s.heads + kv) / s.a2a * s.kv_width * s.itemsize
            + s.batch * s.heads / s.a2a * rows * 4)


def a2a_transient_bytes(s: AttentionShape) -> float:
    """The all-to-all part of a backward's buffers, rows = S / R: the fp32 gradients of q, k, v in head layout
    B rows (H D + K' (D + Dv))/U 4; none without an all-to-all (U = 1)."""
    if s.a2a <= 1:
        return 0.0
    rows, kv = s.seq / s.ring, replicated_kv_heads(s.kv_heads, s.a2a)
    return s.batch * rows * (s.heads * s.head_dim + kv * s.kv_width) / s.a2a * 4


@dataclasses.dataclass(frozen=True)
class A2A(Strategy):
    name: str = "a2a"
    aliases: tuple[str, ...] = ("ulysses",)

    def a2a_degree(self, config: Config, cp: int) -> int:
        return cp

    def check(self, config: Config, cp: int, tensor: int) -> None:
        check_heads(config, cp, tensor)

    def query_rows(self, seq: int, cp: int, a2a: int) -> int:
        return seq  # after the all-to-all a device holds the whole sequence for its heads

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        return a2a_comm_volume(s)

    def activation_bytes(self, s: AttentionShape) -> float:
        return a2a_activation_bytes(s)

    def transient_bytes(self, s: AttentionShape) -> float:
        return a2a_transient_bytes(s)

    def planner_degrees(self, cp: int) -> tuple[int, ...]:
        return (cp,)

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        from maxctx.attention.cp.load_balance import stored_order
        from maxctx.attention.cp.seq_to_heads import a2a_attention
        from maxctx.attention.cp.sharded import context_shard_map
        from maxctx.attention.kernels.local import make_local
        from maxctx.attention.kernels.sinks import attend as sink_attend

        if mesh.shape[RING_AXIS] > 1:
            raise ConfigError(f"context_parallel_strategy=a2a puts the whole context degree on the all-to-all, but "
                              f"the mesh has a ring part of {mesh.shape[RING_AXIS]}; use context_parallel_strategy=usp")
        u = mesh.shape[A2A_AXIS]
        seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
        local = make_local(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh,
                           order=stored_order(seq, u, spec.load_balance),
                           group=h // replicated_kv_heads(kv_heads, u), window=spec.window,
                           splash_blocks=spec.splash_blocks,
                           documents=spec.load_balance == "documents" and u > 1, sort_keys=True,
                           softcap=spec.logit_softcap, ring=sinks_H is not None)

        def inner(q, k, v, pos, seg, sinks):
            return sink_attend(local, 0, q, k, v, pos, seg, pos, seg, sinks)

        def body(q, k, v, pos, seg, sinks):
            return a2a_attention(q, k, v, pos, seg, u, inner, sinks)

        return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, sinks_H)


STRATEGY = A2A()
