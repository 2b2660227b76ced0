"""tokenizer_type=tiktoken and huggingface: tiny tokenizers made here (a tiktoken ranks file of the 256 bytes and a
few merges; a byte-level BPE trained by `tokenizers`), ids equal to the libraries' own, BOS/EOS, the vocabulary and
path checks, and a short `python train.py` run on text per tokenizer_type."""

import base64
import json
import pickle

import numpy as np
import pytest
import tiktoken
import tokenizers

from maxctx.config import ConfigError
from maxctx.data import tokenizer_types
from maxctx.data.tokenizer import EncodeDocument, Tokenizer, load_tokenizer
from maxctx.data.tokenizer_types import LLAMA3_PATTERN, LLAMA3_SPECIAL
from maxctx.loader import load_config
from tests.support import fixtures as F
from tests.support.processes import cpu_env, metrics, run, train_command

MERGES = [b"ab", b"abc", b" a", b" ab", b"de", b"ra", b"ar", b"ta"]
SAMPLES = ["abc de ra", "  Tabs\tand\nnew lines\n\n", "ünïcödé 😀 and 12345 digits", "<|begin_of_text|> is text"]


@pytest.fixture(scope="module")
def docs():
    return F.make_documents(120, seed=5)


@pytest.fixture(scope="module")
def ranks_file(tmp_path_factory):
    ranks = [bytes([b]) for b in range(256)] + MERGES
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(ranks)))
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, docs):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    path = tmp_path_factory.mktemp("hf")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_tiktoken_ids_are_the_librarys_with_llama3_special_tokens(ranks_file, docs):
    tok = Tokenizer(ranks_file, 1024, "tiktoken")
    assert len(LLAMA3_SPECIAL) == len(set(LLAMA3_SPECIAL)) == 256
    n = 256 + len(MERGES)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1)
    ranks = {bytes([b]): b for b in range(256)} | {t: 256 + i for i, t in enumerate(MERGES)}
    direct = tiktoken.Encoding("direct", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                               special_tokens={t: n + i for i, t in enumerate(LLAMA3_SPECIAL)})
    for text in docs[:20] + SAMPLES:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == direct.encode_ordinary(text)
        assert tok.decode(ids) == text
    assert tok.encode("abc").tolist() == [257] and max(tok.encode(SAMPLES[3])) < n  # special text stays text
    assert tok.decode([n, n + 1]) == "<|begin_of_text|><|end_of_text|>"
    assert pickle.loads(pickle.dumps(tok)).encode(docs[0]).tolist() == tok.encode(docs[0]).tolist()  # grain workers


def llama3_slices(text, max_chars, max_run):
    """Meta's reference (llama/tokenizer.py: encode and _split_whitespaces_or_nonwhitespaces)."""
    for start in range(0, len(text), max_chars):
        s = text[start:start + max_chars]
        run_len, run_space, begin = 0, s[0].isspace(), 0
        for i in range(len(s)):
            if run_space ^ s[i].isspace():
                run_len, run_space = 1, s[i].isspace()
            else:
                run_len += 1
                if run_len > max_run:
                    yield s[begin:i]
                    begin, run_len = i, 1
        yield s[begin:]


def test_tiktoken_long_runs_are_cut_like_llama3(monkeypatch):
    monkeypatch.setattr(tokenizer_types, "_MAX_CHARS", 40)
    monkeypatch.setattr(tokenizer_types, "_MAX_RUN", 6)
    for text in ["ab " + "x" * 15 + " " * 9 + "yz", "x" * 13 + " \n\t" * 5 + "y" * 6, "short"]:
        pieces = list(tokenizer_types._slices(text * 3))
        assert pieces == list(llama3_slices(text * 3, 40, 6)) and "".join(pieces) == text * 3


def test_huggingface_ids_are_the_librarys_and_bos_eos_come_from_its_config(hf_dir, docs, tmp_path):
    direct = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for path in (hf_dir, hf_dir / "tokenizer.json"):  # the directory or the file
        tok = Tokenizer(str(path), 512, "huggingface")
        assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (300, 0, 1)  # from the added tokens <s>, </s>
        for text in docs[:20] + SAMPLES:
            ids = tok.encode(text)
            assert ids.tolist() == direct.encode(text, add_special_tokens=False).ids and tok.decode(ids) == text
        assert pickle.loads(pickle.dumps(tok)).encode(docs[0]).tolist() == tok.encode(docs[0]).tolist()
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    (swapped / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    (swapped / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "</s>", "eos_token": {"content": "<s>", "__type": "AddedToken"}}))
    tok = Tokenizer(str(swapped / "tokenizer.json"), 512, "huggingface")  # the config next to the file wins
    assert (tok.bos_id, tok.eos_id) == (1, 0)
    (swapped / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))  # null: none; eos: </s>
    tok = Tokenizer(str(swapped), 512, "huggingface")
    assert (tok.bos_id, tok.eos_id) == (-1, 1)
    (swapped / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json gives bos_token='<\|begin_of_text\|>', which is not"):
        Tokenizer(str(swapped), 512, "huggingface")


@pytest.mark.parametrize("tokenizer_type", ["tiktoken", "huggingface"])
def test_long_texts_in_pieces_give_the_whole_texts_ids(tokenizer_type, ranks_file, hf_dir, docs, monkeypatch):
    """Cut at spaces, the pieces (bounded memory in the library: maxctx.data.tokenizer) keep ' word' whole."""
    from maxctx.data import tokenizer

    tok = Tokenizer(ranks_file if tokenizer_type == "tiktoken" else str(hf_dir), 1024, tokenizer_type)
    text = "  ".join(docs[:40]) + "\n" + " ".join(docs[40:] + SAMPLES)
    whole = tok.reader.encode(text)
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 300)
    assert not tok.cut_drops_space and tok.encode(text).tolist() == whole and tok.decode(whole) == text


def test_each_type_gets_the_same_bos_eos_and_vocabulary_checks(ranks_file, hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"has 520 tokens, more than the model's vocab_size=512.*vocab_size=520"):
        Tokenizer(ranks_file, 512, "tiktoken")
    with pytest.raises(ConfigError, match=r"has 300 tokens, more than the model's vocab_size=256.*vocab_size=300"):
        Tokenizer(str(hf_dir), 256, "huggingface")
    tok = Tokenizer(ranks_file, 1024, "tiktoken")
    pairs = EncodeDocument(None, tok, 1024, add_bos=True, add_eos=True)(("abc de", 0))
    np.testing.assert_array_equal(pairs["inputs"], [264, *tok.encode("abc de")])
    np.testing.assert_array_equal(pairs["targets"], [*tok.encode("abc de"), 265])
    plain = tokenizers.Tokenizer(tokenizers.models.BPE())  # no special tokens at all
    plain.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["a few words", "and some more"], tokenizers.trainers.BpeTrainer(
        vocab_size=270, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    plain.save(str(tmp_path / "tokenizer.json"))
    keys = [f"tokenizer_path={tmp_path}", "tokenizer_type=huggingface", "vocab_size=512"]
    with pytest.raises(ConfigError, match=r"add_bos=true but tokenizer_path=.*\(tokenizer_type=huggingface\) has "
                                          r"no BOS token; set add_bos=false"):
        load_tokenizer(load_config(keys))
    assert load_tokenizer(load_config([*keys, "add_bos=false", "add_eos=false"])).bos_id == -1


def test_bad_tokenizer_files_and_paths_are_named_before_jax(ranks_file, tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("YWI= 0\nnot-base64!! 1\n")
    with pytest.raises(ConfigError, match=r"'.*bad.model' is not a valid tiktoken BPE file \(line 2 is not"):
        Tokenizer(str(bad), 1024, "tiktoken")
    bad.write_text("YQ== 0\n")
    with pytest.raises(ConfigError, match="255 of the 256 single bytes have no rank"):
        Tokenizer(str(bad), 1024, "tiktoken")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer_path='.*' is not a valid tokenizer.json"):
        Tokenizer(str(tmp_path), 1024, "huggingface")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is a directory without a tokenizer.json; give a tokenizer.json file"):
        load_config([f"tokenizer_path={empty}", "tokenizer_type=huggingface"])
    with pytest.raises(ConfigError, match="is a directory; with tokenizer_type=tiktoken give a tiktoken BPE file"):
        load_config([f"tokenizer_path={empty}", "tokenizer_type=tiktoken"])
    with pytest.raises(ConfigError, match="tokenizer_type='tiktokn' .*did you mean 'tiktoken'"):
        load_config([f"tokenizer_path={ranks_file}", "tokenizer_type=tiktokn"])


@pytest.fixture(scope="module")
def text_root(tmp_path_factory, docs):
    """The training text and a sentencepiece model; the runs share one compilation cache (same shapes)."""
    root = tmp_path_factory.mktemp("train_text")
    F.write_txt(str(root / "train.txt"), docs)
    F.tiny_tokenizer(str(root / "sp.model"), docs)
    return root


@pytest.mark.parametrize("tokenizer_type", ["sentencepiece", "tiktoken", "huggingface"])
def test_train_py_trains_on_text_with_each_tokenizer_type(tokenizer_type, text_root, ranks_file, hf_dir, tmp_path):
    root, out = text_root, tmp_path
    path = {"sentencepiece": root / "sp.model", "tiktoken": ranks_file, "huggingface": hf_dir}[tokenizer_type]
    proc = run(train_command(
        "steps=2", "log_period=1", "per_device_batch_size=2", "max_target_length=64", "cpu_devices=1",
        "vocab_size=1024", "base_num_decoder_layers=1", "enable_checkpointing=false", "enable_tensorboard=false",
        "peak_tflops_per_device=1", "dataset_type=text", f"grain_train_files={root}/train.txt",
        f"tokenizer_path={path}", f"tokenizer_type={tokenizer_type}", f"base_output_directory={out}", "run_name=r"),
        env=cpu_env(compile_cache=root / "jax_cache"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [r["loss"] for r in metrics(out / "r") if r.get("event") == "train"]
    assert len(losses) == 2 and all(0 < loss < 8 for loss in losses)
