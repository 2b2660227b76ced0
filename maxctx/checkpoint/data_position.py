"""The data position a checkpoint step resumes from, on any process count.

Each process writes the data-iterator state into the step's data item as `process_<i>-of-<n>.json`. The state is
global (maxctx.data.pipeline: the row stream's position, the same on every process), so a run with another
process count reads any one of them. A state saved per process by an older version (it names its
`process_count`) serves only that process, so it resumes only on the same process count.
"""

from __future__ import annotations

import json
import re
from typing import Any

from etils import epath

from maxctx.config import ConfigError

DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def data_filename(process_index: int, process_count: int) -> str:
    return f"process_{process_index}-of-{process_count}.json"


def load_data_state(data_dir: epath.Path, process_index: int, process_count: int, step_dir: str) -> dict[str, Any]:
    """This process's file when the process count is the one saved, otherwise process 0's global state;
    ConfigError (naming the step and both counts) for an older per-process state on another count."""
    mine = data_dir / data_filename(process_index, process_count)
    if mine.exists():
        return json.loads(mine.read_text())
    saved = sorted((p for p in data_dir.iterdir() if DATA_FILE.fullmatch(p.name)),
                   key=lambda p: int(DATA_FILE.fullmatch(p.name).group(1)))
    if not saved:
        raise ConfigError(f"checkpoint {step_dir} holds no data-iterator state ({data_dir.name}/process_<i>-of-<n>"
                          f".json); start a new run_name with load_full_state_path={step_dir} (data from the start)")
    state = json.loads(saved[0].read_text())
    if "process_count" in state:
        count = DATA_FILE.fullmatch(saved[0].name).group(2)
        raise ConfigError(f"checkpoint {step_dir} was saved by {count} processes, but this run has {process_count}, "
                          f"and its data-iterator state is an older per-process one ({data_dir.name}/"
                          f"{saved[0].name}): process {process_index} has none; resume with {count} processes (a "
                          f"checkpoint saved after this one resumes on any count), or start a new run_name with "
                          f"load_full_state_path={step_dir}")
    return state
