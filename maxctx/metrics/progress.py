"""Host side of step logging: metrics fetched one step late (PendingMetrics), the NaN guard (check_finite), the
progress line (format_progress), the profiler window (Profiler) and device memory (device_memory). Nothing here
blocks the device except where a docstring says so.

maxctx.metrics.step_logger.StepLogger puts all but the profiler together for the training loop (maxctx.train._train),
which calls the profiler itself:

    profiler = Profiler(config.tensorboard_dir, config.profile_start_step, config.profile_steps, primary)
    logger = StepLogger(writer, ...)                  # owns a PendingMetrics; calls check_finite, format_progress
    for step in range(start_step, config.steps):
        profiler.step(step, block_on=state)           # starts or stops the trace at the window's edges
        state, step_metrics = compiled(state, next(batches))   # dispatched; the device runs ahead
        logger.push(step, step_metrics)               # fetches and logs the *previous* step
        ... before an eval or a checkpoint: logger.flush(), so a NaN step is never saved ...
    logger.flush(force=True)
    profiler.stop(block_on=state)                     # in a finally: a window past the last step ends too
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One step's metrics on the host (floats, and lists of floats for vectors). finished: when the step was seen
    finished (time.perf_counter); seconds: since the previous step was seen finished (None for the first, or after
    reset_clock)."""

    step: int
    metrics: dict[str, float]
    seconds: float | None
    finished: float = math.nan


class PendingMetrics:
    """Holds step n's metrics as device arrays until step n+1 is dispatched, then fetches them.

    jax dispatches asynchronously, so reading step n's scalars while step n+1 is queued costs the device nothing;
    reading them right after dispatching step n would stall it for the whole step.

    A step is seen finished when its fetch returns; or, when its metrics were already computed as its dispatch
    returned, at that return. The second case is a synchronous dispatch: a program whose loops the host drives
    (on GPU, a while loop with a computed trip count reads its condition back every iteration) returns only once
    it ran. Timing by fetches alone would then charge each step with the next one's run and the last with
    nothing (benchmarks/gpu.md shows it on a GPU). The step time is the gap between two finishes.
    """

    def __init__(self) -> None:
        self._pending: tuple[int, Any, float | None] | None = None
        self._last_finish: float | None = None

    def push(self, step: int, metrics: Any) -> StepMetrics | None:
        """Stores step `step`'s device metrics, just dispatched; returns the previous step's, fetched to host (None
        at first)."""
        finished = time.perf_counter() if _ready(metrics) else None
        done = self.flush()
        self._pending = (step, metrics, finished)
        return done

    def flush(self) -> StepMetrics | None:
        """Fetches the stored step now (blocks until it finished); None when nothing is stored."""
        if self._pending is None:
            return None
        step, metrics, finished = self._pending
        self._pending = None
        # A vector (an MoE step's per-expert load) stays a list: metrics.jsonl writes it as one.
        host = {k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
        finished = time.perf_counter() if finished is None else finished
        seconds = None if self._last_finish is None else finished - self._last_finish
        self._last_finish = finished
        return StepMetrics(step, host, seconds, finished)

    def reset_clock(self) -> None:
        """Forgets when the last step finished, e.g. after an eval or a checkpoint save paused the loop."""
        self._last_finish = None


def _ready(metrics: Any) -> bool:
    """Whether every device array among `metrics` is already computed (False if any is not, or is no jax.Array)."""
    leaves = jax.tree_util.tree_leaves(metrics)
    return bool(leaves) and all(isinstance(x, jax.Array) and x.is_ready() for x in leaves)


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or Inf loss (or gradient norm); the message names the step."""


def check_finite(step: int, metrics: dict[str, float], keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    """Raises NonFiniteLossError naming the step when any of `keys` present in metrics is NaN or Inf, or when the
    step's `finite` flag (all parameters and optimizer moments finite after the update) is 0."""
    bad = {k: metrics[k] for k in keys if k in metrics and not math.isfinite(metrics[k])}
    if metrics.get("finite", 1.0) != 1.0:
        bad["parameters/moments"] = "non-finite"
    if bad:
        found = ", ".join(f"{k}={v}" for k, v in bad.items())
        lr = f" (learning_rate={metrics['learning_rate']:.3g})" if "learning_rate" in metrics else ""
        raise NonFiniteLossError(f"step {step}: {found}{lr}; stopping the run (this step is not saved).")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _count(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def format_progress(step: int, total_steps: int, metrics: dict[str, float], seconds_per_step: float) -> str:
    """One stdout line, e.g. 'step 120/1000 | loss 3.4512 | 52.10k tok/s | MFU 41.2% | 0.315 s/step | ETA 4m37s'.

    step: steps completed so far; metrics: any of loss, tokens_per_s, mfu; ETA = remaining steps x
    seconds_per_step.
    """
    parts = [f"step {step}/{total_steps}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "tokens_per_s" in metrics:
        parts.append(f"{_count(metrics['tokens_per_s'])} tok/s")
    if math.isfinite(metrics.get("mfu", math.nan)):
        needed = metrics.get("mfu_needed", math.nan)
        # The documents' own attention, where packing makes it differ from the causal rows MFU counts.
        extra = f" (needed {100 * needed:.1f}%)" if math.isfinite(needed) and abs(needed - metrics["mfu"]) > \
            0.005 * metrics["mfu"] else ""
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%{extra}")
    parts.append(f"{seconds_per_step:.3f} s/step")
    parts.append(f"ETA {_duration(max(total_steps - step, 0) * seconds_per_step)}")
    return " | ".join(parts)


class Profiler:
    """A jax.profiler trace of steps [start_step, start_step + num_steps) into `log_dir` (the TensorBoard dir,
    where TensorBoard's profile plugin finds it under plugins/profile). start_step < 0: off."""

    def __init__(self, log_dir: str, start_step: int, num_steps: int, is_primary: bool = True):
        self.log_dir = log_dir
        self.start_step = start_step
        self.stop_step = start_step + max(num_steps, 1)
        self.enabled = start_step >= 0 and is_primary
        self.active = False

    def step(self, step: int, block_on: Any = None) -> None:
        """Call at the top of every step, before dispatching it. Starting and stopping block on `block_on`
        (e.g. the train state) so the trace holds exactly the chosen steps."""
        if not self.enabled:
            return
        if step == self.start_step and not self.active:
            jax.block_until_ready(block_on)
            jax.profiler.start_trace(self.log_dir)
            self.active = True
        elif step == self.stop_step and self.active:
            self.stop(block_on)

    def stop(self, block_on: Any = None) -> None:
        """Ends the trace if one is running (also call after the loop, for a window past the last step)."""
        if self.active:
            jax.block_until_ready(block_on)
            jax.profiler.stop_trace()
            self.active = False


def device_memory(devices: list[jax.Device] | None = None) -> dict[str, float]:
    """Largest bytes in use (and peak) over the local devices, in GiB; {} where the backend reports nothing
    (CPU). Keys: memory_in_use_gib, peak_memory_in_use_gib, memory_limit_gib."""
    in_use, peak, limit = [], [], []
    for device in devices if devices is not None else jax.local_devices():
        try:
            stats = device.memory_stats()
        except (RuntimeError, NotImplementedError):  # some backends raise instead of returning None
            stats = None
        if not stats:
            continue
        in_use.append(stats.get("bytes_in_use", 0))
        peak.append(stats.get("peak_bytes_in_use", 0))
        limit.append(stats.get("bytes_limit", 0))
    if not in_use:
        return {}
    gib = 1024.0**3
    result = {"memory_in_use_gib": max(in_use) / gib, "peak_memory_in_use_gib": max(peak) / gib}
    if any(limit):
        result["memory_limit_gib"] = max(limit) / gib
    return result
