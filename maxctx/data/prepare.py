"""Offline data preparation behind scripts/train_tokenizer.py and scripts/prepare_data.py.

- `train_tokenizer`: a sentencepiece model from .txt/.jsonl documents, with PAD=0, BOS=1, EOS=2, UNK=3 (the ids
  the synthetic data uses, so token-id data and models agree).
- `prepare_shards`: .txt/.jsonl documents -> tokenized ArrayRecord shards (one record per document, token ids
  without BOS/EOS: the pipeline adds those per add_bos/add_eos), written round-robin over `num_shards` files.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator

from maxctx.data.sources import TextSource, encode_tokens
from maxctx.data.tokenizer import Tokenizer
from maxctx.files import expand_files

SPECIAL_IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}


def iter_texts(source: TextSource) -> Iterator[str]:
    for index in range(len(source)):
        value, _ = source[index]
        if isinstance(value, str):
            yield value


def train_tokenizer(texts: Iterator[str], model_path: str, vocab_size: int, model_type: str = "bpe",
                    max_documents: int = 1_000_000) -> None:
    """Trains a sentencepiece model on `texts` and writes it to `model_path`."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=texts, model_writer=model, vocab_size=vocab_size,
                                   model_type=model_type, character_coverage=1.0, input_sentence_size=max_documents,
                                   shuffle_input_sentence=True, minloglevel=2, **SPECIAL_IDS)
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    with open(model_path, "wb") as f:
        f.write(model.getvalue())


def shard_paths(output_prefix: str, num_shards: int) -> list[str]:
    return [f"{output_prefix}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]


def prepare_shards(pattern: str, tokenizer_path: str, output_prefix: str, num_shards: int, text_field: str = "text",
                   vocab_size: int = 1 << 31, progress: bool = True,
                   tokenizer_type: str = "sentencepiece") -> tuple[list[str], int, int]:
    """Tokenizes the documents of the files matching `pattern` into ArrayRecord shards.

    Returns (shard paths, documents written, tokens written). Empty documents are skipped (and counted out).
    """
    from array_record.python.array_record_module import ArrayRecordWriter
    from tqdm import tqdm

    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    source = TextSource(expand_files(pattern, "--input"), "--input", text_field)
    tokenizer = Tokenizer(tokenizer_path, vocab_size, tokenizer_type)
    paths = shard_paths(output_prefix, num_shards)
    os.makedirs(os.path.dirname(os.path.abspath(paths[0])), exist_ok=True)
    writers = [ArrayRecordWriter(path, "group_size:1") for path in paths]
    documents = tokens = 0
    try:
        for index in tqdm(range(len(source)), desc="tokenizing", unit="doc", disable=not progress):
            value, _ = source[index]
            ids = tokenizer.encode(value) if isinstance(value, str) else value
            if not len(ids):
                continue
            writers[documents % num_shards].write(encode_tokens(ids))
            documents += 1
            tokens += len(ids)
    finally:
        for writer in writers:
            writer.close()
    return paths, documents, tokens
