"""Whole runs: `train.py` with context parallelism gives the same loss sequence as without (fp32, 1e-5 relative).

In the suite: one C per strategy (a2a C=2, all_gather C=4, p2p C=8, usp C=8 = ring 2 x a2a 4), against C=1, the
runs of a fixture in parallel processes, on a model with sliding-window layers: every layer local, or local and
global layers alternating (whose global layers are the plain causal path), and with documents placed on the ranks.
The full matrix of global-only runs (every strategy x C in {2, 4, 8}) runs with
`python -m tests.test_context_parallel_train` (about eight minutes on two cores) and prints the largest relative
difference per run; benchmarks/context_parallel.md has its output.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np
import pytest

from tests.support.processes import ROOT, cpu_env, losses as run_dir_losses, train_command
from tests.support.strategies import names as strategy_names

COMMON = ["cpu_devices=8", "steps=10", "dtype=float32", "attention=flash", "log_period=1", "per_device_batch_size=1",
          "base_num_query_heads=8", "base_num_kv_heads=2", "enable_checkpointing=false", "enable_tensorboard=false",
          "flash_block_q=16", "flash_block_kv=16"]


CP = {"a2a": 2, "all_gather": 4}  # the others (p2p, usp, any strategy registered later): C = 8
CASES = [(s, CP.get(s, 8)) for s in strategy_names()]


def start_run(strategy: str, cp: int, out_dir: str, *extra: str) -> tuple[subprocess.Popen, list[str], str]:
    name = f"{strategy}_c{cp}" + "".join(f"_{x.split('=')[1]}" for x in extra if x.startswith("attention_layer"))
    name = next((x.split("=")[1] for x in extra if x.startswith("run_name=")), name)
    cmd = train_command(*COMMON, f"ici_context_parallelism={cp}", f"context_parallel_strategy={strategy}",
                        f"base_output_directory={out_dir}", f"run_name={name}", *extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, cmd, os.path.join(out_dir, name)


def finish_run(run: tuple[subprocess.Popen, list[str], str]) -> list[float]:
    proc, cmd, run_dir = run
    stdout, stderr = proc.communicate(timeout=1200)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    by_step = run_dir_losses(run_dir)
    assert len(by_step) >= 9, f"expected a loss for (almost) every step, got steps {sorted(by_step)}"
    return [by_step[s] for s in sorted(by_step)]


def run_losses(strategy: str, cp: int, out_dir: str) -> list[float]:
    return finish_run(start_run(strategy, cp, out_dir))


# Sliding windows (Mistral v0.1's every-layer window, and local/global layers): a 16-token window over 128 tokens,
# so at C = 8 (chunks of 8 under zig-zag) a local layer's keys come from two chunks back.
# Every other strategy with every layer local, the rest with local and global layers alternating.
LOCAL_CASES = [(s, cp, ("L", "LG")[i % 2]) for i, (s, cp) in enumerate(CASES)]


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("cp_local_runs"))
    keys = lambda pattern: ("sliding_window_size=16", f"attention_layer_pattern={pattern}")  # noqa: E731
    cases = [("all_gather", 1, "L"), ("all_gather", 1, "LG"), *LOCAL_CASES]
    runs = {case: start_run(case[0], case[1], out, *keys(case[2])) for case in cases}
    return {case: finish_run(run) for case, run in runs.items()}


@pytest.mark.parametrize("strategy,cp,pattern", LOCAL_CASES)
def test_cp_run_with_local_layers_has_the_losses_of_the_run_without_cp(local_losses, strategy, cp, pattern):
    want = local_losses["all_gather", 1, pattern]
    np.testing.assert_allclose(local_losses[strategy, cp, pattern], want, rtol=1e-5,
                               err_msg=f"{strategy} C={cp} pattern {pattern} vs C=1")


# context_parallel_load_balance=documents: each batch's documents placed on the context ranks (the synthetic rows
# are packed documents), local and global layers alternating, against the C = 1 run of the same pattern.
@pytest.fixture(scope="module")
def document_losses(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("cp_document_runs"))
    keys = ("sliding_window_size=16", "attention_layer_pattern=LG", "context_parallel_load_balance=documents")
    runs = {case: start_run(*case, out, *keys, f"run_name={case[0]}_c{case[1]}_documents") for case in CASES}
    return {case: finish_run(run) for case, run in runs.items()}


@pytest.mark.parametrize("strategy,cp", CASES)
def test_cp_run_with_documents_placed_has_the_losses_of_the_run_without_cp(local_losses, document_losses,
                                                                            strategy, cp):
    np.testing.assert_allclose(document_losses[strategy, cp], local_losses["all_gather", 1, "LG"], rtol=1e-5,
                               err_msg=f"{strategy} C={cp} documents placed vs C=1")


def test_local_layers_change_the_run(local_losses):
    """The window is not silently dropped: with every layer local the losses differ from those with every other
    layer global (were the window dropped, both would be the global run's)."""
    assert not np.allclose(local_losses["all_gather", 1, "L"], local_losses["all_gather", 1, "LG"], rtol=1e-4)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        want = run_losses("all_gather", 1, out)
        print("C=1 losses:", " ".join(f"{x:.5f}" for x in want))
        for strategy in strategy_names():
            for cp in (2, 4, 8):
                got = run_losses(strategy, cp, out)
                err = np.max(np.abs(np.asarray(got) - want) / np.abs(want))
                print(f"{strategy} C={cp}: max relative loss difference {err:.2e}", flush=True)
