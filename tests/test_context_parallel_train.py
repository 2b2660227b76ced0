"""Whole runs: `train.py` with context parallelism gives the same loss sequence as without (fp32, 1e-4 relative).

In the suite: one C per strategy (a2a C=2, all_gather C=4, p2p C=8, usp C=8 = ring 2 x a2a 4), against C=1. The
full matrix (every strategy x C in {2, 4, 8}) runs with `python tests/test_context_parallel_train.py` (about ten
minutes on two cores) and prints the largest relative difference per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["cpu_devices=8", "steps=10", "dtype=float32", "attention=flash", "log_period=1", "per_device_batch_size=1",
          "base_num_query_heads=8", "base_num_kv_heads=2", "enable_checkpointing=false", "enable_tensorboard=false",
          "flash_block_q=16", "flash_block_kv=16"]


def run_losses(strategy: str, cp: int, out_dir: str) -> list[float]:
    name = f"{strategy}_c{cp}"
    cmd = [sys.executable, "train.py", "configs/base.yml", *COMMON, f"ici_context_parallelism={cp}",
           f"context_parallel_strategy={strategy}", f"base_output_directory={out_dir}", f"run_name={name}"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = {r["step"]: r["loss"] for r in records if r.get("event") == "train"}
    assert len(losses) >= 9, f"expected a loss for (almost) every step, got steps {sorted(losses)}"
    return [losses[s] for s in sorted(losses)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp_runs"))
    return out, run_losses("all_gather", 1, out)


@pytest.mark.parametrize("strategy,cp", [("a2a", 2), ("all_gather", 4), ("p2p", 8), ("usp", 8)])
def test_cp_run_has_the_losses_of_the_run_without_cp(baseline, strategy, cp):
    out, want = baseline
    got = run_losses(strategy, cp, out)
    np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=f"{strategy} C={cp} vs C=1")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        want = run_losses("all_gather", 1, out)
        print("C=1 losses:", " ".join(f"{x:.5f}" for x in want))
        for strategy in ("all_gather", "a2a", "p2p", "usp"):
            for cp in (2, 4, 8):
                got = run_losses(strategy, cp, out)
                err = np.max(np.abs(np.asarray(got) - want) / np.abs(want))
                print(f"{strategy} C={cp}: max relative loss difference {err:.2e}", flush=True)
