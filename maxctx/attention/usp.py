"""usp (unified sequence parallelism): all-to-all over the inner context part, ring over the outer part.

Legend (per device): B batch per device, S the whole sequence, C = U x R the CP degree (U = context_a2a, the
A2A degree, `a2a_degree` below; R = context, the ring degree), H and K heads per tensor shard,
K' = lcm(K, U) kv heads after repetition, D head dim, b bytes per activation element; ids are int32.

The sequence is sharded as shard = ring_rank * U + a2a_rank, so after the all-to-all over `context_a2a` each
device holds ring block r (S/R tokens, H/U heads); the ring then runs over `context` exactly as p2p does.

Cost (the formulas: `collectives` and `activation_bytes` below): a2a's all-to-all over U plus p2p's ring over R
blocks of S/R tokens with K'/U heads; memory O(S/C), with the ring's fp32 accumulator and in-flight blocks on top,
as in p2p.
"""

from __future__ import annotations

from maxctx.attention import a2a, halo
from maxctx.attention.p2p import ring_collectives
from maxctx.attention.strategy import AttentionShape, Collective, replicated_kv_heads
from maxctx.config import Config, ConfigError
from maxctx.parallelism import A2A_AXIS, RING_AXIS, balanced_a2a_degree

LOCAL_BY_HALO = True  # local layers: maxctx.attention.halo, where it moves less
RING = True  # attend takes ring_backward_overlap (maxctx.attention.ring)
NAME, ALIASES = "usp", ()


def a2a_degree(config: Config, cp: int) -> int:
    """context_parallel_a2a_degree when set (> 0). Default: across slices (dcn_context_parallelism > 1)
    U = ici_context_parallelism, so the all-to-all stays on ICI and the ring spans DCN; on one slice the largest
    divisor U of C with U x U <= C that divides the query heads (C=4 -> 2x2, C=8 -> 2x4), so both parts take part."""
    if config.context_parallel_a2a_degree > 0:
        return config.context_parallel_a2a_degree
    if config.dcn_context_parallelism > 1:
        return config.ici_context_parallelism
    return balanced_a2a_degree(cp, config.base_num_query_heads)


def check(config: Config, cp: int, tensor: int) -> None:
    u = a2a_degree(config, cp)
    if cp % u:
        raise ConfigError(f"context_parallel_a2a_degree={u} does not divide the context parallelism {cp}; "
                          f"choose a divisor of {cp}")
    a2a.check_heads(config, u, tensor)


def query_rows(seq: int, cp: int, a2a_part: int) -> int:
    return seq // (cp // a2a_part)


def collectives(s: AttentionShape) -> tuple[list[Collective], list[Collective]]:
    """a2a's collectives over U, then p2p's ring over R blocks of S/R tokens with K'/U kv heads each; a local
    layer: the halo's over all C devices (maxctx.attention.halo), where it applies, as p2p's."""
    local = halo.shape_plan(s)
    if local is not None:
        return halo.collective_bytes(local, s.batch, s.kv_heads, s.head_dim, s.itemsize)
    fwd, bwd = a2a.a2a_collectives(s)
    ring_fwd, ring_bwd = ring_collectives(s.batch, s.seq / s.ring, replicated_kv_heads(s.kv_heads, s.a2a) // s.a2a,
                                          s.head_dim, s.itemsize, s.ring)
    return fwd + ring_fwd, bwd + ring_bwd


def activation_bytes(s: AttentionShape) -> float:
    """As a2a's with rows S / R: O(S/C)."""
    return a2a.activation_bytes(s)


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *, kernel: str, mesh, load_balance: bool,
           block_q: int, block_kv: int, window: int = 0, splash_blocks=None,
           ring_backward_overlap: bool = False):
    from maxctx.attention.alltoall import a2a_attention
    from maxctx.attention.collectives import context_shard_map
    from maxctx.attention.kernels import make_local, stored_order
    from maxctx.attention.ring import ring_attention

    u, r = mesh.shape[A2A_AXIS], mesh.shape[RING_AXIS]
    seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
    local = make_local(kernel, block_q, block_kv, mesh=mesh, order=stored_order(seq, u * r, load_balance),
                       q_shards=r, kv_blocks=r, q_axes=RING_AXIS, group=h // replicated_kv_heads(kv_heads, u),
                       ring=True, window=window, splash_blocks=splash_blocks)

    def inner(q, k, v, pos, seg):
        return ring_attention(local, RING_AXIS, r, ring_backward_overlap, q, k, v, pos, seg, pos, seg)

    def body(q, k, v, pos, seg):
        return a2a_attention(q, k, v, pos, seg, u, inner)

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS)
