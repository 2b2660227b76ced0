"""p2p (ring) context parallelism: K/V blocks travel around the ring while each device attends to the one it holds.

Legend (per device): B batch per device, S the whole sequence, C the CP degree (ring size R = C for p2p), H and K
heads per tensor shard, D head dim, b bytes per activation element; positions and segment ids are int32.

The ring itself (hops, merging, the custom backward, skipping) is maxctx.attention.ring.

Cost (the formulas: `collectives` and `activation_bytes` below): R - 1 hops of the local K/V block and ids in the
forward, the same again plus the travelling fp32 dK/dV accumulators in the backward; memory O(S/C). During a hop
the fp32 out accumulator B s H D 4 and two K/V blocks in flight 4 B s K D b (s = S / C) come on top.
"""

from __future__ import annotations

from maxctx.attention import halo
from maxctx.attention.strategy import AttentionShape, Collective
from maxctx.config import Config
from maxctx.parallelism import mesh_context_degree

LOCAL_BY_HALO = True  # local layers: maxctx.attention.halo, where it moves less
RING = True  # attend takes ring_backward_overlap (maxctx.attention.ring)
NAME, ALIASES = "p2p", ("ring",)


def a2a_degree(config: Config, cp: int) -> int:
    return 1


def check(config: Config, cp: int, tensor: int) -> None:
    """Any head count works."""


def query_rows(seq: int, cp: int, a2a: int) -> int:
    return seq // cp


def ring_collectives(batch: float, rows: float, kv_heads: int, head_dim: int, itemsize: int, ring: int
                     ) -> tuple[list[Collective], list[Collective]]:
    """A ring of R devices, each holding `rows` tokens of K/V (K heads): collective-permute operands
    forward   (R - 1) x (2 B rows K D b + 2 B rows 4)                        K, V, positions, segment ids
    backward  (R - 1) x (2 B rows K D b + 2 B rows 4) + R x 2 B rows K D 4   re-sent K/V, then fp32 dK/dV."""
    hop = 2 * batch * rows * kv_heads * head_dim * itemsize + 2 * batch * rows * 4
    grads = ring * 2 * batch * rows * kv_heads * head_dim * 4
    return ([Collective("collective-permute", (ring - 1) * hop, ring)],
            [Collective("collective-permute", (ring - 1) * hop + grads, ring)])


def collectives(s: AttentionShape) -> tuple[list[Collective], list[Collective]]:
    """The ring over all C devices, S / C tokens each (`ring_collectives`); a local layer: the halo's
    (maxctx.attention.halo), where it applies: with zig-zag, W <= S / 2C and C > 2, two rounds of W rows, so
    forward 2 W (2 B K D b + 2 B 4), backward 2 W 2 B K D b, whatever C."""
    local = halo.shape_plan(s)
    if local is not None:
        return halo.collective_bytes(local, s.batch, s.kv_heads, s.head_dim, s.itemsize)
    return ring_collectives(s.batch, s.seq / s.cp, s.kv_heads, s.head_dim, s.itemsize, s.cp)


def activation_bytes(s: AttentionShape) -> float:
    """Saved for the backward: q, k, v, out (2 H + 2 K) B s D b and lse B H s 4, s = S / C."""
    rows = s.seq / s.cp
    return (2 * s.heads + 2 * s.kv_heads) * s.batch * rows * s.head_dim * s.itemsize + s.batch * s.heads * rows * 4


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *, kernel: str, mesh, load_balance: bool,
           block_q: int, block_kv: int, window: int = 0, splash_blocks=None,
           ring_backward_overlap: bool = False):
    from maxctx.attention.collectives import CONTEXT, context_shard_map
    from maxctx.attention.kernels import make_local, stored_order
    from maxctx.attention.ring import ring_attention

    cp = mesh_context_degree(mesh.shape)
    seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
    local = make_local(kernel, block_q, block_kv, mesh=mesh, order=stored_order(seq, cp, load_balance),
                       q_shards=cp, kv_blocks=cp, q_axes=CONTEXT, group=h // kv_heads, ring=True, window=window,
                       splash_blocks=splash_blocks)

    def body(q, k, v, pos, seg):
        return ring_attention(local, CONTEXT, cp, ring_backward_overlap, q, k, v, pos, seg, pos, seg)

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS)
