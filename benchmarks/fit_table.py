"""The longest context that fits, per CP strategy, for llama3-8b and llama3.1-70b on v5p-128 and v6e-256.

    python3 benchmarks/fit_table.py [--only llama3-8b/v5p-128] [--strategies p2p,usp] [--time-limit-s 1800]

Every probe is one `python -m maxctx.compile ...` subprocess (the command printed in the table, so each row is
reproducible by copying it), compiled for the TPU topology on this machine with libtpu. Mesh: all devices split as
fsdp x context with context parallelism C = 16 (the issue's example), one sequence per fsdp group
(per_device_batch_size = 1/C), remat_policy=full, scan_layers=true, attention=flash (the blockwise JAX kernel:
no block tables, so one setting serves every length). `--splash-check` compiles each row's longest fitting context
again with attention=splash, the production TPU kernel.

Search over S = powers of two: a probe that fits predicts the next one from its memory analysis (arguments fixed,
the rest proportional to S), so most rows need two or three compiles: the largest S that fits and the next power of
two, which must not. Results go to benchmarks/fit_table.jsonl (one line per probe; probes already there are not
run again, so an interrupted run resumes) and benchmarks/fit_table.md (rewritten after every probe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "fit_table.jsonl")
SPLASH_RESULTS = os.path.join(ROOT, "benchmarks", "fit_table_splash.jsonl")
TABLE = os.path.join(ROOT, "benchmarks", "fit_table.md")
GIB = 1024 ** 3

MODELS = ("llama3-8b", "llama3.1-70b")
TOPOLOGIES = ("v5p-128", "v6e-256")
STRATEGIES = ("all_gather", "a2a", "p2p", "usp")
CONTEXT = 16
# First probe per (model, topology), from a rough count (state / devices + ~2 MB per token per device); the
# search moves from there.
START = {("llama3-8b", "v5p-128"): 19, ("llama3-8b", "v6e-256"): 17, ("llama3.1-70b", "v5p-128"): 18,
         ("llama3.1-70b", "v6e-256"): 17}
MIN_EXP, MAX_EXP = 12, 24


def command(model: str, topology: str, strategy: str, seq: int, kernel: str = "flash") -> list[str]:
    return ["python", "-m", "maxctx.compile", "configs/base.yml", f"compile_topology={topology}",
            f"model_name={model}", f"max_target_length={seq}", f"ici_context_parallelism={CONTEXT}",
            "ici_fsdp_parallelism=-1", f"per_device_batch_size={1 / CONTEXT:g}",
            f"context_parallel_strategy={strategy}", "remat_policy=full", f"attention={kernel}"]


def run_probe(model: str, topology: str, strategy: str, seq: int, time_limit_s: float,
              kernel: str = "flash") -> dict:
    cmd = command(model, topology, strategy, seq, kernel)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": round(time.time() - start, 1)}
    lines = proc.stdout.strip().splitlines()
    report = None
    if lines:
        try:
            report = json.loads(lines[-1])
        except json.JSONDecodeError:
            report = None
    if report is None or proc.returncode not in (0, 3):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "error", "returncode": proc.returncode, "error": " | ".join(tail)[-800:],
                "wall_s": round(time.time() - start, 1)}
    return {"status": "fits" if report["fits"] else "over", "report": report, "wall_s": round(time.time() - start, 1)}


def load_results(path: str = RESULTS) -> dict:
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                results[(r["model"], r["topology"], r["strategy"], r["seq"])] = r
    return results


def need_bytes(report: dict) -> float | None:
    hbm, room = report.get("hbm_bytes_per_device"), report.get("headroom_bytes")
    return None if hbm is None or room is None else hbm - room


def predict_exp(report: dict, seq: int) -> int | None:
    """Largest power-of-two exponent whose predicted memory fits in 95% of HBM (arguments fixed, the rest ~ S)."""
    need, hbm = need_bytes(report), report.get("hbm_bytes_per_device")
    if need is None:
        return None
    fixed = report.get("argument_size_in_bytes", 0) if "total_size_in_bytes" in report else 0
    per_token = max(need - fixed, 1) / seq
    budget = 0.95 * hbm - fixed
    if budget <= 0:
        return MIN_EXP - 1
    return int(math.floor(math.log2(budget / per_token)))


def search(model: str, topology: str, strategy: str, results: dict, args, max_probes: int = 99) -> None:
    """Probes powers of two until the largest fitting one and the next (not fitting) are both known."""
    def probes():
        return {e: results.get((model, topology, strategy, 2 ** e)) for e in range(MIN_EXP, MAX_EXP + 1)}

    # Strategies of one model and topology need similar memory: start from another strategy's result.
    done = [k[3] for k, r in results.items() if k[:2] == (model, topology) and r["status"] == "fits"]
    exp = int(math.log2(max(done))) if done else START[(model, topology)]
    for _ in range(max_probes):
        known = {e: r for e, r in probes().items() if r is not None}
        if any(r["status"] in ("error", "timeout") for r in known.values()):
            return
        fit_exps = [e for e, r in known.items() if r["status"] == "fits"]
        over_exps = [e for e, r in known.items() if r["status"] == "over"]
        lo, hi = max(fit_exps, default=None), min(over_exps, default=None)
        if lo is not None and hi is not None and hi == lo + 1:
            return
        if lo == MAX_EXP or hi == MIN_EXP:
            return
        if known:
            last = known[lo] if lo is not None else known[hi]
            pred = predict_exp(last["report"], 2 ** (lo if lo is not None else hi))
            exp = pred if pred is not None else (lo + 1 if lo is not None else hi - 1)
            if lo is not None:
                exp = max(exp, lo + 1)
            if hi is not None:
                exp = min(exp, hi - 1)
            exp = max(MIN_EXP, min(MAX_EXP, exp))
        probe_and_record((model, topology, strategy, 2 ** exp), "flash", results, RESULTS, args)
        write_table({**load_results(), **results})  # other runs of this script may append too


def probe_and_record(key: tuple, kernel: str, results: dict, path: str, args) -> None:
    """Runs the probe for key = (model, topology, strategy, seq), appends it to the results file at `path` and
    to `results`."""
    model, topology, strategy, seq = key
    print(f"[{time.strftime('%H:%M:%S')}] {model} {topology} {strategy} S={seq} {kernel} ...", flush=True)
    r = run_probe(model, topology, strategy, seq, args.time_limit_s, kernel=kernel)
    r.update(model=model, topology=topology, strategy=strategy, seq=seq)
    print(f"    {r['status']} in {r['wall_s']} s" + (f": {r.get('error', '')}" if "error" in r else ""), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(r) + "\n")
    results[key] = r


def best_fit(model: str, topology: str, strategy: str, results: dict) -> int | None:
    fits = [k[3] for k, r in results.items() if k[:3] == (model, topology, strategy) and r["status"] == "fits"]
    return max(fits, default=None)


def splash_check(model: str, topology: str, strategy: str, results: dict, splash_results: dict, args) -> None:
    """Compiles the row's longest fitting context again with attention=splash (its default 512-token blocks)."""
    seq = best_fit(model, topology, strategy, results)
    if seq is not None and (model, topology, strategy, seq) not in splash_results:
        probe_and_record((model, topology, strategy, seq), "splash", splash_results, SPLASH_RESULTS, args)


def splash_cell(model: str, topology: str, strategy: str, results: dict, splash_results: dict) -> str:
    seq = best_fit(model, topology, strategy, results)
    r = splash_results.get((model, topology, strategy, seq)) if seq else None
    if r is None:
        return "not checked"
    if r["status"] in ("error", "timeout"):
        return f"{r['status']}: {_last(r.get('error', ''))}"
    rep = r["report"]
    if rep.get("xla_memory_space"):
        return f"does not compile: {rep['xla_memory_space'].upper()} overflow"
    need = need_bytes(rep)
    gib = "" if need is None else f", {need / GIB:.1f} GiB"
    return f"{'fits' if r['status'] == 'fits' else 'does not fit'}{gib} (compiled in {r['wall_s']:.0f} s)"


def _last(error: str) -> str:
    return error.split(" | ")[-1][:200].replace("|", "/")


def row(model: str, topology: str, strategy: str, results: dict, splash_results: dict) -> str:
    mine = sorted((r for k, r in results.items() if k[:3] == (model, topology, strategy)), key=lambda r: r["seq"])
    fits = [r for r in mine if r["status"] == "fits"]
    over = [r for r in mine if r["status"] == "over"]
    failed = [r for r in mine if r["status"] in ("error", "timeout")]
    best = fits[-1] if fits else None
    first_over = min((r["seq"] for r in over if not best or r["seq"] > best["seq"]), default=None)
    if best is None:
        seq = over[0]["seq"] if over else 2 ** START[(model, topology)]
        cmd = " ".join(command(model, topology, strategy, seq))
        note = "; ".join(f"S={r['seq']} {r['status']}" + (f" ({_last(r['error'])})" if "error" in r else "")
                         for r in mine) or "not run yet (the command is the search's first probe)"
        return f"| {model} | {topology} | {strategy} | - | - | - | {note} | - | `{cmd}` |"
    rep = best["report"]
    gib = need_bytes(rep) / GIB
    if first_over:
        nxt = f"{first_over:,} does not fit"
        over_rep = next(r for r in over if r["seq"] == first_over)["report"]
        if need_bytes(over_rep) is not None:  # XLA may stop at its temporaries: then the need is larger still
            more = ">" if over_rep.get("xla_required_is_temporaries_only") else ""
            nxt += f" (needs {more}{need_bytes(over_rep) / GIB:.1f} GiB)"
    else:
        nxt = "next power of two not probed"
    if failed:
        nxt += "; " + "; ".join(f"S={r['seq']} {r['status']}" for r in failed)
    est = f"{rep['estimate_step_time_s']:.2f} s, MFU {rep['estimate_mfu']:.0%} ({rep['estimate_bound']})"
    return (f"| {model} | {topology} | {strategy} | {best['seq']:,} | {gib:.1f} / "
            f"{rep['hbm_bytes_per_device'] / GIB:.0f} | {est} | {nxt} | "
            f"{splash_cell(model, topology, strategy, results, splash_results)} | "
            f"`{' '.join(command(model, topology, strategy, best['seq']))}` |")


def write_table(results: dict, splash_results: dict | None = None) -> None:
    splash_results = load_results(SPLASH_RESULTS) if splash_results is None else splash_results
    lines = [
        "# Longest context that fits, per CP strategy",
        "",
        "Written by `python3 benchmarks/fit_table.py` (see its docstring); every row's command compiles the real",
        "train step for the TPU topology with libtpu on a machine without a TPU (`maxctx.compile`), so the memory",
        "is XLA's own memory analysis. Mesh: fsdp x context, C = 16, one sequence per fsdp group, remat full,",
        "flash attention. Max context: the largest power of two that compiles within HBM; the next column shows",
        "the next power of two failing. Memory: bytes per chip the program needs / chip HBM (GiB). Step time and",
        "MFU: maxctx.compile's roofline estimate (max of compute, HBM and ICI time at peak rates), not a",
        "measurement; at these lengths attention FLOPs dominate, so it is compute-bound and capped at 75% MFU by",
        "full remat's second forward pass. Powers of two only (no refinement between them).",
        "",
        "Splash at max: the row's command with `attention=flash` replaced by `attention=splash` (the production",
        "TPU kernel, 512-token blocks; calls whose block table would overflow on-chip SMEM run as several kernels",
        "over row chunks, maxctx/attention/splash.py), run by `python3 benchmarks/fit_table.py --splash-check`;",
        "results in fit_table_splash.jsonl; the time is the whole compile on the 2-core development VM.",
        "",
        "| model | topology | strategy | max context | GiB per chip | estimate at max | next | splash at max "
        "| command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for topology in TOPOLOGIES:
            for strategy in STRATEGIES:
                lines.append(row(model, topology, strategy, results, splash_results))
    with open(TABLE, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model/topology pairs, e.g. llama3-8b/v5p-128")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="per compile")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results file")
    parser.add_argument("--breadth-first", action="store_true", help="one probe per row before any second one")
    parser.add_argument("--splash-check", action="store_true",
                        help="compile each selected row's longest fitting context again with attention=splash")
    args = parser.parse_args()
    results = load_results()
    pairs = [tuple(p.split("/")) for p in args.only.split(",") if p] or [(m, t) for m in MODELS for t in TOPOLOGIES]
    rows = [(m, t, s) for m, t in pairs for s in args.strategies.split(",")]
    if not args.table_only:
        if args.breadth_first:  # one probe per row first, so every row has a result early
            for row_key in rows:
                if not any(k[:3] == row_key for k in results):
                    search(*row_key, results, args, max_probes=1)
        for row_key in rows:
            search(*row_key, results, args)
        if args.splash_check:
            splash_results = load_results(SPLASH_RESULTS)
            for row_key in rows:
                splash_check(*row_key, results, splash_results, args)
                write_table(results, splash_results)
    write_table(results)


if __name__ == "__main__":
    main()
