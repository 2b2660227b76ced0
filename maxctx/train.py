"""The training loop: `python train.py configs/base.yml key=value ...`.

config (validated before JAX starts) -> devices / jax.distributed -> mesh -> abstract state and shardings ->
AOT-compiled step (memory and FLOPs logged before step 0) -> init -> for each step: next batch, step, log the
previous step's metrics (one step late, so the host never blocks the device).
"""

from __future__ import annotations

import json
import os
import sys
import time

from maxctx.config import Config, ConfigError, load_config, save_config


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit status (2 for a configuration error)."""
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from maxctx import runtime  # imports JAX; device settings must come before its first use

    try:
        runtime.initialize(config)
        return train(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class JsonlLog:
    """Appends one JSON object per record to <run_dir>/metrics.jsonl (process 0 only)."""

    def __init__(self, path: str, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def train(config: Config) -> int:
    import jax

    from maxctx.data.pipeline import create_data_iterator
    from maxctx.mesh import create_mesh
    from maxctx.model.decoder import count_params
    from maxctx.runtime import is_primary
    from maxctx.train_step import compile_train_step, compiled_stats, init_state, make_setup

    mesh = create_mesh(config)
    primary = is_primary()
    if primary:
        os.makedirs(config.run_dir, exist_ok=True)
        save_config(config, os.path.join(config.run_dir, "config.yml"))
    log = JsonlLog(os.path.join(config.run_dir, "metrics.jsonl"), primary)

    setup = make_setup(config, mesh)
    tokens_per_step = setup.global_batch * config.max_target_length
    start = time.perf_counter()
    compiled = compile_train_step(setup)
    stats = compiled_stats(compiled)
    n_params = count_params(setup.abstract_state["params"])
    if primary:
        print(f"maxctx: {config.model_name} ({n_params / 1e6:.2f}M parameters) on mesh {dict(mesh.shape)}, "
              f"{jax.device_count()} {jax.devices()[0].platform} devices; global batch {setup.global_batch} x "
              f"{config.max_target_length} tokens")
        print(f"compiled train step in {time.perf_counter() - start:.1f}s: per device "
              f"{_format_bytes(stats.get('total_bytes_per_device', 0))} (temp "
              f"{_format_bytes(stats.get('temp_size_in_bytes', 0))}), "
              f"{stats.get('xla_flops_per_device', 0) / 1e9:.3f} GFLOP per step (XLA cost analysis)")
    log.write({"event": "compile", "num_params": n_params, "compile_time_s": time.perf_counter() - start,
               "mesh": dict(mesh.shape), "tokens_per_step": tokens_per_step, **stats})

    state = init_state(setup)
    data = create_data_iterator(config, mesh, "train")
    pending = None  # (step, metrics on device, dispatch time) of the previous step
    last_time = time.perf_counter()
    first_loss = last_loss = None
    for step in range(int(jax.device_get(state["step"])), config.steps):
        batch = next(data)
        state, metrics = compiled(state, batch)
        if pending is not None:
            last_time, record = _finish(pending, last_time, tokens_per_step, config, log, primary)
            first_loss = record["loss"] if first_loss is None else first_loss
            last_loss = record["loss"]
        pending = (step, metrics)
    if pending is not None:
        _, record = _finish(pending, last_time, tokens_per_step, config, log, primary, force=True)
        first_loss = record["loss"] if first_loss is None else first_loss
        last_loss = record["loss"]
    if primary and first_loss is not None:
        print(f"done: {config.steps} steps, loss {first_loss:.4f} -> {last_loss:.4f}; outputs in {config.run_dir}")
    return 0


def _finish(pending, last_time, tokens_per_step, config, log, primary, force=False):
    """Fetches a finished step's metrics (the next step is already dispatched) and logs them on its period."""
    import jax

    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    step_time = now - last_time
    record = {"step": step, **values, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
    if step % config.log_period == 0 or force:
        log.write(record)
        if primary:
            print(f"step {step + 1}/{config.steps} | loss {values['loss']:.4f} | lr {values['learning_rate']:.2e} | "
                  f"grad norm {values['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tokens/s", flush=True)
    return now, record
