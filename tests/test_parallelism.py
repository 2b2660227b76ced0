"""The mesh as a value (maxctx.parallelism, no JAX): the table of axes, the logical rules, MeshPlan and the expert
rule."""

import pytest

from maxctx.attention.cp import strategies
from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.parallelism import AXES, EXPERT_AXES, LOGICAL_RULES, MESH_AXES, mesh_plan


def _config(*overrides):
    return load_config(["configs/base.yml", *overrides])


def test_the_table_names_every_mesh_axis_once_and_what_it_serves():
    assert tuple(m for axis in AXES for m in axis.mesh_axes) == MESH_AXES
    assert len(set(MESH_AXES)) == len(MESH_AXES)
    assert {axis.name: axis.keys for axis in AXES}["context"] == ("ici_context_parallelism",
                                                                  "dcn_context_parallelism")
    by = {axis.name: axis.serves for axis in AXES}
    assert "length" in by["context"] and "heads" in by["tensor"] and "batch" in by["data"]
    assert all(axis in MESH_AXES for axes in LOGICAL_RULES.values() for axis in axes)


def test_a_plan_is_built_once_from_the_config_and_the_strategy():
    usp = _config("ici_context_parallelism=8", "context_parallel_strategy=usp", "base_num_query_heads=8",
                  "base_num_kv_heads=2", "per_device_batch_size=1")
    plan = strategies.mesh_plan(usp, 8)
    assert plan.sizes == {"data": 1, "fsdp": 1, "context": 4, "context_a2a": 2, "tensor": 1}
    assert (plan.cp, plan.ring, plan.a2a, plan.batch_shards, plan.num_devices) == (8, 4, 2, 1, 8)
    assert plan.ici_shape == (1, 1, 4, 2, 1) and plan.dcn_shape == (1, 1, 1, 1, 1)
    fsdp = strategies.mesh_plan(_config("ici_data_parallelism=2"), 8)
    assert fsdp.sizes["fsdp"] == 4 and fsdp.batch_shards == 8 and fsdp.cp == 1
    with pytest.raises(ConfigError, match="does not divide ici_context_parallelism=8"):
        mesh_plan(usp, 8, 3)


def test_experts_borrow_fsdp_and_context():
    # Experts have no axis of their own: an `expert` dimension shards over fsdp and both context parts
    # (tests/test_expert_parallel.py: the degrees expert parallelism takes from them).
    assert LOGICAL_RULES["expert"] == EXPERT_AXES == ("fsdp", "context", "context_a2a")
