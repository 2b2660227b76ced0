"""The training loop: `python train.py configs/base.yml key=value ...`.

config (validated before JAX starts) -> devices / jax.distributed -> mesh -> abstract state and shardings ->
AOT-compiled step (memory and FLOPs logged before step 0) -> init or resume -> for each step: next batch,
dispatch the step, log the previous step's metrics (one step late, so the host never blocks the device),
evaluate and checkpoint on their periods.

Exit status: 0 done, 2 configuration, data or checkpoint error (a failed save included, per
checkpoint_failure_policy; a peer process that never joined), 3 non-finite loss (the last good checkpoint is
kept), 4 out of device memory (HBM, or a kernel's on-chip memory; host memory too), with what to change
(maxctx.plan.out_of_memory).
"""

from __future__ import annotations

import itertools
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any

from maxctx.checkpoint.run_dir import check_writable
from maxctx.config import Config, ConfigError
from maxctx.files import check_remote_paths
from maxctx.loader import load, save_config, usage
from maxctx.plan.out_of_memory import is_out_of_memory, out_of_memory_advice

if TYPE_CHECKING:
    from maxctx.metrics import MetricsWriter, StepLogger
    from maxctx.plan.planner import Plan
    from maxctx.train_step import TrainSetup

EXIT_CONFIG, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY = 2, 3, 4


USAGE = ("Trains the configured model (python train.py, python -m maxctx.train and maxctx-train are the same).\n"
         "Exit status: 0 done (also after Ctrl-C or SIGTERM, saved), 2 bad config, data or checkpoint, a failed "
         "save, a peer process that never joined, or the run directory in use, 3 non-finite loss, 4 out of device "
         "or host memory.")


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit status."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage("python train.py", USAGE))
        return 0
    try:
        config, plan = load(argv)
        check_writable(config)  # the output directory, before JAX starts
        check_remote_paths(config)  # gs:// buckets and inputs: one line for what is missing or forbidden
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from maxctx import runtime  # imports JAX; device settings must come before its first use
    from maxctx.checkpoint.manager import CheckpointError
    from maxctx.data import DataError
    from maxctx.metrics import NonFiniteLossError

    try:
        runtime.initialize(config)
        with runtime.watch_peers(config, rerun_command(argv)):  # if another process dies, one line saying so
            return train(config, plan)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # only without checkpointing: with it, Ctrl-C saves and exits 0 (checkpoint.manager)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except NonFiniteLossError as e:
        lower = getattr(e, "learning_rate", config.learning_rate / 10)
        print(f"error: {e} {rerun_command(argv, learning_rate=f'{lower:.3g}')}", file=sys.stderr)
        return EXIT_NONFINITE
    except MemoryError as e:  # host memory (numpy), not the device's
        print(f"out of host memory: {e}; lower vocab_size, max_target_length or per_device_batch_size, or use a "
              f"host with more memory", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        print(f"out of memory: {str(e).strip()}\n{out_of_memory_advice(str(e), config, argv)}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY


def train(config: Config, plan: Plan | None = None) -> int:
    """The loop of the module doc, from step 0 or the run's last checkpoint, holding the run directory's lock;
    errors propagate to `main`. `plan`: the planner's table when context_parallel_strategy=auto chose (logged)."""
    from maxctx.checkpoint.run_dir import lock_run_dir

    lock = lock_run_dir(config)  # one live run per run directory: a second one exits 2 here
    try:
        return _train(config, plan)
    finally:
        lock.release()


def _train(config: Config, plan: Plan | None = None) -> int:
    import jax

    from maxctx.checkpoint.manager import Checkpointer
    from maxctx.data.pipeline import create_data_iterator
    from maxctx.evaluate.loop import make_evaluator
    from maxctx.mesh import create_mesh
    from maxctx.metrics import NonFiniteLossError, Profiler, peak_flops_per_device, training_flops_per_step
    from maxctx.runtime import is_primary
    from maxctx.train_step import make_setup

    # First, on an idle host: on CPU the peak is a timed matmul, which the data pipeline's threads would slow.
    peak = peak_flops_per_device(jax.devices()[0], config)
    primary, setup = is_primary(), make_setup(config, create_mesh(config))
    data = create_data_iterator(config, setup.mesh, "train")  # data errors surface before anything is written
    evaluate = make_evaluator(config, setup)
    checkpointer = Checkpointer(config, setup, primary)  # load paths and checkpoint shapes checked before writing
    writer = _open_outputs(config, primary)
    profiler = Profiler(config.tensorboard_dir, config.profile_start_step, config.profile_steps, primary)
    state = None
    try:  # from here on, also on an error: saves already started still commit, logs are flushed
        flops_per_step = training_flops_per_step(config, setup.global_batch, config.max_target_length)
        compiled = _compile(config, setup, flops_per_step, peak, writer, plan)
        state = checkpointer.restore_or_init(data)
        start_step = int(jax.device_get(state["step"]))
        batches = itertools.repeat(next(data)) if config.reuse_example_batch else data  # MaxText's perf test
        logger = _step_logger(config, setup, writer, flops_per_step, peak[0], checkpointer)  # just before the loop
        for step in range(start_step, config.steps):
            profiler.step(step, block_on=state)
            state, step_metrics = compiled(state, _next_batch(batches, checkpointer, step, start_step, state, data))
            logger.push(step, step_metrics)
            completed = step + 1
            if evaluate is not None and completed % config.eval_interval == 0:
                logger.flush()
                evaluate(state, completed, writer)
                logger.reset_clock()
            if checkpointer.should_save(completed):
                logger.flush(force=checkpointer.preempted)  # a NaN step is never saved
                checkpointer.save(completed, state, data)
            if checkpointer.preempted:
                break
        logger.flush(force=True)
        checkpointer.wait(last=True)  # the last save committed, or CheckpointError
    except NonFiniteLossError as e:
        raise _diverged(e, checkpointer) from None
    finally:
        checkpointer.close()
        profiler.stop(block_on=state)
        writer.close()
    if primary:
        _print_end(config, start_step, logger, checkpointer.preempted)
    return 0


def _next_batch(batches: Any, checkpointer: Any, step: int, start_step: int, state: dict, data: Any) -> dict:
    """The next batch. A data error (a file changed under the run) ends the run; when a preemption notice came
    while the batch was being read, the steps done are saved first, as the notice asks (one process: a save is
    collective, and the other processes of a job do not stop here)."""
    from maxctx.data import DataError

    try:
        return next(batches)
    except DataError:
        notice = checkpointer.manager is not None and checkpointer.watch.pending()
        if notice and step > start_step and step % checkpointer.config.checkpoint_period:
            checkpointer.preempted = True
            checkpointer.save(step, state, data)
        raise


def _step_logger(config: Config, setup: TrainSetup, writer: MetricsWriter, flops_per_step: float, peak: float,
                 checkpointer: Any) -> Any:
    """The loop's StepLogger; made just before the loop, which has no earlier fetch to time its first step
    against."""
    from maxctx.metrics import StepLogger
    from maxctx.metrics.flops import needed_flops

    tokens = setup.global_batch * config.max_target_length
    return StepLogger(writer, total_steps=config.steps, log_period=config.log_period, peak_flops_per_device=peak,
                      tokens_per_step=tokens, flops_per_step=flops_per_step, num_devices=setup.mesh.devices.size,
                      on_step=checkpointer.divergence.observe,
                      needed_flops=lambda pairs: needed_flops(config, tokens, pairs))


def _diverged(error: Exception, checkpointer: Any) -> Exception:
    """The NaN guard's error, saying which checkpoint predates the divergence (newer ones are set aside) and the
    lower learning rate to resume with."""
    from maxctx.metrics import NonFiniteLossError

    advice, lower = checkpointer.after_divergence()
    diverged = NonFiniteLossError(f"{error} {advice}")
    diverged.learning_rate = lower
    return diverged


def rerun_command(argv: list[str], **changes: str) -> str:
    """This process's command line (python and the entry point as launched) with `changes` to its keys."""
    entry = [sys.argv[0]]
    if sys.argv[0].endswith(os.path.join("maxctx", "train.py")):  # python -m maxctx.train
        entry = ["-m", "maxctx.train"]
    kept = [arg for arg in argv if arg.split("=", 1)[0] not in changes]
    return shlex.join([sys.executable, *entry, *kept, *(f"{k}={v}" for k, v in changes.items())])


def _open_outputs(config: Config, primary: bool) -> MetricsWriter:
    """The run directory's config.yml and metrics writer (only the primary process writes)."""
    from maxctx.metrics import MetricsWriter

    if primary:
        save_config(config, config.run_dir)
    return MetricsWriter(config.run_dir, config.enable_tensorboard, primary, metrics_file=config.metrics_file)


def _compile(config: Config, setup: TrainSetup, flops_per_step: float, peak: tuple[float, str],
             writer: MetricsWriter, plan: Plan | None) -> Any:
    """AOT-compiles the step and records its memory and FLOPs before step 0 (metrics.jsonl, and the header on the
    primary process), with `peak` (FLOP/s per device, its source) and auto's `plan`; returns the compiled step."""
    import jax

    from maxctx.metrics import compile_record
    from maxctx.model.decoder import count_params
    from maxctx.train_step import compile_train_step, load_compiled

    device, num_devices = jax.devices()[0], setup.mesh.devices.size
    peak_flops, peak_source = peak
    start = time.perf_counter()
    if config.compiled_trainstep_file:  # compiled ahead of time by maxctx.compile (MaxText's key)
        compiled = load_compiled(config.compiled_trainstep_file, setup)
    else:
        compiled = compile_train_step(setup)
    record = compile_record(compiled, analytic_flops_per_device=flops_per_step / num_devices)
    record.update(num_params=count_params(setup.abstract_state["params"]), mesh=dict(setup.mesh.shape),
                  compile_time_s=time.perf_counter() - start, global_batch=setup.global_batch,
                  seq_len=config.max_target_length, peak_flops_per_device=peak_flops, peak_source=peak_source)
    if plan is not None:
        record["context_parallel_plan"] = plan.rows()
    writer.write_compile(record)
    if writer.is_primary:
        _print_header(config, record, device.platform, num_devices)
        if plan is not None:
            from maxctx.plan.planner import format_plan

            print("\n".join(format_plan(plan)), flush=True)
    return compiled


def _print_end(config: Config, start_step: int, logger: StepLogger, preempted: bool) -> None:
    """The run's last line: nothing to do (already at `steps`), or the first and last loss unless preempted."""
    if start_step >= config.steps:
        print(f"nothing to do: the run is already at step {start_step} of steps={config.steps}; raise steps to "
              f"train on, or choose a new run_name")
    if logger.first_loss is not None and not preempted:
        print(f"done: step {config.steps}, loss {logger.first_loss:.4f} (first) -> {logger.last_loss:.4f} (last); "
              f"outputs in {config.run_dir}")


def _print_header(config: Config, record: dict, platform: str, num_devices: int) -> None:
    mib = 1024 ** 2
    print(f"maxctx: {config.model_name} ({record['num_params'] / 1e6:.2f}M parameters) on mesh {record['mesh']}, "
          f"{num_devices} {platform} devices; global batch {record['global_batch']} x {record['seq_len']} tokens")
    print(f"compiled train step in {record['compile_time_s']:.1f}s: per device "
          f"{record.get('total_size_in_bytes', 0) / mib:.1f} MiB (temp {record.get('temp_size_in_bytes', 0) / mib:.1f}"
          f" MiB); {record['analytic_flops_per_device'] / 1e9:.3f} model GFLOP per device per step; "
          f"peak {record['peak_flops_per_device'] / 1e12:.3f} TFLOP/s per device ({record['peak_source']})",
          flush=True)


def cli() -> None:
    """The `maxctx-train` console script."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
