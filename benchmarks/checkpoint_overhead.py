"""Step time with a checkpoint saved every step vs no checkpoints, through the real loop (`train.py`).

    python benchmarks/checkpoint_overhead.py [--steps 60] [--devices 4] [key=value ...]

Runs the same training three times in subprocesses: checkpointing off; a save every step with
async_checkpointing=true; a save every step with async_checkpointing=false. The step time is wall-clock time per
step between two logged steps after a warm-up (from the `time` stamps of metrics.jsonl, log_period=1), so it
includes everything a save costs the loop: waiting for the step's metrics (the NaN check before a save), the
device-to-host copy, starting the write, waiting for the previous save, and deleting the checkpoint that falls out
of max_num_checkpoints_to_keep. Prints the three step times and the ratios to the no-save run. Extra key=value
words go to every run (e.g. a larger model_name).

Then the integrity record's share (maxctx.checkpoint.integrity): on the sync run's last checkpoint, the time to
checksum every file of its items (what a save adds, in Orbax's commit) and to verify the step (what a resume
adds), next to a sync save's cost (sync step time minus the no-save step time) and the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "no checkpoints": ["enable_checkpointing=false"],
    "save every step, async": ["checkpoint_period=1", "async_checkpointing=true"],
    "save every step, sync": ["checkpoint_period=1", "async_checkpointing=false"],
}


def step_times(run_dir: str, warmup: int) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        stamps = {r["step"]: r["time"] for r in map(json.loads, f) if r.get("event") == "train"}
    steps = sorted(s for s in stamps if s > warmup)
    return [stamps[b] - stamps[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    parser.add_argument("overrides", nargs="*", help="key=value words for every run")
    args = parser.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name, keys in VARIANTS.items():
            run = name.replace(" ", "_").replace(",", "")
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
                   f"base_output_directory={out}", f"run_name={run}", f"steps={args.steps}", "log_period=1",
                   f"cpu_devices={args.devices}", "enable_tensorboard=false", "peak_tflops_per_device=1",
                   *keys, *args.overrides]
            subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            times = step_times(os.path.join(out, run), args.warmup)
            results[name] = (statistics.mean(times), statistics.median(times))
        integrity = integrity_times(os.path.join(out, "save_every_step_sync", "checkpoints", str(args.steps)))
    base = results["no checkpoints"][0]
    print(f"{args.steps} steps, {args.devices} CPU devices, timed after step {args.warmup}; "
          f"overrides: {' '.join(args.overrides) or '(none)'}")
    print(f"{'variant':<26} {'mean s/step':>12} {'median s/step':>14} {'ratio (mean)':>13}")
    for name, (mean, median) in results.items():
        print(f"{name:<26} {mean:>12.4f} {median:>14.4f} {mean / base:>13.2f}")
    save = results["save every step, sync"][1] - results["no checkpoints"][1]
    size, record, verify = integrity
    print(f"integrity of one checkpoint ({size / 2**20:.1f} MiB): checksums at save {record * 1e3:.1f} ms, "
          f"verification at resume {verify * 1e3:.1f} ms; a sync save costs the loop {save * 1e3:.1f} ms "
          f"(median step, sync minus none)")


def integrity_times(step_dir: str, repeats: int = 5) -> tuple[int, float, float]:
    """(bytes, seconds to checksum every item's files, seconds to verify the step), best of `repeats`."""
    from etils import epath

    from maxctx.checkpoint.integrity import check_step, digest
    from maxctx.checkpoint.manager import ITEMS

    step = epath.Path(step_dir)
    size = sum(size for item in ITEMS for size, _ in digest(step / item).values())
    record, verify = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for item in ITEMS:
            digest(step / item)
        record.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert check_step(step, ITEMS) is None
        verify.append(time.perf_counter() - start)
    return size, min(record), min(verify)


if __name__ == "__main__":
    main()
