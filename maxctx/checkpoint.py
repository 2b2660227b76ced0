"""Orbax checkpoints: periodic async saves, automatic resume, params-only or full-state loads, preemption.

A checkpoint is `<base_output_directory>/<run_name>/checkpoints/<step>/` with three Orbax items:

    state/   {"step", "params", "opt_state"} (StandardSave): every array written by the processes that hold it
    data/    process_<i>-of-<n>.json (JsonSave, one file per process): that process's data-iterator state
    meta/    metadata (JsonSave): step, seed, the step's RNG key, mesh, process count

RNG state. The train step draws no random numbers (the model has no dropout); the run's randomness is the `seed`
(parameter init, synthetic data) and keys derived from it per step, `rng_key(seed, step)`. The checkpoint records
the seed and the key of its step, and resuming with another seed is refused, since it would silently change the
synthetic data and any future per-step randomness.

Where the starting state comes from, first match wins:
  1. this run's own latest complete checkpoint (re-running the same command resumes; own checkpoints win over
     the load paths, so a preempted fine-tune continues from its own progress),
  2. `load_full_state_path`: step, parameters and optimizer state of another run (its data-iterator state is
     not taken: this run reads its own data from its start),
  3. `load_parameters_path`: parameters only; fresh optimizer state, step 0,
  4. fresh initialisation.
A load path is a checkpoint step directory (`<run>/checkpoints/<step>`) or a checkpoints directory (its latest
complete step). Paths, shapes, seed and process count are checked when the Checkpointer is built, before anything
is written; errors are ConfigErrors naming the path, or the parameter and both shapes.

Restores pass the new run's abstract state (ShapeDtypeStructs with their target shardings), so Orbax reads each
device's shard straight into the new layout: a checkpoint saved under one mesh or device count resumes under
another.

Complete checkpoints only. Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` (or
writes commit_success.txt, on object stores) only once every item of every process is written; a save cut off
by a crash or `kill -9` leaves a tmp directory, which is never listed as a step and is deleted at the next start.

Preemption (SIGTERM): the run finishes its current step, saves it, waits for the save to commit and exits 0.
Single process: a signal handler sets a flag read after each step. Multi-process: processes get the signal at
different times and are at different steps, so they must agree on one step to save; JAX's preemption service
(started by jax.distributed.initialize, with its own SIGTERM notifier) spreads the notice and
`reached_preemption_sync_point(step)` turns True on every process at the same step (max step seen + 1). Both are
checked in `should_save`, which every process calls after every step.
"""

from __future__ import annotations

import atexit
import signal
import threading
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from maxctx.config import Config, ConfigError
from maxctx.train_step import TrainSetup, init_state

STATE, DATA, META = "state", "data", "meta"


def rng_key(seed: int, step: int) -> jax.Array:
    """The run's key for `step`: every per-step random draw derives from it (none in the step today)."""
    return jax.random.fold_in(jax.random.key(seed), step)


def data_filename(process_index: int, process_count: int) -> str:
    return f"process_{process_index}-of-{process_count}.json"


def _flat_shapes(tree: Any) -> dict[str, tuple]:
    """{'params/layers/attention/wq': shape, ...} for a state tree or Orbax's metadata tree of one."""

    def name(key) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def check_shapes(saved_tree: Any, target_tree: Any, where: str, other: str, prefix: str = "") -> None:
    """ConfigError naming the first parameter whose shape differs (or that is missing) between a checkpoint and
    this run's abstract state; only names under `prefix` are compared. `other`: the fix's alternative."""
    saved = {k: v for k, v in _flat_shapes(saved_tree).items() if k.startswith(prefix)}
    target = {k: v for k, v in _flat_shapes(target_tree).items() if k.startswith(prefix)}
    fix = f"check model_name and the model-shape keys (base_emb_dim, base_num_*, head_dim, vocab_size, ...), or {other}"
    for key, shape in sorted(target.items(), key=lambda item: not item[0].startswith("params/")):
        if key not in saved:
            raise ConfigError(f"{where} was saved for another model or optimizer: it has no '{key}' (shape {shape} "
                              f"in this config); {fix}")
        if saved[key] != shape:
            raise ConfigError(f"{where} was saved for another model shape: '{key}' has shape {saved[key]} in the "
                              f"checkpoint but {shape} in this config; {fix}")
    extra = sorted(saved.keys() - target.keys())
    if extra:
        raise ConfigError(f"{where} was saved for another model or optimizer: it has '{extra[0]}' (shape "
                          f"{saved[extra[0]]}) that this config does not; {fix}")


def resolve_step_dir(path: str, key: str) -> epath.Path:
    """A load path (a step directory, or a checkpoints directory: its latest complete step) -> the step directory."""
    where = epath.Path(path)
    if not where.exists():
        raise ConfigError(f"{key}='{path}' does not exist; give a checkpoint step directory "
                          f"(<run>/checkpoints/<step>) or a run's checkpoints directory")
    if (where / STATE).is_dir():
        if not ocp.utils.is_checkpoint_finalized(where):
            raise ConfigError(f"{key}='{path}' is an incomplete checkpoint (its save was cut off); give a "
                              f"complete step directory")
        return where
    steps = ocp.utils.checkpoint_steps(where) if where.is_dir() else []
    steps = [s for s in steps if (where / str(s) / STATE).is_dir()]
    if not steps:
        raise ConfigError(f"{key}='{path}' holds no complete maxctx checkpoint (no <step>/{STATE} directory); give "
                          f"a checkpoint step directory (<run>/checkpoints/<step>) or a run's checkpoints directory")
    return where / str(max(steps))


def _state_metadata(state_dir: epath.Path) -> Any:
    return ocp.StandardCheckpointHandler().metadata(state_dir).tree


class PreemptionWatch:
    """Has a preemption notice (SIGTERM) arrived, agreed by every process for the same step? See the module
    docstring for the single- and multi-process mechanisms."""

    def __init__(self) -> None:
        self.multi_process = jax.process_count() > 1
        self.flag = False
        self._previous = None
        if not self.multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.flag = True

    def reached(self, step: int) -> bool:
        if self.multi_process and not self.flag:
            try:
                self.flag = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service=false)
                self.multi_process = False
        return self.flag

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Checkpointer:
    """The run's checkpoints. Build it before writing anything (it checks load paths and shapes), then:

        state = checkpointer.restore_or_init(data)   # and sets the data iterator's state on resume
        for step ...:
            if checkpointer.should_save(step + 1):  # every process, every step
                ...flush metrics, check finite...
                checkpointer.save(step + 1, state, data)
            if checkpointer.preempted: break
        checkpointer.close()                         # waits for the last save to commit
    """

    def __init__(self, config: Config, setup: TrainSetup, primary: bool = True):
        self.config, self.setup, self.primary = config, setup, primary
        self.preempted = False
        self.manager: ocp.CheckpointManager | None = None
        self.source, self.source_dir = "init", None
        directory = epath.Path(config.checkpoint_dir)
        own_steps = ocp.utils.checkpoint_steps(directory) if config.enable_checkpointing else []
        if own_steps:
            self.source, self.source_dir = "resume", directory / str(max(own_steps))
            self._check_resume(self.source_dir)
        elif config.load_full_state_path:
            self.source = "full_state"
            self.source_dir = resolve_step_dir(config.load_full_state_path, "load_full_state_path")
            check_shapes(_state_metadata(self.source_dir / STATE), setup.abstract_state,
                         f"load_full_state_path='{config.load_full_state_path}'",
                         "give a checkpoint of this model (load_parameters_path also takes another optimizer's)")
        elif config.load_parameters_path:
            self.source = "parameters"
            self.source_dir = resolve_step_dir(config.load_parameters_path, "load_parameters_path")
            check_shapes(_state_metadata(self.source_dir / STATE), setup.abstract_state,
                         f"load_parameters_path='{config.load_parameters_path}'", "give a checkpoint of this model",
                         prefix="params/")
        self.watch = None
        if config.enable_checkpointing:
            self.manager = self._make_manager(directory)
            self.watch = PreemptionWatch()
            atexit.register(self.close)

    def _check_resume(self, step_dir: epath.Path) -> None:
        check_shapes(_state_metadata(step_dir / STATE), self.setup.abstract_state, f"checkpoint {step_dir}",
                     "use a new run_name for the new model")
        meta = ocp.JsonCheckpointHandler().restore(step_dir / META)
        if meta.get("seed") != self.config.seed:
            raise ConfigError(f"checkpoint {step_dir} was saved with seed={meta.get('seed')} but seed="
                              f"{self.config.seed}; resume with seed={meta.get('seed')}, or use a new run_name")
        mine = data_filename(jax.process_index(), jax.process_count())
        if not (step_dir / DATA / mine).exists():
            raise ConfigError(f"checkpoint {step_dir} was saved by {meta.get('process_count')} processes, but this "
                              f"run has {jax.process_count()}: the data-iterator state of process "
                              f"{jax.process_index()} ({DATA}/{mine}) is missing; resume with "
                              f"{meta.get('process_count')} processes, or start a new run_name with "
                              f"load_full_state_path={step_dir}")

    def _make_manager(self, directory: epath.Path) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.max_num_checkpoints_to_keep,
            enable_async_checkpointing=self.config.async_checkpointing,
            create=True, cleanup_tmp_directories=True)
        every_process = ocp.options.MultiprocessingOptions(primary_host=None)  # each process writes its own file
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            DATA: ocp.JsonCheckpointHandler(filename=data_filename(jax.process_index(), jax.process_count()),
                                            multiprocessing_options=every_process),
            META: ocp.JsonCheckpointHandler(),
        }
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)

    def restore_or_init(self, data) -> dict:
        """The starting state (see the module docstring for the order); on resume also sets `data`'s state."""
        abstract = self.setup.abstract_state
        if self.source == "resume":
            step = int(self.source_dir.name)
            restored = self.manager.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract), DATA: ocp.args.JsonRestore()}))
            data.set_state(restored[DATA])
            state = restored[STATE]
            self._say(f"resuming from checkpoint step {step} ({self.source_dir})")
        elif self.source == "full_state":
            state = ocp.StandardCheckpointer().restore(self.source_dir / STATE, abstract)
            self._say(f"loaded the full training state of step {int(state['step'])} from {self.source_dir}; "
                      f"data from its start")
        elif self.source == "parameters":
            target = {"params": abstract["params"]}
            params = ocp.PyTreeCheckpointer().restore(self.source_dir / STATE, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))["params"]
            opt_state = jax.jit(self.setup.optimizer.init,
                                out_shardings=self.setup.state_shardings["opt_state"])(params)
            step = jax.device_put(jnp.zeros((), jnp.int32), self.setup.state_shardings["step"])
            state = {"step": step, "params": params, "opt_state": opt_state}
            self._say(f"loaded parameters from {self.source_dir}; fresh optimizer state, step 0")
        else:
            state = init_state(self.setup)
        return state

    def should_save(self, step: int) -> bool:
        """True when `step` (steps completed) is due: the period, the last step, or an agreed preemption notice.
        Every process must call it after every step (the multi-process preemption check is collective)."""
        if self.manager is None:
            return False
        if self.watch.reached(step):
            self.preempted = True
        return self.preempted or step % self.config.checkpoint_period == 0 or step == self.config.steps

    def save(self, step: int, state: dict, data) -> None:
        """Starts saving `state` after `step` steps (returns once the arrays are copied off the device when
        async_checkpointing is on); after a preemption, waits until the save has committed."""
        meta = {"step": step, "seed": self.config.seed,
                "rng_key": jax.random.key_data(rng_key(self.config.seed, step)).tolist(),
                "mesh": dict(self.setup.mesh.shape), "process_count": jax.process_count()}
        self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data.get_state()),
            META: ocp.args.JsonSave(meta)}))
        if self.preempted:
            self.manager.wait_until_finished()
            self._say(f"preemption notice (SIGTERM): saved step {step} to {self.config.checkpoint_dir}; "
                      f"re-run the same command to resume")

    def close(self) -> None:
        """Waits for pending saves to commit; idempotent."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None
        if self.watch is not None:
            self.watch.close()
        atexit.unregister(self.close)

    def _say(self, message: str) -> None:
        if self.primary:
            print(message, flush=True)
