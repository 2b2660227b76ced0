"""Eval on the eval split, as MaxText does it: every eval_interval steps, eval_steps batches of
eval_per_device_batch_size x devices sequences (per_device_batch_size when 0), or with eval_steps=-1 the whole
split, its last batch padded with rows of weight 0 (eval_steps=0: no batches, only the passkey grid).

Every eval scores the same batches (the iterator is rewound to its first state), so evals are comparable. The
loss is the weighted mean over every token scored: sums are added across batches and divided once. The same
holds per position bucket (maxctx.evaluate.step): `loss_by_position` maps '1-2', '2-4', ... to the mean loss of
the tokens at those positions of their documents. With passkey_lengths set, every eval also runs the passkey grid
(maxctx.evaluate.passkey).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from maxctx.config import Config
from maxctx.data.pipeline import create_data_iterator
from maxctx.evaluate.passkey import PasskeyEval
from maxctx.evaluate.step import bucket_labels, jit_eval_step

if TYPE_CHECKING:
    from maxctx.metrics import MetricsWriter
    from maxctx.train_step import TrainSetup


class Evaluator:
    """`evaluator(state, step, writer)` runs one eval and records it; `scores(params)` only computes it."""

    def __init__(self, config: Config, setup: TrainSetup):
        self.steps = None if config.eval_steps == -1 else config.eval_steps  # None: until the split ends
        self.eval_step = jit_eval_step(setup)  # compiled for the eval batch, which may differ from training's
        self.data = create_data_iterator(config, setup.mesh, "eval") if self.steps != 0 else None
        self.start = self.data.get_state() if self.data is not None else None
        self.passkey = PasskeyEval(config, setup, self.eval_step) if config.passkey_grid[0] else None

    def split_scores(self, params: Any) -> dict[str, Any]:
        """loss, perplexity, tokens (the sum of weights), sequences (rows holding a scored token), batches, and
        loss_by_position (buckets holding a scored token)."""
        self.data.set_state(self.start)
        sums: dict[str, Any] = {}
        batches, seq_len = 0, 0
        for batch in itertools.islice(self.data, self.steps):
            out = jax.device_get(self.eval_step(params, batch))
            out.pop("row_correct")
            sums = {k: v + np.asarray(out[k], np.float64) for k, v in sums.items()} if sums else {
                k: np.asarray(v, np.float64) for k, v in out.items()}
            batches, seq_len = batches + 1, batch["inputs"].shape[1]
        if not batches:
            return {"loss": math.nan, "perplexity": math.nan, "tokens": 0.0, "sequences": 0.0, "batches": 0}
        loss = float(sums["loss_sum"] / max(float(sums["weight_sum"]), 1.0))
        by_position = {label: float(total / weight) for label, total, weight
                       in zip(bucket_labels(seq_len), sums["bucket_loss"], sums["bucket_weight"]) if weight > 0}
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(sums["weight_sum"]),
                "sequences": float(sums["rows"]), "batches": batches, "loss_by_position": by_position}

    def scores(self, params: Any) -> dict[str, Any]:
        """split_scores (unless eval_steps=0), and the passkey grid's scores when passkey_lengths is set."""
        values = self.split_scores(params) if self.data is not None else {}
        if self.passkey is not None:
            values.update(self.passkey.scores(params))
        return values

    def __call__(self, state: dict, step: int, writer: MetricsWriter) -> dict[str, Any]:
        values = self.scores(state["params"])
        writer.write_eval(step, values)
        if writer.is_primary:
            print(describe(step, values), flush=True)
        return values


def describe(step: int, values: dict[str, Any]) -> str:
    """The eval's lines for the console."""
    lines = []
    if "loss" in values:
        lines.append(f"eval at step {step}: loss {values['loss']:.4f}, perplexity {values['perplexity']:.2f} "
                     f"({values['batches']} batches, {values['tokens']:.0f} tokens)")
        lines.append("  loss by position: " + ", ".join(f"{k} {v:.3f}" for k, v in values["loss_by_position"].items()))
    if "passkey_accuracy" in values:
        by_length: dict[str, list[str]] = {}
        for cell, accuracy in values["passkey_accuracy"].items():
            length, depth = cell.split("/")
            by_length.setdefault(length, []).append(f"{depth}: {accuracy:.2f}")
        lines.append(f"passkey at step {step}: mean accuracy {values['passkey_mean']:.3f}")
        lines += [f"  length {length}, by depth: " + ", ".join(cells) for length, cells in by_length.items()]
    return "\n".join(lines)


def make_evaluator(config: Config, setup: TrainSetup) -> Evaluator | None:
    """The run's Evaluator, or None with eval_interval=0."""
    return Evaluator(config, setup) if config.eval_interval > 0 else None
