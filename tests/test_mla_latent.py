"""The strategies that move MLA's latent, latent_all_gather (maxctx.attention.cp.latent) and latent_p2p
(maxctx.attention.cp.latent_ring): MLA's attention from the gathered, or ring-passed, latent is the dense attention
of K and V built from it, forward and gradients (q, the latent, wkv_b), in every token order, with the weight split
over tensor shards; the bytes each moves are its formulas, below all_gather's (p2p's) by H (Q + V) / (R + P); its
backward's temp bytes grow with S as its activation and transient formulas do, with no whole K or V; a model without
MLA is refused in one line. The models: the deepseek fixtures' loss and every gradient of a packed batch at C = 4
equal one device's under every strategy that takes MLA (their logits against transformers' are
tests/test_family_matrix.py's).

Legend: B batch, S sequence, H heads, Q = N + P q/k head dim (N without RoPE, P the shared RoPE key), V value head
dim, R latent rank, L = R + P.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import KINDS, AttentionShape, by_kind
from maxctx.attention.dispatch import AttentionSpec, attend_latent
from maxctx.attention.kernels.dot_product import mask_from_positions
from tests.support.hlo import collective_bytes
from tests.support.meshes import FAST_COMPILE, make_mesh
from tests.test_softcap import orders

B, S, H, N, PR, V, R = 2, 32, 4, 8, 4, 6, 12  # PR: the RoPE key's width P
Q, L = N + PR, R + PR
NAME, RING = "latent_all_gather", "latent_p2p"
LATENT = (NAME, RING)
KV = {NAME: "all_gather", RING: "p2p"}  # the per-head K/V strategy each moves the latent in place of


def inputs(seq: int = S, lengths=(5, 11, 9, 7)):
    """q [B, S, H, Q], latent [B, S, L], wkv_b [R, H, N + V], dout [B, S, H, V], positions and segment ids: row 0
    one document, row 1 packed `lengths`."""
    rng = np.random.default_rng(0)
    q, latent = rng.normal(size=(B, seq, H, Q)), rng.normal(size=(B, seq, L))
    w, dout = rng.normal(size=(R, H, N + V)) / R ** 0.5, rng.normal(size=(B, seq, H, V))
    seg = np.stack([np.ones(seq), np.repeat(np.arange(1, len(lengths) + 1), lengths)]).astype(np.int32)
    pos = np.stack([np.arange(seq), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
    return [x.astype(np.float32) for x in (q, latent, w)] + [pos, seg, dout.astype(np.float32)]


def dense(q, latent, w, pos, seg):
    """MLA by its definition: k = [c w_k, k_rope for every head], v = c w_v, causal document-masked softmax."""
    c, k_rope = latent[..., :R], latent[..., R:]
    k = jnp.concatenate([jnp.einsum("bsr,rhn->bshn", c, w[..., :N]),
                         jnp.broadcast_to(k_rope[:, :, None], (B, c.shape[1], H, PR))], axis=-1)
    v = jnp.einsum("bsr,rhv->bshv", c, w[..., N:])
    scores = jnp.einsum("bshd,bthd->bhst", q, k) * Q ** -0.5
    mask = mask_from_positions(pos, seg, pos, seg, 0)[:, None]
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1), v)


def grads(fn, q, latent, w, pos, seg, dout):
    out, pullback = jax.vjp(lambda q, latent, w: fn(q, latent, w, pos, seg), q, latent, w)
    return [out, *pullback(dout)]


def spec(load_balance=True, name=NAME) -> AttentionSpec:
    return AttentionSpec(kernel="blockwise", strategy=name, block_q=4, block_kv=4, load_balance=load_balance)


@pytest.mark.parametrize("name", LATENT)
def test_forward_and_gradients_are_the_dense_attentions_in_every_order(name):
    # C = 4, the heads and wkv_b split over 2 tensor shards; the blockwise kernel's program does not depend on the
    # order, so one compile serves the natural, zig-zag and documents orders.
    args = inputs()
    want = jax.jit(functools.partial(grads, dense))(*args)
    mesh = make_mesh(4, 1, tensor=2)
    by_token = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    attention = functools.partial(attend_latent, spec=spec(name=name), mesh=mesh)
    fn = jax.jit(functools.partial(grads, attention)).lower(
        *[jax.device_put(x, NamedSharding(mesh, P()) if x.ndim == 3 and x.shape[0] == R else by_token)
          for x in args]).compile(FAST_COMPILE)
    for order in ("natural", "zigzag", "documents"):
        perm = orders(S, 4, args[3], args[4])[order]
        stored = [x if x.shape[0] == R else np.take_along_axis(x, perm.reshape(*perm.shape, *[1] * (x.ndim - 2)), 1)
                  for x in args]
        got = fn(*stored)
        for what, g, w in zip(("out", "dq", "dlatent", "dwkv_b"), got, want):
            g = np.asarray(g) if what == "dwkv_b" else np.stack([np.asarray(g)[b][np.argsort(perm[b])]
                                                                 for b in range(B)])
            err = np.abs(g - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
            assert err < 1e-5, f"{order} {what}: {err:.1e}"


@pytest.mark.parametrize("name", LATENT)
@pytest.mark.parametrize("load_balance,order", [(True, "zigzag"), ("documents", "documents")])
def test_splash_takes_the_rings_masks_block_by_block(load_balance, order, name):
    # Splash (interpret mode here) masks each key block with the kernel a ring's hop would use for it: the table
    # indexed by the traced step under zig-zag, the per-call tables of the documents placement.
    seq, lengths = 256, (100, 60, 96)
    args = inputs(seq, lengths)
    want = jax.jit(functools.partial(grads, dense))(*args)
    mesh = make_mesh(2, 1)
    by_token = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    attention = AttentionSpec(kernel="splash", strategy=name, block_q=128, block_kv=128, load_balance=load_balance)
    perm = orders(seq, 2, args[3], args[4])[order]
    stored = [x if x.shape[0] == R else jax.device_put(
        np.take_along_axis(x, perm.reshape(*perm.shape, *[1] * (x.ndim - 2)), 1), by_token) for x in args]
    got = jax.jit(functools.partial(grads, functools.partial(attend_latent, spec=attention, mesh=mesh)))(*stored)
    for what, g, w in zip(("out", "dq", "dlatent", "dwkv_b"), got, want):
        g = np.asarray(g) if what == "dwkv_b" else np.stack([np.asarray(g)[b][np.argsort(perm[b])] for b in range(B)])
        err = np.abs(g - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
        assert err < 1e-5, f"{order} {what}: {err:.1e}"


@pytest.mark.parametrize("name", LATENT)
def test_the_backward_keeps_the_latent_not_k_and_v(name):
    # What the VJP closes over, per device (the arrays stacked over C = 4 shards, or split over them): q, out, lse
    # and the gathered latent with its ids (latent_p2p: the local latent block): the strategy's activation_bytes;
    # no per-head K or V (all_gather keeps them, B S H (Q + V) b).
    q, latent, w, pos, seg, _ = inputs()
    mesh = make_mesh(4, 1)
    pullback = jax.eval_shape(lambda *a: jax.vjp(lambda q, latent, w: attend_latent(
        q, latent, w, pos, seg, spec(name=name), mesh), *a)[1], q, latent, w)
    # Left out: the weight, and the query rows' own ids (an input, per device [B, S/C] stacked over the shards).
    kept = [x for x in jax.tree.leaves(pullback) if x.shape not in (w.shape, (4 * B, S // 4))]
    shape = AttentionShape(batch=B, seq=S, heads=H, kv_heads=H, head_dim=Q, itemsize=4, cp=4, value_head_dim=V,
                           latent_rank=R, rope_dim=PR)
    assert sum(x.size * x.dtype.itemsize for x in kept) / 4 == strategies.get(name).activation_bytes(shape)
    assert not [x.shape for x in kept if x.ndim == 4 and x.shape[:2] == (4 * B, S)]  # nothing per head of S keys
    latents = [x.shape for x in kept if x.ndim == 3 and x.shape[-1] == L]
    assert latents == [(4 * B, S if name == NAME else S // 4, L)]  # gathered, or the device's own S / C rows


def mla_attention(strategy: str, attention: AttentionSpec, mesh, nope: int = N):
    """(q, latent, wkv_b, positions, segment ids) -> out: from the latent under a strategy that moves it, else from K
    and V rebuilt first, as MlaAttention does (`nope`: the q/k head dim without RoPE)."""
    from maxctx.attention.cp.latent import rebuild
    from maxctx.attention.dispatch import attend

    def fwd(q, latent, w, pos, seg):
        if strategy in LATENT:
            return attend_latent(q, latent, w, pos, seg, attention, mesh)
        return attend(q, *rebuild(latent, w, nope), pos, seg, attention, mesh)

    return fwd


def compiled_bytes(strategy: str, backward: bool):
    """Collective bytes per kind of one MLA layer's attention at C = 4 (forward, or forward + backward in q and
    what the strategy moves) from the compiled HLO: the latent under a latent strategy, K and V under the others."""
    mesh = make_mesh(4, 1)
    bs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    ids = [jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=bs)] * 2
    fwd = mla_attention(strategy, AttentionSpec(kernel="blockwise", strategy=strategy, block_q=4, block_kv=4), mesh)

    def fwd_bwd(q, latent, w, pos, seg):
        out, pullback = jax.vjp(lambda q, latent: fwd(q, latent, w, pos, seg), q, latent)
        return pullback(out)

    args = [sd((B, S, H, Q), sharding=bs), sd((B, S, L), sharding=bs), sd((R, H, N + V), sharding=None), *ids]
    return collective_bytes(jax.jit(fwd_bwd if backward else fwd).lower(*args).compile().as_text())


@pytest.mark.parametrize("name", LATENT)
def test_bytes_are_the_formulas_and_below_all_gathers_by_the_heads_times_widths(name):
    # latent_all_gather against all_gather: an all-gather and a reduce-scatter; latent_p2p against p2p: the ring's
    # permutes (C - 1 blocks each way, the fp32 gradients C times in the backward).
    shape = AttentionShape(batch=B, seq=S, heads=H, kv_heads=H, head_dim=Q, itemsize=4, cp=4, value_head_dim=V,
                           latent_rank=R, rope_dim=PR)
    want_fwd, want_bwd = (by_kind(ops) for ops in strategies.get(name).comm_volume(shape))
    got_fwd, got_all = compiled_bytes(name, False), compiled_bytes(name, True)
    # Besides KINDS the backward has an all-reduce of d latent over the tensor axis (groups of one here): the sum
    # over head shards that the model's own wkv_b projection has under tensor parallelism with any strategy.
    assert {k: got_fwd[k] for k in KINDS if got_fwd[k]} == want_fwd, (got_fwd, want_fwd)
    assert {k: got_all[k] for k in KINDS if got_all[k]} == {k: want_fwd.get(k, 0) + want_bwd.get(k, 0)
                                                             for k in {*want_fwd, *want_bwd}}, got_all
    kv = compiled_bytes(KV[name], True)
    ratio = H * (Q + V) / L
    if name == NAME:
        ids = 2 * B * S * 4  # positions and segment ids, gathered alike
        assert (kv["all-gather"] - ids) / (got_all["all-gather"] - ids) == pytest.approx(ratio, rel=1e-9)
        assert kv["reduce-scatter"] / got_all["reduce-scatter"] == pytest.approx(ratio, rel=1e-9)
    else:
        ids = 2 * 3 * 2 * B * (S // 4) * 4  # the ids' C - 1 hops each way, passed alike
        permuted = "collective-permute"
        assert (kv[permuted] - ids) / (got_all[permuted] - ids) == pytest.approx(ratio, rel=1e-9)


def grad_temp_bytes(strategy: str, seq: int, heads: int, q_dim: int, v_dim: int, rank: int) -> int:
    """Temp bytes per device of one MLA attention's gradient (q, latent, wkv_b) at C = 4, fp32, one sequence, with
    blocks of 128 keys (so the kernel's own scores stay a constant): from the latent under latent_all_gather, from
    K and V rebuilt before the layer (as MlaAttention does) under all_gather."""
    mesh = make_mesh(4, 1)
    bs = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    nope = q_dim - PR
    fwd = mla_attention(strategy, AttentionSpec(kernel="blockwise", strategy=strategy, block_q=128, block_kv=128),
                        mesh, nope)

    def loss(*args):
        return (fwd(*args) ** 2).sum()

    sd = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = [sd((1, seq, heads, q_dim), sharding=bs), sd((1, seq, rank + PR), sharding=bs),
            sd((rank, heads, nope + v_dim)), *[jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=bs)] * 2]
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile(FAST_COMPILE)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", LATENT)
def test_the_backwards_memory_grows_as_the_formulas_say_and_holds_no_whole_k_or_v(name):
    # Many heads (32 x (32 + 16) per-head K/V numbers a token against a latent of 24), so K and V held for all S
    # keys (or the ring's S / C) would show. What the planner holds for a layer's attention under the latent, its
    # activation_bytes + transient_bytes, grows with S as the compiled program's temp bytes do (the kernel's blocks
    # add a constant): latent_all_gather 1.21x, latent_p2p 1.18x, asserted within 0.9-1.3x. The K/V strategy
    # it replaces grows them faster: all_gather's K and V of S keys 2.87x (its formulas say 2.54x, and the K and V
    # it is handed, with their gradients, are the layer's), p2p's blocks of S / C keys 1.67x (asserted 1.4x).
    heads, q_dim, v_dim, rank = 32, 32, 16, 16
    slopes = {s: grad_temp_bytes(s, 8192, heads, q_dim, v_dim, rank) - grad_temp_bytes(s, 4096, heads, q_dim,
                                                                                         v_dim, rank)
              for s in (name, KV[name])}
    latent = strategies.get(name)
    held = [latent.activation_bytes(s) + latent.transient_bytes(s) for s in (
        AttentionShape(batch=1, seq=seq, heads=heads, kv_heads=heads, head_dim=q_dim, itemsize=4, cp=4,
                       value_head_dim=v_dim, latent_rank=rank, rope_dim=PR) for seq in (4096, 8192))]
    ratio = slopes[name] / (held[1] - held[0])
    assert 0.9 < ratio < 1.3, f"temp bytes grew {ratio:.2f}x what the formulas hold from S = 4096 to 8192"
    assert slopes[KV[name]] > (2.5 if name == NAME else 1.4) * slopes[name], slopes


@pytest.mark.parametrize("name", LATENT)
def test_a_model_without_mla_is_refused_in_one_line(capsys, name):
    from maxctx.loader import load_config
    from maxctx.train import main

    assert main(["configs/base.yml", "cpu_devices=4", "ici_context_parallelism=4",
                 f"context_parallel_strategy={name}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"context_parallel_strategy={name}" in err and "all_gather" in err, err
    load_config(["configs/base.yml", "model_name=deepseek2-16b", "cpu_devices=4", "ici_context_parallelism=4",
                 f"context_parallel_strategy={name}"])  # MLA: accepted

def packed_batch(tokens: np.ndarray) -> dict:
    """The fixture's tokens as three packed documents (positions restart, the last token of each has no target)."""
    lengths = (50, 45, 33)
    seg = np.repeat(np.arange(1, 4), lengths)[None].astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
    last = np.cumsum(lengths) - 1
    return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "positions": pos, "segment_ids": seg,
            "weights": (~np.isin(np.arange(tokens.shape[1]), last)).astype(np.float32)[None]}


def _loss_and_grads(checkpoint, batch, cp: int, strategy: str, load_balance: str = "true"):
    """(loss, {path: gradient}) of the packed batch under `strategy` at C = `cp` (the batch stored as given)."""
    from maxctx.mesh import batch_sharding
    from maxctx.train_step import loss_terms
    from tests.support.hf import setup
    from tests.support.strategies import config_args

    _, made, state = setup(checkpoint, cp, f"ici_context_parallelism={cp}", *config_args(strategy, cp),
                           f"context_parallel_load_balance={load_balance}")
    placed = {k: jax.device_put(v, batch_sharding(made.mesh)) for k, v in batch.items()}
    fn = jax.jit(jax.value_and_grad(lambda p, b, g=made.graphdef: loss_terms(g, p, b)[0]))
    loss, grads = fn.lower(state["params"], placed).compile(FAST_COMPILE)(state["params"], placed)
    return float(loss), dict(jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, grads)))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """fixture name -> (checkpoint, its tokens as a packed batch, one device's loss and gradients), made once."""
    from tests.support.hf import FIXTURES, import_fixtures

    made = {}

    def get(name: str):
        if name not in made:
            checkpoint = import_fixtures(tmp_path_factory.mktemp(name), [name])[name]
            batch = packed_batch(np.load(FIXTURES / name / "tokens.npy"))
            made[name] = checkpoint, batch, _loss_and_grads(checkpoint, batch, 1, "all_gather")
        return made[name]

    return get


# deepseek3 (query LoRA, sigmoid router with its correction bias, groups) under every strategy that takes MLA, in
# the zig-zag order; deepseek2 (plain query projection, softmax router, a dense first layer) under a K/V ring and the
# latent's in the documents order (each document's pieces spread over the ranks).
TRAINED = [("deepseek3", s, "true") for s in ("all_gather", "a2a", "p2p", "usp", *LATENT)] + [
    ("deepseek2", s, "documents") for s in ("p2p", RING)]


@pytest.mark.parametrize("fixture,name,load_balance", TRAINED)
def test_deepseek_loss_and_gradients_at_c4_are_one_devices(one_device, fixture, name, load_balance):
    # The model's path (MlaAttention hands a latent strategy q, the normed latent with the rotated key, and wkv_b;
    # a K/V strategy the rebuilt K and V): the loss and every parameter's gradient of a packed batch stored in the
    # load balance's order equal one device's.
    from maxctx.attention.cp.load_balance import reorder_batch

    checkpoint, batch, (loss1, grads1) = one_device(fixture)
    stored = reorder_batch(batch, 4, {"true": True}.get(load_balance, load_balance))
    loss4, grads4 = _loss_and_grads(checkpoint, stored, 4, name, load_balance)
    assert abs(loss4 / loss1 - 1) < 1e-5, (loss1, loss4)
    errors = {jax.tree_util.keystr(p): np.abs(grads4[p] - g).max() / max(np.abs(g).max(), 1e-30)
              for p, g in grads1.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda e: -e[1])[:3]


LONG = ["configs/base.yml", "model_name=deepseek2-236b", "compile_topology=v5p-128", "compile_topology_num_slices=4",
        "ici_context_parallelism=64", "ici_fsdp_parallelism=1", "dcn_context_parallelism=4",
        "max_target_length=1048576", "per_device_batch_size=0.00390625", "context_parallel_strategy=auto"]


def test_the_planner_weighs_the_rebuild_against_the_bytes_and_offers_it_to_mla_only():
    # deepseek2-236b at 1M over 4 slices of v5p-128 (C = 256, one sequence): K and V cross DCN under every K/V
    # strategy (usp's all-to-all stays in a slice, but its ring crosses it); the latent moves 128 x 320 / 576 = 71x
    # fewer bytes, and its rebuild of K and V (step_time.rebuild_flops) costs less than that saves. (deepseek2-16b,
    # 16 heads, over 2 slices was this case until the experts' weights were priced as they move: usp 8x16 is
    # 2.6% ahead of the latent there now, docs/choosing_a_strategy.md.)
    from maxctx.loader import load_config
    from maxctx.plan import planner, step_time

    config = load_config(LONG)
    p = planner.plan(config)
    fastest = {c.strategy: c for c in reversed(p.ranked) if c.valid}
    assert p.choice.strategy == NAME, planner.format_plan(p)
    assert p.choice.step_s < 0.97 * fastest["usp"].step_s and p.choice.step_s < 0.1 * fastest["all_gather"].step_s
    chosen = planner.candidate_config(config, NAME, 1)
    mesh = planner.mesh_plan(config)
    assert step_time.rebuild_flops(chosen, mesh, 2) > 0  # the rebuild is priced ...
    assert step_time.rebuild_flops(planner.candidate_config(config, "all_gather", 1), mesh, 2) == 0  # ... for it alone
    llama = planner.plan(load_config([*LONG, "model_name=llama3.1-8b"]))
    assert not {NAME, RING} & {c.strategy for c in llama.ranked}
    assert RING in {c.strategy for c in p.ranked}  # offered, and slower than the gather over DCN (a ring's hops wait
    # on the slowest link): docs/choosing_a_strategy.md
