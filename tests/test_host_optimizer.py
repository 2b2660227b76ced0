"""MaxText's host offload keys (optimizer_memory_host_offload, parameter_memory_host_offload; maxctx.train_step):
the state lives in pinned host memory between steps, and 10 training steps on CPU equal the device-resident run."""

from __future__ import annotations

import re

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
    # attention's output offloaded too: a run's layers are unrolled (maxctx.model.stacks._strided_scan)
    assert_same(everything, loss_and_grads(*keys, "context=offload", "decoder_layer_input_stride=2"))


def test_a_large_layer_input_goes_to_the_host_in_pieces(monkeypatch):
    """Past maxctx.model.stacks.HOST_TRANSFER_ELEMENTS per device (lowered here to half of one device's x) the
    offloaded layer input is named in 4 pieces along D: the loss and gradients are unchanged, and the step names
    [.., D / 4] arrays decoder_layer_input instead of [.., D] ones (what the policy offloads; the TPU compile
    below shows the transfers)."""
    from maxctx.model import stacks
    from tests.test_head_chunks import assert_same, config, loss_and_grads

    keys = ("ici_context_parallelism=4", "per_device_batch_size=0.5", "context_parallel_strategy=p2p",
            "remat_policy=custom", "decoder_layer_input=offload")
    whole, whole_names = loss_and_grads(*keys), named_layer_inputs(config(*keys))
    monkeypatch.setattr(stacks, "HOST_TRANSFER_ELEMENTS", 2048)  # one device's x: 4 x 128 x 64 / 8 = 4096 elements
    assert_same(whole, loss_and_grads.__wrapped__(*keys))
    assert whole_names == {"f32[4,128,64]"}, whole_names
    assert named_layer_inputs(config(*keys)) == {"f32[4,128,16]"}


def named_layer_inputs(cfg) -> set[str]:
    """The shapes the step's jaxpr names decoder_layer_input."""
    from maxctx.train_step import init_state, loss_sums
    from tests.test_tiling import packed_batches

    setup = make_setup(cfg, create_mesh(cfg))
    params = init_state(setup)["params"]
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, b: loss_sums(setup.graphdef, p, b)[0]))(params,
                                                                                       packed_batches(setup, 1)[0])
    return set(re.findall(r"(f32\[[\d,]+\]) = name\[name=decoder_layer_input\]", str(jaxpr)))


LARGE_INPUT_COMPILE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from maxctx.model.stacks import name_layer_input
from maxctx.plan import topology
devices = topology.topology_devices(topology.parse("v5p-8"), 1)
mesh = Mesh(np.array(devices).reshape(1, 1, len(devices), 1), ("data", "fsdp", "context", "context_a2a"))
policy = jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=[],
    names_which_can_be_offloaded=["decoder_layer_input"], offload_src="device", offload_dst="pinned_host")
def layer(x, w):
    x = name_layer_input(x, mesh)
    return x + jnp.sin(x * w).astype(x.dtype), None
def loss(x, w):
    return jnp.sum(jax.lax.scan(jax.checkpoint(layer, policy=policy), x, w)[0].astype(jnp.float32))
x = jax.ShapeDtypeStruct((1, 4 * 2**19, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "context")))
w = jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
print("host GiB", compiled.memory_analysis().host_temp_size_in_bytes / 2**30)
"""


def test_a_layer_input_of_2_31_elements_per_chip_compiles_offloaded_for_tpu():
    """llama3-8b's layer input at 2^25 tokens on 64 chips is [1, 524288, 4096] per chip, 2^31 elements: libtpu
    aborts (llo_loop.cc) on its transfer to the host whole; in pieces it compiles (2 layers, v5p-8, libtpu)."""
    import subprocess
    import sys

    from tests.support.processes import ROOT, tpu_env
    from tests.support.tpu_compile import needs_libtpu

    needs_libtpu()
    done = subprocess.run([sys.executable, "-c", LARGE_INPUT_COMPILE], cwd=ROOT, env=tpu_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    host_gib = float(done.stdout.split("host GiB")[-1])
    assert host_gib >= 8, done.stdout  # both layers' inputs, 4 GiB each, are in pinned host memory (12 GiB measured)


@pytest.mark.parametrize("keys,message", [
    (["decoder_layer_input_host_layers=3"], "decoder_layer_input_host_layers=3 must be -1"),
    (["decoder_layer_input_stride=3"], "decoder_layer_input_stride=3 x the attention layer pattern's period 1"),
    (["decoder_layer_input_stride=2", "decoder_layer_input_host_layers=1"], "needs scan_layers=true"),
])
def test_bad_layer_input_keys_are_refused_with_the_fix(keys, message):
    with pytest.raises(ConfigError, match=message):
        check_devices(load_config(["configs/base.yml", *SMALL, *keys]), 8)
