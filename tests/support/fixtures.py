"""Tiny generated corpora for tests and benchmarks: text, a sentencepiece model, ArrayRecord shards and a TFDS
dataset prepared locally (no network, no TensorFlow).

The text is made of random pseudo-words with a Zipf-like frequency, so a tokenizer of a few hundred pieces
learns real merges and documents vary in length.
"""

from __future__ import annotations

import json

import numpy as np

from maxctx.data.prepare import train_tokenizer

TFDS_NAME = "maxctx_tiny_text"


def make_documents(count: int, seed: int = 0, min_words: int = 3, max_words: int = 60) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnoprstu"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(300)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    lengths = rng.integers(min_words, max_words + 1, size=count)
    return [" ".join(rng.choice(words, size=n, p=weights)) for n in lengths]


def write_txt(path: str, documents: list[str]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(documents) + "\n")
    return path


def write_jsonl(path: str, documents: list, field: str = "text") -> str:
    with open(path, "w") as f:
        for doc in documents:
            f.write(json.dumps({field: doc, "id": len(doc)}) + "\n")
    return path


def write_arrayrecord(path: str, records: list[bytes]) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    return path


def tiny_tokenizer(path: str, documents: list[str], vocab_size: int = 200) -> str:
    train_tokenizer(iter(documents), path, vocab_size)
    return path


def text_dataset_keys(root) -> list[str]:
    """The keys of a small jsonl dataset and its sentencepiece tokenizer written under `root` (the multi-process
    tests' data: 200 documents, seed 5)."""
    docs = make_documents(200, seed=5)
    tokenizer = tiny_tokenizer(str(root / "sp.model"), docs)
    write_jsonl(str(root / "train.jsonl"), docs)
    return ["dataset_type=text", f"grain_train_files={root}/train.jsonl", f"tokenizer_path={tokenizer}"]


def build_tfds(data_dir: str, splits: dict[str, list[str]], name: str = TFDS_NAME) -> str:
    """Prepares a TFDS dataset `name` (one Text feature 'text') with the given splits under `data_dir`, in
    ArrayRecord format, without TensorFlow; returns `name`."""
    import tensorflow_datasets as tfds

    with tfds.core.registered.skip_registration():

        class Builder(tfds.core.GeneratorBasedBuilder):
            VERSION = tfds.core.Version("1.0.0")
            url_infos = None  # nothing to download (TFDS would look for a checksums file beside the code)

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                    {"text": tfds.features.Text()}))

            def _split_generators(self, dl_manager):
                return {split: self._generate_examples(docs) for split, docs in splits.items()}

            def _generate_examples(self, docs):
                for i, doc in enumerate(docs):
                    yield i, {"text": doc}

        Builder.name = name
        tfds.disable_progress_bar()
        Builder(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return name
