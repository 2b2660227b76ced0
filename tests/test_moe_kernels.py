"""The MoE experts' grouped matmul chosen by `moe_kernel` (maxctx.model.moe.kernels): megablox in Pallas interpret
mode gives jax.lax.ragged_dot's values and gradients; each platform's kernel, the refusals; every family's expert
block runs the configured kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxctx.config import ConfigError
from maxctx.model.deepseek.family import DeepseekOptions
from maxctx.model.deepseek.layers import DeepseekMoe
from maxctx.model.gpt_oss.family import GptOssOptions
from maxctx.model.gpt_oss.layers import GptOssExperts
from maxctx.model.layers import ModelConfig
from maxctx.model.moe import kernels
from maxctx.model.moe.family import MoeOptions
from maxctx.model.moe.layers import MoeBlock, grouped_swiglu, route


def test_megablox_gives_ragged_dots_values_and_gradients(monkeypatch):
    """The TPU kernel in Pallas interpret mode (maxctx.model.moe.kernels): the experts' output and its gradients
    for the tokens and every weight, against jax.lax.ragged_dot's; a skewed router leaves an expert empty and gives
    a row count (20 tokens x 2 slots) that is not a whole row tile."""
    d, experts, width, top_k, tokens = 16, 4, 24, 2, 20
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(tokens, d)) + 1.0, jnp.float32)
    router = rng.normal(size=(d, experts)) * 0.1
    router[:, 0] += 1.0
    router[:, 3] -= 1.0  # never chosen: an empty group
    weights = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
               for s in ((experts, d, width), (experts, d, width), (experts, width, d))]
    _, _, chosen = route(x, jnp.asarray(router, jnp.float32), top_k, False, "float32")
    assert not (np.asarray(chosen) == 3).any()
    monkeypatch.setattr(kernels, "TILE", (32, 16, 16))  # a padded last row tile, and a part tile of M

    def loss(matmul, x, *w):
        _, slot_weights, chosen = route(x, jnp.asarray(router, jnp.float32), top_k, False, "float32")
        y = grouped_swiglu(x, slot_weights, chosen, *w, matmul=matmul)
        return jnp.sum(y * jnp.cos(y)), y

    got = jax.jit(jax.value_and_grad(functools.partial(loss, kernels.grouped_matmul("megablox", "cpu")),
                                     argnums=(0, 1, 2, 3), has_aux=True))(x, *weights)
    want = jax.value_and_grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1, 2, 3), has_aux=True)(
        x, *weights)
    np.testing.assert_allclose(got[0][1], want[0][1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_moe_kernel_is_the_platforms_and_a_tpu_kernel_is_refused_on_gpu():
    assert kernels.resolve("auto", "tpu") == "megablox" and kernels.resolve("auto", "cpu") == "ragged_dot"
    assert kernels.resolve("auto", "tpu", "float16") == "ragged_dot"  # megablox takes bf16 and fp32 only
    assert kernels.resolve("ragged_dot", "tpu") == "ragged_dot" and kernels.resolve("megablox", "cpu") == "megablox"
    for name in kernels.PALLAS_TPU:
        with pytest.raises(ConfigError, match=f"moe_kernel={name} is a Pallas TPU kernel and does not run on gpu"):
            kernels.resolve(name, "gpu")
    with pytest.raises(ConfigError, match="moe_kernel='tokamax' is not one of auto, ragged_dot, megablox"):
        kernels.resolve("tokamax", "tpu")
    with pytest.raises(ConfigError, match="moe_kernel=megablox needs dtype=bfloat16 or float32"):
        kernels.resolve("megablox", "tpu", "float16")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek"])
def test_every_familys_expert_block_runs_the_configs_moe_kernel(family):
    """MoeBlock, GPT-OSS's and DeepSeek's expert blocks each resolve ModelConfig.moe_kernel (a name no kernel has
    reaches the resolver's one-line refusal before anything runs)."""
    block, options = {"qwen3_moe": (MoeBlock, MoeOptions), "gpt_oss": (GptOssExperts, GptOssOptions),
                      "deepseek": (DeepseekMoe, DeepseekOptions)}[family]
    cfg = ModelConfig(emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=8, num_layers=1, vocab_size=8,
                      dtype="float32", options=options(num_experts=4, top_k=2, mlp_dim=8), moe_kernel="cutlass")
    with pytest.raises(ConfigError, match="moe_kernel='cutlass' is not one of auto, ragged_dot, megablox"):
        block(cfg, nnx.Rngs(0))(jnp.ones((1, 8, 16)), jnp.ones((1, 8), jnp.int32))
