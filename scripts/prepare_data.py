"""Tokenizes local .txt / .jsonl documents into ArrayRecord shards for dataset_type=arrayrecord.

    python scripts/prepare_data.py --input 'corpus/*.jsonl' --tokenizer tokenizer.model \
        --output data/train --num_shards 16

writes data/train-00000-of-00016.array_record, ...: one record per document, its token ids (BOS/EOS are added
when training, per add_bos/add_eos). Train with dataset_type=arrayrecord
grain_train_files='data/train-*.array_record' tokenizer_path=tokenizer.model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxctx.config import ConfigError  # noqa: E402
from maxctx.data import DataError  # noqa: E402
from maxctx.data.prepare import prepare_shards  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="glob(s) of .txt (one document per line) or .jsonl files")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model (scripts/train_tokenizer.py)")
    parser.add_argument("--output", required=True, help="prefix of the shards: <output>-00000-of-000NN.array_record")
    parser.add_argument("--num_shards", type=int, default=8)
    parser.add_argument("--text_field", default="text", help="jsonl field holding the document")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        paths, documents, tokens = prepare_shards(args.input, args.tokenizer, args.output, args.num_shards,
                                                  args.text_field, progress=not args.no_progress)
    except (ConfigError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {documents} documents, {tokens} tokens into {len(paths)} shards: {paths[0]}, ...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
