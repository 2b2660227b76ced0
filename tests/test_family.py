"""A model family registered from outside maxctx trains, plans and compiles like the built-in one, with no other
file changed: the seam of maxctx.model.families (the JAX-free family) and maxctx.model.stacks (its layer kind),
proven by a toy registered inside this test (and removed after it). It converts too, with its own small HF layout
(maxctx.convert asks the family for it).

The toy is the Llama block with another MLP: GELU(x W_in) W_out, two matrices instead of SwiGLU's three. Its
shape, named tensors and tile say so, and the planner, the FLOPs and the parameter count follow them.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.convert import safetensors
from maxctx.convert.from_hf import import_hf
from maxctx.convert.to_hf import export_hf
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.metrics.flops import training_flops_per_step
from maxctx.model import families, stacks
from maxctx.model.decoder import count_params
from maxctx.model.family import Stack, Tensor
from maxctx.model.layers import Attention, ModelConfig, RMSNorm, param
from maxctx.model.llama import family as llama, hf_layout
from maxctx.model.shape import ModelShape
from maxctx.plan import planner, step_time
from maxctx.train_step import compile_train_step, init_state, jit_train_step, make_setup
from tests.test_tiling import packed_batches

NAME = "toy"
TRACED: list[str] = []  # the toy layer was traced into a step

SMALL = ["configs/base.yml", f"decoder_block={NAME}", "dtype=float32", "attention=flash", "flash_block_q=16",
         "flash_block_kv=16", "max_target_length=64", "per_device_batch_size=0.5"]


class ToyShape(ModelShape):
    @property
    def mlp_params(self) -> int:
        return 2 * self.emb_dim * self.mlp_dim


def toy_tensors(shape: ModelShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    f = shape.mlp_dim // tp
    return {**llama.tensors(shape, tp, context_copies),
            "mlpwi": Tensor(f * shape.itemsize, 2 * shape.emb_dim * f)}


def toy_tensors_hf(keys: dict) -> tuple[hf_layout.Tensor, ...]:
    """Llama's layout with the MLP's two matrices in place of SwiGLU's three."""
    layer = "model.layers.{i}.mlp."
    mlp = (hf_layout.Tensor(("layers", "mlp", "w_in"), layer + "fc_in.weight", ("F", "D"), True, True),
           hf_layout.Tensor(("layers", "mlp", "w_out"), layer + "fc_out.weight", ("D", "F"), True, True))
    return tuple(t for t in hf_layout.tensors(keys) if t.path[:2] != ("layers", "mlp")) + mlp


TOY_HF = types.SimpleNamespace(
    ARCHITECTURES={"ToyForCausalLM": NAME}, DECODER_BLOCKS={NAME: NAME}, tensors=toy_tensors_hf,
    architecture=lambda hf, where: NAME,
    model_keys=lambda hf, where: hf_layout.model_keys({**hf, "architectures": ["LlamaForCausalLM"],
                                                       "hidden_act": "silu"}, where),
    hf_config=lambda keys, arch, dtype, extra: {**hf_layout.hf_config(keys, "llama", dtype, extra),
                                                "architectures": ["ToyForCausalLM"], "model_type": NAME,
                                                "hidden_act": "gelu"})

TOY = dataclasses.replace(
    llama.LLAMA, name=NAME, shape=ToyShape.from_config, tensors=toy_tensors,
    tile=lambda shape, tp: 2 * shape.mlp_dim / tp * shape.itemsize,
    stacks=lambda config: (Stack(NAME, config.base_num_decoder_layers, layer_windows(config)),), hf_layout=TOY_HF)


class GeluMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.w_in = param(rngs, (cfg.emb_dim, cfg.mlp_dim), ("embed", "mlp"), cfg.weight_dtype)
        self.w_out = param(rngs, (cfg.mlp_dim, cfg.emb_dim), ("mlp", "embed"), cfg.weight_dtype)
        self.dtype = cfg.dtype

    def __call__(self, x_BSD):
        h = checkpoint_name(jnp.einsum("BSD,DF->BSF", x_BSD, self.w_in[...].astype(self.dtype)), "mlpwi")
        return checkpoint_name(jnp.einsum("BSF,FD->BSD", jax.nn.gelu(h), self.w_out[...].astype(self.dtype)),
                               "mlpwo")


class ToyLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.attn_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.attn = Attention(cfg, rngs, mesh)
        self.mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.mlp = GeluMLP(cfg, rngs)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        TRACED.append(NAME)
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


@pytest.fixture
def toy():
    families.register(TOY)
    stacks.register_layer(NAME, ToyLayer)
    yield TOY
    families.unregister(NAME)
    stacks.unregister_layer(NAME)
    assert NAME not in families.names()


def train(config: Config, devices, steps: int, aot: bool) -> np.ndarray:
    setup = make_setup(config, create_mesh(config, devices))
    step = compile_train_step(setup) if aot else jit_train_step(setup)
    state, losses = init_state(setup), []
    for batch in packed_batches(setup, steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert count_params(state["params"]) == ToyShape.from_config(config).num_params
    assert "w_in" in state["params"]["layers"]["mlp"] and "w_gate" not in state["params"]["layers"]["mlp"]
    return np.array(losses)


def test_trains_on_one_device_and_compiled_ahead_of_time_with_context_parallelism(toy):
    TRACED.clear()
    one = train(load_config(SMALL), jax.devices()[:1], 3, aot=False)
    assert TRACED and np.all(np.isfinite(one))
    TRACED.clear()
    cp = load_config(SMALL + ["ici_context_parallelism=4", "context_parallel_strategy=p2p"])
    losses = train(cp, jax.devices(), 3, aot=True)  # maxctx.compile's path: compile_train_step
    assert TRACED and np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_planned_from_its_own_shape_and_tensors(toy):
    config = load_config(SMALL + ["cpu_devices=8", "ici_context_parallelism=8", "context_parallel_strategy=auto"])
    dense = dataclasses.replace(config, decoder_block="llama2")
    per, per_dense = step_time.per_token(config, 1), step_time.per_token(dense, 1)
    assert per["bytes"]["mlpwi"] * 2 == per_dense["bytes"]["mlpwi"] == 2 * 384 * 4
    assert per["flops"]["mlpwi"] * 2 == per_dense["flops"]["mlpwi"]
    d, f, layers, tokens = 128, 384, 2, 64
    assert training_flops_per_step(dense, 1, tokens) - training_flops_per_step(config, 1, tokens) == \
        6 * layers * d * f * tokens  # one D x F matrix less per layer, 6 FLOPs per weight and token
    plan = planner.plan(config)
    assert plan.choice.valid and any(c.valid for c in plan.ranked)
    dense_rows = {c.label: c for c in planner.plan(dense).ranked if c.valid}
    rows = {c.label: c for c in plan.ranked if c.valid}
    assert rows.keys() == dense_rows.keys() and all(rows[k].memory_bytes < dense_rows[k].memory_bytes for k in rows)
    assert any("p2p" in line for line in planner.format_plan(plan))


def test_an_unknown_decoder_block_is_one_line_naming_the_families():
    with pytest.raises(ConfigError, match=r"decoder_block='toy' is not a model family; use one of .*llama2, mistral"):
        load_config(SMALL)


def test_converts_through_its_own_hf_layout(toy, tmp_path):
    hf = json.loads((Path(__file__).parent / "fixtures" / "hf" / "llama" / "config.json").read_text())
    hf = {**hf, "architectures": ["ToyForCausalLM"], "model_type": NAME, "hidden_act": "gelu"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    keys = {"base_emb_dim": 32, "base_num_query_heads": 4, "base_num_kv_heads": 2, "head_dim": 16,
            "base_mlp_dim": 64, "vocab_size": 64, "logits_via_embedding": False}
    sizes = {"D": 32, "H": 4, "K": 2, "E": 16, "F": 64, "V": 64}
    rng, specs, arrays = np.random.default_rng(0), [], []
    for t in toy_tensors_hf(keys):
        for i in range(2) if t.per_layer else [None]:
            shape = tuple(int(np.prod([sizes[c] for c in group])) for group in t.hf)
            specs.append((t.name(i), np.dtype(np.float32), shape))
            arrays.append(rng.standard_normal(shape).astype(np.float32))
    safetensors.write(str(tmp_path / "hf" / "model.safetensors"), specs, iter(arrays))
    quiet = lambda *args, **kwargs: None  # noqa: E731
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), [], say=quiet)
    assert f"decoder_block: {NAME}" in (tmp_path / "ckpt" / "model.yml").read_text()
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), "fp32", say=quiet)
    exported = safetensors.model_tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(name for name, _, _ in specs)
    for (name, _, _), array in zip(specs, arrays):
        assert np.array_equal(safetensors.read(exported[name]), array), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]
