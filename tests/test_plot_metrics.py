"""scripts/plot_metrics.py on two fake runs writes readable PNGs."""

import json
import os
import struct

from tests.support.processes import ROOT, python

PLOT = ROOT / "scripts" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir, loss_scale):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"event": "compile", "xla_flops_per_device": 1e9}) + "\n")
        for step in range(0, 100, 10):
            f.write(json.dumps({"event": "train", "step": step, "loss": loss_scale * 5.0 / (1 + step),
                                "tokens_per_s": 1000.0 + step, "mfu": 0.3 + step / 1000}) + "\n")
        f.write(json.dumps({"event": "train", "step": 100, "loss": "nan", "mfu": 0.4}) + "\n")  # skipped
        f.write(json.dumps({"event": "eval", "step": 50, "loss": loss_scale * 0.2}) + "\n")


def test_two_runs_give_valid_pngs(tmp_path):
    runs = [str(tmp_path / "run_p2p"), str(tmp_path / "run_a2a")]
    _fake_run(runs[0], 1.0)
    _fake_run(runs[1], 1.2)
    out = tmp_path / "plots"
    result = python(PLOT, *runs, "--out", out, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("loss.png", "tokens_per_sec.png", "mfu.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (800, 450), name
        assert len(data) > 5000, name  # axes, two lines and a legend, not an empty canvas
    summary = (out / "summary.png").read_bytes()  # loss and MFU side by side (the README's picture)
    assert summary[:8] == PNG_SIGNATURE and struct.unpack(">II", summary[16:24]) == (1100, 400)


def test_help_is_whole_sentences():
    result = python(PLOT, "--help", timeout=60)
    assert result.returncode == 0 and "passkey heatmaps." in " ".join(result.stdout.split()), result.stdout


def test_missing_run_dir_is_an_error(tmp_path):
    result = python(PLOT, tmp_path / "nope", "--out", tmp_path / "plots", timeout=60)
    assert result.returncode == 1 and "metrics.jsonl" in result.stderr


def test_loss_by_position_and_passkey_pngs(tmp_path):
    """Two evaluated checkpoints of one run, and an evaluated model: a curve per eval record, a heatmap per run."""
    runs = [tmp_path / "train_run", tmp_path / "evaluated"]
    for run, steps in zip(runs, ([100, 200], [0])):
        os.makedirs(run)
        with open(run / "metrics.jsonl", "w") as f:
            for step in steps:
                buckets = {f"{2 ** k}-{2 ** (k + 1)}": 5.0 / (k + 1) + 100 / step if step else 3.0 for k in range(12)}
                cells = {f"{n}/{d}": d * n / 8192 for n in (1024, 2048, 4096, 8192) for d in (0, 0.5, 1)}
                f.write(json.dumps({"event": "eval", "step": step, "loss": 2.0, "loss_by_position": buckets,
                                    "passkey_accuracy": cells}) + "\n")
    out = tmp_path / "plots"
    result = python(PLOT, *runs, "--out", out, timeout=120)
    assert result.returncode == 0, result.stderr
    for name, size in (("loss_by_position.png", (800, 450)), ("passkey.png", (800, 450))):  # 2 panels of 3.5 in
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and struct.unpack(">II", data[16:24]) == size, name
        assert len(data) > 5000, name
