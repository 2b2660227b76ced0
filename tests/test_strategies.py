"""The strategy registry: every registered strategy is a whole unit (maxctx.attention.cp.base.Strategy), names
resolve with MaxText's aliases, and the memory formulas scale as each docstring says."""

from __future__ import annotations

import pytest

from maxctx.attention.cp import strategies
from maxctx.attention.cp.base import Strategy
from maxctx.attention.cp.cost import KINDS, AttentionShape
from maxctx.config import ConfigError

# What a strategy must define itself: the base class has no default for these.
OWN = ("global_comm_volume", "activation_bytes", "transient_bytes", "attend")


@pytest.mark.parametrize("name", sorted(strategies.STRATEGIES))
def test_every_strategy_is_a_whole_unit(name):
    strategy = strategies.STRATEGIES[name]
    assert isinstance(strategy, Strategy) and strategy.name == name
    missing = [m for m in OWN if getattr(type(strategy), m) is getattr(Strategy, m)]
    assert not missing, f"{type(strategy).__name__} lacks {missing}"
    a2a = strategy.planner_degrees(8)[0]
    s = AttentionShape(batch=2, seq=1024, heads=8, kv_heads=2, head_dim=16, itemsize=2, cp=8, a2a=a2a)
    fwd, bwd = strategy.comm_volume(s)
    assert {c.kind for c in fwd + bwd} <= set(KINDS)
    assert all(c.bytes > 0 and c.sent_bytes <= c.bytes for c in fwd + bwd)
    assert strategy.activation_bytes(s) > 0 and strategy.transient_bytes(s) > 0


def test_registry_refuses_a_taken_name():
    with pytest.raises(ValueError, match="ring already registered"):
        strategies.register(Strategy("ring2", aliases=("ring",)))
    assert "ring2" not in strategies.STRATEGIES


def test_names_and_aliases():
    assert strategies.resolve("ring") == "p2p" and strategies.resolve("ulysses") == "a2a"
    assert strategies.resolve("usp") == "usp"
    with pytest.raises(ConfigError, match="did you mean 'p2p'"):
        strategies.resolve("p2q")


def shape(cp: int, a2a: int = 1, seq: int = 65536) -> AttentionShape:
    return AttentionShape(batch=1, seq=seq, heads=32, kv_heads=8, head_dim=128, itemsize=2, cp=cp, a2a=a2a)


def test_activation_memory_scales_as_documented():
    ag, p2p, a2a, usp = (strategies.STRATEGIES[n].activation_bytes for n in ("all_gather", "p2p", "a2a", "usp"))
    # O(S/C): doubling C at fixed S halves the ring's and the all-to-all's saved bytes ...
    assert p2p(shape(16)) == pytest.approx(p2p(shape(8)) / 2)
    assert a2a(shape(8, 8)) == pytest.approx(a2a(shape(4, 4)) / 2)  # K = 8: no kv repetition at U <= 8
    assert usp(shape(16, 4)) == pytest.approx(usp(shape(8, 2)) / 2)
    # ... while all_gather keeps the gathered K and V, 2 S K D b bytes at any C: only the rest halves.
    gathered_kv = 2 * 65536 * 8 * 128 * 2
    assert ag(shape(16)) - ag(shape(8)) / 2 == pytest.approx(gathered_kv / 2)
    # With as many kv heads as query heads, every O(S/C) strategy saves the same q, k, v, out and lse bytes.
    mha = dict(batch=1, seq=65536, heads=32, kv_heads=32, head_dim=128, itemsize=2, cp=16)
    assert p2p(AttentionShape(**mha)) == pytest.approx(a2a(AttentionShape(**mha, a2a=16)))
    assert p2p(AttentionShape(**mha)) == pytest.approx(usp(AttentionShape(**mha, a2a=4)))


def test_usp_degenerates_to_its_parts():
    # usp with U = C is a2a's traffic plus one fp32 gradient pass of the ring of one; with U = 1 it is p2p's.
    s = shape(8, 1)
    p2p_fwd, p2p_bwd = strategies.get("p2p").comm_volume(s)
    usp_fwd, usp_bwd = strategies.get("usp").comm_volume(s)
    permute = lambda cs: sum(c.bytes for c in cs if c.kind == "collective-permute")  # noqa: E731
    assert permute(usp_fwd) == permute(p2p_fwd) and permute(usp_bwd) == permute(p2p_bwd)
