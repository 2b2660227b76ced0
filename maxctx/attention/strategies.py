"""The registry of context-parallel strategies: the one list of them (what a strategy module provides:
maxctx.attention.strategy). A new strategy is a new module plus one entry in STRATEGIES."""

from __future__ import annotations

from types import ModuleType

from maxctx.attention import a2a, all_gather, p2p, usp
from maxctx.config import Config
from maxctx.errors import ConfigError, did_you_mean

STRATEGIES: dict[str, ModuleType] = {m.NAME: m for m in (all_gather, a2a, p2p, usp)}
ALIASES: dict[str, str] = {alias: m.NAME for m in STRATEGIES.values() for alias in m.ALIASES}


def resolve(name: str) -> str:
    """The strategy's name, with MaxText's aliases resolved (ring -> p2p, ulysses -> a2a)."""
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        known = [*STRATEGIES, *ALIASES, "auto"]  # auto: resolved by maxctx.plan.planner at load
        raise ConfigError(f"context_parallel_strategy='{name}' is not one of {', '.join(known)}; "
                          f"{did_you_mean(name, known)}")
    return name


def get(name: str) -> ModuleType:
    return STRATEGIES[resolve(name)]


def for_config(config: Config) -> ModuleType:
    return get(config.context_parallel_strategy)


def a2a_degree(config: Config, cp: int) -> int:
    """The all-to-all part U of the CP degree C under the configured strategy (1 for all_gather and p2p)."""
    return for_config(config).a2a_degree(config, cp)
