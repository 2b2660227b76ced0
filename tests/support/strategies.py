"""The registered CP strategies as test cases: tests loop over the registry (maxctx.attention.cp.strategies), so a
strategy registered there is tested like the others without a list to edit. A strategy that moves MLA's latent
(Strategy.moves) runs MLA layers only: `names` and `splits` list the ones that take any attention layer's K and V,
`latent_names` the others (tests/test_family_matrix.py runs them on the MLA fixtures)."""

from __future__ import annotations

from maxctx.attention.cp import strategies
from maxctx.config import Config


def names() -> list[str]:
    return [name for name, s in strategies.STRATEGIES.items() if s.moves == "kv"]


def latent_names() -> list[str]:
    return [name for name, s in strategies.STRATEGIES.items() if s.moves == "latent"]


def splits(cps: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(strategy, ring R, all-to-all U) for every strategy at every C in `cps` and every A2A degree U its planner
    tries there (R = C / U)."""
    return [(name, cp // u, u) for name, s in strategies.STRATEGIES.items() if s.moves == "kv" for cp in cps
            for u in s.planner_degrees(cp)]


def config_args(name: str, cp: int) -> list[str]:
    """The keys that run `name` at its planner's first split of C = cp: the strategy, and the A2A degree where the
    strategy reads it from the config (usp)."""
    s = strategies.get(name)
    a2a = s.candidate_config(Config(), s.planner_degrees(cp)[0]).context_parallel_a2a_degree
    return [f"context_parallel_strategy={name}"] + ([f"context_parallel_a2a_degree={a2a}"] if a2a else [])
