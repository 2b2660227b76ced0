"""The input pipeline on every source: the batch contract, packing invariants, CP order, determinism, exact resume
and eval, on 8 simulated devices with data built here (ArrayRecord shards, text files, a TFDS dataset, a
sentencepiece model trained on generated text)."""

import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxctx.attention.cp.load_balance import restore_order
from maxctx.data import BATCH_KEYS, DataError
from maxctx.data.pipeline import create_data_iterator
from maxctx.data.prepare import prepare_shards
from maxctx.data.sources import encode_tokens
from maxctx.data.tokenizer import Tokenizer
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES
from tests.support import fixtures as F

SEQ = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    docs = F.make_documents(240, seed=1)
    train, evals = docs[:200], docs[200:]
    tok = F.tiny_tokenizer(str(root / "sp.model"), docs)
    for k in range(2):
        F.write_arrayrecord(str(root / f"text-train-{k}.array_record"), [d.encode() for d in train[k::2]])
    F.write_arrayrecord(str(root / "text-eval.array_record"), [d.encode() for d in evals])
    F.write_txt(str(root / "train.txt"), train)
    F.write_jsonl(str(root / "train.jsonl"), train)
    F.write_jsonl(str(root / "eval.jsonl"), evals)
    prepare_shards(str(root / "train.jsonl"), tok, str(root / "tokens"), 3, progress=False)
    prepare_shards(str(root / "eval.jsonl"), tok, str(root / "tokens-eval"), 1, progress=False)
    F.build_tfds(str(root / "tfds"), {"train": train, "validation": evals})
    sp = Tokenizer(tok, 256)
    encoded = [sp.encode(d) for d in docs]
    return {"root": str(root), "tok": tok, "encoded": encoded, "eval_encoded": encoded[200:]}


def source_args(data, kind):
    root, tok = data["root"], data["tok"]
    return {
        "arrayrecord_text": ["dataset_type=arrayrecord", f"grain_train_files={root}/text-train-*",
                             f"grain_eval_files={root}/text-eval.array_record", f"tokenizer_path={tok}"],
        "arrayrecord_tokens": ["dataset_type=arrayrecord", f"grain_train_files={root}/tokens-0*",
                               f"grain_eval_files={root}/tokens-eval-*"],
        "txt": ["dataset_type=text", f"grain_train_files={root}/train.txt", f"tokenizer_path={tok}"],
        "jsonl": ["dataset_type=text", f"grain_train_files={root}/train.jsonl",
                  f"grain_eval_files={root}/eval.jsonl", f"tokenizer_path={tok}"],
        "tfds": ["dataset_type=tfds", f"dataset_name={F.TFDS_NAME}", f"tfds_data_dir={root}/tfds",
                 "eval_split=validation", f"tokenizer_path={tok}"],
    }[kind]


def make(data, kind, *overrides, split="train"):
    args = ["per_device_batch_size=1", f"max_target_length={SEQ}", "grain_prefetch_buffer_size=2",
            *source_args(data, kind), *overrides]
    config = load_config([f"{k}={v}" for k, v in dict(a.split("=", 1) for a in args).items()])  # later wins
    return create_data_iterator(config, create_mesh(config), split)


def host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def draw(iterator, n):
    out = [host(next(iterator)) for _ in range(n)]
    iterator.close()
    return out


def check_contract(batch, encoded, add_bos=True, add_eos=True):
    """Every segment is a contiguous piece of one document, shifted within it; positions count up from the
    segment's start; padding has segment 0 and weight 0."""
    docs = [",".join(map(str, [1] * add_bos + list(d) + [2] * add_eos)) for d in encoded]
    text = "|," + ",|,".join(docs) + ",|"
    assert set(batch) == set(BATCH_KEYS)
    for key in BATCH_KEYS:
        assert batch[key].shape == batch["inputs"].shape
    np.testing.assert_array_equal(batch["weights"], (batch["segment_ids"] > 0).astype(np.float32))
    for row in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            assert (np.diff(idx) == 1).all(), "a segment is contiguous"
            pos = batch["positions"][row, idx]
            assert (np.diff(pos) == 1).all(), "positions count up by one inside a segment"
            inputs, targets = batch["inputs"][row, idx], batch["targets"][row, idx]
            np.testing.assert_array_equal(inputs[1:], targets[:-1])
            piece = "," + ",".join(map(str, [*inputs, targets[-1]])) + ","
            assert piece in text, "a segment's inputs and targets come from one document"
        assert (seg[seg == 0] == 0).all()


@pytest.mark.parametrize("kind", ["arrayrecord_text", "arrayrecord_tokens", "txt", "jsonl", "tfds"])
def test_every_source_meets_the_batch_contract(data, kind):
    it = make(data, kind)
    batch = next(it)
    for value in batch.values():
        assert value.shape == (8, SEQ)
        assert value.sharding.spec == P(BATCH_AXES, CONTEXT_AXES)
    batches = [host(batch)] + draw(it, 1)
    for b in batches:
        check_contract(b, data["encoded"])
        assert b["weights"].mean() > 0.5


@pytest.mark.parametrize("packing", ["first_fit", "concat", "none"])
def test_packing_modes(data, packing):
    batches = draw(make(data, "arrayrecord_tokens", f"packing={packing}"), 3)
    for b in batches:
        check_contract(b, data["encoded"])
    segments = [len(np.unique(s[s > 0])) for b in batches for s in b["segment_ids"]]
    if packing != "concat":  # concat continues a cut document in the next row at its running position
        for b in batches:
            starts = np.diff(b["segment_ids"], axis=1, prepend=0) != 0
            assert (b["positions"][starts & (b["segment_ids"] > 0)] == 0).all(), "positions restart per document"
    if packing == "none":
        assert max(segments) == 1
        assert all((b["positions"][:, 0] == 0).all() for b in batches)
    else:
        assert max(segments) > 1, "short documents share a row"
    if packing == "concat":
        assert all(b["weights"].min() == 1.0 for b in batches), "concat leaves no padding"


def test_documents_end_with_their_own_eos(data):
    b = draw(make(data, "arrayrecord_tokens", "packing=none"), 1)[0]
    lengths = b["weights"].sum(axis=1).astype(int)
    assert (lengths < SEQ).any()
    for row, n in enumerate(lengths):
        assert b["inputs"][row, 0] == 1
        if n < SEQ:  # not trimmed: the last input predicts the document's own EOS, never a next document
            assert b["targets"][row, n - 1] == 2


def test_bos_eos_switches(data):
    b = draw(make(data, "arrayrecord_tokens", "add_bos=false", "add_eos=false"), 1)[0]
    real = b["segment_ids"] > 0
    assert not np.isin(b["inputs"][real], [1, 2]).any() and not np.isin(b["targets"][real], [1, 2]).any()
    check_contract(b, data["encoded"], add_bos=False, add_eos=False)


def test_context_parallel_order_is_the_zigzag_of_the_plain_batch(data):
    plain = draw(make(data, "jsonl", "context_parallel_load_balance=false", "ici_context_parallelism=2"), 2)
    zigzag = draw(make(data, "jsonl", "ici_context_parallelism=2"), 2)
    no_cp = draw(make(data, "jsonl"), 2)
    for p, z, n in zip(plain, zigzag, no_cp):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(restore_order(z[key], 2), p[key])
            np.testing.assert_array_equal(p[key], n[key])
        assert not np.array_equal(z["positions"], p["positions"])


def test_same_config_same_batches_and_seed_changes_order(data):
    a = draw(make(data, "txt"), 3)
    b = draw(make(data, "txt"), 3)
    c = draw(make(data, "txt", "data_shuffle_seed=7"), 3)
    for x, y in zip(a, b):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(x[key], y[key])
    assert not all(np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))


@pytest.mark.parametrize("packing,prefetch", [("first_fit", 2), ("concat", 0), ("none", 2)])
def test_resume_from_saved_state_gives_the_same_next_batches(data, packing, prefetch):
    overrides = (f"packing={packing}", f"grain_prefetch_buffer_size={prefetch}")
    it = make(data, "arrayrecord_text", *overrides)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # the checkpoint stores it as JSON
    expected = draw(it, 4)
    resumed = make(data, "arrayrecord_text", *overrides)
    next(resumed)  # a fresh iterator that has moved elsewhere still lands exactly on the saved position
    resumed.set_state(state)
    for x, y in zip(expected, draw(resumed, 4)):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(x[key], y[key])


def test_resume_across_epochs(data):
    """200 documents, ~4 per row, 8 rows: a few steps cross an epoch boundary (reshuffled per epoch)."""
    it = make(data, "jsonl", "packing=none", "grain_prefetch_buffer_size=0")
    for _ in range(23):
        next(it)
    state = it.get_state()
    expected = draw(it, 4)
    resumed = make(data, "jsonl", "packing=none")
    resumed.set_state(state)
    for x, y in zip(expected, draw(resumed, 4)):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])


def test_grain_worker_processes_give_the_same_kind_of_batches_and_resume(data):
    it = make(data, "arrayrecord_tokens", "grain_worker_count=2")
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = draw(it, 2)
    for b in expected:
        check_contract(b, data["encoded"])
    resumed = make(data, "arrayrecord_tokens", "grain_worker_count=2")
    resumed.set_state(state)
    for x, y in zip(expected, draw(resumed, 2)):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])


@pytest.mark.parametrize("kind", ["arrayrecord_tokens", "jsonl", "tfds"])
def test_eval_split_reads_eval_data_in_a_fixed_order(data, kind):
    extra = ("eval_interval=10",)
    a = draw(make(data, kind, *extra, split="eval"), 2)
    b = draw(make(data, kind, *extra, "data_shuffle_seed=3", split="eval"), 2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    for x in a:
        check_contract(x, data["eval_encoded"])
    train = draw(make(data, kind), 1)[0]
    assert not np.array_equal(train["inputs"], a[0]["inputs"])


def test_eval_iterator_rewinds_with_its_first_state(data):
    it = make(data, "jsonl", "eval_interval=10", split="eval")
    start = it.get_state()
    first = host(next(it))
    next(it)
    it.set_state(start)
    np.testing.assert_array_equal(host(next(it))["inputs"], first["inputs"])
    it.close()


def test_state_from_another_process_count_is_refused(data):
    it = make(data, "jsonl")
    state = it.get_state()
    with pytest.raises(DataError, match="process"):
        it.set_state({**state, "process_count": 2})
    it.close()


def test_token_records_outside_the_vocabulary_are_named(data, tmp_path):
    path = F.write_arrayrecord(str(tmp_path / "bad.array_record"), [encode_tokens([5, 6, 7]),
                                                                    encode_tokens([5, 300])])
    it = make(data, "arrayrecord_tokens", f"grain_train_files={path}", "packing=none",
              "grain_prefetch_buffer_size=0")
    with pytest.raises(DataError, match=f"{path} record 1.*300.*vocab_size=256"):
        next(it)


def test_synthetic_iterator_resumes_and_loads_only_its_rows(data):
    config = load_config(["per_device_batch_size=1", f"max_target_length={SEQ}"])
    it = create_data_iterator(config, create_mesh(config), "train")
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = host(next(it))
    it.set_state(state)
    np.testing.assert_array_equal(host(next(it))["inputs"], expected["inputs"])
