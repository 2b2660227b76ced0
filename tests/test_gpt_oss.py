"""The gpt_oss family beyond the family matrix's logits: the presets hold transformers' parameter count of the
released configs, the imported fixture's loss is transformers' cross-entropy plus router_aux_loss_coef times its
load-balancing loss (the router's bias included), and an MXFP4 release is refused in one line with exit status 2."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from maxctx.convert.cli import main as convert_main
from maxctx.convert.from_hf import import_hf
from maxctx.loader import load_config
from maxctx.mesh import batch_sharding
from maxctx.model import families
from maxctx.model.decoder import Decoder, count_params
from maxctx.model.layers import ModelConfig
from maxctx.train_step import loss_terms
from tests.support.hf import FIXTURES, setup

# transformers 5.25's GptOssForCausalLM on the meta device, GptOssConfig filled with the released config.json's
# values: every parameter, and every parameter less the experts a token does not run (4 of 32, 4 of 128).
# OpenAI's card: 20.91B and 116.83B total, 3.61B and 5.13B active (those without the embedding table, 579M).
RELEASED = [("gpt-oss-20b", 20_914_757_184, 4_187_440_704), ("gpt-oss-120b", 116_829_156_672, 5_711_982_912)]


@pytest.mark.parametrize("name,total,active", RELEASED)
def test_presets_hold_the_released_parameter_counts(name, total, active):
    config = load_config(["configs/base.yml", f"model_name={name}"])
    abstract = nnx.eval_shape(lambda: Decoder(ModelConfig.from_config(config), nnx.Rngs(0)))
    assert count_params(nnx.state(abstract)) == total
    shape = families.shape(config)
    assert (shape.num_params, shape.active_params) == (total, active)


def test_the_loss_is_transformers_with_its_load_balancing_loss(tmp_path):
    """config.json's router_aux_loss_coef (0.02) carried as load_balance_loss_weight, and the term equal to
    transformers' load_balancing_loss_func on the router's logits with their bias."""
    import_hf(str(FIXTURES / "gpt_oss"), str(tmp_path / "ckpt"), [], say=lambda *a, **k: None)
    config, made, state = setup(tmp_path / "ckpt", 1)
    tokens = np.load(FIXTURES / "gpt_oss" / "tokens.npy")
    seq = tokens.shape[1]
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
             "positions": np.arange(seq, dtype=np.int32)[None], "segment_ids": np.ones_like(tokens),
             "weights": (np.arange(seq) < seq - 1).astype(np.float32)[None]}  # the last token has no next
    batch = {k: jax.device_put(v, batch_sharding(made.mesh)) for k, v in batch.items()}
    total, (weight, terms) = jax.jit(lambda p, b: loss_terms(made.graphdef, p, b))(state["params"], batch)
    coef = json.loads((FIXTURES / "gpt_oss" / "config.json").read_text())["router_aux_loss_coef"]
    assert config.load_balance_loss_weight == coef == 0.02
    aux = np.load(FIXTURES / "gpt_oss" / "aux_loss.npy")
    np.testing.assert_allclose(float(terms["load_balance_loss"] / weight), aux, rtol=1e-5)
    expected = np.load(FIXTURES / "gpt_oss" / "token_losses.npy").mean() + coef * aux
    np.testing.assert_allclose(float(total / weight), expected, rtol=1e-5)


def test_an_mxfp4_release_is_refused_in_one_line(tmp_path, capsys):
    directory = tmp_path / "mxfp4"
    shutil.copytree(FIXTURES / "gpt_oss", directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.embed_tokens"]}
    (directory / "config.json").write_text(json.dumps(config))
    argv = ["from_hf", "--hf_path", str(directory), "--output_path", str(tmp_path / "out")]
    assert convert_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "quant_method='mxfp4'" in lines[0] and "dequantise it with transformers" in lines[0]
    assert str(directory / "config.json") in lines[0]
