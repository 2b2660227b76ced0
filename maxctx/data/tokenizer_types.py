"""The three tokenizer_type readers behind maxctx.data.tokenizer.Tokenizer: each opens tokenizer_path and gives
encode, decode, its vocabulary size and its BOS/EOS ids (-1: none). A file it cannot read is a ConfigError naming
tokenizer_path; the checks common to all types (vocabulary size, add_bos/add_eos) are the Tokenizer's.

- sentencepiece: a .model file.
- tiktoken: Llama 3's tokenizer.model, a BPE ranks file (`base64(token) rank` per line), with Llama 3's split
  regex and its 256 special tokens after the ranks (<|begin_of_text|> BOS, <|end_of_text|> EOS).
- huggingface: a tokenizer.json (or the directory holding it), through the `tokenizers` library.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterator

from maxctx.config import ConfigError

# Llama 3's pre-tokenizer split and special tokens (meta-llama/llama3, llama/tokenizer.py).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(4)),
                  "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
                  *(f"<|reserved_special_token_{i}|>" for i in range(5, 251))]
# Llama 3's limits per tiktoken call: BPE time grows with the square of a piece's length, and a long-context
# document can be megabytes, so it is encoded in slices of at most 400K characters cut between runs of at most
# 25K whitespace or non-whitespace characters (as Meta's reference does).
_MAX_CHARS, _MAX_RUN = 400_000, 25_000
# Special tokens a tokenizer.json without a tokenizer_config.json may hold, by their usual names.
_HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_HF_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def _invalid(path: str, what: str, error: Exception | str) -> ConfigError:
    return ConfigError(f"tokenizer_path='{path}' is not a valid {what} ({error})")


class SentencePiece:
    def __init__(self, path: str):
        import sentencepiece as spm

        try:
            self.processor = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise _invalid(path, "sentencepiece model", e) from None
        self.vocab_size = self.processor.vocab_size()
        self.bos_id, self.eos_id = self.processor.bos_id(), self.processor.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)


def read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file. Read here rather than by tiktoken.load, which caches files by path in the temp dir,
    so a tokenizer rewritten in place would be read stale."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise _invalid(path, "tiktoken BPE file", f"line {number} is not 'base64(token) rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise _invalid(path, "tiktoken BPE file", f"its {len(ranks)} ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


class TikToken:
    def __init__(self, path: str):
        import tiktoken

        ranks = read_ranks(path)
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:  # tiktoken's BPE starts from single bytes, and would crash on one it lacks
            raise _invalid(path, "tiktoken BPE file", f"{len(missing)} of the 256 single bytes have no rank, e.g. "
                           f"{bytes([missing[0]])!r}")
        special = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL)}
        try:
            self.encoding = tiktoken.Encoding(os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                              special_tokens=special)
        except ValueError as e:
            raise _invalid(path, "tiktoken BPE file", e) from None
        self.vocab_size = self.encoding.n_vocab
        self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    def encode(self, text: str) -> list[int]:
        """Special tokens' text in a document is encoded as plain text, never as the special ids."""
        return [i for piece in _slices(text) for i in self.encoding.encode_ordinary(piece)]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def _slices(text: str) -> Iterator[str]:
    for start in range(0, len(text), _MAX_CHARS):
        chunk = text[start:start + _MAX_CHARS]
        if len(chunk) <= _MAX_RUN:
            yield chunk
            continue
        begin = 0
        for run in re.finditer(r"\s+|\S+", chunk):  # cut only inside a run longer than _MAX_RUN
            for cut in range(run.start() + _MAX_RUN, run.end(), _MAX_RUN):
                yield chunk[begin:cut]
                begin = cut
        yield chunk[begin:]


class HuggingFace:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self.tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises plain Exception for a bad file
            raise _invalid(path, "tokenizer.json", e) from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = (self._special_id(path, file, key, names)
                                    for key, names in (("bos_token", _HF_BOS), ("eos_token", _HF_EOS)))

    def _special_id(self, path: str, file: str, key: str, names: tuple[str, ...]) -> int:
        """As transformers finds it: `key` in tokenizer_config.json (else special_tokens_map.json) next to the
        tokenizer.json (null: none); in neither, an added special token of a usual name; else -1."""
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config_file = os.path.join(os.path.dirname(file), name)
            if not os.path.isfile(config_file):
                continue
            try:
                with open(config_file) as f:
                    config = json.load(f)
            except ValueError as e:
                raise ConfigError(f"tokenizer_path='{path}': {config_file} is not valid JSON ({e}); fix or remove "
                                  f"it") from None
            if key not in config:
                continue
            token = config[key]
            if isinstance(token, dict):  # an AddedToken: {"content": ..., ...}
                token = token.get("content")
            if token is None:
                return -1
            token_id = self.tokenizer.token_to_id(token)
            if token_id is None:
                raise ConfigError(f"tokenizer_path='{path}': {name} gives {key}='{token}', which is not in "
                                  f"{os.path.basename(file)}; fix {key} in {config_file}")
            return token_id
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        return next((self.tokenizer.token_to_id(n) for n in names if n in added), -1)

    def encode(self, text: str) -> list[int]:
        """Without the tokenizer's post-processor: BOS/EOS come from add_bos/add_eos, as for the other types."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


READERS = {"sentencepiece": SentencePiece, "tiktoken": TikToken, "huggingface": HuggingFace}
