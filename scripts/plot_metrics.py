"""Plots loss, tokens/s and MFU against step from one or more runs' metrics.jsonl, runs overlaid, and the evals'
loss by position and passkey heatmaps.

    python scripts/plot_metrics.py outputs/run_p2p outputs/run_a2a --out plots/

writes plots/summary.png (loss and MFU side by side: the picture in the README), plots/loss.png (eval loss dashed,
when present), plots/tokens_per_sec.png and plots/mfu.png. Each run is labelled by its directory name. When eval
records hold them (training evals, `python -m maxctx.evaluate`): plots/loss_by_position.png, one curve per eval
record (each run's evals at several checkpoints, or several runs of maxctx.evaluate) of the mean loss against the
position in the document, log x; and plots/passkey.png, the passkey accuracy of each run's latest eval by length and
depth, one heatmap per run. Needs matplotlib.
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
    written = [plot_summary(runs, os.path.join(out_dir, "summary.png"), plt)]
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
    for plot, file_name in ((plot_loss_by_position, "loss_by_position.png"), (plot_passkey, "passkey.png")):
        path = plot(runs, os.path.join(out_dir, file_name), plt)
        if path:
            written.append(path)
    return written


def plot_summary(runs: dict[str, dict[str, list[dict]]], path: str, plt) -> str:
    """Loss (evals dashed) and MFU against step in one figure of two panels, runs overlaid."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, label, scale) in zip(axes, (("loss", "loss", 1.0), ("mfu", "MFU (%)", 100.0))):
        for name, records in runs.items():
            steps, values = _series(records["train"], key, scale)
            if steps:
                ax.plot(steps, values, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs step")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _bucket_middle(label: str) -> float:
    """'64-128' -> its geometric middle, where the bucket's mean is drawn on a log axis."""
    low, high = (float(x) for x in label.split("-"))
    return math.sqrt(low * high)


def plot_loss_by_position(runs: dict[str, dict[str, list[dict]]], path: str, plt) -> str | None:
    """One curve per eval record holding loss_by_position; None when no record holds one."""
    curves = [(f"{name} @ step {r['step']}", r["loss_by_position"]) for name, records in runs.items()
              for r in records["eval"] if isinstance(r.get("loss_by_position"), dict) and r["loss_by_position"]]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, buckets in curves:
        ax.plot([_bucket_middle(b) for b in buckets], list(buckets.values()), "-o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_title("eval loss by position in the document")
    ax.set_xlabel("position (tokens from the document's start; doubling buckets)")
    ax.set_ylabel("mean loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_passkey(runs: dict[str, dict[str, list[dict]]], path: str, plt) -> str | None:
    """Each run's latest passkey grid as a heatmap (depth down, length across); None when no run has one."""
    grids = {}
    for name, records in runs.items():
        latest = [r for r in records["eval"] if isinstance(r.get("passkey_accuracy"), dict) and r["passkey_accuracy"]]
        if latest:
            grids[f"{name} @ step {latest[-1]['step']}"] = latest[-1]["passkey_accuracy"]
    if not grids:
        return None
    columns = max(len({k.split("/")[0] for k in cells}) for cells in grids.values())
    width = max(3.5, 1.2 + 0.55 * columns)  # inches per panel: room for each length's column
    fig, axes = plt.subplots(1, len(grids), figsize=(1.0 + width * len(grids), 4.5), squeeze=False,
                             layout="constrained")
    for ax, (title, cells) in zip(axes[0], grids.items()):
        lengths = sorted({int(k.split("/")[0]) for k in cells})
        depths = sorted({float(k.split("/")[1]) for k in cells})
        grid = [[cells.get(f"{n}/{d:g}", math.nan) for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}".rstrip("0").rstrip("."), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths],
                      rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("depth of the key")
        ax.set_title("passkey accuracy\n" + title, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
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
