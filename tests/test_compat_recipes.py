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
    # training/ironwood/Llama3.1-8B-LongContext-Maxtext's 16M row as docs/long_context.md compiles it: without
    # ring_scan_unroll=16 dq_reduction_steps=3 (refused below) and with maxctx's splash for tokamax's.
    "llama3.1-8b_16m_ironwood": "model_name=llama3.1-8b steps=8 enable_checkpointing=false override_model_config=true "
                                "head_dim=256 base_num_query_heads=16 base_num_kv_heads=4 num_vocab_tiling=16 "
                                "per_device_batch_size=0.0078125 max_target_length=16777216 dataset_type=synthetic "
                                "packing=false attention=flash use_tokamax_splash=false use_jax_splash=false "
                                "context_parallel_strategy=ring context_parallel_load_balance=true "
                                "ici_context_parallelism=128 ici_fsdp_parallelism=1 ici_tensor_parallelism=1 "
                                "remat_policy=custom context=offload decoder_layer_input=offload "
                                "optimizer_memory_host_offload=true parameter_memory_host_offload=true "
                                "sa_block_q=2048 sa_block_kv=2048 sa_block_q_dkv=2048 sa_block_kv_dkv=2048 "
                                "tpu_scoped_vmem_limit_kib=98304 compile_topology=tpu7x-128",
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
    ("ring_scan_unroll=16", "not unrolled"),  # the long-context recipes' (docs/long_context.md)
    ("dq_reduction_steps=3", "reduced in one step"),
])
def test_recipe_values_maxctx_lacks_are_refused_in_one_line(override, why):
    with pytest.raises(ConfigError) as error:
        load_config([BASE, override])
    message = str(error.value)
    key, value = override.split("=")
    assert message.startswith(f"MaxText's {key}=") and value.lower() in message.lower(), message
    assert "is not supported by maxctx: " in message and why in message, message
    assert "\n" not in message
