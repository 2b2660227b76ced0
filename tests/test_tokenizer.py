"""sentencepiece tokenizer: a tiny model trained here from generated text, BOS/EOS, the vocabulary check, the
shift of a document into (input, target) pairs, and clear errors for bad tokenizers and empty documents."""

import io

import numpy as np
import pytest
import sentencepiece as spm

from maxctx.config import ConfigError
from maxctx.data import DataError
from maxctx.data.tokenizer import EncodeDocument, Tokenizer, load_tokenizer
from maxctx.loader import load_config
from tests.support import fixtures as F


class FakeSource:
    name = "corpus.jsonl"

    def __len__(self):
        return 10

    def describe(self, index):
        return f"corpus.jsonl line {index + 1}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    docs = F.make_documents(300, seed=2)
    return F.tiny_tokenizer(str(tmp_path_factory.mktemp("tok") / "sp.model"), docs, vocab_size=200), docs


def test_tiny_model_roundtrips_text_with_fixed_special_ids(model):
    path, docs = model
    tok = Tokenizer(path, vocab_size=256)
    assert tok.vocab_size == 200 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode(docs[0])
    assert ids.dtype == np.int32 and 0 < len(ids) < len(docs[0]) and ids.max() < 200
    assert tok.decode(ids) == docs[0]


def test_document_becomes_shifted_pairs_with_bos_and_eos(model):
    tok = Tokenizer(model[0], 256)
    ids = tok.encode("hello world")
    pairs = EncodeDocument(FakeSource(), tok, 256, add_bos=True, add_eos=True)(("hello world", 0))
    np.testing.assert_array_equal(pairs["inputs"], [1, *ids])
    np.testing.assert_array_equal(pairs["targets"], [*ids, 2])
    plain = EncodeDocument(FakeSource(), tok, 256, add_bos=False, add_eos=False)(("hello world", 0))
    np.testing.assert_array_equal(plain["inputs"], ids[:-1])
    np.testing.assert_array_equal(plain["targets"], ids[1:])


def test_token_ids_without_tokenizer_use_bos_1_eos_2():
    pairs = EncodeDocument(FakeSource(), None, 256, True, True)((np.array([7, 8], np.int32), 0))
    np.testing.assert_array_equal(pairs["inputs"], [1, 7, 8])
    np.testing.assert_array_equal(pairs["targets"], [7, 8, 2])


@pytest.mark.parametrize("value", ["", np.zeros(0, np.int32)], ids=["text", "ids"])
def test_zero_token_document_is_skipped_and_counted(model, value, capsys):
    """Skipped like scripts/prepare_data.py does; counted, with a line at the 1st, 2nd, 4th, ... skip; a source
    of nothing else is an error."""
    encode = EncodeDocument(FakeSource(), Tokenizer(model[0], 256), 256, True, True)
    assert [encode((value, i)) for i in range(3)] == [None, None, None] and encode.skipped == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["data: skipped 1 document of zero tokens so far in corpus.jsonl (latest: corpus.jsonl line 1)",
                     "data: skipped 2 documents of zero tokens so far in corpus.jsonl (latest: corpus.jsonl line 2)"]
    with pytest.raises(DataError, match="corpus.jsonl: every document read is of zero tokens"):
        for i in range(3, 10):
            encode((value, i))


def test_text_without_tokenizer_is_named():
    with pytest.raises(DataError, match="corpus.jsonl line 1 holds text but tokenizer_path is empty"):
        EncodeDocument(FakeSource(), None, 256, True, True)(("some text", 0))


def test_tokenizer_larger_than_model_vocabulary(model):
    with pytest.raises(ConfigError, match=r"has 200 tokens, more than the model's vocab_size=128.*vocab_size=200"):
        Tokenizer(model[0], vocab_size=128)


def test_missing_and_invalid_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer_path='.*nope.model' does not exist"):
        Tokenizer(str(tmp_path / "nope.model"), 256)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ConfigError, match=r"tokenizer_path='.*bad.model' is not a valid sentencepiece model"):
        Tokenizer(str(bad), 256)


def test_add_bos_with_a_tokenizer_that_has_none(tmp_path):
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(F.make_documents(200)), model_writer=buf, vocab_size=100,
                                   bos_id=-1, eos_id=1, unk_id=0, minloglevel=2)
    path = tmp_path / "nobos.model"
    path.write_bytes(buf.getvalue())
    config = load_config([f"tokenizer_path={path}"])
    with pytest.raises(ConfigError, match="add_bos=true but tokenizer_path=.* has no BOS token; set add_bos=false"):
        load_tokenizer(config)
    assert load_tokenizer(load_config([f"tokenizer_path={path}", "add_bos=false"])).eos_id == 1


def test_long_text_is_tokenized_in_bounded_pieces_with_the_same_ids(model, monkeypatch):
    """A 30 MB line given whole took 1.2 GB in sentencepiece (6 GB in tokenizers); pieces cut at spaces give the
    whole text's ids, and packing=none's `max_tokens` stops after the piece that reaches it."""
    from maxctx.data import tokenizer

    tok = Tokenizer(model[0], 256)
    text = " ".join(model[1])
    whole, encode, seen = tok.reader.encode(text), tok.reader.encode, []
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 1000)
    monkeypatch.setattr(tok.reader, "encode", lambda piece: seen.append(len(piece)) or encode(piece))
    np.testing.assert_array_equal(tok.encode(text), whole)
    assert len(seen) > len(text) // 1000 and max(seen) <= 1000
    seen.clear()
    pairs = EncodeDocument(FakeSource(), tok, 256, True, True, max_tokens=33)((text, 0))
    assert len(seen) == 1 and len(pairs["inputs"]) >= 33
    np.testing.assert_array_equal(pairs["targets"][:32], whole[:32])


def test_pieces_of_a_tokenizer_that_adds_its_own_word_boundary_leave_the_space_out(tmp_path, monkeypatch):
    """Llama 2's sentencepiece settings: a dummy prefix '▁' and spaces kept as they are, so a piece must not begin
    with the space it was cut at (it would read '▁▁')."""
    from maxctx.data import tokenizer

    docs = F.make_documents(200)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=buf, vocab_size=150, minloglevel=2,
                                   remove_extra_whitespaces=False)
    (tmp_path / "llama2.model").write_bytes(buf.getvalue())
    tok = Tokenizer(str(tmp_path / "llama2.model"), 256)
    text = " ".join(docs)
    whole = tok.reader.encode(text)
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 500)
    assert tok.cut_drops_space and tok.encode(text).tolist() == whole


def test_text_pieces_cut_at_a_space_or_else_mid_word():
    from maxctx.data.tokenizer import text_pieces

    text = "ab cd efgh " + "x" * 20 + " yz"
    assert list(text_pieces(text, False, 8)) == ["ab cd", " efgh", " xxxxxxx", "xxxxxxxx", "xxxxx yz"]
    assert list(text_pieces(text, True, 8)) == ["ab cd", "efgh", "xxxxxxxx", "xxxxxxxx", "xxxx yz"]
    assert list(text_pieces("short", True, 8)) == ["short"]


def test_a_run_of_empty_documents_is_bounded(model, capsys):
    """Skipping runs inside one next() of the pipeline, away from the train loop's preemption check: however many
    documents came before, EMPTY_IN_A_ROW empty ones in a row stop it with one line naming the file."""
    from maxctx.data.tokenizer import EMPTY_IN_A_ROW

    encode = EncodeDocument(FakeSource(), Tokenizer(model[0], 256), 256, True, True)
    assert encode(("some words", 0)) is not None
    assert all(encode(("", 1)) is None for _ in range(EMPTY_IN_A_ROW - 1))
    assert encode(("more words", 2)) is not None and encode(("", 1)) is None  # a document resets the run
    with pytest.raises(DataError, match=f"corpus.jsonl: {EMPTY_IN_A_ROW} documents in a row are of zero tokens "
                                        r"\(latest: corpus.jsonl line 2\); check that file"):
        for _ in range(EMPTY_IN_A_ROW):
            encode(("", 1))
    capsys.readouterr()
