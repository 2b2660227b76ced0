"""The local checkpoint tier in one process (8 simulated devices, tiny arrays, no training): a saved step comes
back into the same shardings; a damaged copy is set aside; a copy saved under another mesh or process count is not
used, and one line says why."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.checkpoint.local_tier import LocalTier, check_keys
from maxctx.config import ConfigError
from maxctx.loader import load_config


def tier(tmp_path, lines, fsdp):
    config = load_config(["enable_emergency_checkpoint=true", f"local_checkpoint_directory={tmp_path}",
                          "local_checkpoint_period=1", "run_name=r"])
    mesh = jax.make_mesh((fsdp, 8 // fsdp), ("fsdp", "tensor"))
    return LocalTier(config, mesh, lines.append), mesh


def state_on(mesh):
    sharding = NamedSharding(mesh, P("fsdp"))
    return {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding),
            "step": jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))}


def abstract(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def test_a_step_comes_back_and_a_damaged_or_foreign_copy_is_not_used(tmp_path, capsys):
    lines = []
    local, mesh = tier(tmp_path, lines, fsdp=4)
    state = state_on(mesh)
    for step in (2, 3):
        local.save(step, state, {"seed": 0}, {"position": "global", "rows": step})
    assert local.newest_common(1) == 3 and local.newest_common(3) is None and not lines
    restored, record = local.restore(3, abstract(state))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert restored["w"].sharding == state["w"].sharding and record["data"]["rows"] == 3
    other, _ = tier(tmp_path, lines, fsdp=2)  # the same process, another mesh
    assert other.newest_common(1) is None
    assert lines[-1].startswith("the local checkpoint tier cannot serve step 3: it was saved by 1 processes on mesh "
                                "{'fsdp': 4, 'tensor': 2}"), lines
    with open(local.directory / "3" / "shards.npz", "r+b") as f:  # flipped bytes in the middle
        f.seek(f.seek(0, 2) // 2)
        f.write(bytes(range(16)))
    assert local.newest_common(1) == 2
    assert "local checkpoint step 3 of process 0 is unusable" in capsys.readouterr().out
    assert sorted(p.name for p in local.directory.iterdir()) == ["2", "3.corrupt"]


def test_the_tier_needs_its_directory_and_period():
    with pytest.raises(ConfigError, match="needs local_checkpoint_directory"):
        check_keys(load_config(["enable_emergency_checkpoint=true", "local_checkpoint_period=5"]))
    with pytest.raises(ConfigError, match="local_checkpoint_period=0 must be > 0"):
        check_keys(load_config(["enable_emergency_checkpoint=true", "local_checkpoint_directory=/tmp/x"]))
