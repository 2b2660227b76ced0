"""Trains a sentencepiece tokenizer on local .txt / .jsonl documents.

    python scripts/train_tokenizer.py --input 'corpus/*.jsonl' --vocab_size 32000 --output tokenizer.model

Special ids: PAD=0, BOS=1, EOS=2, UNK=3. Then train with tokenizer_path=tokenizer.model and a vocab_size of at
least the tokenizer's (rounding up to a multiple of 128 is common).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxctx.config import ConfigError  # noqa: E402
from maxctx.data import DataError  # noqa: E402
from maxctx.data.prepare import iter_texts, train_tokenizer  # noqa: E402
from maxctx.data.sources import TextSource, expand_files  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="glob(s) of .txt (one document per line) or .jsonl files")
    parser.add_argument("--output", required=True, help="path of the .model file to write")
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--model_type", default="bpe", choices=("bpe", "unigram", "char", "word"))
    parser.add_argument("--text_field", default="text", help="jsonl field holding the document")
    parser.add_argument("--max_documents", type=int, default=1_000_000, help="documents sampled for training")
    args = parser.parse_args(argv)
    try:
        source = TextSource(expand_files(args.input, "--input"), "--input", args.text_field)
        train_tokenizer(iter_texts(source), args.output, args.vocab_size, args.model_type, args.max_documents)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # sentencepiece's own errors, e.g. a vocabulary too large for the corpus
        print(f"error: sentencepiece could not train: {str(e).splitlines()[-1]}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({args.vocab_size} tokens) from {len(source)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
