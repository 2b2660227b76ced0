"""Expert parallelism (maxctx.model.moe.dispatch) on 8 CPU devices: an MoE block with its experts spread over E
ranks and the (token, slot) pairs moved to them gives the gathered block's outputs and every gradient, with either
exchange (padded all-to-all; the ragged all-to-all's offsets through its all-gather emulation), with a router
that sends nearly every token to one expert, across fsdp, ring and all-to-all context axes and tensor
parallelism, chunked or not; DeepSeek's router and shared experts, GPT-OSS's biases and clamped GLU too. The
emulation is checked against the collective's documented semantics directly. E that is not a product of the
experts' leading axes is refused in one line, and `auto` drops the splits that cannot make it.
tests/test_expert_comm.py checks the bytes; tests/test_moe.py trains the Mixtral fixture under EP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from maxctx.attention.cp.sharded import shard_map
from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.model.deepseek.family import DeepseekOptions
from maxctx.model.deepseek.layers import DeepseekMoe
from maxctx.model.gpt_oss.family import GptOssOptions
from maxctx.model.gpt_oss.layers import GptOssExperts
from maxctx.model.layers import ModelConfig
from maxctx.model.moe import dispatch
from maxctx.model.moe.family import MoeOptions
from maxctx.model.moe.layers import MoeBlock
from maxctx.parallelism import MESH_AXES
from maxctx.plan import planner
from maxctx.validate import check_devices

D, X, M, K, B, S = 16, 8, 24, 2, 2, 32


def _block(block_cls, options, mesh_shape, ep: int, how: str, chunks: int, skew: bool, kernel: str = "auto"):
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(mesh_shape), MESH_AXES)
    cfg = ModelConfig(emb_dim=D, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=M, num_layers=1, vocab_size=8,
                      dtype="float32", weight_dtype="float32", options=options, expert_parallelism=ep,
                      expert_dispatch=how, mlp_sequence_chunks=chunks, moe_kernel=kernel)
    block = block_cls(cfg, nnx.Rngs(0), mesh)
    if skew:  # expert 3 first for nearly every token: one rank receives almost all the pairs
        block.router[...] = block.router[...].at[:, 3].add(4.0)
    return block


@functools.cache
def _run(block_cls, options, mesh_shape, ep: int = 1, how: str = "auto", chunks: int = 1, skew: bool = False,
         kernel: str = "auto"):
    """(loss, gradients of the parameters and the input) of one block on fixed inputs (a shared direction plus
    noise, so the skewed router agrees on its favourite)."""
    graphdef, state = nnx.split(_block(block_cls, options, mesh_shape, ep, how, chunks, skew, kernel))
    x = jax.random.normal(jax.random.key(1), (B, S, D)) + 0.5
    seg = jnp.ones((B, S), jnp.int32).at[1, -4:].set(0)

    def loss(params, x):
        y, sums = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(jnp.sin(y)) + jnp.sum(sums["moe_load"] * sums["moe_prob"])

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    return float(value), jax.tree.map(np.asarray, grads)


def _same(grads, grads_0):
    """Every gradient equal to fp32's sums in another order: 1e-4 relative, or 1e-5 of the array's largest."""
    for a, b in zip(jax.tree.leaves(grads_0), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


MOE = MoeOptions(num_experts=X, top_k=K, mlp_dim=M, renormalize=True, load_balance_loss_weight=0.01)


@pytest.mark.parametrize("mesh_shape,ep,how,chunks,skew", [
    ((1, 2, 4, 1, 1), 2, "padded", 1, True),  # fsdp ranks; each gathers its experts over the context axis
    ((1, 2, 4, 1, 1), 8, "ragged", 1, False),  # every expert on its own device
    ((1, 2, 4, 1, 1), 8, "ragged", 1, True),
    ((1, 2, 2, 1, 2), 4, "ragged", 2, True),  # fsdp x ring; chunked
    ((1, 1, 2, 2, 2), 4, "padded", 1, True),  # ring x all-to-all context axes
    ((1, 2, 2, 2, 1), 4, "ragged", 1, True),  # ... with tensor parallelism
])
def test_expert_parallelism_is_the_gathered_block(mesh_shape, ep, how, chunks, skew):
    loss, grads = _run(MoeBlock, MOE, mesh_shape, ep, how, chunks, skew)
    loss_0, grads_0 = _run(MoeBlock, MOE, mesh_shape, skew=skew)
    assert loss == pytest.approx(loss_0, rel=1e-6)
    _same(grads, grads_0)


DEEPSEEK = DeepseekOptions(num_experts=X, top_k=K, mlp_dim=M, renormalize=True, load_balance_loss_weight=0.01,
                           sigmoid=True, routed_bias=True, groups=4, top_groups=2, shared_experts=1,
                           routed_scaling_factor=2.5)
GPT_OSS = GptOssOptions(num_experts=X, top_k=K, mlp_dim=M, load_balance_loss_weight=0.01)


@pytest.mark.parametrize("block,options,mesh_shape,ep,how", [
    (DeepseekMoe, DEEPSEEK, (1, 2, 4, 1, 1), 8, "ragged"),  # V3's router and the shared expert
    (GptOssExperts, GPT_OSS, (1, 2, 4, 1, 1), 8, "ragged"),  # biases, clamped GLU
    (GptOssExperts, GPT_OSS, (1, 2, 2, 1, 2), 2, "padded"),  # ... with tensor parallelism, experts gathered over C
])
def test_every_moe_familys_block_under_expert_parallelism(block, options, mesh_shape, ep, how):
    loss, grads = _run(block, options, mesh_shape, ep, how)
    loss_0, grads_0 = _run(block, options, mesh_shape)
    assert loss == pytest.approx(loss_0, rel=1e-6)
    _same(grads, grads_0)


@pytest.mark.parametrize("block,options", [(MoeBlock, MOE), (GptOssExperts, GPT_OSS)])
def test_megablox_leaves_the_buffers_empty_rows_out(block, options):
    """megablox (Pallas interpret mode here, where it leaves unwritten rows NaN) over a receive buffer mostly
    empty: the rows past the last group are in no group, and neither they nor their gradients reach a token, a
    weight or (GPT-OSS) an expert's bias."""
    loss, grads = _run(block, options, (1, 2, 4, 1, 1), 8, "ragged", skew=True, kernel="megablox")
    loss_0, grads_0 = _run(block, options, (1, 2, 4, 1, 1), skew=True)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert loss == pytest.approx(loss_0, rel=1e-6)
    _same(grads, grads_0)


def test_the_emulated_ragged_all_to_all_is_the_documented_collective():
    """jax.lax.ragged_all_to_all's docstring, in numpy: rank i's operand[input_offsets[j] :][: send_sizes[j]] lands
    at rank j's output[output_offsets[j] :] (offsets in the receiver's buffer), the rest of output kept."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("x",))
    n, rows = 4, 6
    rng = np.random.default_rng(0)
    send = rng.integers(0, 3, size=(n, n)).astype(np.int32)  # send[i, j]: rows i -> j
    starts = np.concatenate([np.zeros((n, 1), np.int32), np.cumsum(send, 1)[:, :-1]], 1)
    lands = np.concatenate([np.zeros((1, n), np.int32), np.cumsum(send, 0)[:-1]], 0) + 1  # 1: a gap left
    operand = rng.normal(size=(n, rows, 3)).astype(np.float32)
    output = np.full((n, 12, 3), -1.0, np.float32)

    def local(operand, output, starts, send, lands, recv):
        return dispatch.emulated_ragged_all_to_all(operand[0], output[0], starts[0], send[0], lands[0], recv[0],
                                                   axis_name="x")[None]

    got = shard_map(local, mesh, (P("x"),) * 6, P("x"))(operand, output, starts, send, lands, send.T.copy())
    want = output.copy()
    for i in range(n):
        for j in range(n):
            want[j, lands[i, j]:lands[i, j] + send[i, j]] = operand[i, starts[i, j]:starts[i, j] + send[i, j]]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("keys,match", [
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=4", "expert_parallelism=4"],
     r"expert_parallelism=4 is not a product of the leading axes the experts are sharded over \(fsdp=2, "
     r"context=4.*choose one of 1, 2, 8"),
    (["ici_context_parallelism=8", "expert_parallelism=16"], "does not divide num_experts=8"),
    (["ici_context_parallelism=8", "expert_parallelism=3"], "does not divide num_experts=8"),
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2", "num_experts=16",
      "expert_parallelism=8"], r"does not divide fsdp x context = 2 x 2 = 4"),
    (["decoder_block=llama2", "num_experts=1", "expert_parallelism=2", "ici_context_parallelism=8"],
     "decoder_block=llama2 with num_experts=1 has no experts to spread"),
])
def test_an_expert_degree_the_mesh_cannot_take_is_refused_in_one_line(keys, match):
    config = load_config(["configs/base.yml", "decoder_block=mixtral", "num_experts=8", "num_experts_per_tok=2",
                          "norm_topk_prob=true", "max_target_length=64", *keys])
    with pytest.raises(ConfigError, match=match) as error:
        check_devices(config, 8)  # before JAX, as the layer built on the mesh would refuse it
    assert "\n" not in str(error.value)
    if "product" in match:
        shape = (1, config.ici_fsdp_parallelism, config.ici_context_parallelism, 1, config.ici_tensor_parallelism)
        with pytest.raises(ConfigError, match=match):
            _block(MoeBlock, MOE, shape, config.expert_parallelism, "auto", 1, False)


def test_auto_drops_the_splits_whose_axes_cannot_make_the_expert_degree():
    """E = 4 on fsdp 1 x C = 8 takes the ring axis of usp 4 x 2; a ring of 8 (p2p, all_gather), usp 2 x 4 and a2a
    (the experts' leading axes make 2 and 8, or 8) cannot."""
    config = load_config(["configs/base.yml", "model_name=qwen3-30b-a3b", "compile_topology=v5p-16",
                          "ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=65536",
                          "per_device_batch_size=0.125", "context_parallel_strategy=auto", "expert_parallelism=4"])
    table = planner.plan(config)
    kept = {(c.strategy, c.a2a) for c in table.ranked if c.valid}
    assert kept and all(8 // u == 4 for _, u in kept), kept
    assert any("expert_parallelism=4 is not a product" in c.dropped for c in table.ranked if not c.valid)
