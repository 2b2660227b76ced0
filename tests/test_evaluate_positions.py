"""Loss by position (maxctx.evaluate.step): the doubling buckets, the same buckets under every CP strategy at C = 4
as without CP (zig-zag order, packed synthetic documents), and a converted Hugging Face Llama's per-position loss
equal to transformers' (tests/fixtures/hf, made by scripts/make_hf_fixtures.py), per token and through
`python -m maxctx.evaluate`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxctx.checkpoint.manager import Checkpointer
from maxctx.convert.from_hf import import_hf
from maxctx.data.sources import encode_tokens
from maxctx.evaluate import cli
from maxctx.evaluate.loop import Evaluator
from maxctx.evaluate.step import bucket_labels, bucket_of
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.train_step import init_state, make_setup
from tests.support import fixtures as F
from tests.support.strategies import config_args, names as strategy_names

LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama"


def test_buckets_double_from_the_documents_start():
    assert bucket_labels(128) == ["1-2", "2-4", "4-8", "8-16", "16-32", "32-64", "64-128"]
    assert bucket_labels(100)[-2:] == ["32-64", "64-100"]
    positions = jnp.array([[0, 1, 2, 3, 4, 7, 8, 62, 63, 126, 127]])  # the (p + 1)-th token of its document
    assert bucket_of(positions, 128).tolist() == [[0, 1, 1, 2, 2, 3, 3, 5, 6, 6, 6]]


COMMON = ["dtype=float32", "per_device_batch_size=1", "eval_interval=5", "eval_steps=2", "flash_block_q=16",
          "flash_block_kv=16", "enable_checkpointing=false"]


def by_position(params, *overrides: str) -> dict[str, float]:
    config = load_config([*COMMON, *overrides])
    setup = make_setup(config, create_mesh(config))
    values = Evaluator(config, setup).scores(jax.device_put(params, setup.state_shardings["params"]))
    return {"loss": values["loss"], **values["loss_by_position"]}


@pytest.fixture(scope="module")
def without_cp():
    config = load_config(COMMON)
    params = init_state(make_setup(config, create_mesh(config)))["params"]
    return params, by_position(params)


@pytest.mark.parametrize("strategy,balanced", [(s, True) for s in strategy_names()] + [("p2p", False)])
def test_cp_buckets_equal_those_without_cp(without_cp, strategy, balanced):
    """Zig-zag order (context_parallel_load_balance=true), and once in the plain order."""
    params, expected = without_cp
    got = by_position(params, "ici_context_parallelism=4", *config_args(strategy, 4),
                      f"context_parallel_load_balance={str(balanced).lower()}")
    assert list(got) == list(expected) == ["loss", *bucket_labels(128)]  # packed documents fill every bucket
    np.testing.assert_allclose(list(got.values()), list(expected.values()), rtol=1e-5, err_msg=strategy)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    """The Llama fixture converted, and its tokens as a one-document eval split (no BOS/EOS added)."""
    out = tmp_path_factory.mktemp("hf_eval")
    import_hf(str(LLAMA), str(out / "ckpt"), [], say=lambda *a, **k: None)
    tokens = np.load(LLAMA / "tokens.npy")[0]
    data = F.write_arrayrecord(str(out / "eval.array_record"), [encode_tokens(tokens)])
    args = [str(out / "ckpt" / "model.yml"), f"load_parameters_path={out / 'ckpt'}", "dtype=float32",
            "dataset_type=arrayrecord", f"grain_train_files={data}", f"grain_eval_files={data}", "packing=none",
            "add_bos=false", "add_eos=false", "max_target_length=128", "per_device_batch_size=1", "eval_steps=-1",
            f"base_output_directory={out}", "enable_tensorboard=false"]
    return {"args": args, "tokens": tokens, "expected": np.load(LLAMA / "token_losses.npy")}


def test_converted_llama_per_token_loss_is_transformers(llama):
    config = load_config([*llama["args"], "enable_checkpointing=false"])
    setup = make_setup(config, create_mesh(config, jax.devices()[:1]))
    params = Checkpointer(config, setup).restore_or_init(None)["params"]
    tokens = jnp.asarray(llama["tokens"][None])
    positions = jnp.arange(tokens.shape[1])[None]
    model = nnx.merge(setup.graphdef, params)
    ce, _ = model.token_scores(tokens[:, :-1], positions[:, :-1], jnp.ones_like(tokens[:, :-1]), tokens[:, 1:])
    np.testing.assert_allclose(np.asarray(ce[0]), llama["expected"], rtol=1e-5, atol=1e-5)


def test_maxctx_evaluate_gives_transformers_loss_by_position(llama, capsys):
    """The command on the converted model at C = 4: each bucket is the mean of transformers' losses in it."""
    assert cli.main([*llama["args"], "run_name=hf_c4", "ici_context_parallelism=4"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    buckets = np.asarray(bucket_of(jnp.arange(127), 128))
    expected = {label: float(llama["expected"][buckets == k].mean()) for k, label in enumerate(bucket_labels(128))}
    assert list(record["loss_by_position"]) == list(expected)
    np.testing.assert_allclose(list(record["loss_by_position"].values()), list(expected.values()), rtol=1e-5)
    np.testing.assert_allclose(record["loss"], llama["expected"].mean(), rtol=1e-5)
    lines = (Path(llama["args"][-2].split("=", 1)[1]) / "hf_c4" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["loss_by_position"] == record["loss_by_position"]
