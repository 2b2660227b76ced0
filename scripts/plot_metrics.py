"""Plots loss, tokens/s and MFU against step from one or more runs' metrics.jsonl, runs overlaid.

    python scripts/plot_metrics.py outputs/run_p2p outputs/run_a2a --out plots/

writes plots/loss.png (eval loss dashed, when present), plots/tokens_per_sec.png and plots/mfu.png. Each run
is labelled by its directory name. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (file name, record key, y label, scale applied to the values)
PLOTS = (
    ("loss.png", "loss", "loss", 1.0),
    ("tokens_per_sec.png", "tokens_per_s", "tokens/s (global)", 1.0),
    ("mfu.png", "mfu", "MFU (%)", 100.0),
)


def read_run(run_dir: str) -> dict[str, list[dict]]:
    """The run's train and eval records from <run_dir>/metrics.jsonl, by event kind."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; pass run directories that hold a metrics.jsonl")
    records: dict[str, list[dict]] = {"train": [], "eval": []}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            event = record.get("event", "train")
            if event in records and "step" in record:
                records[event].append(record)
    return records


def _series(records: list[dict], key: str, scale: float) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(record["step"])
            values.append(value * scale)
    return steps, values


def plot_runs(run_dirs: list[str], out_dir: str) -> list[str]:
    """Writes the PNGs into out_dir and returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(d)) or d: read_run(d) for d in run_dirs}
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for file_name, key, label, scale in PLOTS:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, records in runs.items():
            steps, values = _series(records["train"], key, scale)
            if steps:
                (line,) = ax.plot(steps, values, label=name)
                if key == "loss":
                    eval_steps, eval_values = _series(records["eval"], key, scale)
                    if eval_steps:
                        ax.plot(eval_steps, eval_values, "--o", color=line.get_color(), label=f"{name} (eval)")
        ax.set_title(f"{label} vs step")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, file_name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="metrics_plots", help="folder for the PNGs (default: metrics_plots)")
    args = parser.parse_args(argv)
    try:
        for path in plot_runs(args.run_dirs, args.out):
            print(path)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
