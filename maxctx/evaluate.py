"""Eval on the eval split, as MaxText does it: every eval_interval steps, eval_steps batches of
eval_per_device_batch_size x devices sequences (per_device_batch_size when 0), or with eval_steps=-1 the whole
split, its last batch padded with rows of weight 0.

Every eval scores the same batches (the iterator is rewound to its first state), so evals are comparable. The
loss is the weighted mean over every token scored: sums are added across batches and divided once.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import jax

from maxctx.config import Config
from maxctx.data.pipeline import create_data_iterator
from maxctx.train_step import jit_eval_step

if TYPE_CHECKING:
    from maxctx.metrics import MetricsWriter
    from maxctx.train_step import TrainSetup


class Evaluator:
    """`evaluator(state, step, writer)` runs one eval and records it; `scores(params)` only computes it."""

    def __init__(self, config: Config, setup: TrainSetup):
        self.steps = None if config.eval_steps == -1 else config.eval_steps  # None: until the split ends
        self.data = create_data_iterator(config, setup.mesh, "eval")
        self.start = self.data.get_state()
        self.eval_step = jit_eval_step(setup)  # compiled for the eval batch, which may differ from training's

    def scores(self, params: Any) -> dict[str, float]:
        """loss, perplexity, tokens (the sum of weights), sequences (rows holding a scored token), batches."""
        self.data.set_state(self.start)
        loss_sum = weight_sum = sequences = 0.0
        batches = 0
        for batch in itertools.islice(self.data, self.steps):
            sums = jax.device_get(self.eval_step(params, batch))
            loss_sum, weight_sum = loss_sum + float(sums[0]), weight_sum + float(sums[1])
            sequences, batches = sequences + float(sums[2]), batches + 1
        loss = loss_sum / max(weight_sum, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": weight_sum,
                "sequences": sequences, "batches": batches}

    def __call__(self, state: dict, step: int, writer: MetricsWriter) -> None:
        values = self.scores(state["params"])
        writer.write_eval(step, values)
        if writer.is_primary:
            print(f"eval at step {step}: loss {values['loss']:.4f}, perplexity {values['perplexity']:.2f} "
                  f"({values['batches']} batches, {values['tokens']:.0f} tokens)", flush=True)


def make_evaluator(config: Config, setup: TrainSetup) -> Evaluator | None:
    """The run's Evaluator, or None with eval_interval=0."""
    return Evaluator(config, setup) if config.eval_interval > 0 else None
