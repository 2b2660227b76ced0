"""The tokenizer (tokenizer_type: sentencepiece, tiktoken or huggingface; readers in tokenizer_types.py) and the
step that turns a source's document into (input, target) pairs.

Special ids: a tokenizer's own BOS/EOS ids; without a tokenizer (sources of token ids) BOS=1 and EOS=2, the ids
of the synthetic data and of models trained by scripts/train_tokenizer.py (PAD=0, BOS=1, EOS=2, UNK=3).
"""

from __future__ import annotations

import numpy as np

from maxctx import storage
from maxctx.config import Config, ConfigError
from maxctx.data import DataError
from maxctx.data.synthetic import BOS, EOS
from maxctx.data.tokenizer_types import READERS
from maxctx.files import check_tokenizer_path


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

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.reader.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self.reader.decode([int(i) for i in ids])


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
    ... skip (by the process, or grain worker, that reads them). A source of nothing else is a DataError: more
    skips than documents plus `read_ahead` with none encoded. The allowance is the reader's prefetch: its threads
    map the next records (the next epochs' too) while one document's encoding is still running, so an empty
    document can be skipped again and again before the first real one is counted.
    """

    def __init__(self, source, tokenizer: Tokenizer | None, vocab_size: int, add_bos: bool, add_eos: bool,
                 read_ahead: int = 0):
        self.source, self.tokenizer, self.vocab_size = source, tokenizer, vocab_size
        self.read_ahead = read_ahead
        self.skipped = self.encoded = 0
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
            ids = self.tokenizer.encode(value)
        else:
            ids = value
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise DataError(f"{self.source.describe(index)} holds token id {int(ids.max())} or "
                                f"{int(ids.min())}, outside [0, vocab_size={self.vocab_size})")
        if not len(ids):
            return self._skip(index)
        self.encoded += 1
        tokens = np.concatenate([self.prefix, ids, self.suffix])
        if len(tokens) < 2:
            raise DataError(f"{self.source.describe(index)} has one token and add_bos=add_eos=false, so it has no "
                            f"target; set add_bos or add_eos, or remove it")
        return {"inputs": tokens[:-1], "targets": tokens[1:]}

    def _skip(self, index: int) -> None:
        self.skipped += 1
        if not self.encoded and self.skipped >= len(self.source) + self.read_ahead:
            raise DataError(f"{self.source.name}: every document read is of zero tokens (e.g. "
                            f"{self.source.describe(index)}); check text_field and the files")
        if self.skipped & (self.skipped - 1) == 0:  # 1, 2, 4, 8, ...
            print(f"data: skipped {self.skipped} document{'s' * (self.skipped > 1)} of zero tokens so far in "
                  f"{self.source.name} (latest: {self.source.describe(index)})", flush=True)
        return None
