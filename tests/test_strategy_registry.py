"""A strategy registered from outside maxctx is planned, validated and compiled like the built-in ones, with no
other file changed: the README's "a new CP strategy is one module plus one registry line", proven by a toy
registered inside this test (and removed after it).

The toy is p2p under another name with one rule of its own: it refuses context_parallel_load_balance=false.
"""

from __future__ import annotations

import dataclasses

import pytest

from maxctx.attention.cp import strategies
from maxctx.attention.cp.p2p import P2P
from maxctx.config import Config, ConfigError
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.parallelism import RING_AXIS
from maxctx.plan import planner, step_time
from maxctx.train_step import compile_train_step, make_setup

NAME = "toy_ring"
ATTENDED: list[str] = []  # the toy's attend was traced into the compiled step

SMALL = ["configs/base.yml", "cpu_devices=8", "ici_context_parallelism=8", "dtype=float32", "attention=flash",
         "flash_block_q=16", "flash_block_kv=16", "max_target_length=256", "per_device_batch_size=0.125",
         "base_num_query_heads=8", "base_num_kv_heads=2"]


@dataclasses.dataclass(frozen=True)
class BalancedRing(P2P):
    name: str = NAME
    aliases: tuple[str, ...] = ("toy",)

    def check(self, config: Config, cp: int, tensor: int) -> None:
        if not config.context_parallel_load_balance:
            raise ConfigError(f"context_parallel_strategy={self.name} needs context_parallel_load_balance=true")

    def attend(self, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
        ATTENDED.append(self.name)
        return super().attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H)


@pytest.fixture
def toy():
    strategy = strategies.register(BalancedRing())
    yield strategy
    strategies.unregister(NAME)
    assert NAME not in strategies.STRATEGIES and "toy" not in strategies.ALIASES


def test_planned(toy):
    assert (NAME, 1) in planner.candidates(8)
    plan = planner.plan(load_config(SMALL + ["context_parallel_strategy=auto"]))
    by = {c.label: c for c in plan.ranked}
    assert by[NAME].valid and by[NAME].saved_bytes == by["p2p"].saved_bytes > 0
    assert any(NAME in line for line in planner.format_plan(plan))
    dropped = planner.plan(load_config(SMALL + ["context_parallel_strategy=auto",
                                                "context_parallel_load_balance=false"]))
    assert "needs context_parallel_load_balance=true" in {c.label: c for c in dropped.ranked}[NAME].dropped


def test_priced_as_the_ring_it_is(toy):
    # The time model asks the strategy (Strategy.ring, output_copies), never its name: under a policy that keeps
    # `context` the toy's ring output is kept for the backward, as p2p's is, and its estimate is p2p's.
    keep = SMALL + ["remat_policy=minimal_with_context"]
    for name in (NAME, "p2p"):
        config = load_config(keep + [f"context_parallel_strategy={name}"])
        assert step_time._keeps_attention(config, {RING_AXIS: 8}, step_time.placement(config)), name
        assert step_time.per_token(config, 1)["bytes"]["context"] == step_time.per_token(
            load_config(keep + ["context_parallel_strategy=p2p"]), 1)["bytes"]["context"]


def test_validated(toy):
    assert load_config(SMALL + [f"context_parallel_strategy={NAME}"]).context_parallel_strategy == NAME
    assert load_config(SMALL + ["context_parallel_strategy=toy"]).context_parallel_strategy == NAME  # its alias
    with pytest.raises(ConfigError, match=f"context_parallel_strategy={NAME} needs context_parallel_load_balance"):
        load_config(SMALL + [f"context_parallel_strategy={NAME}", "context_parallel_load_balance=false"])


def test_compiled(toy):
    ATTENDED.clear()
    config = load_config(SMALL + [f"context_parallel_strategy={NAME}"])
    compiled = compile_train_step(make_setup(config, create_mesh(config)))
    assert ATTENDED and set(ATTENDED) == {NAME}
    assert "collective-permute" in compiled.as_text()  # the ring's hops


def test_unknown_after_removal():
    with pytest.raises(ConfigError, match="is not one of"):
        load_config(SMALL + [f"context_parallel_strategy={NAME}"])
