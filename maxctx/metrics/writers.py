"""Where metrics go: `<run_dir>/metrics.jsonl` (one JSON object per record) and TensorBoard scalars.

Record kinds in metrics.jsonl, told apart by the "event" field:
    {"event": "compile", ...}          once, before step 0: the compiled step's memory analysis and FLOPs
    {"event": "train", "step": n, ...} every log_period steps: the keys of TAGS below, as plain names; a vector
                                       (moe_expert_load: each expert's share) is a list, one TensorBoard
                                       scalar per entry (moe/expert_load/3)
    {"event": "eval", "step": n, ...}  after each evaluation; loss_by_position ({"1-2": loss, ...}) and
                                       passkey_accuracy ({"<length>/<depth>": accuracy, ...}) are objects

TensorBoard tags follow MaxText (`learning/loss`, `perf/step_time_seconds`, ...) so existing dashboards work;
maxctx adds `perf/mfu`. Only the primary process (jax.process_index() == 0) writes anything. With
`metrics_file=PATH` (MaxText's key) every step also goes to PATH as MaxText writes it: one JSON object per step keyed
by those tags, plus "step" (the step's 0-based index), so scripts written for MaxText's output read it.

A remote run_dir (`gs://...`, any path with "://"): both are written to a local staging folder and mirrored to
run_dir through etils.epath (on a background thread) every `sync_period_s` and at close, because object stores
have no append and tensorboardX reaches GCS only with google-cloud-storage installed. A resumed run first copies
the remote metrics.jsonl back, so the file keeps growing; the last period's records are in the staging folder
(printed at start) if the process dies before the next mirror.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import tempfile
import time
import uuid
import warnings
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
    "moe_expert_load": "moe/expert_load",
    "moe_max_load_ratio": "moe/max_load_ratio",
    "moe_dropped_fraction": "moe/dropped_fraction",
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
    """Python scalars (lists of them) for JSON; NaN and Inf become strings, since JSON has no spelling for them."""
    if isinstance(value, list):
        return [_jsonable(x) for x in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard events under run_dir; a no-op unless `is_primary`.

    Use as a context manager, or call close(). Lines are flushed as written, so a crashed run keeps its log.
    """

    def __init__(self, run_dir: str, enable_tensorboard: bool, is_primary: bool, *, sync_period_s: float = 60.0,
                 metrics_file: str = ""):
        self.run_dir = run_dir
        self.is_primary = is_primary
        self._jsonl = None
        self._tb = None
        self._maxtext = None
        self._mirror: RemoteMirror | None = None
        if not is_primary:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._maxtext = open(metrics_file, "a")  # noqa: SIM115 (open for the run)
        local_dir = run_dir
        if "://" in run_dir:
            self._mirror = RemoteMirror(run_dir, sync_period_s)
            local_dir = self._mirror.local_dir
            print(f"metrics: staged in {local_dir}, mirrored to {run_dir} every {sync_period_s:g} s", flush=True)
        os.makedirs(local_dir, exist_ok=True)
        self._jsonl = open(os.path.join(local_dir, METRICS_FILE), "a")  # noqa: SIM115 (open for the run)
        if enable_tensorboard:
            import tensorboardX  # only the primary process needs it

            # A unique suffix: a resumed run within the same second must not reuse (and, mirrored, overwrite) the
            # previous run's event file name (time in seconds + hostname).
            self._tb = tensorboardX.SummaryWriter(logdir=os.path.join(local_dir, TENSORBOARD_SUBDIR),
                                                  filename_suffix=f".{uuid.uuid4().hex[:8]}")

    def _write_line(self, record: dict[str, Any]) -> None:
        line = {k: {n: _jsonable(x) for n, x in v.items()} if isinstance(v, dict) else _jsonable(v)
                for k, v in record.items()}
        self._jsonl.write(json.dumps(line) + "\n")
        self._jsonl.flush()

    def _scalars(self, step: int, metrics: dict[str, Any], tags: dict[str, str], prefix: str) -> None:
        if self._tb is None:
            return
        for key, value in metrics.items():
            if isinstance(value, dict):  # a tag per entry: eval/loss_by_position/1-2, eval/passkey_accuracy/4096/0.5
                for name, entry in value.items():
                    self._tb.add_scalar(f"{prefix}/{key}/{name}", float(entry), global_step=step)
            elif isinstance(value, list):  # a tag per entry: moe/expert_load/3
                for i, entry in enumerate(value):
                    self._tb.add_scalar(f"{tags.get(key, f'{prefix}/{key}')}/{i}", float(entry), global_step=step)
            elif isinstance(value, (int, float)) or hasattr(value, "item"):
                self._tb.add_scalar(tags.get(key, f"{prefix}/{key}"), float(value), global_step=step)
        self._tb.flush()

    def write_compile(self, record: dict[str, Any]) -> None:
        """The first record of a run: the compiled step's memory and FLOPs (see `compile_record`)."""
        if not self.is_primary:
            return
        self._write_line({"event": "compile", "time": time.time(), **record})
        if self._tb is not None:
            self._tb.add_text("compile", json.dumps(record, indent=1), global_step=0)
            self._tb.flush()
        self._sync()

    def write_step(self, step: int, metrics: dict[str, Any]) -> None:
        """A logged training step: loss, learning rate, norms, throughput, MFU, memory (any subset)."""
        if not self.is_primary:
            return
        self._write_line({"event": "train", "step": int(step), "time": time.time(), **metrics})
        self._scalars(step, metrics, TAGS, "learning")
        self._sync()

    def write_maxtext_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Every step, when metrics_file is set: {"learning/loss": ..., "step": step} as MaxText writes it."""
        if self._maxtext is None:
            return
        line = {TAGS.get(k, f"learning/{k}"): _jsonable(v) for k, v in metrics.items()}
        self._maxtext.write(json.dumps({**line, "step": int(step)}) + "\n")
        self._maxtext.flush()

    def write_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """An evaluation at `step`: 'loss' goes to eval/avg_loss (MaxText), other keys to eval/<key>."""
        if not self.is_primary:
            return
        self._write_line({"event": "eval", "step": int(step), "time": time.time(), **metrics})
        self._scalars(step, metrics, EVAL_TAGS, "eval")
        self._sync()

    def _sync(self) -> None:
        if self._mirror is not None:
            self._mirror.sync()

    def close(self) -> None:
        if self._maxtext is not None:
            self._maxtext.close()
            self._maxtext = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._mirror is not None:
            self._mirror.sync(final=True)
            self._mirror = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteMirror:
    """A local staging folder copied to a remote folder (etils.epath: gs://, s3://, ...) file by file.

    `sync()` starts a copy of the files that changed since the last copy, at most once per `period_s`, on a
    background thread, so a slow or stalled bucket never holds up a training step; while one copy runs, later
    syncs skip (the next one after it picks up everything). `sync(final=True)` (at close) waits for it and copies
    the rest on the caller's thread. Each copy rewrites the whole object, which is what object stores allow;
    metrics files stay small (a record is ~0.5 KB per log period). On start, an existing remote metrics.jsonl is
    copied down, so a resumed run appends.
    """

    def __init__(self, remote_dir: str, period_s: float, local_dir: str | None = None):
        from etils import epath

        self.remote = epath.Path(remote_dir)
        self.local_dir = local_dir or tempfile.mkdtemp(prefix="maxctx-metrics-")
        self.period_s = period_s
        self._copied: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) at its last copy
        self._last = -math.inf  # the first sync copies at once: a wrong bucket shows up at the first record
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="maxctx-mirror")
        self._running: concurrent.futures.Future | None = None
        previous = self.remote / METRICS_FILE
        if previous.exists():
            os.makedirs(self.local_dir, exist_ok=True)
            with open(os.path.join(self.local_dir, METRICS_FILE), "wb") as f:
                f.write(previous.read_bytes())
            info = os.stat(os.path.join(self.local_dir, METRICS_FILE))
            self._copied[METRICS_FILE] = (info.st_size, info.st_mtime_ns)

    def sync(self, final: bool = False) -> None:
        """Starts a copy if the period has passed and none is running; `final`: wait, copy the rest, shut down."""
        if final:
            self.wait()
            self._copy(final=True)
            self._pool.shutdown()
            return
        if time.monotonic() - self._last < self.period_s or (self._running and not self._running.done()):
            return
        self._last = time.monotonic()
        self._running = self._pool.submit(self._copy, False)

    def wait(self) -> None:
        """Blocks until the copy in flight (if any) has finished."""
        if self._running is not None:
            self._running.result()

    def _copy(self, final: bool) -> int:
        copied = 0
        for folder, _, files in os.walk(self.local_dir):
            for name in files:
                rel = os.path.relpath(os.path.join(folder, name), self.local_dir)
                info = os.stat(os.path.join(self.local_dir, rel))
                if self._copied.get(rel) == (info.st_size, info.st_mtime_ns):
                    continue
                target = self.remote / rel
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with open(os.path.join(self.local_dir, rel), "rb") as f:
                        target.write_bytes(f.read())
                except Exception as e:  # noqa: BLE001 (a storage hiccup must not stop training; retried next time)
                    then = ("it is only there now: copy it by hand" if final else "the next sync retries")
                    warnings.warn(f"metrics: copying {rel} to {target} failed ({type(e).__name__}: {e}); the local "
                                  f"copy is in {self.local_dir} and {then}", stacklevel=2)
                    continue
                self._copied[rel] = (info.st_size, info.st_mtime_ns)
                copied += 1
        return copied
