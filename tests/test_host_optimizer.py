"""MaxText's host offload keys (optimizer_memory_host_offload, parameter_memory_host_offload; maxctx.train_step):
the state lives in pinned host memory between steps, and 10 training steps on CPU equal the device-resident run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.train_step import make_setup
from maxctx.validate import check_devices
from tests.test_tiling import train

SMALL = ["dtype=float32", "attention=flash", "flash_block_q=16", "flash_block_kv=16", "ici_context_parallelism=4",
         "max_target_length=64", "per_device_batch_size=0.5", "base_num_decoder_layers=2", "base_emb_dim=32",
         "base_mlp_dim=64", "vocab_size=128", "head_dim=8", "base_num_query_heads=4", "base_num_kv_heads=2",
         "context_parallel_strategy=p2p", "learning_rate=1e-2", "warmup_steps_fraction=0"]


def run(*overrides, steps: int = 10):
    cfg = load_config(["configs/base.yml", *SMALL, *overrides])
    return train(make_setup(cfg, create_mesh(cfg)), steps)


def memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if x.ndim > 0}


def test_ten_steps_with_the_state_on_the_host_equal_the_device_run():
    device_losses, device_state = run()
    host_losses, host_state = run("optimizer_memory_host_offload=true", "parameter_memory_host_offload=true")
    assert memory_kinds(device_state["opt_state"]) == {"device"}
    assert memory_kinds(host_state["opt_state"]) == {"pinned_host"}
    assert memory_kinds(host_state["params"]) == {"pinned_host"}
    assert len(set(device_losses)) > 1, device_losses  # it trains
    np.testing.assert_allclose(host_losses, device_losses, rtol=1e-6, atol=0)
    for ours, theirs in zip(jax.tree.leaves(host_state), jax.tree.leaves(device_state)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-9)


def test_layer_inputs_split_or_strided_give_the_same_gradients():
    """decoder_layer_input_host_layers=1 of 2: the first layer's input goes to the host, the other's stays on the
    device; decoder_layer_input_stride=2: only layer 0 offloads its input, layer 1's is recomputed. The loss
    and gradients equal those with every input on the host. (What goes to the host shows in
    a TPU compile's host bytes: docs/long_context.md, "Half a million tokens per chip".)"""
    from tests.test_head_chunks import assert_same, loss_and_grads

    keys = ("ici_context_parallelism=4", "per_device_batch_size=0.5", "context_parallel_strategy=p2p",
            "remat_policy=custom", "decoder_layer_input=offload")
    everything = loss_and_grads(*keys)
    assert_same(everything, loss_and_grads(*keys, "decoder_layer_input_host_layers=1"))
    assert_same(everything, loss_and_grads(*keys, "decoder_layer_input_stride=2"))


@pytest.mark.parametrize("keys,message", [
    (["decoder_layer_input_host_layers=3"], "decoder_layer_input_host_layers=3 must be -1"),
    (["decoder_layer_input_stride=3"], "decoder_layer_input_stride=3 x the attention layer pattern's period 1"),
    (["decoder_layer_input_stride=2", "decoder_layer_input_host_layers=1"], "needs scan_layers=true"),
])
def test_bad_layer_input_keys_are_refused_with_the_fix(keys, message):
    with pytest.raises(ConfigError, match=message):
        check_devices(load_config(["configs/base.yml", *SMALL, *keys]), 8)
