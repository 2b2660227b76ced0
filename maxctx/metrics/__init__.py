"""Metrics: model FLOPs and MFU, the peak FLOP/s table, TensorBoard + JSONL writers, and the host-side step log.

    flops.py        training FLOPs per step (MaxText convention), throughput and MFU
    peaks.py        peak FLOP/s per device kind (cited), or measured on CPU
    writers.py      MetricsWriter: metrics.jsonl and TensorBoard scalars with MaxText tags
    progress.py     one-step-late fetch, NaN guard, progress line, profiler window, device memory
    step_logger.py  StepLogger: the training loop's step log (those pieces, the timing window and the writer)
"""

from maxctx.metrics.flops import (
    attention_pairs,
    throughput,
    training_flops_per_device,
    training_flops_per_step,
)
from maxctx.metrics.peaks import (
    PEAK_TABLE,
    lookup_peak,
    measure_matmul_flops,
    peak_flops_per_device,
)
from maxctx.metrics.progress import (
    NonFiniteLossError,
    PendingMetrics,
    Profiler,
    StepMetrics,
    check_finite,
    device_memory,
    format_progress,
)
from maxctx.metrics.step_logger import StepLogger
from maxctx.metrics.writers import EVAL_TAGS, TAGS, MetricsWriter, compile_record

__all__ = [
    "EVAL_TAGS", "PEAK_TABLE", "TAGS", "MetricsWriter", "NonFiniteLossError", "PendingMetrics", "Profiler",
    "StepLogger", "StepMetrics", "attention_pairs", "check_finite", "compile_record", "device_memory",
    "format_progress", "lookup_peak", "measure_matmul_flops", "peak_flops_per_device", "throughput",
    "training_flops_per_device", "training_flops_per_step",
]
