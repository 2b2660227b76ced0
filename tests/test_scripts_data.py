"""scripts/train_tokenizer.py and scripts/prepare_data.py from the command line: a tokenizer from jsonl, then
tokenized ArrayRecord shards that hold every non-empty document, and clear errors for bad input."""

import json
import os

import numpy as np

from maxctx.data.sources import ArrayRecordSource
from maxctx.data.tokenizer import Tokenizer
from tests.support import fixtures as F
from tests.support.processes import ROOT, python


def run(script, *args):
    return python(ROOT / "scripts" / script, *args, timeout=120)


def test_train_tokenizer_then_prepare_shards(tmp_path):
    docs = F.make_documents(150, seed=4)
    F.write_jsonl(str(tmp_path / "a.jsonl"), docs[:100])
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in [*docs[100:], ""]))
    model = tmp_path / "tok" / "sp.model"
    proc = run("train_tokenizer.py", "--input", f"{tmp_path}/*.jsonl", "--vocab_size", "180", "--output", str(model))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {model} (180 tokens) from 151 documents" in proc.stdout
    tok = Tokenizer(str(model), 256)
    assert tok.vocab_size == 180 and (tok.bos_id, tok.eos_id) == (1, 2)

    proc = run("prepare_data.py", "--input", f"{tmp_path}/*.jsonl", "--tokenizer", str(model), "--output",
               str(tmp_path / "out" / "train"), "--num_shards", "3")
    assert proc.returncode == 0, proc.stderr
    assert "wrote 150 documents" in proc.stdout and "into 3 shards" in proc.stdout
    assert "tokenizing" in proc.stderr  # the progress bar
    shards = sorted(str(p) for p in (tmp_path / "out").iterdir())
    assert [os.path.basename(s) for s in shards] == [f"train-0000{i}-of-00003.array_record" for i in range(3)]
    source = ArrayRecordSource(shards, "grain_train_files")
    assert len(source) == 150
    stored = sorted(tuple(source[i][0]) for i in range(len(source)))
    assert stored == sorted(tuple(tok.encode(d)) for d in docs)
    assert all(isinstance(source[i][0], np.ndarray) for i in range(3))


def test_prepare_shards_with_a_tiktoken_tokenizer(tmp_path):
    import base64

    docs = F.make_documents(20, seed=6)
    F.write_jsonl(str(tmp_path / "a.jsonl"), docs)
    ranks = tmp_path / "tokenizer.model"  # Llama 3's format: the 256 bytes as ranks, no merges
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    proc = run("prepare_data.py", "--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(ranks),
               "--tokenizer_type", "tiktoken", "--output", str(tmp_path / "out" / "train"), "--num_shards", "1",
               "--no_progress")
    assert proc.returncode == 0, proc.stderr
    source = ArrayRecordSource([str(tmp_path / "out" / "train-00000-of-00001.array_record")], "grain_train_files")
    tok = Tokenizer(str(ranks), 1 << 31, "tiktoken")
    assert sorted(tuple(source[i][0]) for i in range(len(source))) == sorted(tuple(tok.encode(d)) for d in docs)


def test_script_errors_are_one_line_with_exit_2(tmp_path):
    proc = run("train_tokenizer.py", "--input", f"{tmp_path}/none*.txt", "--output", str(tmp_path / "t.model"))
    assert proc.returncode == 2 and "--input" in proc.stderr and "matches no files" in proc.stderr
    F.write_txt(str(tmp_path / "small.txt"), ["ab cd"] * 5)
    proc = run("train_tokenizer.py", "--input", str(tmp_path / "small.txt"), "--vocab_size", "5000", "--output",
               str(tmp_path / "t.model"))
    assert proc.returncode == 2 and "Vocabulary size too high" in proc.stderr
    proc = run("prepare_data.py", "--input", str(tmp_path / "small.txt"), "--tokenizer", str(tmp_path / "no.model"),
               "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no.model' does not exist" in proc.stderr
