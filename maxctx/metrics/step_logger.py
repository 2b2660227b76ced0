"""The training loop's step log: metrics fetched one step late, the NaN check, the timing window, metrics.jsonl and
TensorBoard records and the progress line, behind three calls.

    logger = StepLogger(writer, ...)        # just before the loop: its first step is timed from here
    for step in range(start_step, steps):
        state, metrics = train_step(state, batch)
        logger.push(step, metrics)          # logs the previous step, on log_period
        if a pause is due (eval, checkpoint):
            logger.flush()                  # first, so a NaN step is never saved
            ...
            logger.reset_clock()            # after an eval: its time is not a step's
    logger.flush(force=True)                # the last step is always logged

A step the train step skipped (skip_nonfinite_steps: `skipped` = 1, its state kept) is not checked for NaN nor fed
to the divergence watch; it gets one line, and `skipped_steps` counts skips in every record; MAX_SKIPS_IN_A_ROW
consecutive ones stop the run like a NaN.

Step time is averaged over the steps since the last logged one (steadier than one step); a step ends when
PendingMetrics sees it finished (its fetch, or its dispatch for a program that ran as it was called). A step has no
time when no step finished before it: the loop's first step is timed from the logger's creation; the step after a
`reset_clock` is left out of the window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from maxctx.metrics.flops import throughput
from maxctx.metrics.progress import PendingMetrics, StepMetrics, check_finite, device_memory, format_progress
from maxctx.metrics.writers import MetricsWriter

MAX_SKIPS_IN_A_ROW = 10


class StepLogger:
    """Logs steps to `writer` every `log_period` completed steps (and the loop's first step); prints the progress
    line on the primary process (the writer's). Raises NonFiniteLossError on a NaN or Inf loss or gradient norm.

    first_loss, last_loss: the losses of the first and last steps fetched (None before any).
    """

    def __init__(self, writer: MetricsWriter, *, total_steps: int, log_period: int, tokens_per_step: int,
                 flops_per_step: float, num_devices: int, peak_flops_per_device: float,
                 on_step: Callable[[int, dict[str, float]], None] | None = None,
                 needed_flops: Callable[[float], float] | None = None) -> None:
        self.writer, self._on_step = writer, on_step  # on_step(steps completed, host metrics): every step, first
        self.total_steps, self.log_period = total_steps, log_period
        self._rates = {"tokens_per_step": tokens_per_step, "flops_per_step": flops_per_step,
                       "num_devices": num_devices, "peak_flops_per_device": peak_flops_per_device}
        # needed_flops(attention pairs of the step's documents) -> the step's FLOPs by its documents' own attention
        # (maxctx.metrics.flops.needed_flops): the `mfu_needed` beside MaxText's `mfu`.
        self._needed = needed_flops
        self._pending = PendingMetrics()
        self._loop_start: float | None = time.perf_counter()  # None once the first step is timed
        self._window_seconds, self._window_steps = 0.0, 0  # step time summed since the last logged step
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.skipped_steps, self._skips_in_a_row = 0, 0

    def push(self, step: int, metrics: Any) -> None:
        """Takes step `step`'s device metrics, just dispatched; logs the previous step's."""
        self._log(self._pending.push(step, metrics), force=False)

    def flush(self, force: bool = False) -> None:
        """Logs the step pushed last, waiting for it to finish; `force` logs it even off the log period."""
        self._log(self._pending.flush(), force)

    def reset_clock(self) -> None:
        """Leaves the next step out of the timing window, e.g. after an eval paused the loop."""
        self._pending.reset_clock()

    def _log(self, done: StepMetrics | None, force: bool) -> None:
        if done is None:
            return
        completed = done.step + 1
        if self._skipped(completed, done.metrics):
            self._write(done, completed, force)
            return
        if self._on_step is not None:
            self._on_step(completed, done.metrics)
        check_finite(completed, done.metrics)
        if self.first_loss is None:
            self.first_loss = done.metrics["loss"]
        self.last_loss = done.metrics["loss"]
        self._write(done, completed, force)

    def _skipped(self, completed: int, metrics: dict[str, float]) -> bool:
        """Counts a step the train step skipped (see the module docstring); NonFiniteLossError after too many."""
        if "skipped" in metrics:
            metrics["skipped_steps"] = self.skipped_steps + metrics["skipped"]
        if metrics.get("skipped") != 1.0:
            self._skips_in_a_row = 0
            return False
        self.skipped_steps, self._skips_in_a_row = self.skipped_steps + 1, self._skips_in_a_row + 1
        if self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            check_finite(completed, {**metrics, "finite": 0.0})  # raises, naming the values
        if self.writer.is_primary:
            print(f"step {completed}: loss {metrics['loss']:.4g}, gradient norm {metrics['grad_norm']:.4g}; update "
                  f"skipped, weights kept (skip_nonfinite_steps=true; {self.skipped_steps} skipped so far)",
                  flush=True)
        return True

    def _write(self, done: StepMetrics, completed: int, force: bool) -> None:
        first = self._loop_start is not None
        seconds = self._step_seconds(done)
        if seconds is not None:
            self._window_seconds += seconds
            self._window_steps += 1
        rates = self._throughput(seconds, done.metrics) if seconds is not None else {}
        self.writer.write_maxtext_step(done.step, {**done.metrics, **rates})
        if not (completed % self.log_period == 0 or force or first) or not self._window_steps:
            return
        seconds = self._window_seconds / self._window_steps
        self._window_seconds, self._window_steps = 0.0, 0
        values = {**done.metrics, **self._throughput(seconds, done.metrics), **device_memory()}
        self.writer.write_step(completed, values)
        if self.writer.is_primary:
            print(format_progress(completed, self.total_steps, values, seconds), flush=True)

    def _throughput(self, seconds: float, metrics: dict[str, float]) -> dict[str, float]:
        rates = throughput(seconds, **self._rates)
        if self._needed is not None and "attention_pairs" in metrics:
            needed = self._needed(metrics["attention_pairs"])
            rates["mfu_needed"] = rates["mfu"] * needed / self._rates["flops_per_step"]
        return rates

    def _step_seconds(self, done: StepMetrics) -> float | None:
        """The step's time since the previous step finished; the loop's first step, which has none, from the loop's
        start."""
        if self._loop_start is None:
            return done.seconds
        seconds, self._loop_start = done.finished - self._loop_start, None
        return seconds
