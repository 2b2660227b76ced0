"""train.py with test hooks, for the checkpoint tests, set by environment variables:

- SLOW_STEP: the JSON write of that step's data item sleeps, so the async save is still in flight when the test
  kills the process;
- SIGTERM_STEP: the process sends SIGTERM to itself after that step (only process SIGTERM_PROCESS when that is
  set);
- ENOSPC_STEPS: comma-separated steps whose saves fail as on a full disk (the JSON write raises
  OSError(ENOSPC), in Orbax's background thread when saves are asynchronous);
- NAN_STEPS: comma-separated steps (1-based) whose training batch gets NaN loss weights, so their loss and
  gradient are NaN;
- DATA_ERROR_BATCH: reading that training batch (1-based) raises a DataError (a file changed under the run), and
  a SIGTERM arrives while it is read.
"""

import asyncio
import errno
import os
import signal
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository, not this folder

import orbax.checkpoint as ocp  # noqa: E402

from maxctx import train  # noqa: E402
from maxctx.checkpoint import manager as checkpoint  # noqa: E402
from maxctx.data import DataError, pipeline  # noqa: E402

slow_step, sigterm_step = int(os.environ.get("SLOW_STEP", -1)), int(os.environ.get("SIGTERM_STEP", -1))
enospc_steps = [s for s in os.environ.get("ENOSPC_STEPS", "").split(",") if s]
save_fn = ocp.JsonCheckpointHandler._save_fn


async def slow_save_fn(self, x, directory):
    if any(os.path.basename(str(directory.parent)).startswith(f"{step}.") for step in enospc_steps):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    if os.path.basename(str(directory.parent)).startswith(f"{slow_step}."):
        print(f"SAVING {slow_step}", flush=True)
        await asyncio.sleep(120)
    await save_fn(self, x, directory)


should_save = checkpoint.Checkpointer.should_save


def should_save_after_signal(self, step):
    only = os.environ.get("SIGTERM_PROCESS")
    if step == sigterm_step and (only is None or only == os.environ.get("JAX_PROCESS_ID")):
        os.kill(os.getpid(), signal.SIGTERM)
    return should_save(self, step)


nan_steps = {int(s) for s in os.environ.get("NAN_STEPS", "").split(",") if s}
data_error_batch = int(os.environ.get("DATA_ERROR_BATCH", -1))
create_data_iterator = pipeline.create_data_iterator


class NanBatches:
    """The training iterator, with NaN weights in the batches of NAN_STEPS (its state methods pass through)."""

    def __init__(self, iterator):
        self.iterator, self.batches = iterator, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.batches + 1 == data_error_batch:
            os.kill(os.getpid(), signal.SIGTERM)
            raise DataError("train.txt changed while the run was reading it (hooked_train)")
        batch, self.batches = next(self.iterator), self.batches + 1
        state = self.iterator.get_state()  # synthetic data: the rows read, so the step count survives a resume
        step = state["rows"] // self.iterator.layout.global_shape[0] if "rows" in state else self.batches
        if step in nan_steps:
            batch = {**batch, "weights": batch["weights"] * float("nan")}
        return batch

    def __getattr__(self, name):
        return getattr(self.iterator, name)


def nan_data_iterator(config, mesh, split="train"):
    iterator = create_data_iterator(config, mesh, split)
    return NanBatches(iterator) if split == "train" else iterator


if __name__ == "__main__":
    pipeline.create_data_iterator = nan_data_iterator
    ocp.JsonCheckpointHandler._save_fn = slow_save_fn
    checkpoint.Checkpointer.should_save = should_save_after_signal
    sys.exit(train.main(sys.argv[1:]))
