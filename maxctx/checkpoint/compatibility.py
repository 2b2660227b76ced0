"""Can a checkpoint be used by this config? Checked before anything is restored, each failure a ConfigError naming
the key (or parameter) and both values, with the fix.

- Resuming a run: the data source and everything its iterator state depends on (`RESUME_KEYS`), the model-shape
  keys (config.MODEL_KEYS) and the tokenizer must be what the checkpoint was saved with, as recorded in its meta
  item (`resume_record`); otherwise the run would silently read other data from a position meant for the old
  source, or fail with a KeyError. The alternative is `load_full_state_path`: the state of that step, with this
  config's data from its start.
  The tokenizer is recorded by its content too (`tokenizer_digest`): a file replaced at the same path would change
  the token ids under the same data position. The weights' dtype must match as well (`STATE_KEYS`): another one
  would cast the saved state.
- Resuming with another schedule length (`steps`, or learning_rate_schedule_steps), other grain_train_files,
  another compute dtype or another global batch (per_device_batch_size, devices, gradient_accumulation_steps) is
  allowed but changes the run, so it gets one line each (`resume_changes`): what changes
  (the learning rate at the resumed step; the data order; the losses; the sequences per step, the data reading on
  from the same position, the schedule going on by step or by tokens per schedule_on_batch_change) and the key
  that keeps the old behaviour.
- A record from an older version lacks some of these fields; those are not compared. Its relative paths are read
  against this working directory, as the loader reads every path key.
- Any load: every parameter's shape (`check_shapes`), from Orbax's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax
import numpy as np

from maxctx import storage
from maxctx.config import MODEL_KEYS, Config, ConfigError
from maxctx.loader import PATH_KEYS, absolute_path

RESUME_KEYS = ("dataset_type", "dataset_name", "dataset_split", "tfds_data_dir", "text_field",
               "tokenizer_path", "tokenizer_type", "add_bos", "add_eos", "packing", "data_shuffle_seed",
               "enable_data_shuffling", "max_target_length", "grain_worker_count")
STATE_KEYS = ("weight_dtype",)  # the dtype the saved state is in
# A change is reported, not refused; the auxiliary loss weights (MoE) are stored with the model keys.
LOSS_WEIGHT_KEYS = ("load_balance_loss_weight", "router_z_loss_weight")
NOTICE_KEYS = ("schedule_steps", "grain_train_files", "dtype", "global_batch", *LOSS_WEIGHT_KEYS)
# What the Hugging Face reader reads in a tokenizer's folder (maxctx.data.tokenizer_types).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_digest(config: Config) -> str:
    """sha256 of the tokenizer's content ("" without one): its file, and for tokenizer_type=huggingface the files
    of _TOKENIZER_FILES next to it or in the folder it names."""
    if not config.tokenizer_path:
        return ""
    path = storage.local_copy(config.tokenizer_path)
    files = [] if os.path.isdir(path) else [path]
    if config.tokenizer_type == "huggingface":
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        files += [os.path.join(folder, name) for name in _TOKENIZER_FILES]
    digest = hashlib.sha256()
    for file in dict.fromkeys(files):
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(os.path.basename(file).encode() + hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def resume_record(config: Config, global_batch: int) -> dict[str, Any]:
    """What a resume must match, stored in each checkpoint's meta item under "config"."""
    keys = (*RESUME_KEYS, *STATE_KEYS, *NOTICE_KEYS, *MODEL_KEYS)
    return {**{key: getattr(config, key) for key in keys if hasattr(config, key)}, "global_batch": global_batch,
            "tokenizer_sha256": tokenizer_digest(config)}


def _changed(key: str, was: Any, now: Any) -> bool:
    """Whether a saved field differs from this run's; paths compared as the loader reads them (older versions
    recorded relative paths)."""
    if key in PATH_KEYS and isinstance(was, str) and isinstance(now, str):
        was, now = absolute_path(key, was), absolute_path(key, now)
    return was != now


def _difference(key: str, was: Any, now: Any, config: Config) -> str:
    """"<what the checkpoint was saved with> but <this run's>; <the fix>" for a refused record field."""
    if key == "tokenizer_sha256":
        return (f"tokenizer_path='{config.tokenizer_path}' holding other content (sha256 {was[:12]}..., now "
                f"{now[:12]}...): the token ids would change under the data position it resumes at; put the "
                f"tokenizer it was saved with back there")
    return f"{key}={was!r} but this run has {now!r}; resume with {key}={was}"


def check_resume_record(saved: dict[str, Any] | None, config: Config, global_batch: int, step_dir: str) -> None:
    """ConfigError naming the first key whose value differs from the one the checkpoint was saved with
    (checkpoints without a record, from before it was kept, are not checked; nor fields an older record lacks)."""
    if not saved:
        return
    for key, value in resume_record(config, global_batch).items():
        if key in saved and _changed(key, saved[key], value) and key not in NOTICE_KEYS:
            raise ConfigError(f"checkpoint {step_dir} was saved with {_difference(key, saved[key], value, config)}, "
                              f"or start a new run_name with load_full_state_path={step_dir} (its parameters and "
                              f"optimizer state; data from the start)")


def resume_notices(saved: dict[str, Any] | None, config: Config, step: int,
                   schedule_at: int | None = None) -> list[str]:
    """One line for each NOTICE_KEYS value this resume changes: what it changes and how to keep the old one (the
    global batch's line comes from `resume_changes`: it names the schedule's step, which the restored state holds).
    `schedule_at`: the schedule's own step, where it is not `step` (maxctx.optimizer)."""
    from maxctx.optimizer import learning_rate_schedule

    saved, notices, at = saved or {}, [], step if schedule_at is None else schedule_at
    was = saved.get("schedule_steps")
    if was is not None and was != config.schedule_steps:
        old = dataclasses.replace(config, learning_rate_schedule_steps=was)
        notices.append(f"resuming at step {step} on a learning-rate schedule of {config.schedule_steps} steps "
                       f"(steps={config.steps}), not the {was} it was saved with: the learning rate at step {step} "
                       f"goes from {float(learning_rate_schedule(old)(at)):.3g} to "
                       f"{float(learning_rate_schedule(config)(at)):.3g}; to keep the old schedule, add "
                       f"learning_rate_schedule_steps={was}")
    was = saved.get("grain_train_files")
    if was is not None and _changed("grain_train_files", was, config.grain_train_files):
        notices.append(f"resuming with grain_train_files='{config.grain_train_files}', not '{was}' as saved: the "
                       f"data iterator keeps its position but now walks the new files' documents, so the data from "
                       f"step {step} on is not what the old run would have read; to keep the old data order, "
                       f"resume with grain_train_files='{was}'")
    was = saved.get("dtype")
    if was is not None and was != config.dtype:
        notices.append(f"resuming at step {step} with dtype={config.dtype}, not {was} as saved: the step computes in "
                       f"{config.dtype} (the saved state is as it was), so the losses from step {step} on differ "
                       f"from what the old run's would have been; to keep them, resume with dtype={was}")
    for key in LOSS_WEIGHT_KEYS:
        was = saved.get(key)
        if was is not None and was != getattr(config, key):
            notices.append(f"resuming at step {step} with {key}={getattr(config, key)}, not {was} as saved: the "
                           f"loss from step {step} on weighs that auxiliary term differently; to keep it, resume "
                           f"with {key}={was}")
    return notices


def resume_changes(state: dict, saved: dict[str, Any] | None, config: Config,
                   global_batch: int) -> tuple[dict, list[str]]:
    """(the resumed `state`, one line for each change this resume makes to the run): `resume_notices`, and when
    the global batch (in sequences) is not the one saved, the schedule's step moved per schedule_on_batch_change
    (maxctx.optimizer.resumed_schedule_step) and `global_batch_notice`. Collective: every process calls it."""
    from maxctx.optimizer import resumed_schedule_step, schedule_step, with_schedule_step

    step, was = int(jax.device_get(state["step"])), (saved or {}).get("global_batch")
    count = schedule_step(state["opt_state"])
    before = int(jax.device_get(count))
    if was is None or was == global_batch:
        return state, resume_notices(saved, config, step, before)
    after = resumed_schedule_step(before, was, global_batch, config.schedule_on_batch_change)
    if after != before:  # built on every process from the same value: the count is replicated
        moved = jax.make_array_from_callback((), count.sharding, lambda _: np.asarray(after, count.dtype))
        state = {**state, "opt_state": with_schedule_step(state["opt_state"], moved)}
    return state, [global_batch_notice(was, global_batch, config, step, before, after),
                   *resume_notices(saved, config, step, after)]


def global_batch_notice(was: int, now: int, config: Config, step: int, before: int, after: int) -> str:
    """The line for a resume at `step` with another global batch (in sequences), the schedule's step going from
    `before` to `after`."""
    from maxctx.optimizer import learning_rate_schedule, resumed_schedule_step

    accumulation, schedule = config.gradient_accumulation_steps, learning_rate_schedule(config)
    devices = round(now / (config.per_device_batch_size * accumulation))
    if config.schedule_on_batch_change == "tokens":
        how = (f"by tokens (schedule_on_batch_change=tokens): from its step {before} to {after}, the learning rate "
               f"{float(schedule(before)):.3g} -> {float(schedule(after)):.3g}")
    else:
        other = resumed_schedule_step(before, was, now, "tokens")
        how = (f"by step at its step {before} (learning rate {float(schedule(before)):.3g}; "
               f"schedule_on_batch_change=tokens would move it to step {other}, {float(schedule(other)):.3g})")
    return (f"resuming at step {step} with a global batch of {now} sequences (per_device_batch_size="
            f"{config.per_device_batch_size:g} x {devices} devices x gradient_accumulation_steps={accumulation}), "
            f"not the {was} it was saved with: the data reads on from the same position, "
            f"{now * config.max_target_length} tokens a step instead of {was * config.max_target_length}, and the "
            f"learning-rate schedule goes on {how}; to keep the old batch, resume with per_device_batch_size x "
            f"devices x gradient_accumulation_steps = {was}")


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
