"""Keys of MaxText's recipes (tpu-recipes and MaxText's benchmarks/): accepted with MaxText's meaning, or refused
with "MaxText's X is not supported by maxctx: ..."; command lines from the recipes load."""

import os

import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")

# Recipe command lines (tpu-recipes' training/*/xpk/run_recipe.sh), shapes cut down to load on any machine.
RECIPES = {
    "llama3.1-70b_128k_storage": "model_name=llama3.1-70b dtype=bfloat16 per_device_batch_size=0.125 "
                                 "async_checkpointing=False enable_checkpointing=False use_iota_embed=True "
                                 "ici_fsdp_parallelism=-1 ici_context_parallelism=8 dataset_type=synthetic "
                                 "sa_block_q=2048 sa_block_kv=2048 sa_q_layout=SEQ_MINOR sa_k_layout=HEAD_DIM_MINOR "
                                 "sa_v_layout=SEQ_MINOR max_target_length=131072 attention=flash steps=30 "
                                 "checkpoint_storage_use_zarr3=False checkpoint_storage_use_ocdbt=True "
                                 "use_vertex_tensorboard=False enable_checkpoint_cloud_logger=False "
                                 "profile_periodically_period=-1 compile_topology=v5p-64",
    "dense_with_moe_defaults": "model_name=llama3-8b dataset_type=synthetic sparse_matmul=True megablox=True "
                               "use_custom_sort_vjp=True mu_dtype=float32 allow_split_physical_axes=False "
                               "use_vertex_tensorboard=false vertex_tensorboard_project= use_qwix_quantization=false "
                               "cpu_devices=8",
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_command_lines_load(name):
    load_config([BASE, *RECIPES[name].split()])


@pytest.mark.parametrize("override,why", [
    ("use_vertex_tensorboard=true", "tb-gcp-uploader"),
    ("allow_split_physical_axes=true", "whole physical axes"),
    ("use_max_logit_estimate=30", "max-logit estimate is not implemented"),
    ("mu_dtype=bfloat16", "first moment is kept in float32"),
    ("sa_q_layout=SEQ_MAJOR", "HEAD_DIM_MINOR or SEQ_MINOR"),
    ("profile_periodically_period=100", "one profile per run"),
    ("use_qwix_quantization=true", "without quantization"),
])
def test_recipe_values_maxctx_lacks_are_refused_in_one_line(override, why):
    with pytest.raises(ConfigError) as error:
        load_config([BASE, override])
    message = str(error.value)
    key, value = override.split("=")
    assert message.startswith(f"MaxText's {key}=") and value.lower() in message.lower(), message
    assert "is not supported by maxctx: " in message and why in message, message
    assert "\n" not in message
