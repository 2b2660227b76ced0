"""The passkey heatmap and loss by position of the tiny model, evaluated at S = 64 to 64K tokens on simulated CPU
devices with context parallelism.

    python benchmarks/passkey_cpu.py [--out /tmp/passkey_cpu] [--images docs/images]

Four commands, each a subprocess printed before it runs (a step whose output exists is skipped):

1. train: the tiny model, 800 steps of 16 x 64 tokens of the passkey-rich synthetic mix on one CPU device (the
   recipe of tests/test_evaluate_passkey.py), with an eval (loss by position, passkey at 64) every 200 steps;
2. continue: 200 more steps at 512 tokens (4 x 512 per step, learning_rate=1e-3) from its checkpoint, like a
   continued pretraining at longer context;
3. evaluate both checkpoints with `python -m maxctx.evaluate` on 8 simulated devices, one sequence over all of
   them (ici_context_parallelism=8, p2p, zig-zag order): loss by position on 2 synthetic eval sequences of 4096
   tokens, and the passkey grid at 64 ... 65536 tokens, depths 0, 0.5 and 1, one example per cell (a 64K example
   is one forward pass of about 2.5 minutes on two cores, so more examples per cell did not fit in the session);
4. scripts/plot_metrics.py on the three runs: loss_by_position.png (the training run's four evals and the two
   evaluated checkpoints) and passkey.png (the latest grid of each run), copied to --images.

Prints each command's wall time and the accuracy table in Markdown (benchmarks/passkey_cpu.md holds it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = "64,128,256,512,1024,4096,8192,16384,32768,65536"
TRAIN = ["synthetic_passkey_fraction=1", "max_target_length=64", "per_device_batch_size=16", "dtype=float32",
         "steps=800", "checkpoint_period=800", "eval_interval=200", "eval_steps=4", "passkey_lengths=64",
         "passkey_examples=16", "passkey_depths=0,0.5,1", "log_period=100", "cpu_devices=1"]
CONTINUE = ["max_target_length=512", "per_device_batch_size=4", "steps=200", "checkpoint_period=200",
            "eval_interval=200", "passkey_lengths=512", "passkey_examples=8", "learning_rate=1e-3", "log_period=20"]
EVALUATE = ["cpu_devices=8", "ici_context_parallelism=8", "context_parallel_strategy=p2p", "max_target_length=4096",
            "per_device_batch_size=0.125", "eval_steps=2", f"passkey_lengths={LENGTHS}", "passkey_depths=0,0.5,1",
            "passkey_examples=1"]


def run(command: list[str], done: str) -> float:
    """Runs `command` unless `done` exists; returns its wall time (0 when skipped)."""
    print("$ " + " ".join(command), flush=True)
    if os.path.exists(done):
        print(f"  skipped: {done} exists", flush=True)
        return 0.0
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/passkey_cpu", help="base_output_directory of the runs")
    parser.add_argument("--images", default=os.path.join(ROOT, "docs", "images"), help="where the PNGs go")
    args = parser.parse_args(argv)
    out, py = os.path.abspath(args.out), sys.executable
    base, longer = os.path.join(out, "passkey_tiny"), os.path.join(out, "passkey_tiny_512")
    times = {
        "train": run([py, "train.py", "configs/base.yml", "run_name=passkey_tiny", f"base_output_directory={out}",
                      *TRAIN], os.path.join(base, "checkpoints", "800")),
        "continue": run([py, "train.py", f"{base}/config.yml", "run_name=passkey_tiny_512",
                         f"load_parameters_path={base}/checkpoints", *CONTINUE],
                        os.path.join(longer, "checkpoints", "200")),
    }
    for name, run_dir in (("passkey_tiny_eval", base), ("passkey_tiny_512_eval", longer)):
        times[name] = run([py, "-m", "maxctx.evaluate", f"{run_dir}/config.yml", f"run_name={name}",
                           f"load_parameters_path={run_dir}/checkpoints", *EVALUATE],
                          os.path.join(out, name, "metrics.jsonl"))
    plots = os.path.join(out, "plots")
    run([py, "scripts/plot_metrics.py", base, *(os.path.join(out, n) for n in ("passkey_tiny_eval",
                                                                             "passkey_tiny_512_eval")),
         "--out", plots], os.path.join(plots, "none"))
    os.makedirs(args.images, exist_ok=True)
    for name in ("loss_by_position.png", "passkey.png"):
        shutil.copy(os.path.join(plots, name), os.path.join(args.images, f"passkey_cpu_{name}"))
    print("\n| wall time | " + " | ".join(times) + " |\n|---|" + "---:|" * len(times))
    print("| s | " + " | ".join(f"{t:.0f}" for t in times.values()) + " |")
    for name in ("passkey_tiny_eval", "passkey_tiny_512_eval"):
        record = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))][-1]
        cells = record["passkey_accuracy"]
        lengths = sorted({int(k.split("/")[0]) for k in cells}, key=int)
        depths = sorted({k.split("/")[1] for k in cells}, key=float)
        print(f"\n{name} (step {record['step']}): passkey accuracy, depth by length\n")
        print("| depth | " + " | ".join(str(n) for n in lengths) + " |\n|---|" + "---:|" * len(lengths))
        for d in depths:
            print(f"| {d} | " + " | ".join(f"{cells[f'{n}/{d}']:.0f}" for n in lengths) + " |")
        print("\nloss by position: " + ", ".join(f"{k} {v:.3f}" for k, v in record["loss_by_position"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
