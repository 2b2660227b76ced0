"""Where metrics go: `<run_dir>/metrics.jsonl` (one JSON object per record) and TensorBoard scalars.

Record kinds in metrics.jsonl, told apart by the "event" field:
    {"event": "compile", ...}          once, before step 0: the compiled step's memory analysis and FLOPs
    {"event": "train", "step": n, ...} every log_period steps: the keys of TAGS below, as plain names
    {"event": "eval", "step": n, ...}  after each evaluation

TensorBoard tags follow MaxText (`learning/loss`, `perf/step_time_seconds`, ...) so existing dashboards work;
maxctx adds `perf/mfu`. Only the primary process (jax.process_index() == 0) writes anything.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Self

TENSORBOARD_SUBDIR = "tensorboard"  # Config.tensorboard_dir is <run_dir>/tensorboard too.
METRICS_FILE = "metrics.jsonl"

# Record key -> TensorBoard tag. Keys not listed go to 'learning/<key>'.
TAGS = {
    "loss": "learning/loss",
    "grad_norm": "learning/grad_norm",
    "param_norm": "learning/param_norm",
    "learning_rate": "learning/current_learning_rate",
    "tokens": "learning/total_weights",
    "step_time_s": "perf/step_time_seconds",
    "tokens_per_s": "perf/tokens_per_sec",
    "per_device_tokens_per_sec": "perf/per_device_tokens_per_sec",
    "per_device_tflops_per_sec": "perf/per_device_tflops_per_sec",
    "mfu": "perf/mfu",
    "memory_in_use_gib": "perf/memory_in_use_gib",
    "peak_memory_in_use_gib": "perf/peak_memory_in_use_gib",
}
EVAL_TAGS = {"loss": "eval/avg_loss", "tokens": "eval/total_weights"}  # others: 'eval/<key>'


def compile_record(compiled: Any, *, analytic_flops_per_device: float | None = None) -> dict[str, Any]:
    """What the compiled step costs, from `jax.stages.Compiled`: memory_analysis() bytes and XLA's FLOPs.

    XLA's `cost_analysis()["flops"]` is per device, counts a while-loop body once (scan_layers) and counts remat
    recompute; `analytic_flops_per_device` (the MFU numerator) is recorded next to it for comparison.
    """
    record: dict[str, Any] = {}
    memory = compiled.memory_analysis()
    if memory is not None:
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                      "alias_size_in_bytes", "generated_code_size_in_bytes", "host_temp_size_in_bytes"):
            if hasattr(memory, field):
                record[field] = int(getattr(memory, field))
        if {"argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"} <= record.keys():
            record["total_size_in_bytes"] = (record["argument_size_in_bytes"] + record["output_size_in_bytes"]
                                             + record["temp_size_in_bytes"] - record.get("alias_size_in_bytes", 0))
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
        cost = cost[0] if cost else None
    if cost and "flops" in cost:
        record["xla_flops_per_device"] = float(cost["flops"])
    if analytic_flops_per_device is not None:
        record["analytic_flops_per_device"] = float(analytic_flops_per_device)
    return record


def _jsonable(value: Any) -> Any:
    """Python scalars for JSON; NaN and Inf become strings, since JSON has no spelling for them."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard events under run_dir; a no-op unless `is_primary`.

    Use as a context manager, or call close(). Lines are flushed as written, so a crashed run keeps its log.
    """

    def __init__(self, run_dir: str, enable_tensorboard: bool, is_primary: bool):
        self.run_dir = run_dir
        self.is_primary = is_primary
        self._jsonl = None
        self._tb = None
        if not is_primary:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, METRICS_FILE), "a")  # noqa: SIM115 (open for the run)
        if enable_tensorboard:
            import tensorboardX  # only the primary process needs it

            self._tb = tensorboardX.SummaryWriter(logdir=os.path.join(run_dir, TENSORBOARD_SUBDIR))

    def _write_line(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._jsonl.flush()

    def _scalars(self, step: int, metrics: dict[str, Any], tags: dict[str, str], prefix: str) -> None:
        if self._tb is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) or hasattr(value, "item"):
                self._tb.add_scalar(tags.get(key, f"{prefix}/{key}"), float(value), global_step=step)
        self._tb.flush()

    def write_compile(self, record: dict[str, Any]) -> None:
        """The first record of a run: the compiled step's memory and FLOPs (see `compile_record`)."""
        if not self.is_primary:
            return
        self._write_line({"event": "compile", "time": time.time(), **record})
        if self._tb is not None:
            self._tb.add_text("compile", json.dumps(record, indent=1), global_step=0)

    def write_step(self, step: int, metrics: dict[str, Any]) -> None:
        """A logged training step: loss, learning rate, norms, throughput, MFU, memory (any subset)."""
        if not self.is_primary:
            return
        self._write_line({"event": "train", "step": int(step), "time": time.time(), **metrics})
        self._scalars(step, metrics, TAGS, "learning")

    def write_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """An evaluation at `step`: 'loss' goes to eval/avg_loss (MaxText), other keys to eval/<key>."""
        if not self.is_primary:
            return
        self._write_line({"event": "eval", "step": int(step), "time": time.time(), **metrics})
        self._scalars(step, metrics, EVAL_TAGS, "eval")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
