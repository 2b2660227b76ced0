"""The dropless MoE layer (maxctx.model.moe): a skewed router computes every token as a dense per-token reference
does; the load-balancing loss is transformers' (the mixtral fixture's aux_loss.npy, weighted by its
router_aux_loss_coef, which conversion carries both ways) and, with the router z-loss, does not depend on the mesh
(loss and gradients at C = 1 and C = 4); Mixtral's renormalised top-k weights are what give transformers' logits;
a training run logs each expert's load."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxctx.attention.cp.load_balance import reorder_batch
from maxctx.config import ConfigError
from maxctx.convert.from_hf import import_hf
from maxctx.convert.to_hf import export_hf
from maxctx.loader import load_config
from maxctx.mesh import batch_sharding, create_mesh
from maxctx.model.decoder import Decoder
from maxctx.model.layers import ModelConfig
from maxctx.model.moe import hf_layout
from maxctx.model.moe.family import MoeOptions
from maxctx.model.moe.layers import MoeBlock
from maxctx.plan import planner, step_time
from maxctx.train_step import loss_terms, make_setup
from tests.support.hf import FIXTURES, logits, relative_error, setup
from tests.support.strategies import config_args

quiet = lambda *args, **kwargs: None  # noqa: E731


def _dense_reference(x_TD, router, w_gate, w_up, w_down, top_k: int, renormalize: bool,
                     kept=None) -> np.ndarray:
    """Each token through its top-k experts one at a time, in float64; with `kept` [T, k] only the kept slots."""
    out = np.zeros_like(x_TD)
    for t, x in enumerate(x_TD):
        logits_ = x @ router
        p = np.exp(logits_ - logits_.max())
        p /= p.sum()
        chosen = np.argsort(-p)[:top_k]
        w = p[chosen] / (p[chosen].sum() if renormalize else 1.0)
        for j, (weight, e) in enumerate(zip(w, chosen)):
            gate, up = x @ w_gate[e], x @ w_up[e]
            if kept is None or kept[t, j]:
                out[t] += weight * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


def _capacity_reference(chosen_BSK: np.ndarray, real_BS: np.ndarray, capacity: int) -> np.ndarray:
    """kept[B, S, k]: per sequence, token by token and slot by slot, each expert's first `capacity` real pairs."""
    kept = np.zeros(chosen_BSK.shape, bool)
    for b, row in enumerate(chosen_BSK):
        taken: dict[int, int] = {}
        for t, slots in enumerate(row):
            for j, e in enumerate(slots):
                if real_BS[b, t] and taken.get(e, 0) < capacity:
                    kept[b, t, j], taken[e] = True, taken.get(e, 0) + 1
    return kept


@pytest.mark.parametrize("renormalize,chunks", [(True, 1), (False, 2)])
def test_a_skewed_router_computes_every_token_as_the_dense_reference(renormalize, chunks):
    d, experts, width, top_k, seq = 16, 4, 24, 2, 32
    options = MoeOptions(num_experts=experts, top_k=top_k, mlp_dim=width, renormalize=renormalize,
                         router_z_loss_weight=0.1)
    cfg = ModelConfig(emb_dim=d, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=width, num_layers=1,
                      vocab_size=8, dtype="float32", options=options, mlp_sequence_chunks=chunks)
    block = MoeBlock(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, seq, d)).astype(np.float32) + 1.0  # a shared direction the router favours
    router = rng.normal(size=(d, experts)).astype(np.float32) * 0.1
    router[:, 0] += 1.0  # expert 0 first for almost every token
    block.router[...] = jnp.asarray(router)
    top = np.argsort(-(x.reshape(-1, d) @ router), axis=-1)[:, :top_k]
    assert (top[:, 0] == 0).mean() > 0.9  # skewed: an expert with capacity for its share would drop most of them

    segment_ids = np.ones((2, seq), np.int32)
    segment_ids[1, -4:] = 0  # padding: computed, but neither counted nor in the z-loss
    y, sums = jax.jit(lambda m, x, seg: m(x, seg))(block, jnp.asarray(x), jnp.asarray(segment_ids))
    weights = [np.asarray(w[...], np.float64) for w in (block.w_gate, block.w_up, block.w_down)]
    expected = _dense_reference(x.reshape(-1, d).astype(np.float64), router.astype(np.float64), *weights, top_k,
                                renormalize)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, d), expected, rtol=1e-4, atol=1e-5)
    real = segment_ids.reshape(-1) != 0
    assert float(sums["moe_load"].sum()) == real.sum() * top_k  # every real (token, slot) assignment counted
    assert float(sums["moe_load"][0]) == (top[real] == 0).sum()
    logits_ = x.reshape(-1, d)[real].astype(np.float64) @ router
    log_z = logits_.max(-1) + np.log(np.exp(logits_ - logits_.max(-1, keepdims=True)).sum(-1))
    assert float(sums["moe_z"]) == pytest.approx((log_z**2).sum(), rel=1e-5)  # ST-MoE's z-loss, summed


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "mixtral"
    import_hf(str(FIXTURES / "mixtral"), str(out), [], say=quiet)
    return out


def _loss_and_grads(checkpoint: Path, cp: int, *overrides: str):
    """(loss, {term: value}, gradients) of the fixture's tokens at C = cp (zig-zag order under CP)."""
    tokens = np.load(FIXTURES / "mixtral" / "tokens.npy")
    config, made, state = setup(checkpoint, cp, f"ici_context_parallelism={cp}", *overrides)
    seq = tokens.shape[1]
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
             "positions": np.arange(seq, dtype=np.int32)[None], "segment_ids": np.ones_like(tokens),
             "weights": (np.arange(seq) < seq - 1).astype(np.float32)[None]}  # the last token has no next
    batch = reorder_batch(batch, cp) if cp > 1 else batch
    batch = {k: jax.device_put(v, batch_sharding(made.mesh)) for k, v in batch.items()}
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss_terms(made.graphdef, p, b), has_aux=True))
    (total, (weight, terms)), grads = grad(state["params"], batch)
    return float(total / weight), {k: np.asarray(v / weight) for k, v in terms.items()}, grads


@functools.cache
def _one_device(checkpoint: Path):
    return _loss_and_grads(checkpoint, 1)


def test_the_aux_losses_are_transformers_and_the_same_at_every_context_degree(mixtral):
    """The load-balancing loss with the fixture's router_aux_loss_coef (0.001, carried by from_hf) and the router
    z-loss at ST-MoE's weight (0.001: 13% of the router's gradient here): terms, loss and every gradient the same
    at C = 1 and C = 4."""
    z = "router_z_loss_weight=0.001"
    loss_1, terms_1, grads_1 = _loss_and_grads(mixtral, 1, z)
    aux = np.load(FIXTURES / "mixtral" / "aux_loss.npy")
    np.testing.assert_allclose(terms_1["load_balance_loss"], aux, rtol=1e-5)
    # the cross-entropy plus router_aux_loss_coef x the term, as transformers adds it, and 0.001 x the z-loss
    coef = json.loads((FIXTURES / "mixtral" / "config.json").read_text())["router_aux_loss_coef"]
    cross_entropy = np.load(FIXTURES / "mixtral" / "token_losses.npy").mean()
    assert terms_1["router_z_loss"] > 0
    assert loss_1 == pytest.approx(cross_entropy + coef * aux + 0.001 * terms_1["router_z_loss"], rel=1e-5)
    loss_4, terms_4, grads_4 = _loss_and_grads(mixtral, 4, z, "context_parallel_strategy=p2p")
    assert loss_4 == pytest.approx(loss_1, rel=1e-5)
    for term in ("load_balance_loss", "router_z_loss"):
        assert terms_4[term] == pytest.approx(terms_1[term], rel=1e-5), term
    np.testing.assert_allclose(terms_4["moe_expert_load"], terms_1["moe_expert_load"], rtol=1e-6)
    # to fp32's summation order, an entry's error bounded by 1e-5 of its leaf's largest: an attention weight's
    # entry that cancels to -1.5e-4 (its leaf reaches 1.45) differs by 1.1e-6 under XLA:CPU on an AMD EPYC host
    for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_4)):
        a = np.asarray(a)
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


@pytest.mark.parametrize("strategy,ep,how", [("all_gather", 4, "padded"), ("p2p", 4, "ragged"), ("a2a", 4, "padded"),
                                             ("usp", 2, "ragged")])
def test_the_fixture_trains_under_expert_parallelism_with_the_one_device_loss(mixtral, strategy, ep, how):
    """The four experts spread over E of the 4 context devices (usp: its ring axis, the experts gathered over its
    all-to-all axis), the pairs moved by either exchange (ragged: its CPU emulation): the loss, aux terms and
    every gradient of C = 1."""
    loss_1, terms_1, grads_1 = _one_device(mixtral)
    loss, terms, grads = _loss_and_grads(mixtral, 4, *config_args(strategy, 4), f"expert_parallelism={ep}",
                                         f"expert_dispatch={how}")
    assert loss == pytest.approx(loss_1, rel=1e-5)
    assert terms["load_balance_loss"] == pytest.approx(terms_1["load_balance_loss"], rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_mixtral_without_renormalised_top_k_weights_is_not_transformers(mixtral):
    expected = np.load(FIXTURES / "mixtral" / "logits.npy")
    tokens = np.load(FIXTURES / "mixtral" / "tokens.npy")
    assert relative_error(logits(mixtral, tokens), expected) < 1e-5
    _, made, state = setup(mixtral, 1)
    cfg = made.model_config
    plain = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, renormalize=False))
    graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(plain, nnx.Rngs(0))))[0]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    got = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, np.ones_like(tokens)))(state["params"])
    assert relative_error(np.asarray(got), expected) > 1e-2


def test_expert_weights_shard_over_fsdp_and_context_and_the_planner_prices_the_experts():
    config = load_config(["configs/base.yml", "decoder_block=mixtral", "num_experts=8", "num_experts_per_tok=2",
                          "norm_topk_prob=true", "ici_fsdp_parallelism=2", "ici_context_parallelism=4"])
    made = make_setup(config, create_mesh(config, jax.devices()[:8]))
    moe = made.state_shardings["params"]["layers"]["moe"]
    assert moe["w_gate"].spec == jax.sharding.PartitionSpec(None, ("fsdp", "context"), None, None)  # [L, X, D, M]
    assert moe["w_down"].spec == jax.sharding.PartitionSpec(None, ("fsdp", "context"), None, None)
    # a token's experts, not all of them: mlpwi is k gate and up projections and the router
    flops = step_time.per_token(config, 1)["flops"]
    d, m, x, k = config.base_emb_dim, config.base_mlp_dim, 8, 2
    assert flops["mlpwi"] == 4 * k * d * m + 2 * d * x + 8 * x
    qwen = load_config(["configs/base.yml", "compile_topology=v5p-128", "model_name=qwen3-30b-a3b",
                        "max_target_length=1048576", "ici_context_parallelism=64", "per_device_batch_size=0.015625",
                        "attention=splash", "context_parallel_strategy=auto"])
    assert planner.plan(qwen).choice.valid


@pytest.mark.parametrize("key", ["load_balance_loss_weight", "router_z_loss_weight"])
def test_a_negative_aux_loss_weight_is_refused(key):
    with pytest.raises(ConfigError, match=f"{key}=-0.1 must be >= 0"):
        load_config(["configs/base.yml", "decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2",
                     f"{key}=-0.1"])


@pytest.mark.parametrize("change,match", [({"decoder_sparse_step": 0}, "decoder_sparse_step is 0"),
                                          ({"mlp_only_layers": [5]}, r"mlp_only_layers is \[5\], not a list of "
                                                                     r"layer indices in \[0, 2\)"),
                                          ({"mlp_only_layers": "0"}, "mlp_only_layers is '0', not a list"),
                                          ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1")])
def test_layouts_the_released_models_lack_are_refused_in_one_line(change, match):
    hf = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    assert hf_layout.model_keys(hf, "config.json")["num_experts"] == 4
    with pytest.raises(ConfigError, match=match):
        hf_layout.model_keys({**hf, **change}, "config.json")


def test_router_aux_loss_coef_is_the_load_balancing_weight_in_and_out(tmp_path):
    import shutil

    import yaml

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "qwen3_moe", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.02}))
    import_hf(str(hf), str(tmp_path / "ckpt"), [], say=quiet)
    assert yaml.safe_load((tmp_path / "ckpt" / "model.yml").read_text())["load_balance_loss_weight"] == 0.02
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "same"), "fp32", say=quiet)
    assert json.loads((tmp_path / "same" / "config.json").read_text())["router_aux_loss_coef"] == 0.02
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "trained"), "fp32", ["load_balance_loss_weight=0.005"],
              say=quiet)
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["router_aux_loss_coef"] == 0.005
    with pytest.raises(ConfigError, match="router_aux_loss_coef is -1"):
        hf_layout.model_keys({**config, "router_aux_loss_coef": -1}, "config.json")


def test_a_moe_run_logs_each_experts_load(tmp_path):
    """train.py (2 micro-batches a step, a capacity): every train record of metrics.jsonl has the per-expert load
    [X], shares summing to 1, the busiest expert's load over the mean and the share of pairs dropped; TensorBoard a
    scalar per expert and moe/dropped_fraction."""
    from tests.support.processes import metrics, run, train_command
    from tests.test_metrics_writers import read_scalars

    experts = 4
    result = run(train_command(f"base_output_directory={tmp_path}", "run_name=moe", "cpu_devices=1", "steps=2",
                               "log_period=1", "decoder_block=mixtral", f"num_experts={experts}",
                               "num_experts_per_tok=2", "norm_topk_prob=true", "base_emb_dim=32", "base_mlp_dim=32",
                               "head_dim=16", "max_target_length=32", "per_device_batch_size=4",
                               "gradient_accumulation_steps=2", "router_z_loss_weight=0.001", "dtype=float32",
                               "capacity_factor=1.0",
                               "attention=dot_product", "enable_checkpointing=false", "peak_tflops_per_device=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    train = [r for r in metrics(tmp_path / "moe") if r.get("event") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        load = record["moe_expert_load"]
        assert len(load) == experts and sum(load) == pytest.approx(1.0, abs=1e-5)
        assert record["moe_max_load_ratio"] >= 1.0 and record["router_z_loss"] > 0
        assert 0 <= record["moe_dropped_fraction"] < 0.5
    scalars = read_scalars(str(tmp_path / "moe" / "tensorboard"))
    assert [v for _, v in scalars["moe/dropped_fraction"]] == pytest.approx([r["moe_dropped_fraction"] for r in train])
    assert [value for _, value in scalars["moe/expert_load/3"]] == pytest.approx([r["moe_expert_load"][3]
                                                                                  for r in train])


@pytest.mark.parametrize("sigmoid,groups,bias", [(True, 4, True), (False, 4, False)])
def test_the_load_is_the_experts_deepseeks_router_chose(sigmoid, groups, bias):
    """V3's sigmoid scores with the correction bias, and V2's group-limited choice, pick other experts than a plain
    softmax top-k: the load (metrics, load balancing) counts the ones chosen, padding left out."""
    from maxctx.model.deepseek.family import DeepseekOptions
    from maxctx.model.deepseek.layers import DeepseekMoe, route

    o = DeepseekOptions(num_experts=8, top_k=2, mlp_dim=8, groups=groups, top_groups=1, sigmoid=sigmoid,
                        routed_bias=bias, renormalize=True)
    cfg = ModelConfig(emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=8, num_layers=1, vocab_size=8,
                      dtype="float32", options=o)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 32, 16)).astype(np.float32)
    seg = np.stack([np.ones(32), np.repeat([1, 0], [24, 8])]).astype(np.int32)
    block = DeepseekMoe(cfg, nnx.Rngs(0))
    if bias:
        block.bias[...] = jnp.asarray(rng.normal(size=8).astype(np.float32))
    experts = np.asarray(route(jnp.asarray(x.reshape(64, 16)), block.router[...], o, "float32",
                               block.bias[...] if bias else None)[2])
    load = np.asarray(block(jnp.asarray(x), jnp.asarray(seg))[1]["moe_load"])
    np.testing.assert_array_equal(load, np.bincount(experts[seg.reshape(-1) != 0].reshape(-1), minlength=8))


def test_dense_layers_among_the_moe_ones_are_stacked_by_run_and_counted():
    """The qwen3_moe_sparse fixture (decoder_sparse_step 2, mlp_only_layers [3]: dense, MoE, dense, dense; its
    logits and round trip are tests/test_family_matrix.py's): a stack per run of like layers, every parameter of
    the checkpoint counted (the dense layers' SwiGLU of intermediate_size, no experts), the active ones without
    the experts a token does not run; a step leaving no MoE layer is refused."""
    from maxctx.model import families
    from tests.support.hf import tensors

    hf = json.loads((FIXTURES / "qwen3_moe_sparse" / "config.json").read_text())
    keys = hf_layout.model_keys(hf, "config.json")
    assert (keys["interleave_moe_layer_step"], keys["mlp_only_layers"]) == (2, "3")
    args = ["configs/base.yml", "decoder_block=qwen3_moe", *(f"{k}={v}" for k, v in keys.items())]
    config = load_config(args)
    family = families.get("qwen3_moe")
    assert [(s.kind, s.count) for s in family.stacks(config)] == [("qwen", 1), ("qwen3_moe", 1), ("qwen", 2)]
    shape = family.shape(config)
    assert shape.num_params == sum(t.size for t in tensors(FIXTURES / "qwen3_moe_sparse").values())
    d, m, x, k = 32, 48, 4, 2
    assert shape.num_params - shape.active_params == 3 * (x - k) * d * m  # one MoE layer's idle experts
    with pytest.raises(ConfigError, match="leave no MoE layer"):
        load_config([a.replace("interleave_moe_layer_step=2", "interleave_moe_layer_step=8") for a in args])
    with pytest.raises(ConfigError, match=r"mlp_only_layers='0,4': 4 is not a layer index in \[0, 4\)"):
        load_config([*args, "mlp_only_layers=0,4"])


def _skewed(factor: float, seq: int = 32):
    """A MoeBlock of 4 experts, 2 a token, with `capacity_factor` and a router that puts expert 0 first for almost
    every token; (block, x[2, S, D], segment ids with the last 4 of row 1 padding, router, chosen experts)."""
    d, experts, top_k = 16, 4, 2
    options = MoeOptions(num_experts=experts, top_k=top_k, mlp_dim=24, capacity_factor=factor)
    cfg = ModelConfig(emb_dim=d, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=24, num_layers=1, vocab_size=8,
                      dtype="float32", options=options)
    block = MoeBlock(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, seq, d)).astype(np.float32) + 1.0
    router = rng.normal(size=(d, experts)).astype(np.float32) * 0.1
    router[:, 0] += 1.0
    block.router[...] = jnp.asarray(router)
    chosen = np.argsort(-(x @ router), axis=-1, kind="stable")[..., :top_k]
    segment_ids = np.ones((2, seq), np.int32)
    segment_ids[1, -4:] = 0
    return block, x, segment_ids, router, chosen


def test_a_capacity_drops_each_experts_later_pairs_of_a_sequence_and_logs_their_share():
    """capacity_factor=1: each expert takes ceil(1 x 32 x 2 / 4) = 16 pairs of each sequence, token by token and
    slot by slot, padding taking none; the output is the dense reference without the dropped slots, and the
    logged moe_dropped_fraction is their share of the real pairs."""
    from maxctx.model.moe.layers import aux_terms

    block, x, segment_ids, router, chosen = _skewed(1.0)
    real = segment_ids != 0
    kept = _capacity_reference(chosen, real, 16)
    dropped = int((real[..., None] & ~kept).sum())
    assert 10 < dropped < int(real.sum())  # expert 0's overflow: dropped, and not everything
    y, sums = jax.jit(lambda m, x, seg: m(x, seg))(block, jnp.asarray(x), jnp.asarray(segment_ids))
    weights = [np.asarray(w[...], np.float64) for w in (block.w_gate, block.w_up, block.w_down)]
    expected = _dense_reference(x.reshape(-1, 16).astype(np.float64), router.astype(np.float64), *weights, 2,
                                False, kept.reshape(-1, 2))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16)[real.reshape(-1)], expected[real.reshape(-1)],
                               rtol=1e-4, atol=1e-5)
    assert float(sums["moe_dropped"]) == dropped
    assert float(aux_terms(sums, block.cfg)["moe_dropped_fraction"][1]) == pytest.approx(dropped / (real.sum() * 2))


def test_no_capacity_is_the_dropless_program_and_a_roomy_one_drops_nothing():
    """capacity_factor=0 adds nothing (no moe_dropped, the dropless grouped matmul's output bit for bit); a
    capacity no expert reaches (4: 64 pairs of a 32-token sequence) gives the same bits and drops 0."""
    from maxctx.model.moe.layers import grouped_swiglu, route

    outputs = {}
    for factor in (0.0, 4.0):
        block, x, segment_ids, _, _ = _skewed(factor)
        outputs[factor] = jax.jit(lambda m, x, seg: m(x, seg))(block, jnp.asarray(x), jnp.asarray(segment_ids))
    y, sums = outputs[0.0]
    assert sorted(sums) == ["moe_load", "moe_prob", "moe_tokens"]

    @jax.jit
    def dropless(x_TD, router, *experts):
        return grouped_swiglu(x_TD, *route(x_TD, router, 2, False, "float32")[1:], *experts)

    dropless = dropless(jnp.asarray(x.reshape(-1, 16)), block.router[...], block.w_gate[...], block.w_up[...],
                        block.w_down[...])
    assert np.asarray(y).reshape(-1, 16).tobytes() == np.asarray(dropless).tobytes()
    assert np.asarray(outputs[4.0][0]).tobytes() == np.asarray(y).tobytes()
    assert float(outputs[4.0][1]["moe_dropped"]) == 0


@pytest.mark.parametrize("keys,match", [
    (["capacity_factor=0.5"], "capacity_factor=0.5 drops tokens by design: below 1"),
    (["capacity_factor=1.25", "ici_context_parallelism=4"], "split over 4 context shards x mlp_sequence_chunks=1"),
    (["capacity_factor=1.25", "mlp_sequence_chunks=2"], "split over 1 context shards x mlp_sequence_chunks=2"),
    (["capacity_factor=1.25", "decoder_block=deepseek", "base_num_kv_heads=4"],
     "decoder_block=deepseek's MoE layers are dropless"),
    (["decoder_block=qwen3", "mlp_only_layers=0"], "decoder_block=qwen3 does not place its layers by them")])
def test_a_capacity_where_it_drops_tokens_by_design_is_refused(keys, match):
    """In one line, naming the rule (maxctx.model.moe.capacity); and the layer placement keys where a family would
    ignore them."""
    from maxctx.validate import check_devices

    base = ["configs/base.yml", "decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2"]
    check_devices(load_config([*base, "capacity_factor=1.25"]), 8)
    with pytest.raises(ConfigError, match=match):
        check_devices(load_config([*base, *keys]), 8)
