"""Orbax checkpoints: periodic async saves, automatic resume, params-only or full-state loads, preemption.

A checkpoint is `<base_output_directory>/<run_name>/checkpoints/<step>/` with three Orbax items:

    state/   {"step", "params", "opt_state"} (StandardSave): every array written by the processes that hold it
    data/    process_<i>-of-<n>.json (JsonSave, one file per process): the data-iterator state, global (the same
             in every file), so any process count resumes from it (maxctx.checkpoint.data_position)
    meta/    metadata (JsonSave): step, seed, the step's RNG key, mesh, process count

RNG state. The train step draws no random numbers (the model has no dropout); the run's randomness is the `seed`
(parameter init, synthetic data) and keys derived from it per step, `rng_key(seed, step)`. The checkpoint records
the seed and the key of its step, and resuming with another seed is refused, since it would silently change the
synthetic data and any future per-step randomness.

Where the starting state comes from, first match wins:
  1. this run's own latest complete checkpoint (re-running the same command resumes; own checkpoints win over
     the load paths, so a preempted fine-tune continues from its own progress): the newest intact step of either
     tier, the persistent one here or, with enable_emergency_checkpoint, each host's local one
     (maxctx.checkpoint.local_tier) when it is newer and every process can serve it,
  2. `load_full_state_path`: step, parameters and optimizer state of another run (its data-iterator state is
     not taken: this run reads its own data from its start),
  3. `load_parameters_path`: parameters only; fresh optimizer state, step 0,
  4. fresh initialisation.
A load path is a checkpoint step directory (`<run>/checkpoints/<step>`) or a checkpoints directory (its latest
complete step). Paths, shapes, seed and, on resume, the data source (maxctx.checkpoint.compatibility) are
checked when the Checkpointer is built, before anything is restored; errors are ConfigErrors naming the path,
the key and both values, or the parameter and both shapes.

Restores pass the new run's abstract state (ShapeDtypeStructs with their target shardings), so Orbax reads each
device's shard straight into the new layout: a checkpoint saved under one mesh or device count resumes under
another.

Verified checkpoints only. Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` (or
writes commit_success.txt, on object stores) only once every item of every process is written; a save cut off
by a crash or `kill -9` leaves a tmp directory, which is never listed as a step and is deleted at the next start.
Just before that commit, each item records the size and CRC-32 of its files (maxctx.checkpoint.integrity).
Resuming verifies the newest step; one that is incomplete, unreadable or fails verification (or that Orbax then
fails to restore) is reported in one line, renamed aside to `<step>.corrupt` (never deleted) and the next older
step is tried. With none left, or a load path at a damaged step, a CheckpointError (exit 2) says what to do.

Preemption (SIGTERM) and Ctrl-C: the run finishes its current step, saves it, waits for the save to commit and
exits 0 (maxctx.checkpoint.preemption says how every process agrees on that step).

Failed saves (maxctx.checkpoint.failure): a save that fails on storage (disk full, quota, I/O) leaves the committed
steps as they were and no step a resume would pick; `checkpoint_failure_policy=exit` stops the run with one line
(exit 2), `continue` says so in one line and tries again at the next save (a failed last or preemption save still
exits 2). Every process calls `save` and `wait` at the same step, so all agree on a failure and act alike.

Divergence (divergence.py): a state with non-finite parameters or moments is never saved (the step's `finite`
flag, checked before each save); retention keeps the newest checkpoint known good besides the latest
max_num_checkpoints_to_keep, and when the NaN guard stops the run, the checkpoints saved since the divergence
began are set aside (`<step>.suspect`) so that the command it prints resumes from the last good one.
"""

from __future__ import annotations

import atexit
import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from maxctx.checkpoint import failure as failures
from maxctx.checkpoint.compatibility import check_resume_record, check_shapes, resume_changes, resume_record
from maxctx.checkpoint.data_position import data_filename, load_data_state
from maxctx.checkpoint.divergence import DivergenceWatch, KeepLastGood
from maxctx.checkpoint.integrity import VerifiedJsonHandler, VerifiedStandardHandler, check_step
from maxctx.checkpoint.local_tier import LocalTier, check_keys
from maxctx.checkpoint.preemption import PreemptionWatch
from maxctx.checkpoint.steps import (
    DATA,
    ITEMS,
    META,
    STATE,
    CheckpointError,
    resolve_step_dir,
    set_aside,
    state_metadata,
    step_dirs,
)
from maxctx.config import Config, ConfigError
from maxctx.train_step import TrainSetup, init_state


def _from_primary(value: int) -> int:
    """Process 0's `value` on every process (a barrier too)."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def rng_key(seed: int, step: int) -> jax.Array:
    """The run's key for `step`: every per-step random draw derives from it (none in the step today)."""
    return jax.random.fold_in(jax.random.key(seed), step)


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
        self._pending: int | None = None  # the step of the save in flight, until it is known to have committed
        self.manager: ocp.CheckpointManager | None = None
        self.source, self.source_dir = "init", None
        self.directory = directory = epath.Path(config.checkpoint_dir)
        check_keys(config)
        self.local = (LocalTier(config, setup.mesh, self._say)
                      if config.enable_checkpointing and config.enable_emergency_checkpoint else None)
        self._local_step: int | None = None
        resumed = config.enable_checkpointing and self._resumes()
        if not resumed and config.load_full_state_path:
            self.source = "full_state"
            self.source_dir = resolve_step_dir(config.load_full_state_path, "load_full_state_path")
            check_shapes(state_metadata(self.source_dir / STATE), setup.abstract_state,
                         f"load_full_state_path='{config.load_full_state_path}'",
                         "give a checkpoint of this model (load_parameters_path also takes another optimizer's)")
        elif not resumed and config.load_parameters_path:
            self.source = "parameters"
            self.source_dir = resolve_step_dir(config.load_parameters_path, "load_parameters_path")
            check_shapes(state_metadata(self.source_dir / STATE), setup.abstract_state,
                         f"load_parameters_path='{config.load_parameters_path}'", "give a checkpoint of this model",
                         prefix="params/")
        self.watch = None
        self.divergence = DivergenceWatch(0)  # replaced at restore_or_init, from the starting step
        if config.enable_checkpointing:
            self.manager = self._make_manager(directory)
            self._quiet = failures.QuietStorageErrors()
            logging.getLogger("absl").addFilter(self._quiet)  # failed saves are reported in one line
            failures.quiet_abandoned_writes()
            self.watch = PreemptionWatch()
            atexit.register(self.close)

    def _resumes(self) -> bool:
        """Picks this run's own newest intact step of either tier, if any (the local one when it is newer and every
        process can serve it, maxctx.checkpoint.local_tier); True when there is one."""
        persistent = self._newest_good() if step_dirs(self.directory) else None
        newest = int(persistent.name) if persistent is not None else -1
        self._local_step = self.local.newest_common(newest) if self.local is not None else None
        if self._local_step is not None:
            self.source, self.source_dir = "local", self.local.directory / str(self._local_step)
            self._check_meta(self.local.meta(self._local_step), str(self.source_dir))
        elif persistent is not None:
            self.source, self.source_dir = "resume", persistent
            self._check_resume(persistent)
        return self.source != "init"

    def _newest_good(self) -> epath.Path:
        """The newest step that verifies; newer ones are set aside, each reported in one line. Process 0 checks
        (the checkpoint directory is shared) and tells the others."""
        chosen = -1
        if self.primary:
            for step_dir in step_dirs(self.directory):
                problem = check_step(step_dir, ITEMS)
                if problem is None:
                    chosen = int(step_dir.name)
                    break
                self._set_aside(step_dir, problem)
        chosen = _from_primary(chosen)
        if chosen < 0:
            aside = sorted(p.name for p in self.directory.iterdir() if ".corrupt" in p.name)
            raise CheckpointError(f"no good checkpoint left in {self.directory} (set aside: {', '.join(aside)}); "
                                  f"re-running the same command starts this run over from step 0, or start a new "
                                  f"run_name with load_parameters_path=<an older, good step directory>")
        return self.directory / str(chosen)

    def _set_aside(self, step_dir: epath.Path, problem: str) -> None:
        target = set_aside(step_dir, "corrupt")
        self._say(f"checkpoint step {step_dir.name} is unusable: {problem}; set aside as {target.name} (nothing "
                  f"deleted)")

    def _check_resume(self, step_dir: epath.Path) -> None:
        meta = ocp.JsonCheckpointHandler().restore(step_dir / META)
        self._check_meta(meta, str(step_dir), step_dir / STATE)
        self._data_state = load_data_state(step_dir / DATA, jax.process_index(), jax.process_count(), str(step_dir))

    def _check_meta(self, meta: dict, where: str, state_dir: epath.Path | None = None) -> None:
        """The resume record, the shapes in `state_dir` (a persistent step's) and the seed of a step of either
        tier against this config; what the resume changes is said once the state is restored (resume_changes)."""
        check_resume_record(meta.get("config"), self.config, self.setup.global_batch, where)
        if state_dir is not None:
            check_shapes(state_metadata(state_dir), self.setup.abstract_state, f"checkpoint {where}",
                         "use a new run_name for the new model")
        if meta.get("seed") != self.config.seed:
            raise ConfigError(f"checkpoint {where} was saved with seed={meta.get('seed')} but seed="
                              f"{self.config.seed}; resume with seed={meta.get('seed')}, or use a new run_name")
        self._record = meta.get("config")

    def _make_manager(self, directory: epath.Path) -> ocp.CheckpointManager:
        policies = ocp.checkpoint_managers
        keep = policies.AnyPreservationPolicy([
            policies.LatestN(self.config.max_num_checkpoints_to_keep or None),  # 0: keep all
            KeepLastGood(lambda: self.divergence.good_until)])  # never only suspect ones (maxctx.checkpoint.divergence)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=keep, enable_async_checkpointing=self.config.async_checkpointing,
            create=True, cleanup_tmp_directories=True)
        every_process = ocp.options.MultiprocessingOptions(primary_host=None)  # each process writes its own file
        # Each handler records its files' sizes and checksums just before Orbax commits the step.
        handlers = {STATE: VerifiedStandardHandler.of(self.config),
                    DATA: VerifiedJsonHandler(filename=data_filename(jax.process_index(), jax.process_count()),
                                              multiprocessing_options=every_process),
                    META: VerifiedJsonHandler()}
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler in handlers.items():
            save, restore = ((ocp.args.StandardSave, ocp.args.StandardRestore) if item == STATE else
                             (ocp.args.JsonSave, ocp.args.JsonRestore))
            registry.add(item, save, handler)
            registry.add(item, restore, handler)
        return ocp.CheckpointManager(directory, options=options, handler_registry=registry)

    def restore_or_init(self, data) -> dict:
        """The starting state (see the module docstring for the order); on resume also sets `data`'s state."""
        abstract = self.setup.abstract_state
        if self.source == "resume":
            state = self._restore_own(data)
        elif self.source == "local":
            state, record = self.local.restore(self._local_step, abstract)
            data.set_state(record["data"])
            self._say(f"resuming from local checkpoint step {self._local_step} ({self.source_dir})")
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
        if self.source in ("resume", "local"):
            state, notices = resume_changes(state, self._record, self.config, self.setup.global_batch)
            for notice in notices:
                self._say(notice)
        self.divergence = DivergenceWatch(int(jax.device_get(state["step"])))
        return state

    def _restore_own(self, data) -> dict:
        """Restores the verified step chosen at construction; should Orbax still fail to read it, sets it aside and
        falls back like a step that failed verification."""
        from maxctx.plan.out_of_memory import is_out_of_memory

        # The data state is read by _check_resume: the file of another process count, when that is what was saved.
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(self.setup.abstract_state)})
        while True:
            step, error = int(self.source_dir.name), None
            try:
                restored = self.manager.restore(step, args=args)
            except Exception as e:  # noqa: BLE001 - any failure to read a step makes it unusable
                if is_out_of_memory(e):
                    raise
                error = e
            if not _any_process(error is not None):
                break
            if self.primary:
                lines = str(error).strip().splitlines() or [""]
                self._set_aside(self.source_dir, "another process could not restore it" if error is None else
                                f"Orbax cannot restore it ({type(error).__name__}: {lines[0][:200]})")
            self.manager.reload()
            self.source_dir = self._newest_good()
            self._check_resume(self.source_dir)
        data.set_state(self._data_state)
        self._say(f"resuming from checkpoint step {step} ({self.source_dir})")
        return restored[STATE]

    def should_save(self, step: int) -> bool:
        """True when `step` (steps completed) is due: the period, the last step, or an agreed preemption notice.
        Every process must call it after every step (the multi-process preemption check is collective)."""
        if self.manager is None:
            return False
        if self.watch.reached(step):
            self.preempted = True
        return self._persistent_due(step) or (self.local is not None and self.local.due(step))

    def _persistent_due(self, step: int) -> bool:
        return self.preempted or step % self.config.checkpoint_period == 0 or step == self.config.steps

    def save(self, step: int, state: dict, data) -> None:
        """Saves the local tier when due (synchronously: it is a local disk), then starts saving `state` after
        `step` steps to the persistent tier when due (returns once the arrays are copied off the device when
        async_checkpointing is on); after a preemption, waits until the save has committed. A failed persistent
        save (this one, or the previous asynchronous one) is handled per checkpoint_failure_policy."""
        meta = {"step": step, "seed": self.config.seed,
                "rng_key": jax.random.key_data(rng_key(self.config.seed, step)).tolist(),
                "mesh": dict(self.setup.mesh.shape), "process_count": jax.process_count(),
                "learning_rate": self.config.learning_rate,
                "config": resume_record(self.config, self.setup.global_batch)}
        if self.local is not None and self.local.due(step):
            error = failures.storage_error(lambda: self.local.save(step, state, meta, data.get_state()))
            if error is not None:  # this host's own disk: the persistent tier goes on as before
                print(f"local checkpoint step {step} of process {jax.process_index()} not saved: "
                      f"{failures.storage_problem(error)}; the persistent tier goes on", flush=True)
        if not self._persistent_due(step):
            return
        self.wait()
        self._pending = step
        error = failures.storage_error(lambda: self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data.get_state()),
            META: ocp.args.JsonSave(meta)})))
        if _any_process(error is not None):
            self._save_failed(error, last=self.preempted or step == self.config.steps)
        elif self.preempted:
            self.wait(last=True)
            self._say(f"{self.watch.reason}: saved step {step} to {self.config.checkpoint_dir}; "
                      f"re-run the same command to resume")

    def wait(self, last: bool = False) -> None:
        """Waits for the save in flight to commit; a failure is handled per checkpoint_failure_policy (`last`: no
        later save will try again, so it exits 2 whatever the policy). Every process calls it at the same step."""
        if self.manager is None:
            return
        error = failures.storage_error(self.manager.wait_until_finished)  # Orbax raises a failure only once
        if _any_process(error is not None):
            self._save_failed(error, last)
        self._pending = None

    def _save_failed(self, error: Exception | None, last: bool) -> None:
        """One line about the failed save of `self._pending` (its partial files removed once its other writes have
        ended); raises CheckpointError unless the policy is `continue` and a later save will try again."""
        step, self._pending = self._pending, None
        failures.settle_writes()
        if self.primary:
            failures.remove_partial_save(self.directory, step)
        good = step_dirs(self.directory)
        line, go_on = failures.failure_report(step, error, self.directory, good[0].name if good else None,
                                              self.config.checkpoint_failure_policy, last)
        if not go_on:
            raise CheckpointError(line)
        self._say(line)

    def after_divergence(self) -> tuple[str, float]:
        """After the NaN guard stopped the run: waits for pending saves, sets aside the checkpoints newer than the
        last state known good (`<step>.suspect`) and returns (where to resume from, ending in ':' for the command,
        a lower learning rate: a tenth of this run's, at most the one the good checkpoint was trained with)."""
        watch, lower = self.divergence, self.config.learning_rate / 10
        since = f"suspect since step {watch.suspect_since} ({watch.reason}); " if watch.suspect_since else ""
        if self.manager is None:
            return f"{since}no checkpoints (enable_checkpointing=false); start over with a lower learning rate:", lower
        failures.storage_error(self.manager.wait_until_finished)  # a failed save left no step behind
        suspect = [p for p in step_dirs(self.directory) if int(p.name) > watch.good_until]
        if self.local is not None:
            self.local.set_aside_after(watch.good_until)
        if self.primary:
            for step_dir in suspect:
                set_aside(step_dir, "suspect")
        aside = f"set aside {', '.join(p.name + '.suspect' for p in suspect)} (saved after it); " if suspect else ""
        good = [p for p in step_dirs(self.directory) if int(p.name) <= watch.good_until]
        if not good:
            return (f"{since}{aside}no checkpoint predates the divergence; this command starts the run over from "
                    f"step 0 with a lower learning rate:", lower)
        meta = ocp.JsonCheckpointHandler().restore(good[0] / META)
        lower = min(lower, meta.get("learning_rate", lower))
        return (f"{since}{aside}checkpoint step {good[0].name} predates it; resume from it with a lower learning "
                f"rate:", lower)

    def close(self) -> None:
        """Waits for pending saves to commit; idempotent. On an error path (the normal end calls `wait(last=True)`
        first), a save that fails here is only reported."""
        if self.manager is not None:
            error = failures.storage_error(self.manager.wait_until_finished)
            if error is not None:
                self._say(f"saving checkpoint step {self._pending} failed: {failures.storage_problem(error)}")
            self.manager.close()
            self.manager = None
            logging.getLogger("absl").removeFilter(self._quiet)
        if self.watch is not None:
            self.watch.close()
        atexit.unregister(self.close)

    def _say(self, message: str) -> None:
        if self.primary:
            print(message, flush=True)
