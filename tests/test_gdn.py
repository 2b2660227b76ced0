"""The Gated DeltaNet (maxctx.model.qwen35): the chunked form equals the recurrent reference, the context-parallel
prefix scan equals one device (forward and gradients) and leaks no state across a document start on a rank
boundary, its collective bytes are the formula whatever the sequence length, and each piece of the layer moves the
Qwen3.5 logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp.load_balance import zigzag_permutation
from maxctx.convert.from_hf import import_hf
from maxctx.loader import load_config
from maxctx.model import families
from maxctx.model.decoder import Decoder, count_params
from maxctx.model.layers import ModelConfig
from maxctx.model.qwen35 import cp as gdn_cp, family as qwen35_family, gdn
from maxctx.model.qwen35.family import QWEN3_5
from maxctx.plan import planner, step_time
from tests.support.hf import FIXTURES, logits, relative_error, tensors
from tests.support.hlo import collective_bytes
from tests.support.meshes import FAST_COMPILE, make_mesh

B, HK, N, K, V, W = 2, 2, 4, 8, 6, 4
X = 2 * HK * K + N * V


def inputs(seq: int, seed: int = 0):
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)  # noqa: E731
    return f(B, seq, X), f(B, seq, N), f(B, seq, N), 0.5 * f(X, W), f(N), f(N)


@pytest.mark.parametrize("group", [16, 2])  # 2: seven chunks in four checkpointed groups, the last padded
def test_chunked_equals_recurrent_across_documents_and_padding(group, monkeypatch):
    monkeypatch.setattr(gdn, "GROUP", group)
    r = np.random.default_rng(1)
    s = 100  # not a multiple of the chunk: the padding must change nothing
    q, k = (gdn.l2_normalize(jnp.asarray(r.normal(size=(B, s, N, K)), jnp.float32)) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, s, N, V)), jnp.float32)
    g = -jnp.asarray(r.uniform(0, 1, size=(B, s, N)), jnp.float32)
    beta = jax.nn.sigmoid(jnp.asarray(r.normal(size=(B, s, N)), jnp.float32))
    seg = np.ones((B, s), np.int32)
    seg[0, 37:], seg[1, 64:], seg[1, 90:] = 2, 2, 0  # a start mid-chunk, one on a chunk boundary, padding
    starts = gdn.document_starts(jnp.asarray(seg), jnp.full((B,), -1))
    start_state = jnp.asarray(r.normal(size=(B, N, K, V)), jnp.float32)
    args = (q, k, v, g, beta, starts, start_state)
    want, want_state = fast(gdn.recurrent, *args)
    got, got_state = fast(functools.partial(gdn.chunked, chunk=16), *args)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got_state, want_state, atol=2e-6)
    a, u = fast(functools.partial(gdn.transition, chunk=16), *args[:-1])
    np.testing.assert_allclose(jnp.einsum("BNKJ,BNJV->BNKV", a, start_state) + u, want_state, atol=2e-6)

    if group != 2:
        return  # the gradients once, through four groups

    def loss(form, args):  # every input's gradient, through the output and the final state
        o, m = form(*args)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(m))

    floats = [0, 1, 2, 3, 4, 6]  # starts (5) is boolean
    grad = lambda form: jax.grad(lambda xs: loss(form, [*xs[:5], starts, xs[5]]))([args[i] for i in floats])  # noqa: E731
    want = fast(lambda: grad(gdn.recurrent))
    got = fast(lambda: grad(functools.partial(gdn.chunked, chunk=16)))
    for g_got, g_want in zip(got, want):
        np.testing.assert_allclose(g_got, g_want, atol=2e-5, rtol=2e-5)


def cp_mix(mesh, seg, *args):
    """`sharded_mix` on the mesh (mesh None: one device), jitted, with the loss's gradient."""
    def loss(args):
        return jnp.sum(jnp.sin(gdn_cp.sharded_mix(mesh, *args[:3], seg, *args[3:], (HK, K, V))))

    return fast(jax.value_and_grad(loss), args)


def fast(fn, *args):
    """fn(*args) compiled without XLA's backend optimisations (compile time dominates these tests)."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def test_prefix_scan_at_four_ranks_equals_one_device():
    seq = 64
    args = inputs(seq)
    seg = jnp.asarray(np.repeat([[1] * 40 + [2] * 24], B, 0), jnp.int32)
    (want, want_grads), (got, got_grads) = cp_mix(None, seg, *args), cp_mix(make_mesh(4, 1), seg, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_zigzag_order_at_four_ranks_equals_one_device():
    seq, cp = 64, 4
    args = inputs(seq, seed=3)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 44], B, 0), jnp.int32)
    order = zigzag_permutation(seq, cp)
    mesh = make_mesh(cp, 1)
    got = fast(lambda *x: gdn_cp.sharded_mix(mesh, *x[:3], seg[:, order], *x[3:], (HK, K, V), zigzag=True),
               *(x[:, order] if x.ndim == 3 else x for x in args))
    want = fast(lambda *x: gdn_cp.sharded_mix(None, *x[:3], seg, *x[3:], (HK, K, V)), *args)
    np.testing.assert_allclose(got[:, np.argsort(order)], want, rtol=1e-5, atol=1e-6)


def test_a_document_start_on_a_rank_boundary_leaks_no_state():
    """Rank 2 begins a document: its outputs are those of that document alone, whatever rank 0 and 1 hold."""
    seq = 64
    mesh = make_mesh(4, 1)
    seg = jnp.asarray(np.repeat([[1] * 32 + [2] * 32], B, 0), jnp.int32)
    qkv, b, a, *params = inputs(seq)
    mixed = jax.jit(lambda *x: gdn_cp.sharded_mix(mesh, *x, seg, *params, (HK, K, V))).lower(qkv, b, a)
    mixed = mixed.compile(FAST_COMPILE)
    base = mixed(qkv, b, a)
    other = mixed(*(x.at[:, :32].set(-x[:, :32]) for x in (qkv, b, a)))
    alone = fast(lambda *x: gdn_cp.sharded_mix(None, *x, seg[:, 32:], *params, (HK, K, V)),
                 qkv[:, 32:], b[:, 32:], a[:, 32:])
    np.testing.assert_allclose(base[:, 32:], alone, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(base[:, 32:], other[:, 32:])
    assert not np.allclose(base[:, :32], other[:, :32])


@functools.cache
def collective_kinds(seq: int, cp: int, zigzag: bool) -> dict:
    mesh = make_mesh(cp, 1)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if x.ndim == 3 else None)
            for x in inputs(seq)]
    seg = jax.ShapeDtypeStruct((B, seq), jnp.int32, sharding=sharding)

    def fwd(qkv, b, a, conv, a_log, dt_bias, seg):
        return gdn_cp.sharded_mix(mesh, qkv, b, a, seg, conv, a_log, dt_bias, (HK, K, V), zigzag)

    hlo = jax.jit(fwd).lower(*args, seg).compile(FAST_COMPILE).as_text()
    return dict(collective_bytes(hlo))


@pytest.mark.parametrize("cp,zigzag", [(4, False), (8, True)])
def test_collective_bytes_are_the_formula_at_two_lengths(cp, zigzag):
    want = qwen35_family.exchange_bytes(B, N, K, V, X, W, 4, cp, zigzag)
    assert collective_kinds(128, cp, zigzag) == collective_kinds(512, cp, zigzag) == {"collective-permute": want}


@pytest.mark.parametrize("name,expected", [("qwen3.5-9b", 8_953_803_264), ("qwen3.5-27b", 26_895_998_464)])
def test_preset_parameter_counts(name, expected):
    """transformers' Qwen3_5ForCausalLM of the release's text config counts these (tests/fixtures' venv, meta
    device); so do the parameter tree and the family's formula."""
    config = load_config(["configs/base.yml", f"model_name={name}"])
    abstract = nnx.eval_shape(lambda: Decoder(ModelConfig.from_config(config), nnx.Rngs(0)))
    assert count_params(nnx.state(abstract)) == families.shape(config).num_params == expected


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5") / "ckpt"
    import_hf(str(FIXTURES / "qwen3_5"), str(out), [], say=lambda *a, **k: None)
    return out


def drop_conv(x_BSX, w_XW, segment_ids_BS, halo_BHX, halo_ids_BH):
    return jax.nn.silu(x_BSX.astype(jnp.float32) * w_XW[:, -1].astype(jnp.float32))  # the token's own tap only


def full_rope(config):
    return dataclasses.replace(QWEN3_5.options(config), rotary_dims=config.head_dim)


@pytest.mark.parametrize("piece", ["conv", "partial_rope"])
def test_each_piece_is_what_gives_transformers_logits(qwen3_5, monkeypatch, piece):
    """Without the short convolution's earlier taps, or with RoPE on the whole head instead of its quarter, the
    logits leave transformers' (tests/test_family_matrix.py: within 1e-5 of the range with every piece)."""
    if piece == "conv":
        monkeypatch.setattr(gdn, "causal_conv", drop_conv)
    else:
        monkeypatch.setattr(families, "_FAMILIES", {**families._FAMILIES, "qwen3_5": dataclasses.replace(
            QWEN3_5, options=full_rope)})
    tokens = np.load(FIXTURES / "qwen3_5" / "tokens.npy")
    assert relative_error(logits(qwen3_5, tokens), np.load(FIXTURES / "qwen3_5" / "logits.npy")) > 1e-3


def test_the_planner_prices_the_linear_layers_and_plans_a_million_tokens():
    """The linear layers' delta rule has FLOPs of its own (a softmax layer's `context` has none; its attention is
    counted apart), and qwen3.5-9b at 2^20 tokens on v5p-128 gets a plan (an estimate, not a compile)."""
    config = load_config(["configs/base.yml", "compile_topology=v5p-128", "model_name=qwen3.5-9b",
                          "max_target_length=1048576", "ici_context_parallelism=64", "ici_fsdp_parallelism=1",
                          "per_device_batch_size=0.015625", "attention=splash", "context_parallel_strategy=auto",
                          "remat_policy=full"])
    flops = step_time.per_token(config, 1)["flops"]
    assert flops["context"] > 0
    assert planner.plan(config).choice.valid


def million(**changes):
    """qwen3.5-9b on v5p-128 at 2^20 tokens, C = 64, one sequence; `changes` replace keys."""
    keys = {"compile_topology": "v5p-128", "model_name": "qwen3.5-9b", "max_target_length": 1048576,
            "ici_context_parallelism": 64, "ici_fsdp_parallelism": 1, "per_device_batch_size": 0.015625,
            "attention": "splash", "context_parallel_strategy": "usp", "context_parallel_a2a_degree": 4,
            "remat_policy": "full", **changes}
    return load_config(["configs/base.yml", *(f"{k}={v}" for k, v in keys.items())])


@pytest.mark.parametrize("zigzag", [True, False])
def test_the_time_model_prices_the_prefix_scan_by_log2_c_whatever_the_length(zigzag):
    """A step waits for each linear layer's prefix scan, forward and backward: the same at 2^20 and 2^22 tokens,
    and each doubling of C adds a collective-permute of the fp32 states (two under the zig-zag's two scans), each
    with the ICI latency."""
    def seconds(seq: int, cp: int) -> float:
        config = million(max_target_length=seq, ici_context_parallelism=cp, ici_fsdp_parallelism=64 // cp,
                         per_device_batch_size=1 / cp, context_parallel_load_balance=str(zigzag).lower(),
                         context_parallel_strategy="p2p", context_parallel_a2a_degree=0)
        hw = step_time.hardware(config, 64)
        return step_time.linear_exchange_s(config, planner.mesh_plan(config), hw, 1), hw.link_bytes_per_s

    (short, link), (long, _), (wide, _) = seconds(2**20, 8), seconds(2**22, 8), seconds(2**20, 16)
    scans, passes, layers = 1 + zigzag, 2, 24  # forward and backward; qwen3.5-9b's 32 layers, 8 of them full
    step = 4 * 32 * (128 * 128 + 128 * 128) / link + step_time.ICI_LATENCY_S
    assert short == long > 0
    assert wide - short == pytest.approx(layers * passes * scans * step, rel=1e-9)


def test_the_step_runs_the_delta_rule_and_exchanges_only_the_full_layers_attention():
    """The delta rule's FLOPs join the matmul term (more under CP: each rank also builds its run's map), and the
    CP strategy's collectives are priced for the 8 full-attention layers, not all 32."""
    config = million()
    shape, plan = families.shape(config), planner.mesh_plan(config)
    hw = step_time.hardware(config, 64)
    est = step_time.estimate(config, plan, 1, hw)
    rate = hw.peak_flops * step_time.XLA_MATMUL_EFFICIENCY
    tokens = 2**20 / 64
    assert shape.linear_flops(tokens, 64) > shape.linear_flops(tokens, 1) > 0
    assert est.matmul_s * rate == pytest.approx(shape.matmul_flops(tokens) + shape.linear_flops(tokens, 64))
    scan = step_time.linear_exchange_s(config, plan, hw, est.forwards_per_layer)
    attention = step_time._cp_seconds(config, plan, hw, hw.peak_flops * step_time.attention_efficiency(config),
                                      est.forwards_per_layer)[1]
    assert scan > 0
    assert est.exposed_collective_s == pytest.approx(8 * attention + scan)


def test_qwen3_next_preset_counts_are_transformers():
    """transformers' Qwen3NextForCausalLM of its default (the release's) config counts 79,674,391,296 parameters
    (meta device), 3,874,929,408 of them a token's (10 of the 512 experts); so do the tree and the formula."""
    config = load_config(["configs/base.yml", "model_name=qwen3-next-80b-a3b"])
    abstract = nnx.eval_shape(lambda: Decoder(ModelConfig.from_config(config), nnx.Rngs(0)))
    shape = families.shape(config)
    assert count_params(nnx.state(abstract)) == shape.num_params == 79_674_391_296
    assert shape.active_params == 3_874_929_408


def with_mtp(name: str, directory, key: bool = True) -> str:
    """The fixture `name` copied with a released checkpoint's multi-token prediction layer: mtp_num_hidden_layers
    1 in config.json (unless not `key`) and an mtp.* tensor beside the model's."""
    import json

    from maxctx.convert import safetensors

    directory.mkdir()
    config = json.loads((FIXTURES / name / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1} if key else config))
    arrays = {**tensors(FIXTURES / name), "mtp.fc.weight": np.zeros((2, 2), np.float32)}
    safetensors.write(str(directory / "model.safetensors"), [(k, v.dtype, v.shape) for k, v in arrays.items()],
                      iter(arrays.values()))
    return str(directory)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_multi_token_prediction_layers_are_refused_or_skipped_on_request(name, tmp_path):
    from maxctx.errors import ConfigError

    hf = with_mtp(name, tmp_path / "hf")
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers=1.*--skip_mtp_layers"):
        import_hf(hf, str(tmp_path / "refused"), [], say=lambda *a, **k: None)
    said = []
    import_hf(hf, str(tmp_path / "ckpt"), [], say=lambda *a, **k: said.append(a[0]), skip_mtp_layers=True)
    assert "skipped 1 tensors of multi-token prediction layers (mtp.*)" in said
    with pytest.raises(ConfigError, match=r"'mtp.fc.weight' is a multi-token prediction layer's .*--skip_mtp_layers"):
        import_hf(with_mtp(name, tmp_path / "no_key", key=False), str(tmp_path / "x"), [], say=lambda *a, **k: None)


def test_qwen3_next_loss_is_transformers_with_its_load_balancing_term(tmp_path):
    """The fixture's mean cross-entropy plus router_aux_loss_coef (0.001, carried by from_hf) x the load-balancing
    term, the term transformers' (aux_loss.npy: output_router_logits over the four layers' routers)."""
    import json

    from maxctx.train_step import loss_terms
    from tests.support.hf import setup

    import_hf(str(FIXTURES / "qwen3_next"), str(tmp_path / "ckpt"), [], say=lambda *a, **k: None)
    tokens = np.load(FIXTURES / "qwen3_next" / "tokens.npy")
    _, made, state = setup(tmp_path / "ckpt", 1)
    seq = tokens.shape[1]
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": np.ones_like(tokens),
             "positions": np.arange(seq, dtype=np.int32)[None],
             "weights": (np.arange(seq) < seq - 1).astype(np.float32)[None]}  # the last token has no next
    total, (weight, terms) = jax.jit(lambda p, b: loss_terms(made.graphdef, p, b))(state["params"], batch)
    aux = np.load(FIXTURES / "qwen3_next" / "aux_loss.npy")
    np.testing.assert_allclose(terms["load_balance_loss"] / weight, aux, rtol=1e-5)
    coef = json.loads((FIXTURES / "qwen3_next" / "config.json").read_text())["router_aux_loss_coef"]
    cross_entropy = np.load(FIXTURES / "qwen3_next" / "token_losses.npy").mean()
    assert float(total / weight) == pytest.approx(cross_entropy + coef * aux, rel=1e-5)


RELEASED_QWEN3_NEXT = {  # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (transformers 4.57's form), as remembered
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 5120, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
    "rope_scaling": None, "partial_rotary_factor": 0.25, "tie_word_embeddings": False, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "mtp_num_hidden_layers": 1}


def test_the_released_qwen3_next_config_is_the_preset():
    """Without layer_types (built from full_attention_interval, as transformers does) and with RoPE's keys at the
    top level, the release's config.json gives the preset's model keys once its MTP layer is skipped."""
    from maxctx.model.qwen3_next import hf_layout

    hf, skip = hf_layout.without_mtp(RELEASED_QWEN3_NEXT)
    keys = hf_layout.model_keys(hf, "config.json")
    preset = load_config(["configs/base.yml", "model_name=qwen3-next-80b-a3b"])
    assert skip == ("mtp.",) and keys["full_attention_interval"] == 4
    assert {k: v for k, v in keys.items() if getattr(preset, k) != v} == {}


def test_qwen3_next_without_its_shared_expert_is_refused():
    from maxctx.errors import ConfigError

    with pytest.raises(ConfigError, match="shared_experts=0: decoder_block=qwen3_next.*set shared_experts >= 1"):
        load_config(["configs/base.yml", "model_name=qwen3-next-80b-a3b", "shared_experts=0"])


@pytest.mark.parametrize("change,message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 .*dense MLP layers"),
    ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] .*dense MLP layers"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"shared_expert_intermediate_size": 700}, "shared_expert_intermediate_size=700 is not a multiple"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2: .*--skip_mtp_layers")])
def test_qwen3_next_layouts_maxctx_does_not_run_are_refused_in_one_line(change, message):
    from maxctx.errors import ConfigError
    from maxctx.model.qwen3_next import hf_layout

    with pytest.raises(ConfigError, match=message) as refused:
        hf_layout.model_keys({**RELEASED_QWEN3_NEXT, "mtp_num_hidden_layers": 0, **change}, "config.json")
    assert "\n" not in str(refused.value)
