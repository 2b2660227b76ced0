"""Synthetic, learnable, packed documents: `dataset_type=synthetic`.

Each document is a walk on a fixed random sparse Markov chain over the content tokens (every token has four
successors, the first taken with probability 0.7), framed by BOS and EOS. A model can learn it (the loss falls
from ln V towards the chain's entropy, about 1 nat), and documents of random length are packed into rows with
segment ids and positions, so the packed-document path is exercised from the first run.

Batches are a pure function of (seed, step): the same config gives the same batches on any mesh or process count.
"""

from __future__ import annotations

import numpy as np

from maxctx.config import ConfigError
from maxctx.data import passkey

PAD, BOS, EOS = 0, 1, 2
FIRST_CONTENT = 3
MIN_VOCAB = FIRST_CONTENT + 2  # the chain needs two content tokens to walk between
MIN_LENGTH = 3  # documents of 4 to seq_len + 1 tokens (a row holds seq_len + 1 of them: inputs plus the last target)
SUCCESSORS = 4
SUCCESSOR_PROBS = np.array([0.7, 0.1, 0.1, 0.1])


def transition_table(vocab_size: int, seed: int) -> np.ndarray:
    """[V, 4] successor table of the chain (content tokens only)."""
    rng = np.random.default_rng([seed, 7919])
    return rng.integers(FIRST_CONTENT, vocab_size, size=(vocab_size, SUCCESSORS))


def make_document(rng: np.random.Generator, table: np.ndarray, length: int) -> np.ndarray:
    """BOS, `length - 2` chain tokens, EOS."""
    vocab = table.shape[0]
    tokens = np.empty(length, np.int32)
    tokens[0], tokens[-1] = BOS, EOS
    current = rng.integers(FIRST_CONTENT, vocab)
    choices = rng.choice(SUCCESSORS, size=length, p=SUCCESSOR_PROBS)
    for i in range(1, length - 1):
        tokens[i] = current
        current = table[current, choices[i]]
    return tokens


def pack_row(documents: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Packs documents into one row of `seq_len` (input, target) pairs.

    Each document of n tokens gives n - 1 pairs (its last input predicts its own EOS), so no target crosses a
    document boundary; a document that does not fit is cut; the tail is padding with weight 0.
    """
    row = {"inputs": np.zeros(seq_len, np.int32), "targets": np.zeros(seq_len, np.int32),
           "positions": np.zeros(seq_len, np.int32), "segment_ids": np.zeros(seq_len, np.int32),
           "weights": np.zeros(seq_len, np.float32)}
    start = 0
    for segment, doc in enumerate(documents, start=1):
        n = min(len(doc) - 1, seq_len - start)
        if n <= 0:
            break
        row["inputs"][start:start + n] = doc[:n]
        row["targets"][start:start + n] = doc[1:n + 1]
        row["positions"][start:start + n] = np.arange(n)
        row["segment_ids"][start:start + n] = segment
        row["weights"][start:start + n] = 1.0
        start += n
    return row


def chain_vocab(vocab_size: int, passkey_fraction: float) -> int:
    """The ids the chain walks below: with passkey documents in the mix, not the passkey format's reserved top ids,
    so digits and markers appear only where they mean something."""
    return vocab_size - passkey.TOKEN_FORMAT_IDS if passkey_fraction > 0 else vocab_size


def passkey_document(rng: np.random.Generator, table: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """A passkey document (maxctx.data.passkey's token-id format) of about `length` tokens: BOS, a chain walk with
    the needle at a random depth, the question, the key, EOS."""
    fmt = passkey.token_format(vocab_size, BOS)
    filler = make_document(rng, table, max(length - fmt.overhead, 4))[1:-1]
    tokens, _ = passkey.passkey_tokens(fmt, filler, float(rng.random()), passkey.random_key(rng))
    return np.concatenate([tokens, [EOS]]).astype(np.int32)


class SyntheticSource:
    """Generates global batches [global_batch, seq_len] as a pure function of the step. Streams (0 train,
    1 eval) draw different documents from the same chain; with `passkey_fraction` > 0 that fraction of the
    documents are passkey documents (synthetic_passkey_fraction)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int, stream: int = 0,
                 passkey_fraction: float = 0.0):
        if vocab_size < MIN_VOCAB:
            raise ConfigError(f"vocab_size={vocab_size} is too small for dataset_type=synthetic (ids 0-2 are PAD, BOS "
                              f"and EOS, and the chain needs two content tokens); set vocab_size >= {MIN_VOCAB}")
        if seq_len < MIN_LENGTH:
            raise ConfigError(f"max_target_length={seq_len} is too short for dataset_type=synthetic (a document is "
                              f"BOS, two or more content tokens and EOS); set max_target_length >= {MIN_LENGTH}")
        self.seq_len, self.global_batch, self.seed, self.stream = seq_len, global_batch, seed, stream
        self.passkey_fraction, self.vocab_size = passkey_fraction, vocab_size
        self.table = transition_table(chain_vocab(vocab_size, passkey_fraction), seed)

    def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """The global batch of `step` (or only `rows` of it; each row is generated independently)."""
        rows = rows or slice(0, self.global_batch)
        out = [self._row(step, r) for r in range(*rows.indices(self.global_batch))]
        return {key: np.stack([row[key] for row in out]) for key in out[0]}

    def _row(self, step: int, row: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.stream, step, row])
        documents, total = [], 0
        while total < self.seq_len:
            length = int(rng.integers(max(4, self.seq_len // 8), self.seq_len + 2))
            if self.passkey_fraction > 0 and rng.random() < self.passkey_fraction:  # no draw when off: same data
                documents.append(passkey_document(rng, self.table, length, self.vocab_size))
            else:
                documents.append(make_document(rng, self.table, length))
            total += len(documents[-1]) - 1
        return pack_row(documents, self.seq_len)
