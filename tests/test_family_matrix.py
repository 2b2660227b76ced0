"""Every model family's Hugging Face fixture (tests/fixtures/hf/<name>, made by scripts/make_hf_fixtures.py from
a tiny random model transformers saved) x every CP strategy: imported through train.py's load path it gives
transformers' fp32 logits on 1 device and on 4 under each strategy, and exports back bit-identical.

The matrix is the fixture folders: a family lands with its fixture and is tested here under every strategy without
a list to edit (the Llama / Mistral ones, with their own negative controls, are tests/test_convert.py's). The
fixtures in PLAIN hand the strategies what another fixture here already does (grouped-query attention, causal or
windowed, with its scale; qwen3_next: qwen3_5's linear and gated layers, its MoE per token; qwen3_moe_sparse:
qwen3_moe's and qwen3's layers in runs; gpt_oss: its sinks with windows under every strategy, zig-zag and packed,
forward and gradients, are tests/test_attention_sinks.py's at a fraction of a model row's cost): each runs one
strategy at C = 4, the strategies dealt out in turn, to keep the suite's time; the rest (soft-cap and windows:
gemma2, olmo3; MLA's value head dim: deepseek2; Gated DeltaNet's prefix scan: qwen3_5; and any new fixture) run
all. A strategy that moves MLA's latent (maxctx.attention.cp.latent) runs on the MLA fixtures (deepseek2,
deepseek3) only: the other families are refused it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from maxctx.convert.to_hf import export_hf
from tests.support.hf import FIXTURES, import_fixtures, logits, relative_error, tensors
from tests.support.strategies import config_args, latent_names, names as strategy_names

LLAMA = ("llama", "llama3_1", "mistral")
MODELS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists() and p.name not in LLAMA)
MLA = ("deepseek2", "deepseek3")
PLAIN = ("deepseek3", "gemma3", "gpt_oss", "mixtral", "olmo2", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_sparse",
         "qwen3_next")
quiet = lambda *args, **kwargs: None  # noqa: E731


def _cases() -> list[tuple[str, int, str]]:
    """(fixture, C, strategy): every fixture on 1 device; at C = 4 every strategy, or one for a PLAIN fixture; the
    strategies that move MLA's latent for the MLA fixtures."""
    every = strategy_names()
    plain = [name for name in MODELS if name in PLAIN]
    return ([(name, 1, "all_gather") for name in MODELS]
            + [(name, 4, s) for name in MODELS if name not in PLAIN for s in every]
            + [(name, 4, every[i % len(every)]) for i, name in enumerate(plain)]
            + [(name, 4, s) for name in MODELS if name in MLA for s in latent_names()])


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), MODELS)


@pytest.mark.parametrize("name,cp,strategy", _cases())
def test_logits_match_transformers(imported, name, cp, strategy):
    expected = np.load(FIXTURES / name / "logits.npy")
    got = logits(imported[name], np.load(FIXTURES / name / "tokens.npy"), cp, *config_args(strategy, cp))
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_identical(imported, tmp_path, name):
    export_hf(str(imported[name]), str(tmp_path), "fp32", say=quiet)
    before, after = tensors(FIXTURES / name), tensors(tmp_path)
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == source["architectures"]
