"""Vocab tiling, MLP sequence chunks and layer-input offload vs none, through the real loop at S = 65,536.

    python benchmarks/long_context_cpu.py [--length 65536] [--steps 3] [--devices 8] [--vocab 256] [key=value ...]

Trains the tiny model on one sequence of --length tokens per step, over --devices simulated CPU devices, all of them
on the context axis (ici_context_parallelism = devices, per_device_batch_size = 1/devices), with
context_parallel_strategy=p2p and attention=flash, twice per vocabulary size, each run a subprocess of train.py:

    (a) tiled + offload  num_vocab_tiling=8 mlp_sequence_chunks=8 remat_policy=custom decoder_layer_input=offload
    (b) plain            the defaults: num_vocab_tiling=1 mlp_sequence_chunks=1 remat_policy=full

remat_policy=custom with every other tensor at `remat` is full remat with the one kept tensor (the layer input)
moved to pinned host memory, so (a) and (b) do the same arithmetic and their losses must agree to rounding.

Per run, from metrics.jsonl (log_period=1): the compiled step's temp and host temp memory per device
(memory_analysis, before step 0), the compile time, the step time and tokens/s of the steps after the first (the
first is timed from the loop's start, so it also carries first-run costs; compilation is ahead of time and not in
it), the first step's time, and the loss of every step. Prints a Markdown table per vocabulary size with (a), (b)
and (a)/(b), and the largest relative loss difference. CPU step times are noisy and say little about accelerators;
the memory rows are properties of the compiled program. On CPU, XLA reports no host temp memory and offloading
saves no device memory (tests/test_tiling.py checks the offload on a TPU topology). Extra key=value words go to every
run. A larger --vocab (e.g. 32768) makes the logits matter, but the plain run then holds about 2 GiB of temporaries
per device, 8 devices in one host's RAM: check with `python -m maxctx.compile` first (benchmarks/long_context_cpu.md).
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
    "tiled + offload": ["num_vocab_tiling=8", "mlp_sequence_chunks=8", "remat_policy=custom",
                        "decoder_layer_input=offload"],
    "plain": [],
}
MIB = 2 ** 20


def run(out: str, name: str, keys: list[str], args: argparse.Namespace, vocab: int) -> dict:
    """Trains one variant in a subprocess; returns its compile record, train records and wall time."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
           f"base_output_directory={out}", f"run_name={name}", f"steps={args.steps}", "log_period=1",
           f"cpu_devices={args.devices}", f"ici_context_parallelism={args.devices}",
           f"per_device_batch_size={1 / args.devices}", f"max_target_length={args.length}",
           f"vocab_size={vocab}", "context_parallel_strategy=p2p", "attention=flash",
           "enable_checkpointing=false", "enable_tensorboard=false", "peak_tflops_per_device=1",
           *keys, *args.overrides]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    compiled = next(r for r in records if r.get("event") == "compile")
    steps = sorted((r for r in records if r.get("event") == "train"), key=lambda r: r["step"])
    return {"compile": compiled, "steps": steps, "wall_s": wall}


def rows(result: dict) -> dict[str, float]:
    """The table's numbers for one run."""
    c, steps = result["compile"], result["steps"]
    later = [r for r in steps if r["step"] > 1] or steps  # step 1 also carries first-run costs
    return {
        "temp MiB/device": c["temp_size_in_bytes"] / MIB,
        "host temp MiB/device": c.get("host_temp_size_in_bytes", 0) / MIB,
        "total MiB/device (args + out + temp - alias)": c["total_size_in_bytes"] / MIB,
        "compile s": c["compile_time_s"],
        "first step s": steps[0]["step_time_s"],
        f"step s (mean of steps {later[0]['step']}-{later[-1]['step']})": statistics.mean(
            r["step_time_s"] for r in later),
        "tokens/s (same steps)": statistics.mean(r["tokens_per_s"] for r in later),
        "run wall s": result["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536, help="tokens per sequence (one sequence per step)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices, all on the context axis")
    parser.add_argument("--vocab", default="256", help="comma-separated vocab sizes; one pair of runs each")
    parser.add_argument("overrides", nargs="*", help="key=value words for every run")
    args = parser.parse_args()
    a, b = VARIANTS
    print(f"tiny model, S={args.length}, {args.devices} simulated CPU devices (C={args.devices}, p2p, flash), "
          f"one sequence per step, {args.steps} steps; overrides: {' '.join(args.overrides) or '(none)'}")
    for vocab in [int(v) for v in args.vocab.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            results = {name: run(out, name.replace(" + ", "_"), keys, args, vocab) for name, keys in VARIANTS.items()}
        ra, rb = rows(results[a]), rows(results[b])
        print(f"\nvocab_size={vocab}\n")
        print(f"| | ({a}) | ({b}) | (a)/(b) |\n|---|---:|---:|---:|")
        for key in ra:
            ratio = f"{ra[key] / rb[key]:.2f}" if rb[key] else "-"
            print(f"| {key} | {ra[key]:.1f} | {rb[key]:.1f} | {ratio} |")
        losses = {name: [r["loss"] for r in results[name]["steps"]] for name in VARIANTS}
        for name, values in losses.items():
            print(f"\n{name} losses: {' '.join(f'{x:.6f}' for x in values)}", end="")
        worst = max(abs(x - y) / abs(y) for x, y in zip(*losses.values()))
        print(f"\nlargest relative loss difference (a) vs (b): {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
