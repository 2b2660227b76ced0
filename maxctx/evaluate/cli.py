"""`python -m maxctx.evaluate CONFIG key=value ... load_parameters_path=PATH`: the training run's evals, without
training, on the parameters of a checkpoint: a run's (`<run>/checkpoints`, its latest step, or one step's
directory) or a converted Hugging Face model's (`python -m maxctx.convert from_hf`).

- loss and loss by position on the eval split (eval_steps batches; -1 the whole split; 0 none),
- the passkey grid when passkey_lengths is set,

on the configured mesh (every CP strategy), printed and appended to `<base_output_directory>/<run_name>/
metrics.jsonl` (and TensorBoard) as an eval record at the checkpoint's step, with "checkpoint" naming it; the last
line of stdout is that record as JSON. `scripts/plot_metrics.py` draws the records of several such runs. It holds
the run directory's lock (maxctx.checkpoint.run_dir) meanwhile, so it never writes into a live run's metrics.
Exit status: 0 done, 2 a bad config, checkpoint or data (or the run directory in use), 3 a non-finite loss.
"""

from __future__ import annotations

import json
import math
import sys

from maxctx.config import ConfigError
from maxctx.files import check_remote_paths
from maxctx.loader import load, usage

USAGE = ("Evaluates a checkpoint (load_parameters_path=) without training: loss by position on the eval split and "
         "the passkey grid (passkey_lengths=...).\nExit status: 0 done, 2 bad config, checkpoint or data, or the run "
         "directory in use, 3 non-finite loss.")
# maxctx.train's statuses (that layer imports this one, not the reverse).
EXIT_CONFIG, EXIT_NONFINITE = 2, 3
# Evaluation never saves, and its checks are those of a run that evaluates.
FIXED = ["enable_checkpointing=false", "eval_interval=1"]


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage("python -m maxctx.evaluate", USAGE))
        return 0
    try:
        config, _ = load([*argv, *FIXED])
        if not config.load_parameters_path:
            raise ConfigError("load_parameters_path is empty; give the checkpoint to evaluate (a step directory, a "
                              "run's checkpoints directory, or a converted model's output_path)")
        check_remote_paths(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from maxctx import runtime
    from maxctx.checkpoint.manager import CheckpointError
    from maxctx.data import DataError
    from maxctx.metrics import NonFiniteLossError

    try:
        runtime.initialize(config)
        record = evaluate(config)
    except (ConfigError, CheckpointError, DataError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    print(json.dumps(record))
    return 0


def evaluate(config) -> dict:
    """Holding the run directory's lock (ConfigError while a live run holds it): restores the parameters, runs
    the evals once, records them; returns the eval record. NonFiniteLossError, with nothing recorded, when the
    loss is not finite."""
    from maxctx.checkpoint.run_dir import lock_run_dir

    lock = lock_run_dir(config)
    try:
        return _evaluate(config)
    finally:
        lock.release()


def _evaluate(config) -> dict:
    from maxctx.checkpoint.manager import Checkpointer, resolve_step_dir
    from maxctx.evaluate.loop import Evaluator, describe
    from maxctx.mesh import create_mesh
    from maxctx.metrics import MetricsWriter
    from maxctx.runtime import is_primary
    from maxctx.train_step import make_setup

    setup = make_setup(config, create_mesh(config))
    step_dir = resolve_step_dir(config.load_parameters_path, "load_parameters_path")
    step = int(step_dir.name) if step_dir.name.isdigit() else 0
    evaluator = Evaluator(config, setup)
    checkpointer = Checkpointer(config, setup, is_primary())
    try:
        params = checkpointer.restore_or_init(None)["params"]
    finally:
        checkpointer.close()
    values = {"checkpoint": str(step_dir), **evaluator.scores(params)}
    if not math.isfinite(values.get("loss", 0.0)):
        from maxctx.metrics import NonFiniteLossError

        cause = ("the eval split gave no batches; check grain_eval_files or eval_split" if not values["batches"] else
                 "the checkpoint's parameters or the eval's numerics are not finite; evaluate an earlier checkpoint")
        raise NonFiniteLossError(f"eval loss {values['loss']} on checkpoint {step_dir} ({values['batches']} "
                                 f"batches), not recorded: {cause}")
    with MetricsWriter(config.run_dir, config.enable_tensorboard, is_primary()) as writer:
        writer.write_eval(step, values)
    if is_primary():
        print(describe(step, values), flush=True)
    return {"event": "eval", "step": step, **values}


def cli() -> None:
    """The `maxctx-evaluate` console script."""
    sys.exit(main(sys.argv[1:]))
