"""The passkey eval: at each (length L, depth d) of the config's grid, `passkey_examples` documents of L tokens
(maxctx.data.passkey), each a haystack with a random 5-7 digit key at depth d and the question at the end. An
example counts as retrieved when the greedy prediction of every token of the answer is right under teacher forcing:
one forward pass per example, through the same sharded eval step as the eval split (maxctx.evaluate.step), so it
runs at any length the training step runs at, with any CP strategy.

Filler: the run's eval documents (a file or TFDS eval split; synthetic data's Markov chain), or with only a
tokenizer the passkey papers' sentences (maxctx.data.passkey.FILLER_TEXT). Every process builds the same examples
(a pure function of the seed) and loads the rows its devices hold, as the synthetic data does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from maxctx.attention.cp.load_balance import reorder_batch
from maxctx.config import Config
from maxctx.data import passkey
from maxctx.data.global_batch import host_layout, to_global_arrays
from maxctx.data.pipeline import padding_rows
from maxctx.data.sources import make_source
from maxctx.data.synthetic import BOS, chain_vocab, make_document, transition_table
from maxctx.data.tokenizer import EncodeDocument, load_tokenizer
from maxctx.datasets import DATASETS
from maxctx.parallelism import BATCH_AXES, mesh_context_degree
from maxctx.train_step import TrainSetup


def passkey_format(config: Config) -> passkey.PasskeyFormat:
    """Text in the tokenizer's tokens when the config has a tokenizer, else the token-id format."""
    tokenizer = load_tokenizer(config)
    if tokenizer is not None:
        return passkey.text_format(tokenizer, config.add_bos)
    return passkey.token_format(config.vocab_size, BOS if config.add_bos else -1)


def filler_tokens(config: Config, count: int) -> np.ndarray:
    """`count` tokens of filler (the eval split's documents, cycled; see the module doc); no BOS or EOS."""
    dataset = DATASETS[config.dataset_type]
    if not dataset.source:  # synthetic: the chain the run's eval documents walk
        if config.tokenizer_path:  # a tokenizer without eval text (e.g. a converted model): the papers' filler
            sentence = load_tokenizer(config).encode(passkey.FILLER_TEXT)
            return np.resize(sentence, count).astype(np.int32)
        rng = np.random.default_rng([config.seed, 31])
        table = transition_table(chain_vocab(config.vocab_size, config.synthetic_passkey_fraction), config.seed)
        return make_document(rng, table, count + 2)[1:-1]
    source = make_source(config, "eval")
    encode = EncodeDocument(source, load_tokenizer(config), config.vocab_size, add_bos=False, add_eos=False)
    parts, total = [], 0
    for index in range(len(source)):
        pair = encode(source[index])
        if pair is not None:
            parts.append(np.concatenate([pair["inputs"], pair["targets"][-1:]]))
            total += len(parts[-1])
        if total >= count:
            break
    if not total:
        raise ValueError(f"{source.name} holds no tokens to make passkey filler from")
    return np.resize(np.concatenate(parts), count).astype(np.int32)


def grid_rows(fmt: passkey.PasskeyFormat, filler: np.ndarray, length: int, depths: tuple[float, ...],
              examples: int, seed: int, needle: bool = True) -> dict[str, np.ndarray]:
    """[len(depths) x examples, length] rows, depth-major; each example's filler starts at its own offset."""
    rows = []
    for i, depth in enumerate(depths):
        for j in range(examples):
            rng = np.random.default_rng([seed, 31, length, i, j])
            start = int(rng.integers(len(filler)))
            window = np.take(filler, np.arange(start, start + length) % len(filler))
            rows.append(passkey.passkey_row(fmt, window, length, depth, passkey.random_key(rng), needle))
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


class PasskeyEval:
    """`scores(params)`: {"passkey_accuracy": {"<length>/<depth>": share of examples retrieved}, "passkey_mean"}."""

    def __init__(self, config: Config, setup: TrainSetup, eval_step: Any, needle: bool = True):
        self.config, self.setup, self.eval_step, self.needle = config, setup, eval_step, needle
        self.lengths, self.depths = config.passkey_grid
        self.fmt = passkey_format(config)
        self.filler = filler_tokens(config, 2 * max(self.lengths))
        self.cp = mesh_context_degree(setup.mesh.shape) if config.context_parallel_load_balance else 1
        self.shards = int(np.prod([setup.mesh.shape[a] for a in BATCH_AXES]))
        self._rows: dict[int, dict[str, np.ndarray]] = {}

    def batch_rows(self, length: int) -> int:
        """Rows per forward pass: the eval batch's tokens (at least one row per data shard), whole rows."""
        tokens = self.config.eval_batch_size(self.setup.mesh.devices.size) * self.config.max_target_length
        return self.shards * max(1, tokens // (length * self.shards))

    def rows(self, length: int) -> dict[str, np.ndarray]:
        if length not in self._rows:
            self._rows[length] = grid_rows(self.fmt, self.filler, length, self.depths, self.config.passkey_examples,
                                           self.config.seed, self.needle)
        return self._rows[length]

    def correct(self, params: Any, length: int) -> np.ndarray:
        """1.0 per retrieved example of `length`, in grid_rows' order."""
        rows, per_batch = self.rows(length), self.batch_rows(length)
        total = len(rows["inputs"])
        padded = -(-total // per_batch) * per_batch
        pad = padding_rows(padded - total, length)
        rows = {key: np.concatenate([value, pad[key]]) for key, value in rows.items()}
        layout = host_layout(self.setup.mesh, per_batch, length)
        out = []
        for start in range(0, padded, per_batch):
            local = {key: np.concatenate([value[start + a:start + b] for a, b in layout.row_blocks])
                     for key, value in rows.items()}
            batch = to_global_arrays(reorder_batch(local, self.cp, self.config.context_parallel_load_balance),
                                     self.setup.mesh, layout)
            out.append(np.asarray(jax.device_get(self.eval_step(params, batch)["row_correct"])))
        return np.concatenate(out)[:total]

    def scores(self, params: Any) -> dict[str, Any]:
        accuracy = {}
        for length in self.lengths:
            by_depth = self.correct(params, length).reshape(len(self.depths), self.config.passkey_examples)
            for depth, hits in zip(self.depths, by_depth):
                accuracy[f"{length}/{depth:g}"] = float(hits.mean())
        return {"passkey_accuracy": accuracy, "passkey_mean": float(np.mean(list(accuracy.values())))}
