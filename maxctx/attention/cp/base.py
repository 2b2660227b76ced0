"""What a context-parallel strategy is: an instance of `Strategy`, registered once in maxctx.attention.cp.strategies.
One module per strategy (all_gather.py, a2a.py, p2p.py, usp.py) subclasses it and overrides what differs from the
defaults:

    name, aliases                     the config value and MaxText's other names for it
    local_by_halo                     True: a local (sliding-window) layer runs as maxctx.attention.cp.halo's exchange
                                      where that moves less; default False (the strategy's own path)
    ring                              True: the layer runs maxctx.attention.cp.ring over the `context` mesh axis, whose
                                      out and log-sum-exp are named `context` (remat keeps them for the backward);
                                      default False
    output_copies                     arrays of the attention output's size one layer names `context`; default 1
    overlapped_backward               True: the ring's backward sends overlap its hops' kernels, as the software-
                                      pipelined backward does (AttentionSpec.ring_backward_overlap), which the
                                      planner prices (memory: one more fp32 dK/dV block; time: hidden sends);
                                      default False, maxctx's program (a variant prices MaxText's rings:
                                      maxctx.attention.cp.strategies.replaced)
    moves                             what the strategy exchanges: "kv" (per-head K and V: any attention layer) or
                                      "latent" (MLA's latent and shared RoPE key, the layer rebuilding K and V:
                                      `attend_latent`, maxctx.attention.cp.latent); default "kv"
    keeps_output_for_backward(ring)   whether a policy keeping `context` spares the backward the forward's rerun
                                      (maxctx.plan.step_time); default: a ring of 2 or more
    a2a_degree(config, cp)            the all-to-all part U of the CP degree C; default 1 (the ring part is C / U)
    check(config, cp, tensor)         the strategy's own config rules (raise ConfigError), run before JAX starts;
                                      default none
    check_model(config, latent_rank)  the strategy's rules on the model's attention, given MLA's latent rank R (0:
                                      no MLA), run by maxctx.validate (which knows the model families); default none
    query_rows(seq, cp, a2a)          query rows one device's kernel call tiles (splash's 128-row rule); default S/C
    global_comm_volume(shape)         (forward, backward) collectives of one global layer, formulas of AttentionShape
    activation_bytes(shape)           attention activations one layer saves for its backward, per device
    transient_bytes(shape)            buffers the backward holds besides them (the planner's attention memory)
    rebuild_flops(shape)              (forward, backward) FLOPs one layer spends per device, beyond the model's own
                                      projections, rebuilding K and V from what it moved (the time model prices
                                      them at the matmul rate); default (0, 0)
    planner_degrees(cp)               the A2A degrees U the planner tries, one candidate each; default (1,)
    label(cp, a2a)                    the planner's name for a candidate; default the strategy's name
    candidate_config(config, a2a)     the config that runs a candidate
    attend(q, k, v, positions, segment_ids, mesh, spec, sinks_H=None) -> out    the shard_map'd attention, with
                                      attention sinks [H] merged once per row when given (kernels/sinks.py)
    attend_latent(q, latent, wkv_b, positions, segment_ids, mesh, spec) -> out    a strategy that moves the latent:
                                      MLA's attention from its latent (maxctx.attention.dispatch.attend_latent)

`comm_volume(shape)` is what the roofline and the planner read: a local layer's halo traffic where the halo applies,
else `global_comm_volume`. Formulas are functions of maxctx.attention.cp.cost.AttentionShape, the single statement of
the strategy's cost; tests/test_attention_comm.py checks them against the compiled HLO. A strategy imports JAX only
inside `attend`, so config validation and the planner read the registry without starting JAX.

`attend`'s `spec` is the layer's maxctx.attention.dispatch.AttentionSpec with its kernel resolved: block sizes,
token order, window, splash's blocks and the ring settings (ring_backward_overlap; splash_blocks.ring_backward),
the same object for every strategy, which reads what applies to it.
"""

from __future__ import annotations

import dataclasses

from maxctx.attention.cp import halo
from maxctx.attention.cp.cost import AttentionShape, Collective
from maxctx.config import Config

CommVolume = tuple[list[Collective], list[Collective]]  # (forward, backward) collectives of one layer


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One context-parallel strategy (module doc). Frozen: a registered strategy is a value; a variant is
    `dataclasses.replace(strategy, name=...)` or a subclass."""

    name: str
    aliases: tuple[str, ...] = ()
    local_by_halo: bool = False
    ring: bool = False
    output_copies: int = 1
    overlapped_backward: bool = False
    moves: str = "kv"

    def keeps_output_for_backward(self, ring_degree: int) -> bool:
        """Whether a remat policy that keeps `context` keeps this strategy's attention output and log-sum-exp, so
        that the backward does not run the forward again: only a ring of 2 or more names them (the kernels' own
        VJPs keep residuals no policy names)."""
        return self.ring and ring_degree > 1

    def a2a_degree(self, config: Config, cp: int) -> int:
        return 1

    def check(self, config: Config, cp: int, tensor: int) -> None:
        """Any head count and token order works."""

    def check_model(self, config: Config, latent_rank: int) -> None:
        """Any model's attention works."""

    def query_rows(self, seq: int, cp: int, a2a: int) -> int:
        return seq // cp

    def halo_plan(self, s: AttentionShape) -> halo.HaloPlan | None:
        """The halo exchange a local layer of this shape runs as, or None (the strategy's own path)."""
        return halo.shape_plan(s) if self.local_by_halo else None

    def comm_volume(self, s: AttentionShape) -> CommVolume:
        """(forward, backward) collectives of one layer per device: the halo's where it applies, else the
        strategy's global ones."""
        local = self.halo_plan(s)
        if local is not None:
            return halo.comm_volume(local, s.batch, s.kv_heads, s.kv_width, s.itemsize)
        return self.global_comm_volume(s)

    def global_comm_volume(self, s: AttentionShape) -> CommVolume:
        raise NotImplementedError(f"{type(self).__name__}.global_comm_volume")

    def activation_bytes(self, s: AttentionShape) -> float:
        raise NotImplementedError(f"{type(self).__name__}.activation_bytes")

    def transient_bytes(self, s: AttentionShape) -> float:
        raise NotImplementedError(f"{type(self).__name__}.transient_bytes")

    def rebuild_flops(self, s: AttentionShape) -> tuple[float, float]:
        return 0.0, 0.0

    def planner_degrees(self, cp: int) -> tuple[int, ...]:
        return (1,)

    def label(self, cp: int, a2a: int) -> str:
        return self.name

    def candidate_config(self, config: Config, a2a: int) -> Config:
        """The config that runs this strategy at A2A degree `a2a` (one of planner_degrees)."""
        return dataclasses.replace(config, context_parallel_strategy=self.name, context_parallel_a2a_degree=0)

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        raise NotImplementedError(f"{type(self).__name__}.attend")

    def attend_latent(self, q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS, mesh, spec):
        raise NotImplementedError(f"{type(self).__name__} moves {self.moves}, not MLA's latent")
