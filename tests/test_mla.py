"""Multi-head latent attention and the DeepSeek-V2 / V3 family (maxctx.model.deepseek): attention with a value head
dim apart from the query/key one under every kernel path and CP strategy, with packing and both load-balance orders;
each MLA and router feature is what gives transformers' logits on the deepseek2 / deepseek3 fixtures (dropped, the
logits move); the presets' parameter counts are the released models'.

Under CP strategies at C = 4 and across kernels, tests/test_family_matrix.py runs the same fixture; the formulas of
the bytes each strategy moves with Dv != D are tests/test_attention_comm.py's (test_mla_value_head_dim).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.attention.kernels.dot_product import mask_from_positions
from maxctx.model.deepseek.layers import rotary_interleaved, route
from maxctx.model.rope import rotary
from tests.support.hf import FIXTURES, logits, relative_error
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.test_softcap import orders

DQ, DV = 12, 8  # q/k and v head dims (MLA's 192 and 128, small)


def inputs(seq: int, lengths: tuple[int, ...]):
    """q, k [2, seq, H, DQ], v [2, seq, K, DV], dout, positions, segment ids: row 0 one document, row 1 `lengths`."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, seq, 4, DQ)), rng.normal(size=(2, seq, 2, DQ))
    v, dout = rng.normal(size=(2, seq, 2, DV)), rng.normal(size=(2, seq, 4, DV))
    seg = np.stack([np.ones(seq), np.repeat(np.arange(1, len(lengths) + 1), lengths)]).astype(np.int32)
    pos = np.stack([np.arange(seq), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    return [x.astype(np.float32) for x in (q, k, v)] + [pos, seg, dout.astype(np.float32)]


def dense(q, k, v, pos, seg, window: int):
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bshd,bthd->bhst", q, k) * q.shape[-1] ** -0.5
    mask = mask_from_positions(pos, seg, pos, seg, window)[:, None]
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1), v)


def grads(fn, q, k, v, pos, seg, dout):
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, pos, seg), q, k, v)
    return [out, *pullback(dout)]


def check(spec: AttentionSpec, ring: int, a2a: int, seq: int, lengths, order_names):
    """attend's out, dq, dk, dv under `spec` (a mesh of ring x a2a, the batch stored in each order) equal the dense
    reference's, fp32 1e-5 relative."""
    args = inputs(seq, lengths)
    want = jax.jit(functools.partial(grads, functools.partial(dense, window=spec.window)))(*args)
    mesh = make_mesh(ring, a2a)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    fn = jax.jit(functools.partial(grads, functools.partial(attend, spec=spec, mesh=mesh)))
    fn = fn.lower(*[jax.device_put(x, sharding) for x in args]).compile(FAST_COMPILE)
    for name in order_names:
        perm = orders(seq, ring * a2a, args[3], args[4])[name]
        stored = [np.take_along_axis(x, perm.reshape(*perm.shape, *[1] * (x.ndim - 2)), 1) for x in args]
        got = fn(*[jax.device_put(x, sharding) for x in stored])
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            g = np.stack([np.asarray(g)[b][np.argsort(perm[b])] for b in range(2)])
            err = np.abs(g - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
            assert err < 1e-5, f"{spec.kernel} {spec.strategy} {name} window={spec.window} {what}: {err:.1e}"


@pytest.mark.parametrize("strategy,ring,a2a,window,names", [
    ("usp", 2, 2, 0, ("natural", "zigzag", "documents")),  # the all-to-all and the ring's joined K/V hops
    ("all_gather", 4, 1, 6, ("zigzag",))])  # a local layer's halo exchange of joined K/V pieces
def test_value_head_dim_under_strategies(strategy, ring, a2a, window, names):
    spec = AttentionSpec(kernel="blockwise", strategy=strategy, block_q=4, block_kv=4, window=window,
                         load_balance="documents" if names == ("documents",) else True)
    check(spec, ring, a2a, 32, (5, 11, 9, 7), names)


def test_splash_pads_the_value_head_dim():
    # Splash's call and its ring hops' dQ/dK/dV kernels get V zero-padded to q's head dim, out and dV sliced back.
    from maxctx.attention.kernels import splash

    spec = AttentionSpec(kernel="splash", strategy="p2p", block_q=128, block_kv=128,
                         splash_blocks=splash.Blocks(ring_backward=True))
    check(spec, 2, 1, 256, (100, 156), ("zigzag",))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (the fixture imported into a maxctx checkpoint, its tokens, transformers' logits), made once."""
    from maxctx.convert.from_hf import import_hf

    made = {}

    def get(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            import_hf(str(FIXTURES / name), str(out), [], say=lambda *a, **k: None)
            made[name] = out, np.load(FIXTURES / name / "tokens.npy"), np.load(FIXTURES / name / "logits.npy")
        return made[name]

    return get


def rotate_half(x, positions, rope):
    return rotary(x, positions, rope)


def unrotated_key(x, positions, rope):
    return x if x.shape[2] == 1 else rotary_interleaved(x, positions, rope)  # [B, S, 1, P]: the shared key


def unbiased(x_TD, router_DX, o, dtype, bias_X=None):
    return route(x_TD, router_DX, o, dtype, None)


# With every feature, the fixtures give transformers' logits (< 1e-5 of their range: tests/test_family_matrix.py,
# on 1 device and under each strategy); without any one of them, not.
@pytest.mark.parametrize("name,change,patch", [
    ("deepseek2", "mscale=0", None),  # YaRN's mscale_all_dim out of the softmax scale
    ("deepseek2", None, ("rotary_interleaved", rotate_half)),  # rotate-half where the checkpoint rotates pairs
    ("deepseek2", None, ("rotary_interleaved", unrotated_key)),  # the shared RoPE key left unrotated
    ("deepseek3", "n_routing_groups=-1", None),  # V3's group-limited top-k
    ("deepseek3", None, ("route", unbiased))])  # V3's correction bias out of the choice
def test_each_feature_is_needed_for_transformers_logits(imported, monkeypatch, name, change, patch):
    from maxctx.model.deepseek import layers

    checkpoint, tokens, expected = imported(name)
    if patch is not None:
        monkeypatch.setattr(layers, *patch)
    error = relative_error(logits(checkpoint, tokens, 1, *([change] if change else [])), expected)
    assert error > 1e-3, f"{name} {change or patch[1].__name__}: the logits do not move ({error:.1e})"


def test_group_limited_routing():
    # transformers' group_limited_greedy: experts outside each token's best groups (by their best score) never win.
    from maxctx.model.deepseek.family import DeepseekOptions

    rng = np.random.default_rng(1)
    x, router = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    opts = DeepseekOptions(num_experts=16, top_k=3, groups=4, top_groups=2, routed_scaling_factor=2.5)
    probs, weights, experts = (np.asarray(a) for a in route(x, router, opts, jnp.float32))
    best = np.argsort(-probs.reshape(64, 4, 4).max(-1), axis=-1)[:, :2]
    masked = np.where((np.arange(16)[None, None] // 4 == best[:, :, None]).any(1), probs, 0.0)
    want = np.sort(np.argsort(-masked, axis=-1)[:, :3], axis=-1)
    np.testing.assert_array_equal(np.sort(experts, axis=-1), want)
    np.testing.assert_allclose(np.sort(weights, -1), np.sort(2.5 * np.take_along_axis(probs, want, -1), -1),
                               rtol=1e-6)
    ungrouped = route(x, router, dataclasses.replace(opts, groups=1, top_groups=1), jnp.float32)[2]
    assert (np.sort(np.asarray(ungrouped), -1) != want).any()  # the groups change some token's experts here


# Parameters of transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM for the released config.json (counted on
# the meta device; V3's with its routers' correction biases, which it holds as buffers, and without the
# multi-token prediction layer).
@pytest.mark.parametrize("name,count", [("deepseek2-16b", 15_706_484_224), ("deepseek2-236b", 235_741_434_880),
                                        ("deepseek3-671b", 671_026_419_200), ("kimi-k2-1t", 1_026_408_232_448)])
def test_preset_parameter_counts(name, count):
    from flax import nnx

    from maxctx.model import families
    from maxctx.model.decoder import Decoder, count_params
    from tests.test_model import _model_config

    config, cfg = _model_config(model_name=name)
    assert count_params(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))) == count
    shape = families.shape(config)
    assert shape.num_params == count  # the family's formula, which the planner uses
    assert shape.active_params < shape.num_params / 5  # 2.7B of 15.7B, 21.4B of 236B, 37.6B of 671B, 32.9B of 1T


def test_weight_decay_takes_the_latent_matrices_not_the_norms_or_the_router_bias():
    # The LoRA ranks' logical axis is replicated like head_dim; named `norm`, the optimizer would not decay them.
    from flax import nnx

    from maxctx.model.decoder import Decoder, param_axes
    from maxctx.optimizer import decay_mask
    from tests.test_model import _model_config

    sizes = dict(base_num_decoder_layers=2, first_num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                 n_routing_groups=2, topk_routing_group=1, base_emb_dim=32, base_mlp_dim=32, base_moe_mlp_dim=16,
                 base_num_query_heads=2, base_num_kv_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                 qk_rope_head_dim=4, v_head_dim=4, vocab_size=32)
    _, cfg = _model_config(model_name="deepseek3-671b", head_dim=8, **sizes)
    mask = decay_mask(param_axes(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))))
    for stack in ("layers", "layers_1"):
        attn = mask[stack]["attn"]
        assert all(attn[w] for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
        assert not attn["kv_norm"]["scale"] and not attn["q_norm"]["scale"]
    assert not mask["layers_1"]["moe"]["bias"]


def _copy_fixture(directory, name: str, config_edit, tensors_edit) -> None:
    """The fixture `name` written to `directory` with its config.json and tensors edited."""
    import json

    from maxctx.convert import safetensors
    from tests.support.hf import tensors as read_tensors

    directory.mkdir()
    config = json.loads((FIXTURES / name / "config.json").read_text())
    config_edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    values = read_tensors(FIXTURES / name)
    tensors_edit(values)
    safetensors.write(str(directory / "model.safetensors"), [(n, v.dtype, v.shape) for n, v in values.items()],
                      iter(values.values()))


def _quantize(w, block):
    """(float8 weight, float32 scale per block, the weight they give) as DeepSeek's releases store it: each block's
    largest magnitude at float8_e4m3fn's largest finite value, 448. The weight given is within half a float8 step
    of w: 2^-4 |w|, or 2^-10 of the block's scale where w / scale is subnormal."""
    import ml_dtypes

    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[:w.shape[0], :w.shape[1]] = w
    amax = np.abs(padded.reshape(rows, block[0], cols, block[1])).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-12) / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]
    quantized = (w / full).astype(ml_dtypes.float8_e4m3fn)
    given = quantized.astype(np.float32) * full
    assert (np.abs(given - w) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * full) * (1 + 1e-6)).all()
    return quantized, scale, given


FP8_BLOCK = [8, 16]  # not the released [128, 128] (the fixture's dims are smaller), and not square


def test_fp8_block_quantised_checkpoint_is_dequantised_on_import(imported, tmp_path):
    from maxctx.convert.from_hf import import_hf
    from maxctx.convert.to_hf import export_hf
    from tests.support.hf import tensors as read_tensors

    reference = {}

    def quantize(values):
        for name in [n for n in values if n.endswith("_proj.weight") or n.endswith("_proj_with_mqa.weight")]:
            values[name], values[name + "_scale_inv"], reference[name] = _quantize(values[name], FP8_BLOCK)

    hf = tmp_path / "fp8"
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": FP8_BLOCK}
    _copy_fixture(hf, "deepseek3", lambda c: c.update(quantization_config=quantization), quantize)
    assert len(reference) == 3 * 5 + 3 + 2 * (8 * 3 + 3)  # attention x 3 layers, the dense MLP, experts and shared
    import_hf(str(hf), str(tmp_path / "mx"), [], say=lambda *a, **k: None)
    export_hf(str(tmp_path / "mx" / "0"), str(tmp_path / "back"), "fp32", say=lambda *a, **k: None)
    back = read_tensors(tmp_path / "back")
    for name, want in reference.items():  # bit for bit the float8 values times their blocks' scales
        np.testing.assert_array_equal(back[name], want, err_msg=name)
    assert not any(n.endswith("_scale_inv") for n in back)
    import json

    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    # Each weight within half a float8 step of the fixture's (_quantize) moves a token's logits by about 2^-4 of
    # the weights' share (1e-2 to 3e-2 of the fixture logits' range, measured); a token whose experts change with
    # them (top-k is not continuous) moves further, up to 0.15: the median token within 3e-2, every one within 0.25.
    _, tokens, expected = imported("deepseek3")
    per_token = np.abs(logits(tmp_path / "mx", tokens) - expected).max(-1) / (expected.max() - expected.min())
    assert 1e-3 < np.median(per_token) < 3e-2 and per_token.max() < 0.25, (np.median(per_token), per_token.max())


def _one_line_refusal(capsys, hf, out, *flags: str) -> str:
    from maxctx.convert.cli import main

    assert main(["from_hf", "--hf_path", str(hf), "--output_path", str(out), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _drop_scale(values):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    values[name] = _quantize(values[name], FP8_BLOCK)[0]


@pytest.mark.parametrize("quantization,edit,names", [
    ({"quant_method": "fp8", "weight_block_size": FP8_BLOCK}, _drop_scale, ("experts.3.up_proj.weight'",
                                                                           "_scale_inv' is missing", "[8, 16]")),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, lambda v: None, ("quant_method='bitsandbytes'",
                                                                             "FP8 block-quantised")),
    ({"quant_method": "fp8", "weight_block_size": [128]}, lambda v: None, ("weight_block_size=[128]",))])
def test_fp8_without_its_scales_or_another_quantization_is_refused(tmp_path, capsys, quantization, edit, names):
    _copy_fixture(tmp_path / "hf", "deepseek3", lambda c: c.update(quantization_config=quantization), edit)
    line = _one_line_refusal(capsys, tmp_path / "hf", tmp_path / "out")
    assert all(n in line for n in names), line


def _with_mtp(config):
    config["num_nextn_predict_layers"] = 1


def _mtp_tensors(values):
    """A made-up multi-token prediction layer after the fixture's 3: its own tensors and a copy of layer 2's."""
    rng = np.random.default_rng(0)
    for name in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight"):
        values[f"model.layers.3.{name}"] = rng.normal(size=(4, 4)).astype(np.float32)
    for name in [n for n in values if n.startswith("model.layers.2.")]:
        values[name.replace("model.layers.2.", "model.layers.3.")] = values[name]


def test_multi_token_prediction_layers_are_refused_or_skipped_by_the_flag(tmp_path, capsys):
    import json

    from maxctx.convert.from_hf import import_hf
    from maxctx.convert.to_hf import export_hf
    from tests.support.hf import tensors as read_tensors

    hf = tmp_path / "mtp"
    _copy_fixture(hf, "deepseek3", _with_mtp, _mtp_tensors)
    line = _one_line_refusal(capsys, hf, tmp_path / "refused")
    assert "num_nextn_predict_layers=1" in line and "--skip_mtp_layers" in line, line
    said = []
    import_hf(str(hf), str(tmp_path / "mx"), [], say=lambda *a, **k: said.append(a[0]), skip_mtp_layers=True)
    mtp = sum(n.startswith("model.layers.3.") for n in read_tensors(hf))
    assert f"skipped {mtp} tensors of multi-token prediction layers (model.layers.3.*)" in said
    export_hf(str(tmp_path / "mx" / "0"), str(tmp_path / "back"), "fp32", say=lambda *a, **k: None)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    back, fixture = read_tensors(tmp_path / "back"), read_tensors(FIXTURES / "deepseek3")
    assert back.keys() == fixture.keys()
    assert all(np.array_equal(back[n], fixture[n]) for n in fixture)


def _sequence_balance_reference(x, seg, router, bias, o) -> float:
    """DeepSeek-V3's eq. 17-20 in float64, a row of the batch as one sequence, padding left out."""
    terms = []
    for row in range(x.shape[0]):
        real = seg[row] != 0
        s = 1 / (1 + np.exp(-(x[row][real].astype(np.float64) @ router)))
        chosen = np.asarray(route(jnp.asarray(x[row][real]), jnp.asarray(router), o, jnp.float32,
                                  jnp.asarray(bias))[2])
        f = o.num_experts / (o.top_k * real.sum()) * np.bincount(chosen.reshape(-1), minlength=o.num_experts)
        terms.append(np.sum(f * (s / s.sum(-1, keepdims=True)).mean(0)))
    return float(np.mean(terms))


def test_sequence_balance_loss_is_the_papers_and_the_same_under_context_parallelism():
    from flax import nnx

    from maxctx.attention.cp.load_balance import zigzag_permutation
    from maxctx.model.deepseek.family import DeepseekOptions
    from maxctx.model.deepseek.layers import DeepseekMoe, aux_terms
    from maxctx.model.layers import ModelConfig

    o = DeepseekOptions(num_experts=8, top_k=2, mlp_dim=8, groups=4, top_groups=2, sigmoid=True, routed_bias=True,
                        renormalize=True, sequence_balance_loss_weight=0.1)
    cfg = ModelConfig(emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=8, num_layers=1, vocab_size=8,
                      dtype="float32", options=o)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 32, 16)).astype(np.float32)
    seg = np.stack([np.ones(32), np.repeat([1, 2, 3, 0], [9, 13, 6, 4])]).astype(np.int32)  # packed, padded
    block = DeepseekMoe(cfg, nnx.Rngs(0))
    block.bias[...] = jnp.asarray(rng.normal(size=8).astype(np.float32) * 0.1)
    graphdef, state = nnx.split(block)

    def term(graphdef, state, x, seg):
        value = aux_terms(nnx.merge(graphdef, state)(x, seg)[1], cfg)["sequence_balance_loss"]
        return value[1]

    value, grads = jax.jit(jax.value_and_grad(functools.partial(term, graphdef)))(state, x, seg)
    want = _sequence_balance_reference(x, seg, np.asarray(block.router[...]), np.asarray(block.bias[...]), o)
    assert float(value) == pytest.approx(want, rel=1e-5)
    mesh = make_mesh(4, 1)
    chunked = dataclasses.replace(cfg, mlp_sequence_chunks=2)
    graphdef_4 = nnx.split(DeepseekMoe(chunked, nnx.Rngs(0), mesh))[0]
    perm = zigzag_permutation(32, 4)  # the zig-zag order context_parallel_load_balance stores
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    value_4, grads_4 = jax.jit(jax.value_and_grad(functools.partial(term, graphdef_4)))(
        state, jax.device_put(x[:, perm], sharding), jax.device_put(seg[:, perm], sharding))
    assert float(value_4) == pytest.approx(float(value), rel=1e-6)
    router, router_4 = np.asarray(grads["router"][...]), np.asarray(grads_4["router"][...])
    assert np.abs(router).max() > 0
    np.testing.assert_allclose(router_4, router, rtol=1e-5, atol=1e-7 * np.abs(router).max())


def test_sequence_balance_loss_weight_reaches_the_loss_and_zero_leaves_it_out(imported):
    from flax import nnx

    from tests.support.hf import setup

    checkpoint, tokens, _ = imported("deepseek3")
    seq = tokens.shape[1]
    batch = (tokens, np.arange(seq, dtype=np.int32)[None], np.ones_like(tokens), np.roll(tokens, -1, axis=1),
             np.ones(tokens.shape, np.float32))

    def terms(made, params):
        return nnx.merge(made.graphdef, params).loss_terms(*batch)[2]

    _, made, state = setup(checkpoint, 1)
    assert "sequence_balance_loss" not in jax.eval_shape(functools.partial(terms, made), state["params"])
    _, made, state = setup(checkpoint, 1, "sequence_balance_loss_weight=0.0001")
    weight, value = jax.jit(functools.partial(terms, made))(state["params"])["sequence_balance_loss"]
    assert weight == 0.0001 and 0.5 < float(value) < 4.0  # 1 when balanced, at most X / k = 4


def test_the_bias_signal_is_the_layers_load_imbalance():
    """routed_bias_update_rate > 0: the layer adds a term of value 0 whose gradient in the correction bias is the
    load of the experts its router chose minus their mean (padding left out); off, no such term."""
    from flax import nnx

    from maxctx.model.deepseek.family import DeepseekOptions
    from maxctx.model.deepseek.layers import DeepseekMoe
    from maxctx.model.layers import ModelConfig

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 32, 16)).astype(np.float32))
    seg = jnp.asarray(np.stack([np.ones(32), np.repeat([1, 0], [20, 12])]).astype(np.int32))
    for rate in (0.0, 0.01):
        o = DeepseekOptions(num_experts=8, top_k=2, mlp_dim=8, groups=4, top_groups=2, sigmoid=True,
                            routed_bias=True, renormalize=True, bias_update_rate=rate)
        cfg = ModelConfig(emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=8, num_layers=1,
                          vocab_size=8, dtype="float32", options=o)
        block = DeepseekMoe(cfg, nnx.Rngs(0))
        block.bias[...] = jnp.asarray(rng.normal(size=8).astype(np.float32) * 0.3)
        graphdef, state = nnx.split(block)
        sums = jax.eval_shape(lambda s, g=graphdef: nnx.merge(g, s)(x, seg)[1], state)
        assert ("moe_bias_signal" in sums) == (rate > 0)
    signal = jax.jit(jax.value_and_grad(lambda s: nnx.merge(graphdef, s)(x, seg)[1]["moe_bias_signal"]))
    value, grads = signal(state)
    assert float(value) == 0.0
    chosen = np.asarray(route(x.reshape(64, 16), block.router[...], o, jnp.float32, block.bias[...])[2])
    load = np.bincount(chosen[np.asarray(seg).reshape(-1) != 0].reshape(-1), minlength=8)
    assert load.std() > 0
    np.testing.assert_allclose(np.asarray(grads["bias"][...]), load - load.mean(), rtol=1e-6)
    assert not np.asarray(grads["router"][...]).any()  # the signal reaches the bias alone


def test_a_step_moves_each_layers_bias_by_the_sign_of_its_load_and_nothing_else(imported):
    """DeepSeek-V3's update, b -= rate sign(load - mean) per MoE layer, where the load's imbalance is the bias's
    gradient (the test above): applied by the step outside the optimizer, whose gradient norm (and so its clipping)
    leaves the signal out; the signal is not logged."""
    import optax

    from maxctx.train_step import jit_train_step, loss_terms
    from tests.support.hf import setup

    checkpoint, tokens, _ = imported("deepseek3")
    seq = tokens.shape[1]
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
             "positions": np.arange(seq, dtype=np.int32)[None], "segment_ids": np.ones_like(tokens),
             "weights": np.ones(tokens.shape, np.float32)}
    rate = 0.01
    _, made, state = setup(checkpoint, 1, f"routed_bias_update_rate={rate}")
    before = jax.tree.map(np.asarray, state["params"])
    (total, (weight, _)), grads = jax.jit(jax.value_and_grad(lambda p, b: loss_terms(made.graphdef, p, b),
                                                             has_aux=True))(state["params"], batch)
    new, metrics = jit_train_step(made)(state, batch)
    flat = lambda tree: dict(jax.tree_util.tree_leaves_with_path(tree))  # noqa: E731
    tagged = [path for path, leaf in flat(made.sign_updated).items() if leaf]
    assert len(tagged) == 1  # the MoE stack's bias [2 layers, X]
    g = np.asarray(flat(grads)[tagged[0]])
    assert g.shape == (2, 8) and np.abs(np.sign(g)).sum() > 8
    np.testing.assert_allclose(np.asarray(flat(new["params"])[tagged[0]]), flat(before)[tagged[0]] - rate * np.sign(g),
                               atol=1e-7)
    others = [np.asarray(value / weight) for path, value in flat(grads).items() if path != tagged[0]]
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(others)), rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(float(total / weight), rel=1e-6)
    assert not any(name.startswith("_") for name in metrics)


def test_a_bias_update_without_the_bias_is_refused():
    from maxctx.config import ConfigError
    from maxctx.loader import load_config

    with pytest.raises(ConfigError, match="routed_bias_update_rate=0.001 must be >= 0 and moves the correction"):
        load_config(["configs/base.yml", "model_name=deepseek2-16b", "routed_bias_update_rate=0.001"])
