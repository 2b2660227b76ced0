"""The registry of context-parallel strategies, keyed by the config value: the one list of them (what a strategy
is: maxctx.attention.cp.base.Strategy). A new strategy is one module defining a Strategy plus one `register` line below;
the planner, the roofline, validation and the dispatch read the registry and need no change."""

from __future__ import annotations

import contextlib
import dataclasses

from maxctx import parallelism
from maxctx.attention.cp import a2a, all_gather, latent, latent_ring, p2p, usp
from maxctx.attention.cp.base import Strategy
from maxctx.config import Config
from maxctx.errors import ConfigError, did_you_mean
from maxctx.parallelism import MeshPlan, context_degree

STRATEGIES: dict[str, Strategy] = {}
ALIASES: dict[str, str] = {}


def register(strategy: Strategy) -> Strategy:
    """Adds `strategy` under its name and aliases; a name or alias already taken is refused."""
    taken = [n for n in (strategy.name, *strategy.aliases) if n in STRATEGIES or n in ALIASES or n == "auto"]
    if taken:
        raise ValueError(f"strategy {strategy.name}: {', '.join(taken)} already registered")
    STRATEGIES[strategy.name] = strategy
    ALIASES.update({alias: strategy.name for alias in strategy.aliases})
    return strategy


def unregister(name: str) -> None:
    """Removes a registered strategy and its aliases (a test's own strategy, when it is done)."""
    strategy = STRATEGIES.pop(name)
    for alias in strategy.aliases:
        del ALIASES[alias]


@contextlib.contextmanager
def replaced(**fields):
    """Every registered ring strategy (p2p, usp) replaced by its variant with `fields` while the block runs: how
    a benchmark or test prices another program's rings, e.g. MaxText's, whose backward sends overlap
    (`overlapped_backward=True`)."""
    saved = dict(STRATEGIES)
    try:
        STRATEGIES.update({n: dataclasses.replace(s, **fields) for n, s in saved.items() if s.ring})
        yield
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(saved)


def resolve(name: str) -> str:
    """The strategy's name, with MaxText's aliases resolved (ring -> p2p, ulysses -> a2a)."""
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        known = [*STRATEGIES, *ALIASES, "auto"]  # auto: resolved by maxctx.plan.planner at load
        raise ConfigError(f"context_parallel_strategy='{name}' is not one of {', '.join(known)}; "
                          f"{did_you_mean(name, known)}")
    return name


def get(name: str) -> Strategy:
    return STRATEGIES[resolve(name)]


def for_config(config: Config) -> Strategy:
    return get(config.context_parallel_strategy)


def a2a_degree(config: Config, cp: int) -> int:
    """The all-to-all part U of the CP degree C under the configured strategy (1 for all_gather and p2p)."""
    return for_config(config).a2a_degree(config, cp)


def mesh_plan(config: Config, num_devices: int) -> MeshPlan:
    """The mesh the configured strategy runs on over `num_devices`: context split by its A2A degree U (1 without
    context parallelism)."""
    cp = context_degree(config, num_devices)
    return parallelism.mesh_plan(config, num_devices, a2a_degree(config, cp) if cp > 1 else 1)


register(all_gather.STRATEGY)
register(a2a.STRATEGY)
register(p2p.STRATEGY)
register(usp.STRATEGY)
register(latent.STRATEGY)
register(latent_ring.STRATEGY)
