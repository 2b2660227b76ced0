"""`context_parallel_strategy=auto`: choose the CP strategy and its all-to-all degree from the model, the sequence
length and the topology, before JAX starts (maxctx.loader.load calls `resolve_auto`); with `remat_policy=auto`
also (or, with the strategy given, only) the remat placement of each named tensor (maxctx.plan.remat), each
strategy costed at every placement within the HBM and host budgets.

Candidates: every registered strategy (maxctx.attention.cp.strategies) at each A2A degree its `planner_degrees`
gives (all_gather and p2p U = 1, a2a U = C, usp every divisor 1 < U < C of the CP degree C; a strategy that moves
MLA's latent, latent_all_gather and latent_p2p, for a model with MLA only, its rebuild of K and V priced at the
matmul rate: step_time.rebuild_flops). Each is checked
with the same rules as a hand-written config (the strategy's `check`, the mesh split, splash's 128 rows);
an invalid one is dropped with the rule's message. For each valid one, per device:

    attention memory  the strategy's `activation_bytes` (what one layer saves for its backward; tests check it
                      against the compiled program), plus the backward's transient buffers (its `transient_bytes`)
    memory            maxctx.plan.memory.device_bytes: what the program holds at its peak, the larger of the top
                      layer's backward and the loss's vocab tile, on top of the optimizer state, the fp32
                      gradient and what the remat policy keeps on the device (its module doc); the layer's
                      attention is the memory above per head group (/ attention_head_chunks) with the
                      projections' gradients; a candidate above FIT_FRACTION of HBM is ranked after the fitting
                      ones (auto takes the least memory when none fits)
    compute           maxctx.plan.step_time.estimate's (the one step-time model, calibrated on MaxText's measured
                      rows): matmuls, attention, what the backward recomputes and memory-bound work
    exposed comm      step_time's exposed collectives and host transfers. Its CP collectives (exposed_per_layer):
                      per layer of the attention_layer_pattern, from the strategy's `comm_volume` formulas (forward
                      ones once per forward pass): all-gather, reduce-scatter, all-to-all and a local layer's halo
                      permutes wait for their bytes (not overlapped: synchronous in the program compiled for TPU);
                      a forward ring hop overlaps the attention of the block it carries, so each of its hops
                      exposes max(0, hop bytes / bandwidth - block compute) + latency + the merge of its result
                      into the fp32 accumulators in HBM; a backward hop likewise where the strategy's backward
                      overlaps (Strategy.overlapped_backward: the software-pipelined ring backward, which only
                      benchmarks and tests build); maxctx's program sends after the hop's kernel, so every
                      backward send waits in full: the estimate charges what the program does
    step              compute + exposed comm

Bandwidths (per device, one direction): a ring hop uses one ICI link; all-gather and reduce-scatter use both
directions of every torus dimension their group spans; an all-to-all is bisection-bound in each dimension it
spans (bytes x extent / 8 per link on a wraparound ring, / 4 on a line, the slowest dimension setting the time:
`_collective_s`); a group larger than ici_context_parallelism crosses DCN, whose part goes at
DCN_BYTES_PER_S. The all-to-all of a2a and usp must stay inside a slice (maxctx.parallelism.split_context), so
across slices only ring-style traffic (p2p, usp's ring, all_gather's gather) crosses DCN.

Ranking: fitting candidates (HBM, and host memory for offloaded tensors: maxctx.plan.remat) by step time; among
those within TIE of the fastest (the model cannot tell them apart) one that does not stride the layer input, and of
those the one with the most room in its tighter budget (the least memory, when nothing is offloaded), is chosen.
Not modelled: load imbalance. docs/choosing_a_strategy.md has the model's assumptions and its choices against the
fit table and MaxText's measurements. No JAX here, except the peak FLOP/s table (maxctx.metrics.peaks), imported
only when a TPU's peak is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import AttentionShape
from maxctx.config import Config, ConfigError
from maxctx.model import families
from maxctx.parallelism import (
    A2A_AXIS,
    AXES,
    DATA_AXIS,
    RING_AXIS,
    TENSOR_AXIS,
    MeshPlan,
    check_expert_mesh,
    mesh_sizes,
)
from maxctx.plan import documents, memory, remat, step_time, topology
from maxctx.plan.roofline import attention_shape

# The device and the collectives' timing live in the step-time model; named here for the planner's readers.
from maxctx.plan.step_time import (  # noqa: F401
    DCN_BYTES_PER_S,
    DCN_LATENCY_S,
    ICI_LATENCY_S,
    Hardware,
    _collective_s,
    exposed_per_layer,
    hardware,
)

GIB = 1024 ** 3
FIT_FRACTION = 0.9  # of HBM: room for the estimate's spread around the compiled figure (benchmarks/hbm_heap_fit.md)
TIE = 0.01  # step times within 1% of the fastest count as equal; the most headroom wins among them
PLACEMENTS_SHOWN = 3  # remat_policy=auto: each strategy's best placements kept in the table


@dataclasses.dataclass(frozen=True)
class Candidate:
    strategy: str
    a2a: int  # U; the ring part is C / U
    cp: int
    saved_bytes: float = 0.0  # the strategy's activation_bytes: what one layer's attention saves for the backward
    attention_bytes: float = 0.0  # saved_bytes + the strategy's transient_bytes
    memory_bytes: float = 0.0
    compute_s: float = 0.0
    exposed_s: float = 0.0
    fits: bool = False
    dropped: str = ""  # why it is not a choice: the config rule it breaks, or the memory it needs
    valid: bool = True  # False: a config rule drops it (no estimates)
    # (name, remat | device | offload) for each of REMAT_NAMES, and ("decoder_layer_input_stride", N)
    placement: tuple[tuple[str, str | int], ...] = ()
    remat_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()  # the family's (label, names) placed together
    host_bytes: float = 0.0  # what the offloaded tensors hold in host memory per device (memory.held_host_bytes)
    forwards_per_layer: float = 0.0  # attention forwards per layer the estimate assumes (2: recomputed)
    headroom: float = 0.0  # the larger of HBM / its budget and host / its budget (remat's tie-break)

    @property
    def label(self) -> str:
        return strategies.get(self.strategy).label(self.cp, self.a2a)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def placed(self) -> str:
        """Where the remat policy puts the tensors, in short (remat.describe)."""
        return remat.describe(dict(self.placement), self.forwards_per_layer,
                              self.remat_groups)[0] if self.placement else ""

    @property
    def recomputed(self) -> str:
        return remat.describe(dict(self.placement), self.forwards_per_layer,
                              self.remat_groups)[1] if self.placement else ""


@dataclasses.dataclass(frozen=True)
class Plan:
    hardware: Hardware
    cp: int
    ranked: tuple[Candidate, ...]  # the choice first, then the other fitting ones, then the dropped ones
    keys: str = "context_parallel_strategy=auto"  # what the plan chooses
    attention: str = "causal S^2/2 per row"  # which attention pairs the step times count (documents.attention_counted)

    @property
    def choice(self) -> Candidate:
        return self.ranked[0]

    def rows(self) -> list[dict]:
        """The table as JSON-able rows (for the compile record in metrics.jsonl)."""
        return [{"strategy": c.strategy, "a2a": c.a2a, "ring": c.cp // c.a2a, "label": c.label,
                 "saved_gib": round(c.saved_bytes / GIB, 4),
                 "attention_gib": round(c.attention_bytes / GIB, 3), "memory_gib": round(c.memory_bytes / GIB, 3),
                 "step_s": c.step_s, "exposed_s": c.exposed_s, "fits": c.fits, "valid": c.valid,
                 "dropped": c.dropped, "placement": dict(c.placement), "host_gib": round(c.host_bytes / GIB, 3),
                 "attention_forwards_per_layer": c.forwards_per_layer, "recomputed": c.recomputed}
                for c in self.ranked]


def _shape(config: Config, cp: int, tp: int, a2a: int, window: int = 0) -> AttentionShape:
    mesh = {RING_AXIS: cp // a2a, A2A_AXIS: a2a, TENSOR_AXIS: tp}
    return attention_shape(config, mesh, config.per_device_batch_size * cp * tp, window)


def _placement(config: Config) -> tuple:
    """Where the policy puts each named tensor, and the layer input's stride (so a candidate applied to a config
    resolved with another stride gets its own: --verify)."""
    return (*step_time.placement(config).items(), ("decoder_layer_input_stride", config.decoder_layer_input_stride))


def candidates(cp: int) -> list[tuple[str, int]]:
    """(strategy, U) pairs: every registered strategy at each of its planner_degrees."""
    return [(name, u) for name, unit in strategies.STRATEGIES.items() for u in unit.planner_degrees(cp)]


def candidate_config(config: Config, strategy: str, a2a: int, placement: dict[str, str] | None = None) -> Config:
    """The config running `strategy` at A2A degree `a2a` and, when given with a custom or auto policy, the remat
    `placement` (remat_policy=custom with its keys)."""
    out = strategies.get(strategy).candidate_config(config, a2a)
    if placement and config.remat_policy in ("custom", "auto"):
        out = dataclasses.replace(out, remat_policy="custom", **placement)
    return out


def _mesh(config: Config, n: int | None) -> tuple[dict[str, int], dict[str, int]]:
    if n is not None:
        return mesh_sizes(config, n)
    keys = [key for axis in AXES if axis.name in (RING_AXIS, TENSOR_AXIS) for key in axis.keys]
    if any(getattr(config, k) == -1 for k in keys):
        raise ConfigError(f"context_parallel_strategy=auto needs the context and tensor degrees before JAX starts, "
                          f"but one of {', '.join(keys)} is -1; give them as numbers, or set cpu_devices or "
                          f"compile_topology")
    configured = [axis for axis in AXES if axis.name != DATA_AXIS]
    return ({axis.name: getattr(config, axis.keys[0]) for axis in configured},
            {axis.name: getattr(config, axis.keys[1]) for axis in configured})


def mesh_plan(config: Config) -> MeshPlan:
    """The mesh the planner prices every candidate on (each with its own A2A degree): the config's on its
    topology's devices, or, with no device count, its configured degrees (data 1; an fsdp of -1, which only a
    device count resolves, as 1)."""
    ici, dcn = _mesh(config, topology.num_devices(config))
    return MeshPlan({a.name: max(1, ici.get(a.name, 1)) for a in AXES},
                    {a.name: max(1, dcn.get(a.name, 1)) for a in AXES})


def plan(config: Config, check: Callable[[Config], None] | None = None,
         only: tuple[str, int] | None = None) -> Plan:
    """Every candidate estimated and ranked (module doc). `check(candidate_config)` raises ConfigError for an
    invalid candidate (maxctx.validate passes its device checks); without it, the strategy's own rules and the
    in-slice all-to-all rule are applied. `only`: (strategy, U), the config's own strategy (remat_policy=auto
    with a strategy given). Under remat_policy=auto each strategy is costed at every placement of
    maxctx.plan.remat and the table keeps its PLACEMENTS_SHOWN best."""
    base = mesh_plan(config)
    cp, tp = base.cp, base.sizes[TENSOR_AXIS]
    hw = hardware(config, topology.num_devices(config))
    host_budget = memory.host_budget_per_device(config)
    pairs = [only] if only else candidates(cp) if cp > 1 else [("all_gather", 1)]
    if not only:  # a strategy that moves MLA's latent has none to move in another model
        pairs = [(n, u) for n, u in pairs if strategies.get(n).moves == "kv" or _shape(config, cp, tp, u).latent_width]
    out = []
    for name, u in pairs:
        cand = config if only else candidate_config(config, name, u)
        try:
            if check is not None:
                check(remat.apply(cand, {}))
            elif cp > 1:
                strategies.get(name).check(cand, cp, tp)
                if base.ici[RING_AXIS] % u:
                    raise ConfigError(f"the A2A degree {u} does not divide ici_context_parallelism="
                                      f"{base.ici[RING_AXIS]}; all-to-all runs inside a slice")
            check_expert_mesh(cand, dataclasses.replace(base, a2a=u).sizes)  # E from this split's axes
        except ConfigError as e:
            out.append(Candidate(name, u, cp, dropped=str(e), valid=False))
            continue
        s = _shape(config, cp, tp, u)
        saved = strategies.get(name).activation_bytes(s) if cp > 1 else 0.0
        attn = saved + strategies.get(name).transient_bytes(s) if cp > 1 else 0.0
        mesh = dataclasses.replace(base, a2a=u)
        costed = [_cost(remat.apply(cand, where), Candidate(name, u, cp, saved, attn), mesh, hw, host_budget)
                  for where in remat.placements(cand)]
        out += _shown(costed) if remat.is_auto(config) else costed
    keys = " ".join(k for k, chosen in (("context_parallel_strategy=auto", only is None),
                                         ("remat_policy=auto", remat.is_auto(config))) if chosen)
    return Plan(hw, cp, tuple(_rank(out)), keys, documents.attention_counted(config, cp))


def _cost(config: Config, cand: Candidate, mesh: MeshPlan, hw: Hardware, host_budget: float) -> Candidate:
    """`cand` (strategy and attention memory) with `config`'s remat placement estimated on `mesh`: memory, host
    bytes, step."""
    sizes = mesh.sizes
    tp, shards = sizes[TENSOR_AXIS], mesh.num_devices // sizes[DATA_AXIS]  # weights shard over fsdp x context x tensor
    hbm = memory.device_bytes(config, tp, shards, cand.attention_bytes).total
    est = step_time.estimate(config, mesh, config.per_device_batch_size * mesh.num_devices, hw)
    held = memory.held_host_bytes(config, tp)
    budget = FIT_FRACTION * hw.hbm_bytes
    over = [f"needs ~{hbm / GIB:.1f} GiB, over {FIT_FRACTION:.0%} of {hw.hbm_bytes / GIB:.0f} GiB HBM"
            ] if hbm > budget else []
    if held > host_budget and held:
        over.append(f"holds ~{held / GIB:.1f} GiB of host memory per device, over {memory.HOST_FRACTION:.0%} of "
                    f"its {host_budget / memory.HOST_FRACTION / GIB:.1f} GiB" if host_budget else
                    "offloads to a host whose memory is not known (maxctx.plan.topology)")
    headroom = max(hbm / budget, held / host_budget if host_budget else 0.0)
    return dataclasses.replace(cand, memory_bytes=hbm, compute_s=est.compute_s,
                               exposed_s=est.exposed_collective_s + est.exposed_host_s, fits=not over,
                               dropped="; ".join(over), placement=_placement(config),
                               remat_groups=families.for_config(config).remat_groups,
                               host_bytes=held, forwards_per_layer=est.forwards_per_layer, headroom=headroom)


def _shown(costed: list[Candidate]) -> list[Candidate]:
    """Of one strategy's placements: its PLACEMENTS_SHOWN best, and of the faster ones a budget drops, the one
    nearest to fitting (what the budgets cost, and by how much it is over them)."""
    ranked = _rank(costed)
    if ranked[0].fits:
        ranked = [c for c in ranked if c.fits]
        faster = [c for c in costed if not c.fits and c.step_s < ranked[0].step_s * (1 - TIE)]
        if faster:
            return ranked[:PLACEMENTS_SHOWN - 1] + [min(faster, key=lambda c: (c.headroom, c.step_s))]
    return ranked[:PLACEMENTS_SHOWN]


def _strided(c: Candidate) -> bool:
    """Whether the candidate strides the layer input (every layer's forward runs once more): among tied candidates
    one without a stride wins, so a stride is chosen only where it is faster (module doc)."""
    return dict(c.placement).get("decoder_layer_input_stride", 1) > 1


def _rank(cands: list[Candidate]) -> list[Candidate]:
    """Fitting ones by step time (the least memory among the tied fastest first), then the ones over HBM by
    memory (when none fits, auto takes the least memory and the compile says whether it fits), then the invalid."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: c.step_s)
    invalid = sorted((c for c in cands if not c.valid), key=lambda c: c.label)
    too_big = sorted((c for c in cands if c.valid and not c.fits), key=lambda c: c.memory_bytes)
    if fitting:
        tied = [c for c in fitting if c.step_s <= fitting[0].step_s * (1 + TIE)]
        best = min(tied, key=lambda c: (_strided(c), c.headroom, c.memory_bytes, c.attention_bytes))
        fitting.remove(best)
        fitting.insert(0, best)
    return fitting + too_big + invalid


def resolve_auto(config: Config, check: Callable[[Config], None] | None = None) -> tuple[Config, Plan]:
    """The config with the planner's choice in place of `auto` (context_parallel_strategy, remat_policy or both),
    and the plan."""
    only = None
    if config.context_parallel_strategy != "auto":
        name = strategies.resolve(config.context_parallel_strategy)
        only = (name, strategies.get(name).a2a_degree(config, mesh_plan(config).cp))
    if remat.is_auto(config):
        remat.check_auto(config)
    p = plan(config, check, only=only)
    best = p.choice
    if not best.valid:
        raise ConfigError(f"{'remat_policy' if only else 'context_parallel_strategy'}=auto: no "
                          f"{'placement' if only else 'strategy'} is valid for this config\n"
                          + "\n".join(format_plan(p)))
    chosen = config if only else candidate_config(config, best.strategy, best.a2a)
    return remat.apply(chosen, dict(best.placement)), p


def format_plan(p: Plan) -> list[str]:
    """The ranked table, one line per candidate, the choice first: per device, the attention's memory, HBM, host
    memory held by offloaded tensors, the predicted step and its exposed communication, attention forwards per
    layer, and the remat placement with what the backward recomputes."""
    none = "" if p.choice.fits else "; none fits by the estimate, so the least memory is chosen"
    lines = [f"{p.keys} over C={p.cp} on {p.hardware.name} (estimates, not measurements{none}; per device; "
             f"attention counted: {p.attention}):",
             f"  {'':2}{'strategy':<12} {'attention':>10} {'HBM':>10} {'host':>10} {'step':>12} {'exposed comm':>13}"
             f" {'fwd/layer':>9}  placement (not listed: remat) -> recomputed"]
    for i, c in enumerate(p.ranked):
        mark = "->" if i == 0 else ""
        if not c.valid:
            lines.append(f"  {mark:2}{c.label:<12} dropped: {c.dropped}")
            continue
        note = f"  dropped: {c.dropped}" if c.dropped else ""
        lines.append(f"  {mark:2}{c.label:<12} {c.attention_bytes / GIB:>6.2f} GiB {c.memory_bytes / GIB:>6.1f} GiB "
                     f"{c.host_bytes / GIB:>6.1f} GiB {_seconds(c.step_s):>12} {_seconds(c.exposed_s):>13} "
                     f"{c.forwards_per_layer:>9g}  {c.placed} -> {c.recomputed}{note}")
    return [*lines, why_chosen(p)]


def why_chosen(p: Plan) -> str:
    """One line saying which rule of `_rank` put the marked row first (docs/choosing_a_strategy.md)."""
    best, budget = p.choice, FIT_FRACTION * p.hardware.hbm_bytes
    if not best.valid:
        return "  -> marked: no candidate is valid for this config (each row says why)"
    if not best.fits:
        return (f"  -> marked: none fits in {budget / GIB:.1f} GiB ({FIT_FRACTION:.0%} of HBM) by the estimate, so "
                f"the one needing the least memory; compile it (python -m maxctx.compile) to see whether it fits")
    fastest = min((c for c in p.ranked if c.fits), key=lambda c: c.step_s)
    why = f"  -> marked: {best.label}, {_seconds(best.step_s)}, "
    if fastest is best:
        why += f"the fastest that fits in {budget / GIB:.1f} GiB ({FIT_FRACTION:.0%} of HBM) and its host budget"
    else:
        rule = ("no layer-input stride (one forward less per layer)" if _strided(fastest) and not _strided(best)
                else "the most memory headroom")
        why += (f"within {TIE:.0%} of the fastest that fits ({fastest.label}, {_seconds(fastest.step_s)}), which "
                f"count as tied; among tied rows {rule} decides")
    over = [c for c in p.ranked if c.valid and not c.fits and c.step_s < best.step_s * (1 - TIE)]
    return why + (f"; {len(over)} faster row(s) need more memory than the budgets" if over else "")


def _seconds(x: float) -> str:
    return f"{x:.4g} s" if x >= 1 else f"{x * 1e3:.4g} ms"
