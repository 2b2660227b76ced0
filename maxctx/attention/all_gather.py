"""all_gather context parallelism: gather K and V over the context axes, attend local queries to all of them.

Legend (per device): B batch per device (global / (data x fsdp)), S the whole sequence, C the CP degree
(context x context_a2a), H and K query and kv heads per tensor shard, D head dim, b bytes per activation element.
Positions and segment ids are int32.

Collective bytes per layer (size of each collective's full result/operand on one device; the wire carries
(C-1)/C of it):
    forward   all-gather   K, V:                 2 B S K D b
              all-gather   positions, seg ids:   2 B S 4
    backward  reduce-scatter dK, dV (autodiff of the gather):   2 B S K D b
Attention activation memory per device (saved for backward): q and out 2 B (S/C) H D b, the gathered K and V
2 B S K D b (O(S), not O(S/C): the price of this strategy), lse B H (S/C) 4 (flash); the kernel's temp on top
(flash: one [B, H, block_q, block_kv] fp32 score block; dot_product: B H (S/C) S 4).
Works with any token order: masks come from the gathered positions and segment ids.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from maxctx.attention.collectives import CONTEXT, context_shard_map
from maxctx.attention.kernels import make_local, stored_order


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *, kernel: str, mesh: Mesh, load_balance: bool,
           block_q: int, block_kv: int):
    cp = mesh.shape["context"] * mesh.shape["context_a2a"]
    seq, h, kv_heads = q_BSHD.shape[1], q_BSHD.shape[2], k_BSKD.shape[2]
    local = make_local(kernel, block_q, block_kv, mesh=mesh, order=stored_order(seq, cp, load_balance),
                       q_shards=cp, q_axes=CONTEXT, group=h // kv_heads)

    def body(q, k, v, pos, seg):
        k_all, v_all, pos_all, seg_all = (jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
                                          for x in (k, v, pos, seg))
        out, _ = local.attend(0, q, k_all, v_all, pos, seg, pos_all, seg_all)
        return out

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS)
