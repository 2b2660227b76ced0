"""Every user error, whether the config loader finds it or the run's set-up does (the data pipeline), reaches the
user as one line and exit status 2, not as a traceback, and nothing is written to the run directory.

Each case goes through `maxctx.train.main` in this process (8 simulated CPU devices from conftest)."""

import pytest

from maxctx.train import EXIT_CONFIG, main
from tests.support import fixtures as F
from tests.support.processes import BASE_YML

TINY = ["steps=1", "per_device_batch_size=1", "base_num_decoder_layers=1",
        "enable_checkpointing=false", "enable_tensorboard=false"]

CASES = [  # overrides ({empty}: an ArrayRecord file of no records), the line's prefix, text the line holds
    pytest.param(["vocab_size=4"], "config error: ", "vocab_size=4 is too small for dataset_type=synthetic",
                 id="synthetic_vocab_too_small"),
    pytest.param(["packing=first_fits"], "config error: ", "packing='first_fits'", id="packing_unknown"),
    pytest.param(["max_target_length=2"], "config error: ", "max_target_length=2 is too short for dataset_type="
                 "synthetic", id="synthetic_length_too_short"),
    pytest.param(["dataset_type=arrayrecord", "grain_train_files={empty}"], "data error: ", "hold no records",
                 id="dataset_without_records"),
    # All-to-all stays inside a slice: an explicit A2A degree larger than the slice's context part (was a
    # ValueError from maxctx.mesh, after JAX started; now a config check, from the topology's device count).
    pytest.param(["compile_topology=v5p-16", "compile_topology_num_slices=2", "ici_fsdp_parallelism=2",
                  "ici_context_parallelism=4", "dcn_context_parallelism=2", "dcn_data_parallelism=1",
                  "base_num_query_heads=8",
                  "base_num_kv_heads=2", "context_parallel_strategy=usp", "context_parallel_a2a_degree=8"],
                 "config error: ", "does not divide ici_context_parallelism=4", id="usp_a2a_degree_across_slices"),
    pytest.param(["compile_topology=v5p-9"], "config error: ", "v5p-9", id="unknown_topology"),
    pytest.param(["hardware=tpu"], "config error: ", "hardware=tpu, but JAX found cpu devices", id="hardware"),
    # Both were tracebacks from open() / os.makedirs() after the compile ({tmp}: the test's folder, {empty} a file).
    pytest.param(["metrics_file={tmp}"], "config error: ", "is a directory", id="metrics_file_folder"),
    pytest.param(["metrics_file={empty}/metrics.txt"], "config error: ", "is a file, not a directory",
                 id="metrics_file_under_a_file"),
]


@pytest.mark.parametrize("overrides,prefix,expected", CASES)
def test_error_exits_2_with_one_line(tmp_path, capsys, overrides, prefix, expected):
    empty = F.write_arrayrecord(str(tmp_path / "empty.array_record"), [])
    out = tmp_path / "out"
    status = main([str(BASE_YML), *TINY, f"base_output_directory={out}",
                   *(o.format(empty=empty, tmp=tmp_path) for o in overrides)])
    err = capsys.readouterr().err.strip()
    assert status == EXIT_CONFIG, err
    assert len(err.splitlines()) == 1 and err.startswith(prefix) and expected in err, err
    assert not out.exists()


def test_attention_dispatch_errors_are_config_errors():
    # Unreachable through a validated config, but a caller building AttentionSpec by hand gets the same one line.
    import jax.numpy as jnp

    from maxctx.attention.dispatch import AttentionSpec, attend, resolve_kernel
    from maxctx.config import ConfigError
    from tests.support.meshes import make_mesh

    with pytest.raises(ConfigError, match="attention='magic' is not one of auto, flash, dot_product, blockwise"):
        resolve_kernel("magic")
    x = jnp.zeros((1, 16, 4, 8))
    ids = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(ConfigError, match="use context_parallel_strategy=usp"):
        attend(x, x, x, ids, ids, AttentionSpec(kernel="flash", strategy="a2a"), make_mesh(2, 2))
