"""The expert strategy's collectives (maxctx.model.moe.experts, `gathered`) against the compiled HLO of one MoE
layer's forward and backward on 8 CPU devices: the all-gather of every expert-block parameter once per layer and
the reduce-scatter of its gradient, as the formulas say; the load-balancing sums' all-reduce does not grow with the
sequence. fp32 throughout: XLA:CPU runs a bf16 collective in fp32, so only fp32 bytes are what a TPU moves."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxctx.attention.cp.cost import by_kind
from maxctx.config import Config
from maxctx.mesh import logical_to_spec
from maxctx.model.gpt_oss.family import GptOssOptions
from maxctx.model.gpt_oss.layers import GptOssExperts
from maxctx.model.layers import ModelConfig
from maxctx.model.moe import experts
from maxctx.model.moe.family import MoeOptions
from maxctx.model.moe.layers import MoeBlock
from maxctx.parallelism import MESH_AXES
from maxctx.plan import roofline
from tests.support.hlo import collective_bytes

D, X, M, K, B = 16, 8, 24, 2, 2


@functools.cache
def compiled(block_cls, options, mesh_shape: tuple[int, ...], seq: int, ep: int = 1, chunks: int = 1) -> dict:
    """Collective bytes per kind of one expert block's forward and backward (the gradients of every parameter and
    of the input, as a layer in a model takes them), with expert parallelism `ep` (padded: the CPU's dispatch)
    over `chunks` chunks."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(mesh_shape), MESH_AXES)
    cfg = ModelConfig(emb_dim=D, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=M, num_layers=1, vocab_size=8,
                      dtype="float32", weight_dtype="float32", options=options, expert_parallelism=ep,
                      mlp_sequence_chunks=chunks)
    graphdef, state = nnx.split(block_cls(cfg, nnx.Rngs(0), mesh))
    abstract = nnx.from_flat_state([
        (path, jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            mesh, logical_to_spec(tuple(v.get_metadata()["axes"]), v.shape, mesh))))
        for path, v in nnx.to_flat_state(state)])
    act = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    x = jax.ShapeDtypeStruct((B, seq, D), jnp.float32, sharding=NamedSharding(mesh, P(*act.spec, None)))
    seg = jax.ShapeDtypeStruct((B, seq), jnp.int32, sharding=act)

    def loss(params, x, seg):
        y, sums = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(jnp.sin(y)) + jnp.sum(sums["moe_load"] * sums["moe_prob"])

    return collective_bytes(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(abstract, x, seg).compile().as_text())


@pytest.mark.parametrize("family,mesh_shape", [("moe", (1, 2, 4, 1, 1)), ("moe", (1, 2, 2, 1, 2)),
                                               ("gpt_oss", (1, 2, 4, 1, 1))])
def test_the_experts_collectives_are_the_formulas(family, mesh_shape):
    sizes = dict(zip(MESH_AXES, mesh_shape))
    if family == "moe":
        options = MoeOptions(num_experts=X, top_k=K, mlp_dim=M, renormalize=True, load_balance_loss_weight=0.01)
        block, params = MoeBlock, experts.routed_params(X, D, M, 4)
    else:
        options = GptOssOptions(num_experts=X, top_k=K, mlp_dim=M, load_balance_loss_weight=0.01)
        block, params = GptOssExperts, experts.gpt_oss_params(X, D, M, 4, 4)
    got = compiled(block, options, mesh_shape, 64)
    forward, backward = experts.comm_volume(params, sizes)
    want = by_kind(forward + backward)
    assert {k: got.get(k, 0) for k in want} == want
    assert got.get("all-to-all", 0) == 0 and got.get("collective-permute", 0) == 0
    if mesh_shape[-1] == 1:  # (with tensor parallelism, its sums of the tokens' partial outputs come on top)
        # What is left is the load sums' all-reduce: O(X) numbers a layer, not the [B, S, X] router outputs.
        assert got.get("all-reduce", 0) < 64 * X
    if family == "moe" and mesh_shape[-1] == 1:
        assert compiled(block, options, mesh_shape, 128) == got  # nothing grows with the sequence


@pytest.mark.parametrize("family,mesh_shape,ep,chunks", [("moe", (1, 2, 4, 1, 1), 8, 1), ("moe", (1, 2, 4, 1, 1), 2, 2),
                                                          ("moe", (1, 2, 2, 1, 2), 4, 1),
                                                          ("gpt_oss", (1, 2, 4, 1, 1), 2, 1)])
def test_expert_parallelism_moves_what_its_formulas_say(family, mesh_shape, ep, chunks):
    """Each EP rank gathers its X / E experts over the axes left (none at E = fsdp x C), the router whole; the
    tokens go there and back by all-to-all ([E R, D] each way and the rows' experts forward, transposed in the
    backward; a chunk's forward runs again in the backward, maxctx.model.tiling)."""
    sizes = dict(zip(MESH_AXES, mesh_shape))
    if family == "moe":
        options = MoeOptions(num_experts=X, top_k=K, mlp_dim=M, renormalize=True, load_balance_loss_weight=0.01)
        block, params = MoeBlock, experts.routed_params(X, D, M, 4)
    else:  # the router, its bias and b_down gathered whole, the rest by EP rank
        options = GptOssOptions(num_experts=X, top_k=K, mlp_dim=M, load_balance_loss_weight=0.01)
        block, params = GptOssExperts, experts.gpt_oss_params(X, D, M, 4, 4)
    seq = 64
    got = compiled(block, options, mesh_shape, seq, ep, chunks)
    pairs = B * seq // (sizes["data"] * sizes["fsdp"] * sizes["context"] * sizes["context_a2a"]) * K
    weights = experts.comm_volume(params, sizes, degree=ep)
    tokens = experts.dispatch_volume(pairs, D, 4, X, ep, "padded", chunks, forward_passes=1 + (chunks > 1))
    want = by_kind(weights[0] + weights[1] + tokens[0] + tokens[1])
    assert {k: got.get(k, 0) for k in want} == want
    assert got.get("collective-permute", 0) == 0
    if mesh_shape[-1] == 1:
        assert got.get("all-reduce", 0) < 64 * X  # the load sums only
    if ep == 8:  # every expert whole on its rank: only the router is gathered (and its gradient scattered)
        assert got["all-gather"] == D * X * 4 and got["reduce-scatter"] == D * X * 4

def test_the_planner_prices_the_experts_as_the_compiled_program_moves_them():
    """roofline.traffic's ICI term takes a mixture of experts' routers and experts at what the compiled layer puts
    on the wire ((G - 1) / G of each all-gather's result and reduce-scatter's operand), not as FSDP weights (fp32
    gradients, weight-dtype gathers)."""
    mesh_shape = (1, 2, 4, 1, 1)
    sizes, group = dict(zip(MESH_AXES, mesh_shape)), 8
    options = MoeOptions(num_experts=X, top_k=K, mlp_dim=M, renormalize=True, load_balance_loss_weight=0.01)
    got = compiled(MoeBlock, options, mesh_shape, 64)
    wire = (got["all-gather"] + got["reduce-scatter"]) * (group - 1) / group
    layer = types.SimpleNamespace(num_experts=X, emb_dim=D, moe_mlp_dim=M, moe_layers=3, itemsize=4)
    params, moved = roofline.expert_traffic(layer, sizes, forward_passes=1)
    assert (params, moved) == (3 * (D * X + 3 * X * D * M), 3 * wire)
    remat = roofline.expert_traffic(layer, sizes, forward_passes=2)[1]  # the gather again under remat
    assert remat == moved + 3 * got["all-gather"] * (group - 1) / group
    assert roofline.expert_traffic(types.SimpleNamespace(num_layers=2), sizes, 1) == (0.0, 0.0)  # a dense model
    # Expert parallelism over all 8 devices (padded, as compiled on CPU): the router's gather and scatter, and
    # apart (the step-time model waits for them) the tokens' all-to-alls, every one over the 8, on the wire.
    ep = compiled(MoeBlock, options, mesh_shape, 64, 8)
    assert roofline.expert_traffic(layer, sizes, 1, 8)[1] == 3 * (ep["all-gather"] + ep["reduce-scatter"]) * 7 / 8
    layer.top_k = K
    config = Config(expert_parallelism=8, expert_dispatch="padded")
    moved = roofline.dispatch_exchanges(config, layer, B * 64 / group, 1)
    assert sum(c.sent_bytes for c in moved) == pytest.approx(3 * ep["all-to-all"] * 7 / 8)
