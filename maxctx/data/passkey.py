"""Passkey documents: a haystack of filler, a needle saying a random 5-7 digit key at depth d, and the question at
the end, followed by the key. The passkey eval (maxctx.evaluate.passkey) scores the key's tokens by teacher forcing;
`synthetic_passkey_fraction` mixes such documents into the synthetic training data.

Two formats, both in the tokenizer's own tokens:
- text (a tokenizer): "The pass key is" KEY ". Remember it." ... "What is the pass key? The pass key is" KEY,
  each piece encoded on its own (KEY as " 12345"), so the key's tokens are the same in the needle and the answer.
- token ids (no tokenizer: synthetic data, pre-tokenized records): the top 14 ids of the vocabulary stand for the
  ten digits and the three marker words, in the same layout.

The question ends with the needle's opening words, so the answer is the key continuing them: retrieving it is
copying what followed the same words earlier in the document.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

MIN_DIGITS, MAX_DIGITS = 5, 7
TOKEN_FORMAT_IDS = 14  # the token-id format's reserved ids: 10 digits, intro (2), outro, question word
INTRO, OUTRO, QUESTION = "The pass key is", ". Remember it.", "What is the pass key? The pass key is"
# The filler of the passkey papers (Mohtashami & Jaggi 2023), used when the run has no eval text of its own.
FILLER_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclasses.dataclass(frozen=True)
class PasskeyFormat:
    """Token ids of the parts of a passkey document."""

    intro: tuple[int, ...]
    outro: tuple[int, ...]
    question: tuple[int, ...]  # ends with `intro`'s words: the answer continues it
    bos: int  # -1: none
    digit_ids: tuple[int, ...] = ()  # token-id format: the id of each digit 0-9
    tokenizer: Any = None  # text format: encodes " <key>"

    def key_tokens(self, key: str) -> np.ndarray:
        if self.tokenizer is not None:
            return self.tokenizer.encode(" " + key)
        return np.asarray([self.digit_ids[int(c)] for c in key], np.int32)

    @property
    def overhead(self) -> int:
        """Tokens of a document besides the filler, with the longest key."""
        key = len(self.key_tokens("9" * MAX_DIGITS))
        return (self.bos >= 0) + len(self.intro) + len(self.outro) + len(self.question) + 2 * key


def token_format(vocab_size: int, bos: int = 1) -> PasskeyFormat:
    """The token-id format: digits are ids V-10..V-1, the markers V-14..V-11."""
    top = vocab_size - TOKEN_FORMAT_IDS
    intro = (top, top + 1)
    return PasskeyFormat(intro=intro, outro=(top + 2,), question=(top + 3, *intro), bos=bos,
                         digit_ids=tuple(range(top + 4, vocab_size)))


def text_format(tokenizer: Any, add_bos: bool) -> PasskeyFormat:
    ids = lambda text: tuple(int(t) for t in tokenizer.encode(text))  # noqa: E731
    return PasskeyFormat(intro=ids(INTRO), outro=ids(OUTRO), question=ids(QUESTION),
                         bos=tokenizer.bos_id if add_bos else -1, tokenizer=tokenizer)


def random_key(rng: np.random.Generator) -> str:
    """5 to 7 digits, the first not 0."""
    digits = int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def passkey_tokens(fmt: PasskeyFormat, filler: np.ndarray, depth: float, key: str,
                   needle: bool = True) -> tuple[np.ndarray, int]:
    """(BOS, filler with the needle at `depth` of it, question, key; the index where the answer's key starts).
    needle=False leaves the key out of the haystack (the control: the answer cannot be known)."""
    key_ids = fmt.key_tokens(key)
    cut = int(round(depth * len(filler)))
    inside = [np.asarray(fmt.intro), key_ids, np.asarray(fmt.outro)] if needle else []
    parts = [np.asarray([fmt.bos] if fmt.bos >= 0 else [], np.int32), filler[:cut], *inside, filler[cut:],
             np.asarray(fmt.question)]
    head = np.concatenate([np.asarray(p, np.int32) for p in parts])
    return np.concatenate([head, key_ids]).astype(np.int32), len(head)


def passkey_row(fmt: PasskeyFormat, filler: np.ndarray, length: int, depth: float, key: str,
                needle: bool = True) -> dict[str, np.ndarray]:
    """One example of exactly `length` (input, target) pairs, as one document (segment 1, positions 0..length-1),
    with as much of `filler` as fits; weights 1 only on the targets that are the answer's key tokens."""
    key_len = len(fmt.key_tokens(key))
    fixed = (fmt.bos >= 0) + len(fmt.question) + key_len + (len(fmt.intro) + key_len + len(fmt.outro)) * needle
    room = length + 1 - fixed
    if room < 0 or len(filler) < room:
        raise ValueError(f"a passkey example of {length} tokens needs {fixed} tokens besides the filler and "
                         f"{max(room, 0)} of filler (got {len(filler)}); use a longer length")
    tokens, answer = passkey_tokens(fmt, filler[:room], depth, key, needle)
    row = {"inputs": tokens[:-1], "targets": tokens[1:], "positions": np.arange(length, dtype=np.int32),
           "segment_ids": np.ones(length, np.int32), "weights": np.zeros(length, np.float32)}
    row["weights"][answer - 1:] = 1.0  # target t is token t + 1: the answer's tokens are targets answer-1...
    return row
