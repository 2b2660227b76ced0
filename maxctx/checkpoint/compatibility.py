"""Can a checkpoint be used by this config? Checked before anything is restored, each failure a ConfigError naming
the key (or parameter) and both values, with the fix.

- Resuming a run: the data source and everything its iterator state depends on (`RESUME_KEYS`, plus the global
  batch in sequences, which may be spread over another mesh), the model-shape keys (config.MODEL_KEYS) and the
  tokenizer must be what the checkpoint was saved with, as recorded in its meta item (`resume_record`); otherwise
  the run would silently read other data from a position meant for the old source, or fail with a KeyError. The
  alternative is `load_full_state_path`: the state of that step, with this config's data from its start.
- Resuming with another schedule length (`steps`, or learning_rate_schedule_steps) or other grain_train_files is
  allowed but changes the run, so it gets one line each (`resume_notices`): what changes (the learning rate at the
  resumed step; the data order) and the key that keeps the old behaviour.
- Any load: every parameter's shape (`check_shapes`), from Orbax's metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from maxctx.config import MODEL_KEYS, Config, ConfigError

RESUME_KEYS = ("dataset_type", "dataset_name", "dataset_split", "tfds_data_dir", "text_field",
               "tokenizer_path", "tokenizer_type", "add_bos", "add_eos", "packing", "data_shuffle_seed",
               "max_target_length", "grain_worker_count")
NOTICE_KEYS = ("schedule_steps", "grain_train_files")  # recorded too; a change is reported, not refused


def resume_record(config: Config, global_batch: int) -> dict[str, Any]:
    """What a resume must match, stored in each checkpoint's meta item under "config"."""
    keys = (*RESUME_KEYS, *NOTICE_KEYS, *MODEL_KEYS)
    return {**{key: getattr(config, key) for key in keys if hasattr(config, key)}, "global_batch": global_batch}


def check_resume_record(saved: dict[str, Any] | None, config: Config, global_batch: int, step_dir: str) -> None:
    """ConfigError naming the first key whose value differs from the one the checkpoint was saved with
    (checkpoints without a record, from before it was kept, are not checked)."""
    if not saved:
        return
    now = resume_record(config, global_batch)
    for key, value in now.items():
        if key in saved and saved[key] != value and key not in NOTICE_KEYS:
            what = ("the global batch (per_device_batch_size x devices x gradient_accumulation_steps)"
                    if key == "global_batch" else key)
            was = f"{saved[key]!r}" if isinstance(saved[key], str) else saved[key]
            raise ConfigError(f"checkpoint {step_dir} was saved with {what}={was} but this run has {value!r}; "
                              f"resume with {key}={saved[key]}, or start a new run_name with load_full_state_path="
                              f"{step_dir} (its parameters and optimizer state; data from the start)")


def resume_notices(saved: dict[str, Any] | None, config: Config, step: int) -> list[str]:
    """One line for each NOTICE_KEYS value this resume changes: what it changes and how to keep the old one."""
    from maxctx.optimizer import learning_rate_schedule

    saved, notices = saved or {}, []
    was = saved.get("schedule_steps")
    if was is not None and was != config.schedule_steps:
        old = dataclasses.replace(config, learning_rate_schedule_steps=was)
        notices.append(f"resuming at step {step} on a learning-rate schedule of {config.schedule_steps} steps "
                       f"(steps={config.steps}), not the {was} it was saved with: the learning rate at step {step} "
                       f"goes from {float(learning_rate_schedule(old)(step)):.3g} to "
                       f"{float(learning_rate_schedule(config)(step)):.3g}; to keep the old schedule, add "
                       f"learning_rate_schedule_steps={was}")
    was = saved.get("grain_train_files")
    if was is not None and was != config.grain_train_files:
        notices.append(f"resuming with grain_train_files='{config.grain_train_files}', not '{was}' as saved: the "
                       f"data iterator keeps its position but now walks the new files' documents, so the data from "
                       f"step {step} on is not what the old run would have read; to keep the old data order, "
                       f"resume with grain_train_files='{was}'")
    return notices


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
