"""The training loop: `python train.py configs/base.yml key=value ...`.

config (validated before JAX starts) -> devices / jax.distributed -> mesh -> abstract state and shardings ->
AOT-compiled step (memory and FLOPs logged before step 0) -> init or resume -> for each step: next batch,
dispatch the step, log the previous step's metrics (one step late, so the host never blocks the device),
evaluate and checkpoint on their periods.

Exit status: 0 done, 2 configuration error, 3 non-finite loss (the last good checkpoint is kept), 4 out of device
memory (HBM, or a kernel's on-chip memory), with what to change.
"""

from __future__ import annotations

import re
import sys
import time

from maxctx.config import Config, ConfigError, load_config, save_config

EXIT_CONFIG, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY = 2, 3, 4


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit status."""
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from maxctx import runtime  # imports JAX; device settings must come before its first use
    from maxctx.data import DataError
    from maxctx.metrics import NonFiniteLossError

    try:
        runtime.initialize(config)
        return train(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        print(f"out of memory: {str(e).strip()}\n{out_of_memory_advice(str(e), config, argv)}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's device-memory errors (compile or run time); other RESOURCE_EXHAUSTED statuses (a coordination
    service or storage quota) are not."""
    import jax

    message = str(error)
    return (isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in message
            and re.search(r"out of memory|memory space|exceeds available", message, re.IGNORECASE) is not None)


def out_of_memory_advice(message: str, config: Config, argv: list[str]) -> str:
    """What to change: for a kernel's on-chip memory, its block sizes; for HBM, the memory levers, and the
    command that checks a fit before launching."""
    from maxctx.attention.dispatch import resolve_kernel
    from maxctx.compile import onchip_advice, xla_out_of_memory

    space = xla_out_of_memory(message).get("xla_memory_space")
    if space:
        import jax

        kernel = resolve_kernel(config.attention, platform=jax.devices()[0].platform, dtype=config.dtype)
        return f"what to change: {onchip_advice(space, kernel)}"
    plan = " ".join(["python -m maxctx.compile", *argv, "compile_topology=<your slice, e.g. v5p-128>"])
    return (f"what to change: lower per_device_batch_size or max_target_length, set remat_policy=full, or spread the "
            f"state and sequence over more devices (ici_fsdp_parallelism, ici_context_parallelism); check a setting "
            f"without a TPU first: {plan}")


def train(config: Config) -> int:
    import jax

    from maxctx import metrics as M
    from maxctx.checkpoint import Checkpointer
    from maxctx.data.pipeline import create_data_iterator
    from maxctx.mesh import create_mesh
    from maxctx.model.decoder import count_params
    from maxctx.runtime import is_primary
    from maxctx.train_step import compile_train_step, jit_eval_step, make_setup

    mesh = create_mesh(config)
    primary = is_primary()
    setup = make_setup(config, mesh)
    num_devices = mesh.devices.size
    seq_len = config.max_target_length
    tokens_per_step = setup.global_batch * seq_len
    flops_per_step = M.training_flops_per_step(config, setup.global_batch, seq_len)
    data = create_data_iterator(config, mesh, "train")  # data errors surface before anything is written
    eval_data = create_data_iterator(config, mesh, "eval") if config.eval_interval > 0 else None
    checkpointer = Checkpointer(config, setup, primary)  # load paths and checkpoint shapes checked before writing

    if primary:
        save_config(config, config.run_dir)
    writer = M.MetricsWriter(config.run_dir, config.enable_tensorboard, primary)
    profiler, state = None, None
    try:  # from here on, also on an error: saves already started still commit, logs are flushed
        peak, peak_source = M.peak_flops_per_device(jax.devices()[0], config)

        start = time.perf_counter()
        compiled = compile_train_step(setup)
        record = M.compile_record(compiled, analytic_flops_per_device=flops_per_step / num_devices)
        record.update(num_params=count_params(setup.abstract_state["params"]), mesh=dict(mesh.shape),
                      compile_time_s=time.perf_counter() - start, global_batch=setup.global_batch, seq_len=seq_len,
                      peak_flops_per_device=peak, peak_source=peak_source)
        writer.write_compile(record)
        if primary:
            _print_header(config, record, jax.devices()[0].platform, num_devices)

        state = checkpointer.restore_or_init(data)
        start_step = int(jax.device_get(state["step"]))
        eval_step = jit_eval_step(setup) if eval_data is not None else None
        eval_start = eval_data.get_state() if eval_data is not None else None
        pending = M.PendingMetrics()
        profiler = M.Profiler(config.tensorboard_dir, config.profile_start_step, config.profile_steps, primary)
        losses: list[float] = []

        window = {"seconds": 0.0, "steps": 0}  # step time summed since the last logged step

        def log(done: M.StepMetrics | None, force: bool = False) -> None:
            if done is None:
                return
            completed = done.step + 1
            M.check_finite(completed, done.metrics)
            losses.append(done.metrics["loss"])
            if done.seconds is not None or done.step == start_step:
                # The first step has no previous fetch to time against: it is timed from the loop's start.
                window["seconds"] += done.seconds if done.seconds is not None else time.perf_counter() - loop_start
                window["steps"] += 1
            if not (completed % config.log_period == 0 or force or done.step == start_step) or not window["steps"]:
                return
            seconds = window["seconds"] / window["steps"]  # mean over the log period: steadier than one step
            window.update(seconds=0.0, steps=0)
            perf = M.throughput(seconds, tokens_per_step=tokens_per_step, flops_per_step=flops_per_step,
                                num_devices=num_devices, peak_flops_per_device=peak)
            values = {**done.metrics, **perf, **M.device_memory()}
            writer.write_step(completed, values)
            if primary:
                print(M.format_progress(completed, config.steps, values, seconds), flush=True)

        loop_start = time.perf_counter()
        for step in range(start_step, config.steps):
            profiler.step(step, block_on=state)
            batch = next(data)
            state, step_metrics = compiled(state, batch)
            log(pending.push(step, step_metrics))
            completed = step + 1
            if eval_step is not None and completed % config.eval_interval == 0:
                log(pending.flush())
                _evaluate(eval_step, state, eval_data, eval_start, config, writer, completed, primary)
                pending.reset_clock()
            if checkpointer.should_save(completed):
                log(pending.flush(), force=checkpointer.preempted)  # a NaN step is never saved
                checkpointer.save(completed, state, data)
            if checkpointer.preempted:
                break
        log(pending.flush(), force=True)
    finally:
        checkpointer.close()
        if profiler is not None:
            profiler.stop(block_on=state)
        writer.close()
    if primary and start_step >= config.steps:
        print(f"nothing to do: the run is already at step {start_step} of steps={config.steps}; raise steps to "
              f"train on, or choose a new run_name")
    if primary and losses and not checkpointer.preempted:
        print(f"done: step {config.steps}, loss {losses[0]:.4f} (first) -> {losses[-1]:.4f} (last); "
              f"outputs in {config.run_dir}")
    return 0


def _evaluate(eval_step, state, eval_data, eval_start: dict, config: Config, writer, step: int,
              primary: bool) -> None:
    import math

    import jax

    eval_data.set_state(eval_start)  # every eval scores the same batches, so evals are comparable
    loss_sum = weight_sum = 0.0
    for _ in range(config.eval_steps):
        sums = jax.device_get(eval_step(state["params"], next(eval_data)))
        loss_sum, weight_sum = loss_sum + float(sums[0]), weight_sum + float(sums[1])
    loss = loss_sum / max(weight_sum, 1.0)
    values = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": weight_sum}
    writer.write_eval(step, values)
    if primary:
        print(f"eval at step {step}: loss {loss:.4f}, perplexity {values['perplexity']:.2f}", flush=True)


def _print_header(config: Config, record: dict, platform: str, num_devices: int) -> None:
    mib = 1024 ** 2
    print(f"maxctx: {config.model_name} ({record['num_params'] / 1e6:.2f}M parameters) on mesh {record['mesh']}, "
          f"{num_devices} {platform} devices; global batch {record['global_batch']} x {record['seq_len']} tokens")
    print(f"compiled train step in {record['compile_time_s']:.1f}s: per device "
          f"{record.get('total_size_in_bytes', 0) / mib:.1f} MiB (temp {record.get('temp_size_in_bytes', 0) / mib:.1f}"
          f" MiB); {record['analytic_flops_per_device'] / 1e9:.3f} model GFLOP per device per step; "
          f"peak {record['peak_flops_per_device'] / 1e12:.3f} TFLOP/s per device ({record['peak_source']})",
          flush=True)
