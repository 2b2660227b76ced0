"""A checkpoints directory's steps: the items of a step, listing and setting aside step directories, and load
paths resolved to a verified step directory."""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from maxctx.checkpoint.integrity import check_step
from maxctx.config import ConfigError

STATE, DATA, META = "state", "data", "meta"
ITEMS = (STATE, DATA, META)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, or no good one left); the message says which and what to do."""


def step_dirs(directory: epath.Path) -> list[epath.Path]:
    """The step directories (`<step>/`, whatever they hold) of a checkpoints directory, newest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: -int(p.name))


def set_aside(step_dir: epath.Path, suffix: str) -> epath.Path:
    """Renames `<step>` to `<step>.<suffix>` (or `.<suffix>2`, ...: never over an earlier one); returns the new path."""
    target, n = step_dir.parent / f"{step_dir.name}.{suffix}", 1
    while target.exists():
        n += 1
        target = step_dir.parent / f"{step_dir.name}.{suffix}{n}"
    step_dir.rename(target)
    return target


def resolve_step_dir(path: str, key: str) -> epath.Path:
    """A load path (a step directory, or a checkpoints directory: its latest complete step) -> the step directory."""
    where = epath.Path(path)
    if not where.exists():
        raise ConfigError(f"{key}='{path}' does not exist; give a checkpoint step directory "
                          f"(<run>/checkpoints/<step>) or a run's checkpoints directory")
    if not (where / STATE).is_dir():
        steps = [p for p in step_dirs(where) if (p / STATE).is_dir()]
        if not steps:
            raise ConfigError(f"{key}='{path}' holds no complete maxctx checkpoint (no <step>/{STATE} directory); "
                              f"give a checkpoint step directory (<run>/checkpoints/<step>) or a run's checkpoints "
                              f"directory")
        where = steps[0]
    if not ocp.utils.is_checkpoint_finalized(where):
        raise ConfigError(f"{key}='{path}' is an incomplete checkpoint (its save was cut off); give a "
                          f"complete step directory")
    problem = check_step(where, (STATE,))
    if problem:
        raise CheckpointError(f"{key}='{path}': checkpoint {where} is damaged: {problem}; give another step "
                              f"directory (<run>/checkpoints/<step>)")
    return where


def state_metadata(state_dir: epath.Path) -> Any:
    return ocp.StandardCheckpointHandler().metadata(state_dir).tree
