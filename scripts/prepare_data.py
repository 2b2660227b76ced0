"""Tokenizes local .txt / .jsonl documents into ArrayRecord shards for dataset_type=arrayrecord.

    python scripts/prepare_data.py --input 'corpus/*.jsonl' --tokenizer tokenizer.model \
        --output data/train --num_shards 16

writes data/train-00000-of-00016.array_record, ...: one record per document, its token ids (BOS/EOS are added
when training, per add_bos/add_eos). Train with dataset_type=arrayrecord
grain_train_files='data/train-*.array_record' tokenizer_path=tokenizer.model (and the same tokenizer_type).
--tokenizer_type tiktoken reads Llama 3's tokenizer.model, huggingface a tokenizer.json (or its directory).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxctx.config import ConfigError, choices  # noqa: E402
from maxctx.data import DataError  # noqa: E402
from maxctx.data.prepare import prepare_shards  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="glob(s) of .txt (one document per line) or .jsonl files")
    parser.add_argument("--tokenizer", required=True,
                        help="the tokenizer file: a sentencepiece .model (scripts/train_tokenizer.py) by default")
    parser.add_argument("--tokenizer_type", choices=choices("tokenizer_type"), default="sentencepiece",
                        help="as the config key: sentencepiece, tiktoken (Llama 3) or huggingface (tokenizer.json)")
    parser.add_argument("--output", required=True, help="prefix of the shards: <output>-00000-of-000NN.array_record")
    parser.add_argument("--num_shards", type=int, default=8)
    parser.add_argument("--text_field", default="text", help="jsonl field holding the document")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        paths, documents, tokens = prepare_shards(args.input, args.tokenizer, args.output, args.num_shards,
                                                  args.text_field, progress=not args.no_progress,
                                                  tokenizer_type=args.tokenizer_type)
    except (ConfigError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {documents} documents, {tokens} tokens into {len(paths)} shards: {paths[0]}, ...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
