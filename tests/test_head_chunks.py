"""Head-chunked attention (attention_head_chunks, maxctx.model.layers.Attention): exact, same bytes moved.

- The loss and every gradient equal the unchunked ones (fp32, 1e-6 relative) under every CP strategy with packed
  documents, with a sliding window (local and global layers), and with heads split over a tensor axis.
- The compiled step moves the same collective bytes per kind (HLO) with 2 groups as with 1.
- Bad values are refused before JAX with the key and the fix.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import numpy as np
import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.plan.program import Program, _output, shape_bytes
from maxctx.train_step import init_state, loss_sums, make_setup
from maxctx.validate import check_devices
from tests.support.strategies import names as strategy_names
from tests.test_tiling import assert_same_gradients, packed_batches

S = 128
SMALL = ["dtype=float32", "attention=flash", "flash_block_q=16", "flash_block_kv=16", f"max_target_length={S}",
         "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=128", "vocab_size=256", "head_dim=16"]
# 8 query and 4 kv heads at C = 4: two groups of 4 query and 2 kv heads, so each group's kv heads are repeated for
# a2a's all-to-all just as the whole layer's are (4 -> 4 and 2 -> 4 would not hold bytes equal; module doc of
# maxctx.attention.cp.a2a).
HEADS = ["base_num_query_heads=8", "base_num_kv_heads=4"]


def config(*overrides):
    return load_config(["configs/base.yml", *SMALL, *overrides])


@functools.cache
def loss_and_grads(*overrides):
    """(loss, gradients, the compiled program's HLO text) of one packed batch; compiled once per key set."""
    cfg = config(*overrides)
    setup = make_setup(cfg, create_mesh(cfg))
    params = init_state(setup)["params"]
    batch = packed_batches(setup, 1)[0]
    grad_fn = jax.value_and_grad(loss_sums, argnums=1, has_aux=True)
    compiled = jax.jit(grad_fn, static_argnums=0).lower(setup.graphdef, params, batch).compile()
    (loss, _), grads = compiled(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


def assert_same(reference, chunked_result):
    (loss0, grads0, _), (loss1, grads1, _) = reference, chunked_result
    assert abs(loss1 / loss0 - 1) < 1e-6, (loss0, loss1)
    assert_same_gradients(grads0, grads1)


C4 = ("ici_context_parallelism=4", "per_device_batch_size=0.5")
CASES = {"all_gather, tensor 2": ("ici_context_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=0.5",
                                  "context_parallel_strategy=all_gather"),
         "a2a, window": (*C4, "context_parallel_strategy=a2a", "sliding_window_size=24", "attention_layer_pattern=LG"),
         "p2p, 4 groups": (*C4, "context_parallel_strategy=p2p", "attention_head_chunks=4"),
         "usp": (*C4, "context_parallel_strategy=usp", "context_parallel_a2a_degree=2")}
assert set(strategy_names()) <= {name.split(",")[0] for name in CASES}, "a strategy without an exactness case"


def chunked(keys: tuple[str, ...]) -> tuple[str, ...]:
    return keys if any(k.startswith("attention_head_chunks") for k in keys) else (*keys, "attention_head_chunks=2")


def unchunked(keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(k for k in keys if not k.startswith("attention_head_chunks"))


@pytest.mark.parametrize("name", CASES)
def test_head_chunks_give_the_same_loss_and_gradients(name):
    assert_same(loss_and_grads(*HEADS, *unchunked(CASES[name])), loss_and_grads(*HEADS, *chunked(CASES[name])))


def collectives(hlo: str) -> tuple[Counter, Counter]:
    """Bytes per collective kind of a compiled program: (of floating-point arrays, of int32 arrays: the
    positions and segment ids that travel with K/V)."""
    program = Program(hlo)
    assert not program.uncounted_loops, program.uncounted_loops
    total = program.collective_bytes()
    ids = Counter()
    for ins, times in program.instructions():
        kind = ins.op.removesuffix("-start")
        if kind in ("collective-permute", "all-to-all", "all-gather") and not ins.op.endswith("-done"):
            result = _output(ins) if ins.op.endswith("-start") else ins.result
            ids[kind] += times * sum(shape_bytes(m.group()) for m in re.finditer(r"s32\[[0-9,]*\]", result))
    return total - ids, ids


@pytest.mark.parametrize("name", ["p2p, 4 groups", "usp"])
def test_head_chunks_move_the_same_collective_bytes(name):
    """Every collective moves the same bytes of K, V, q, out and their gradients with N groups as with 1; the
    positions and segment ids (int32, 8 bytes a token) travel with each group's K/V: up to N times theirs; usp's
    all-to-all of q, k, v runs once more in the backward (below). (With
    tensor parallelism the output projection's all-reduce runs once per group, N times the bytes; where K / N kv
    heads must be repeated for the all-to-all and K need not, a2a moves more: neither case is here.)"""
    one, ids_one = collectives(loss_and_grads(*HEADS, *unchunked(CASES[name]))[2])
    two, ids_two = collectives(loss_and_grads(*HEADS, *chunked(CASES[name]))[2])
    assert one["collective-permute"] > 0, one
    if name == "usp":
        # A group's backward recomputes its q, k, v and their all-to-all (kept, they would hold what the groups
        # save); out keeps its own (the ring's residuals). Of the unchunked layer's three passes of all-to-alls
        # (forward, remat's forward, backward: q, k, v, out or their gradients, 2H + 2K heads each), that is
        # H + 2K heads of one pass more.
        h, k = 8, 4
        assert two["all-to-all"] - one["all-to-all"] == one["all-to-all"] / 3 * (h + 2 * k) / (2 * h + 2 * k)
        one, two = Counter({**one, "all-to-all": 0}), Counter({**two, "all-to-all": 0})
    assert two == one, (one, two)
    n = int(chunked(CASES[name])[-1].split("=")[1])
    for kind in ids_one | ids_two:
        assert ids_one[kind] <= ids_two[kind] <= n * ids_one[kind], (kind, ids_one, ids_two)


@pytest.mark.parametrize("keys,message", [
    (["attention_head_chunks=0"], "attention_head_chunks=0 must be"),
    (["ici_context_parallelism=4", "attention_head_chunks=3"], "does not divide base_num_kv_heads=4"),
    (["ici_context_parallelism=4", "context_parallel_strategy=a2a", "attention_head_chunks=4"],
     "not divisible by the A2A degree 4"),
])
def test_bad_head_chunks_are_refused_with_the_fix(keys, message):
    with pytest.raises(ConfigError, match=message):
        check_devices(config(*HEADS, "per_device_batch_size=0.5", *keys), 8)
