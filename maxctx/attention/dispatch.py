"""The one attention entry point the model calls: picks the kernel and the context-parallel strategy.

Layouts: q[B_(data,fsdp), S_(context,context_a2a), H_tensor, D], k/v[B, S, K_tensor, D], positions and segment ids
[B, S]; out like q. With context parallelism C > 1 the call goes to a strategy module (one per strategy, same
signature), which shard_maps over the mesh; with C = 1 the kernel runs on the global arrays under jit.
"""

from __future__ import annotations

import dataclasses



from maxctx.attention.dot_product import dot_product_attention


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    kernel: str = "dot_product"  # dot_product | flash | splash | cudnn | auto
    strategy: str = "all_gather"  # all_gather | a2a | p2p | usp
    load_balance: bool = True
    block_q: int = 512
    block_kv: int = 512


KERNELS = {"dot_product": dot_product_attention}


def resolve_kernel(name: str) -> str:
    """`auto` -> the best kernel the platform has."""
    if name != "auto":
        return name
    return "dot_product"


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, spec: AttentionSpec, mesh=None):
    """Causal, document-masked attention; returns out[B, S, H, D]."""
    kernel = KERNELS[resolve_kernel(spec.kernel)]
    out, _ = kernel(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, positions_BS, segment_ids_BS)
    return out


__all__ = ["AttentionSpec", "attend"]
