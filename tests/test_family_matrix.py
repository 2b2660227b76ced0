"""Every model family's Hugging Face fixture (tests/fixtures/hf/<name>, made by scripts/make_hf_fixtures.py from
a tiny random model transformers saved) x every CP strategy: imported through train.py's load path it gives
transformers' fp32 logits on 1 device and on 4 under each strategy, and exports back bit-identical.

The matrix is the fixture folders: a family lands with its fixture and is tested here without a list to edit
(the Llama / Mistral ones, with their own negative controls, are tests/test_convert.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from maxctx.convert.to_hf import export_hf
from tests.support.hf import FIXTURES, import_fixtures, logits, relative_error, tensors
from tests.support.strategies import config_args, names as strategy_names

LLAMA = ("llama", "llama3_1", "mistral")
MODELS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists() and p.name not in LLAMA)
quiet = lambda *args, **kwargs: None  # noqa: E731


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), MODELS)


@pytest.mark.parametrize("cp,strategy", [(1, "all_gather")] + [(4, s) for s in strategy_names()])
@pytest.mark.parametrize("name", MODELS)
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
