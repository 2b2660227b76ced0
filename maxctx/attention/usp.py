"""usp (unified sequence parallelism): all-to-all over the inner context part, ring over the outer part.

Legend (per device): B batch per device, S the whole sequence, C = U x R the CP degree (U = context_a2a, the
A2A degree; R = context, the ring degree; default in maxctx.validate.a2a_degree), H and K heads per tensor shard,
K' = lcm(K, U) kv heads after repetition, D head dim, b bytes per activation element; ids are int32.

The sequence is sharded as shard = ring_rank * U + a2a_rank, so after the all-to-all over `context_a2a` each
device holds ring block r (S/R tokens, H/U heads); the ring then runs over `context` exactly as p2p does.

Collective bytes per layer (operands on one device):
    forward   all-to-all        (2 H + 2 K') B (S/C) D b
              all-gather        positions, segment ids 2 B (S/R) 4
              collective-permute (R - 1) x (2 B (S/R) (K'/U) D b + 2 B (S/R) 4)
    backward  all-to-all        (2 H + 2 K') B (S/C) D b
              collective-permute (R - 1) x (2 B (S/R) (K'/U) D b + 2 B (S/R) 4) + R x 2 B (S/R) (K'/U) D 4
Attention activation memory per device: saved q, out 2 B (S/R) (H/U) D b, k, v 2 B (S/R) (K'/U) D b, lse
B (H/U) (S/R) 4: O(S/C); the ring's fp32 accumulator and in-flight blocks on top, as in p2p.
"""

from __future__ import annotations

from jax.sharding import Mesh

from maxctx.attention.a2a import a2a_attention, replicated_kv_heads
from maxctx.attention.collectives import context_shard_map
from maxctx.attention.kernels import make_local, stored_order
from maxctx.attention.p2p import ring_attention

RING_AXIS = "context"


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *, kernel: str, mesh: Mesh, load_balance: bool,
           block_q: int, block_kv: int):
    u, r = mesh.shape["context_a2a"], mesh.shape[RING_AXIS]
    seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
    local = make_local(kernel, block_q, block_kv, mesh=mesh, order=stored_order(seq, u * r, load_balance),
                       q_shards=r, kv_blocks=r, q_axes=RING_AXIS, group=h // replicated_kv_heads(kv_heads, u),
                       ring=True)
    def inner(q, k, v, pos, seg):
        return ring_attention(local, RING_AXIS, r, q, k, v, pos, seg, pos, seg)

    def body(q, k, v, pos, seg):
        return a2a_attention(q, k, v, pos, seg, u, inner)

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS)
