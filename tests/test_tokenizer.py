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
