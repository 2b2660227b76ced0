"""The tokenizer (tokenizer_type: sentencepiece, tiktoken or huggingface; readers in tokenizer_types.py) and the
step that turns a source's document into (input, target) pairs.

Special ids: a tokenizer's own BOS/EOS ids; without a tokenizer (sources of token ids) BOS=1 and EOS=2, the ids
of the synthetic data and of models trained by scripts/train_tokenizer.py (PAD=0, BOS=1, EOS=2, UNK=3).

Long texts are tokenized in pieces of at most PIECE_CHARS characters (`text_pieces`): the libraries hold 40
(sentencepiece) to 200 (tokenizers) bytes per character of the text they are given, so one 30 MB line peaked at 1.3
(sentencepiece) and 6.3 GB (tokenizers) of host memory; in pieces, at 0.16 and 0.33 GB: what is left is the line's
text and its int32 ids, which packing=none stops at `max_tokens` and first_fit and concat keep whole (they cut the
document into rows, dropping nothing). Pieces are cut at a space, so the ids are the whole text's for tokenizers
whose tokens do not span spaces (sentencepiece's default split_by_whitespace, byte-level BPEs' pre-tokenizers,
tiktoken); a piece with no space in its second half is cut mid-word, where the ids can differ.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from maxctx import storage
from maxctx.config import Config, ConfigError
from maxctx.data import DataError
from maxctx.data.synthetic import BOS, EOS
from maxctx.data.tokenizer_types import READERS
from maxctx.files import check_tokenizer_path

PIECE_CHARS = 100_000
EMPTY_IN_A_ROW = 10_000  # EncodeDocument's bound on skipping


class Tokenizer:
    """A tokenizer of any tokenizer_type; ConfigError naming tokenizer_path when it is missing, invalid or larger
    than the model's vocabulary. bos_id/eos_id are -1 when it has none."""

    def __init__(self, path: str, vocab_size: int, tokenizer_type: str = "sentencepiece"):
        check_tokenizer_path(path, tokenizer_type)
        self.reader = READERS[tokenizer_type](storage.local_copy(path))
        self.path, self.vocab_size = path, self.reader.vocab_size
        if self.vocab_size > vocab_size:
            raise ConfigError(f"tokenizer_path='{path}' has {self.vocab_size} tokens, more than the model's "
                              f"vocab_size={vocab_size}; set vocab_size={self.vocab_size} or more, or use a "
                              f"smaller tokenizer")
        self.bos_id, self.eos_id = self.reader.bos_id, self.reader.eos_id
        self.cut_drops_space = _cut_drops_space(self.reader)

    def encode(self, text: str, max_tokens: int | None = None) -> np.ndarray:
        """`text`'s ids, tokenized in pieces (module doc); with `max_tokens`, only until at least that many ids."""
        parts, count = [], 0
        for piece in text_pieces(text, self.cut_drops_space, PIECE_CHARS):
            parts.append(np.asarray(self.reader.encode(piece), np.int32))
            count += len(parts[-1])
            if max_tokens is not None and count >= max_tokens:
                break
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def decode(self, ids) -> str:
        return self.reader.decode([int(i) for i in ids])


def text_pieces(text: str, drop_space: bool, size: int) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, each cut at the last space of its second half (else at
    `size`); the space begins the next piece, or with `drop_space` is left out."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + size // 2, start + size)
        if cut < 0:
            yield text[start:start + size]
            start += size
        else:
            yield text[start:cut]
            start = cut + drop_space
    yield text[start:] if start else text


def _cut_drops_space(reader) -> bool:
    """Whether a piece cut at a space must begin after it: tokenizers that begin every text with a word boundary of
    their own (sentencepiece's add_dummy_prefix without remove_extra_whitespaces, Llama 2's tokenizer.json) would
    read a second one; byte-level BPEs keep ' two' as one pre-token, so there the space stays."""
    whole, first = reader.encode("one two"), reader.encode("one")
    return whole != first + reader.encode(" two") and whole == first + reader.encode("two")


def load_tokenizer(config: Config) -> Tokenizer | None:
    """The config's tokenizer (None when tokenizer_path is empty), with its BOS/EOS checked against add_*."""
    if not config.tokenizer_path:
        return None
    tokenizer = Tokenizer(config.tokenizer_path, config.vocab_size, config.tokenizer_type)
    for key, token_id in (("add_bos", tokenizer.bos_id), ("add_eos", tokenizer.eos_id)):
        if getattr(config, key) and token_id < 0:
            raise ConfigError(f"{key}=true but tokenizer_path='{config.tokenizer_path}' "
                              f"(tokenizer_type={config.tokenizer_type}) has no {key[4:].upper()} token; set "
                              f"{key}=false or use a tokenizer with one")
    return tokenizer


class EncodeDocument:
    """A grain map: (document, index) from a source -> {'inputs': doc[:-1], 'targets': doc[1:]} token ids.

    The shift happens here, on the whole document with its BOS/EOS, so a document's last input predicts its own
    EOS and no target ever belongs to another document, however rows are later packed, split or reordered.

    A document of zero tokens (`{"text": ""}`) maps to None, which the pipeline filters out, as
    scripts/prepare_data.py leaves them out; they are counted, and the count is printed at the 1st, 2nd, 4th, 8th,
    ... skip (by the process, or grain worker, that reads them). Skipping happens inside one `next()` of the
    pipeline, away from the train loop's preemption check, so it is bounded; a DataError ends it:
    - a source of nothing else: more skips than documents plus `read_ahead` with none encoded. The allowance is the
      reader's prefetch: its threads map the next records (the next epochs' too) while one document's encoding is
      still running, so an empty document can be skipped again and again before the first real one is counted;
    - EMPTY_IN_A_ROW documents of zero tokens in a row (well under a second of skipping), whatever came before.

    `max_tokens` (packing=none, whose rows keep a document's first seq_len + 1 tokens) stops tokenizing there.
    """

    def __init__(self, source, tokenizer: Tokenizer | None, vocab_size: int, add_bos: bool, add_eos: bool,
                 read_ahead: int = 0, max_tokens: int | None = None):
        self.source, self.tokenizer, self.vocab_size = source, tokenizer, vocab_size
        self.read_ahead, self.max_tokens = read_ahead, max_tokens
        self.skipped = self.encoded = self.in_a_row = 0
        bos, eos = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer else (BOS, EOS)
        self.prefix = np.asarray([bos] if add_bos else [], np.int32)
        self.suffix = np.asarray([eos] if add_eos else [], np.int32)

    def __call__(self, document) -> dict[str, np.ndarray] | None:
        value, index = document
        if isinstance(value, str):
            if self.tokenizer is None:
                raise DataError(f"{self.source.describe(index)} holds text but tokenizer_path is empty; set "
                                f"tokenizer_path (and tokenizer_type), or store token ids "
                                f"(scripts/prepare_data.py)")
            ids = self.tokenizer.encode(value, self.max_tokens)
        else:
            ids = value
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise DataError(f"{self.source.describe(index)} holds token id {int(ids.max())} or "
                                f"{int(ids.min())}, outside [0, vocab_size={self.vocab_size})")
        if not len(ids):
            return self._skip(index)
        self.encoded += 1
        self.in_a_row = 0
        tokens = np.concatenate([self.prefix, ids, self.suffix])
        if len(tokens) < 2:
            raise DataError(f"{self.source.describe(index)} has one token and add_bos=add_eos=false, so it has no "
                            f"target; set add_bos or add_eos, or remove it")
        return {"inputs": tokens[:-1], "targets": tokens[1:]}

    def _skip(self, index: int) -> None:
        self.skipped += 1
        self.in_a_row += 1
        if not self.encoded and self.skipped >= len(self.source) + self.read_ahead:
            raise DataError(f"{self.source.name}: every document read is of zero tokens (e.g. "
                            f"{self.source.describe(index)}); check text_field and the files")
        if self.in_a_row >= EMPTY_IN_A_ROW:
            raise DataError(f"{self.source.name}: {self.in_a_row} documents in a row are of zero tokens (latest: "
                            f"{self.source.describe(index)}); check that file, and leave empty documents out of "
                            f"the data (scripts/prepare_data.py does)")
        if self.skipped & (self.skipped - 1) == 0:  # 1, 2, 4, 8, ...
            print(f"data: skipped {self.skipped} document{'s' * (self.skipped > 1)} of zero tokens so far in "
                  f"{self.source.name} (latest: {self.source.describe(index)})", flush=True)
        return None
