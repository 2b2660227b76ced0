"""What attention costs, as formulas: the shape of one attention layer on one device (`AttentionShape`) and the
collective ops a strategy's layer runs (`Collective`, of one of the HLO `KINDS`). A strategy
(maxctx.attention.cp.base) states its traffic and memory as functions of `AttentionShape`; the roofline
(maxctx.plan.roofline) and the planner (maxctx.plan.planner) sum them, and tests/test_attention_comm.py checks them
against the compiled HLO. No JAX.
"""

from __future__ import annotations

import dataclasses
import math

# The HLO ops the strategies use. Counted per device as XLA shows them: the result of all-gather, all-to-all and
# collective-permute, the operand of reduce-scatter.
KINDS = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One attention layer on one device. B batch per device (global / (data x fsdp)), S the whole sequence, H and
    K query and kv heads per tensor shard, D head dim of q and k, Dv of v and the output (`value_head_dim`; 0: D,
    MLA's 128 against D = 192; MLA's latent: `latent_rank`, `rope_dim`), b bytes per activation element, C = R x U
    the CP degree (U the all-to-all part, R the ring part). Positions and segment ids are int32. Sizes may be
    fractional (the roofline's tokens per device)."""

    batch: float
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    cp: int
    a2a: int = 1
    window: int = 0  # a local layer's sliding window (0: a global layer)
    load_balance: bool = True
    value_head_dim: int = 0
    # MLA (maxctx.model.deepseek): the KV latent's rank (kv_lora_rank) and the shared RoPE key's width, which a
    # strategy moving the latent (maxctx.attention.cp.latent) gathers in place of K and V; 0: not MLA.
    latent_rank: int = 0
    rope_dim: int = 0

    @property
    def latent_width(self) -> int:
        """The latent and the shared RoPE key: one token's numbers that MLA's K and V are built from."""
        return self.latent_rank + self.rope_dim if self.latent_rank else 0

    @property
    def v_dim(self) -> int:
        """Dv: v's and the output's head dim."""
        return self.value_head_dim or self.head_dim

    @property
    def kv_width(self) -> int:
        """D + Dv: one kv head's K and V numbers per token (2 D without MLA)."""
        return self.head_dim + self.v_dim

    @property
    def ring(self) -> int:
        return self.cp // self.a2a


@dataclasses.dataclass(frozen=True)
class Collective:
    """`bytes` of HLO op `kind` on one device per layer (summed over its calls), over groups of `group` devices."""

    kind: str
    bytes: float
    group: int

    @property
    def sent_bytes(self) -> float:
        """Bytes one device puts on the wire: a collective-permute sends its whole operand; all-gather, all-to-all
        and reduce-scatter send (group - 1) / group of theirs."""
        if self.kind == "collective-permute":
            return self.bytes
        return self.bytes * (self.group - 1) / self.group


def replicated_kv_heads(kv_heads: int, degree: int) -> int:
    """K' = lcm(K, U): kv heads after the all-to-all strategies repeat them, so that U divides them."""
    return math.lcm(kv_heads, degree)


def by_kind(ops: list[Collective]) -> dict[str, float]:
    """Bytes per HLO op kind (what tests/support/hlo.py reads from a compiled program)."""
    out: dict[str, float] = {}
    for c in ops:
        out[c.kind] = out.get(c.kind, 0.0) + c.bytes
    return out
