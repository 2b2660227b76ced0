"""`remat_policy=auto`: where each named tensor of `remat_policy=custom` goes (`remat`, `device` or `offload`),
chosen by the planner (maxctx.plan.planner) to minimise the step-time model's predicted step within two budgets:

    HBM   the planner's memory estimate per device (maxctx.plan.memory: kept tensors at KEPT_ON_DEVICE x their bytes)
          within FIT_FRACTION of the device's HBM
    host  what the offloaded tensors hold in pinned host memory per device while the step runs (every layer's,
          L t x their bytes per token) within memory.HOST_FRACTION of the host DRAM per device: the topology's VM
          memory per chip (maxctx.plan.topology.Chip.host_bytes, from Google's machine-type pages) / devices per
          chip; host DRAM per process is that x the chips it drives. A topology without a sourced figure (v4,
          local devices) offloads nothing.

The placements searched: the layer input on the device or offloaded (a scanned layer's input is the scan's
residual, so `remat` would keep it on the device all the same); the query, key and value projections together;
`context`, `out_proj`, `mlpwi`, `mlpwo` each: 2 x 3^5 = 486 per strategy, and with the layer input offloaded,
each again with `decoder_layer_input_stride=2` (only every other layer's input on the host, every layer's forward
once more in the backward; where the layers split into runs of 2) - 729 in all, each estimated by
maxctx.plan.step_time (about 50 us each). Among the fitting placements within planner.TIE of the fastest (the
model cannot tell them apart), one without the stride, and of those the one with the most headroom in the tighter
budget, wins: the larger of HBM used /
HBM budget and host used / host budget is the smallest.
"""

from __future__ import annotations

import dataclasses
import itertools

from maxctx.config import REMAT_NAMES, Config, ConfigError, layer_windows
from maxctx.model import families
from maxctx.plan import memory, step_time

PLACES = ("remat", "device", "offload")


def is_auto(config: Config) -> bool:
    return config.remat_policy == "auto"


def check_auto(config: Config) -> None:
    """remat_policy=auto chooses every per-tensor key itself: one given by hand is refused."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    given = [f"{name}={getattr(config, name)}" for name in REMAT_NAMES if getattr(config, name) != defaults[name]]
    if given:
        raise ConfigError(f"remat_policy=auto chooses each tensor's placement itself, but {', '.join(given)} "
                          f"is given; drop it, or use remat_policy=custom to place the tensors by hand")


def placements(config: Config) -> list[dict[str, str]]:
    """The placements to search: every one of the module doc's under remat_policy=auto (none offloading when the
    host budget is unknown), else the config's own."""
    if not is_auto(config):
        return [step_time.placement(config)]
    offload = memory.host_budget_per_device(config) > 0
    groups = [names for _, names in families.for_config(config).remat_groups]
    choices = [("device", "offload") if group[0] == "decoder_layer_input" else PLACES for group in groups]
    out = []
    for combo in itertools.product(*choices):
        if not offload and "offload" in combo:
            continue
        out.append({name: where for group, where in zip(groups, combo) for name in group})
        if combo[0] == "offload" and _can_stride(config):  # the input of every other layer only
            out.append({**out[-1], "decoder_layer_input_stride": 2})
    return out


def _can_stride(config: Config) -> bool:
    """Whether decoder_layer_input_stride=2 is a candidate: the config sets no stride or host layers of its own,
    and its scanned layers split into runs of 2 periods (maxctx.validate)."""
    period = len(layer_windows(config))
    return (config.scan_layers and config.decoder_layer_input_stride == 1
            and config.decoder_layer_input_host_layers < 0 and families.shape(config).num_layers % (2 * period) == 0)


def apply(config: Config, where: dict[str, str]) -> Config:
    """The config running placement `where`: remat_policy=custom with each tensor's key set (unchanged when the
    config's policy is not auto)."""
    if not is_auto(config):
        return config
    return dataclasses.replace(config, remat_policy="custom", **where)


def describe(where: dict[str, str], forwards_per_layer: float,
             groups: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[str, str]:
    """(the placement in short, what the backward recomputes) for the planner's table; `groups`: the family's
    (label, names) placed together."""
    placed = {label: where[names[0]] for label, names in groups}
    short = " ".join(f"{label}={w}" for label, w in placed.items() if w != "remat")
    if where.get("decoder_layer_input_stride", 1) > 1:
        short += f" stride={where['decoder_layer_input_stride']}"
    redone = [label for (label, names), w in zip(groups, placed.values())
              if w == "remat" and names[0] != "decoder_layer_input"]
    if forwards_per_layer > 1:
        redone.insert(0, "attention")
    return short or "all remat", ", ".join(redone) or "nothing"
