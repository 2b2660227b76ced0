"""Mesh construction from ici_*/dcn_* sizes and the logical-axis rule table."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.mesh import axis_sizes, batch_sharding, create_mesh, logical_to_spec


def _config(*overrides):
    return load_config(["configs/base.yml", *overrides])


def test_default_fsdp_fills_all_devices():
    mesh = create_mesh(_config())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "context": 1, "context_a2a": 1, "tensor": 1}


def test_explicit_axes():
    mesh = create_mesh(_config("ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_context_parallelism=2",
                               "ici_tensor_parallelism=2"))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "context": 2, "context_a2a": 1, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_context_split_for_usp_and_a2a():
    usp = _config("ici_context_parallelism=8", "context_parallel_strategy=usp", "base_num_query_heads=8",
                  "base_num_kv_heads=2", "per_device_batch_size=1")
    assert axis_sizes(usp, 8) == {"data": 1, "fsdp": 1, "context": 4, "context_a2a": 2, "tensor": 1}
    a2a = _config("ici_context_parallelism=4", "context_parallel_strategy=a2a")
    assert axis_sizes(a2a, 8)["context_a2a"] == 4 and axis_sizes(a2a, 8)["context"] == 1
    explicit = _config("ici_context_parallelism=8", "context_parallel_strategy=usp", "base_num_query_heads=8",
                       "base_num_kv_heads=2", "context_parallel_a2a_degree=4")
    assert axis_sizes(explicit, 8)["context_a2a"] == 4


def test_mesh_product_checked_against_real_devices():
    with pytest.raises(ConfigError, match="there are 8 devices"):
        create_mesh(_config("ici_fsdp_parallelism=2"))


def test_logical_rules():
    assert logical_to_spec(("batch", "length", "activation_embed")) == P(("data", "fsdp"), ("context", "context_a2a"),
                                                                          None)
    assert logical_to_spec(("embed", "mlp")) == P(("fsdp", "context", "context_a2a"), "tensor")
    mesh = create_mesh(_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"))
    # A dimension the mesh axis does not divide is replicated over it instead of failing.
    assert logical_to_spec(("embed", "heads"), (8, 3), mesh) == P("fsdp", None)
    assert logical_to_spec(("embed", "heads"), (6, 4), mesh) == P(None, "tensor")


def test_batch_sharding_splits_rows_and_sequence():
    mesh = create_mesh(_config("ici_fsdp_parallelism=2", "ici_context_parallelism=4"))
    x = jax.device_put(jax.numpy.zeros((4, 16)), batch_sharding(mesh))
    assert x.addressable_shards[0].data.shape == (2, 4)
