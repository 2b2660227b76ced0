"""The tables of docs/choosing_a_strategy.md: what `context_parallel_strategy=auto` chooses for every row of the fit
table, how it ranks the strategies on the shapes of MaxText's published v5p measurements, and how its memory
estimate compares with the compiled memory of every fit-table probe.

    python3 benchmarks/choosing_a_strategy.py > benchmarks/choosing_a_strategy.md

No compile: each fit-table row's command (benchmarks/fit_table.md) is loaded with context_parallel_strategy=auto
(maxctx.plan.planner), and its choice is checked against the fit table's compiled results: it fits (compiled) when the
fit table compiled the chosen strategy, with the same offload setting, at this length or longer. The roofline
column is maxctx.plan.step_time's estimate (the one `maxctx.compile` prints) for the chosen strategy over the
best of the valid strategies at the same length.
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from maxctx import parallelism  # noqa: E402
from maxctx.attention.cp import strategies  # noqa: E402
from maxctx.loader import load_config  # noqa: E402
from maxctx.plan import planner, step_time, topology  # noqa: E402

# MaxText's measurements, v5p-128 (64 chips), bf16, 2M tokens per step: PR #4687 (step times, llama2-7b) and, as
# issue 17 summarises them, PRs #4836 / #4893 (the fastest USP split per length, llama3-8b).
MAXTEXT = [
    ("llama2-7b", 32768, 16, 4, "all_gather 8.83 s ~ a2a (Ulysses) 8.90 s < p2p (ring) 16.38 s (PR #4687)"),
    ("llama3-8b", 65536, 64, 1, "usp 16x4 fastest (PRs #4836, #4893, as summarised in issue 17)"),
    ("llama3-8b", 262144, 64, 1, "usp 8x8 fastest (PRs #4836, #4893, as summarised in issue 17)"),
]


# auto's choices the fit table did not compile, compiled for docs/choosing_a_strategy.md: the row's command with
# context_parallel_strategy=auto, `python -m maxctx.compile` (model, topology, offload, tokens, label) -> the
# compiled GiB per chip and HBM.
COMPILED = {("llama3-8b", "v6e-256", "on", 3670016, "usp 8x32"): (9.03, 32),
            ("llama3-8b", "v6e-256", "on", 29360128, "usp 32x8"): (24.56, 32),
            ("llama3-8b", "v6e-256", "off", 13631488, "usp 32x8"): (31.05, 32),
            ("llama3-8b", "v6e-256", "off", 12582912, "usp 32x8"): (28.70, 32),
            ("llama3.1-70b", "v5p-512", "off", 4194304, "usp 32x8"): (42.19, 95),
            ("llama3.1-70b", "v5p-512", "on", 7340032, "usp 32x8"): (16.59, 95),
            ("llama3.1-70b", "v5p-512", "on", 25165824, "usp 32x8"): (42.60, 95)}


def fit_rows() -> list[dict]:
    """The first table of benchmarks/fit_table.md: one dict per row."""
    rows = []
    for line in open(os.path.join(ROOT, "benchmarks", "fit_table.md")):
        if line.startswith("Memory breakdown"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 12 or cells[0] in ("model", "---"):
            continue
        command = re.search(r"`(python -m maxctx\.compile [^`]*)`", cells[-1])
        top = re.match(r"([\d,]+)", cells[4])
        gib = re.match(r"([\d.]+) /", cells[6])
        rows.append({"model": cells[0], "topology": cells[1], "strategy": cells[2], "offload": cells[3],
                     "max": int(top[1].replace(",", "")) if top else None, "max_note": cells[4],
                     "compiled_gib": float(gib[1]) if gib else None,
                     "argv": command[1].split()[3:] if command else None})
    return rows


def num_params() -> dict[str, int]:
    out = {}
    for line in open(os.path.join(ROOT, "benchmarks", "fit_table.jsonl")):
        try:
            report = json.loads(line).get("report", {})
        except json.JSONDecodeError:
            continue
        if "num_params" in report:
            out[report["model_name"]] = report["num_params"]
    return out


def roofline_step(config, cand, params: int) -> float:
    n = topology.num_devices(config)
    cfg = planner.candidate_config(config, cand.strategy, cand.a2a)
    mesh = parallelism.mesh_plan(cfg, n, cand.a2a)
    return step_time.estimate(cfg, mesh, cfg.global_batch_size(n), step_time.hardware(cfg, n)).step_s


def auto_argv(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("context_parallel_strategy=")] + ["context_parallel_strategy=auto"]


def fit_table() -> list[str]:
    rows, params = fit_rows(), num_params()
    maxima = {(r["model"], r["topology"], r["strategy"], r["offload"]): r for r in rows}
    lines = ["| model | topology | offload | tokens | row's strategy: memory estimate / compiled | auto's choice | "
             "estimated step (auto) | runner-up | fits (compiled) | roofline: choice / best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        if r["argv"] is None:
            continue
        config = load_config(auto_argv(r["argv"]))
        key = (r["model"], r["topology"], r["offload"], config.max_target_length)
        if key in seen:
            continue
        seen.add(key)
        plan = planner.plan(config)
        best, fitting = plan.choice, [c for c in plan.ranked if c.fits]
        runner = fitting[1] if len(fitting) > 1 else None
        fits = _fits(config, best, r, maxima.get((r["model"], r["topology"], best.strategy, r["offload"])))
        own = next(c for c in plan.ranked if c.strategy == r["strategy"] and (
            c.strategy != "usp" or c.a2a == _default_a2a(config)))
        steps = {c.label: roofline_step(config, c, params[r["model"]]) for c in plan.ranked if c.valid}
        ratio = steps[best.label] / min(steps.values())
        lines.append(f"| {r['model']} | {r['topology']} | {r['offload']} | {config.max_target_length:,} | "
                     f"{own.label}: {own.memory_bytes / planner.GIB:.1f} / {r['compiled_gib']} GiB | "
                     f"{best.label} | {best.step_s:.1f} s | "
                     f"{f'{runner.label} {runner.step_s:.1f} s' if runner else '-'} | {fits} | {ratio:.3f} |")
    return lines


def _default_a2a(config) -> int:
    """The A2A degree the fit table's usp rows ran with (usp's default for the config)."""
    from maxctx.attention.cp import strategies

    cfg = planner.candidate_config(config, "usp", 0)
    return strategies.get("usp").a2a_degree(cfg, planner.plan(config).cp)


def _fits(config, best, row: dict, compiled: dict | None) -> str:
    """Whether the fit table (or COMPILED) compiled auto's choice at this length (with the same offload setting)."""
    extra = COMPILED.get((row["model"], row["topology"], row["offload"], config.max_target_length, best.label))
    if extra is not None:
        return f"{'yes' if extra[0] <= extra[1] else 'NO'} (compiled for this page: {extra[0]} / {extra[1]} GiB)"
    if best.strategy == row["strategy"] and (best.strategy != "usp" or best.a2a == _default_a2a(config)):
        return "yes (this row's compile)"
    if compiled is None or compiled["max"] is None:
        return "not compiled in the fit table"
    if best.strategy == "usp" and best.a2a != _default_a2a(config):
        return f"not compiled (the fit table's usp is U={_default_a2a(config)}, up to {compiled['max']:,})"
    if compiled["max"] >= config.max_target_length:
        return f"yes (compiled up to {compiled['max']:,})"
    return f"unknown: compiled up to {compiled['max_note']}"


def maxtext_table(overlap: bool = True) -> list[str]:
    """auto's order on MaxText's shapes, and the same order among the candidates MaxText can run: its Ulysses
    (and USP's Ulysses part) needs the kv heads divisible by the A2A degree, so usp with U > K (maxctx repeats kv
    heads there) has no MaxText measurement. `overlap`: cost the software-pipelined ring backward (MaxText's; the
    ring strategies' overlapped_backward variants); False: maxctx's ring, whose backward sends wait."""
    lines = ["| model, S, C (fsdp) | auto's order (choice first), estimated step | among MaxText's candidates "
             "(U divides the kv heads) | p2p / all_gather (estimate) | MaxText measured |", "|---|---|---|---|---|"]
    for model, seq, cp, fsdp, measured in MAXTEXT:
        config = load_config(["configs/base.yml", "compile_topology=v5p-128", f"model_name={model}",
                              f"max_target_length={seq}", f"ici_context_parallelism={cp}",
                              f"ici_fsdp_parallelism={fsdp}", f"per_device_batch_size={2 ** 21 / 64 / seq}",
                              "remat_policy=full", "attention=splash", "context_parallel_strategy=auto"])
        with strategies.replaced(overlapped_backward=overlap):
            plan = planner.plan(config)
        ranking = ", ".join(f"{i + 1}. {c.label} {c.step_s:.2f} s" for i, c in enumerate(c for c in plan.ranked
                                                                                       if c.fits))
        theirs = " < ".join(c.label for c in sorted((c for c in plan.ranked if c.fits and (
            c.strategy in ("all_gather", "p2p") or config.base_num_kv_heads % c.a2a == 0)), key=lambda c: c.step_s))
        by = {c.label: c for c in plan.ranked}
        lines.append(f"| {model}, {seq // 1024}K, C={cp} (fsdp {fsdp}) | {ranking} | {theirs} | "
                     f"{by['p2p'].step_s / by['all_gather'].step_s:.2f} | {measured} |")
    return lines


def memory_table() -> list[str]:
    """The planner's memory estimate over the compiled memory of every probe of benchmarks/fit_table.jsonl (the
    last one per model, topology, strategy, offload, length and kernel, whose compile reported its memory) and of
    COMPILED, per group: the range of the ratios. The working-set constants were calibrated on the llama3-8b p2p
    and usp rows of v5p-128; every other row is held out."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fit_table import command, load_results

    groups = {}
    for (model, topo, strategy, offload, seq, kernel), probe in load_results().items():
        report = probe.get("report") or {}
        if "total_size_in_bytes" not in report:
            continue
        config = load_config(auto_argv(command(model, topo, strategy, offload, seq)[3:]))
        est = next(c for c in planner.plan(config).ranked
                   if c.strategy == strategy and c.a2a == max(1, report["mesh"]["context_a2a"]))
        key = (model, topo, strategy, "on" if offload else "off", kernel)
        groups.setdefault(key, []).append(est.memory_bytes / report["total_size_in_bytes"])
    rows = fit_rows()
    for (model, topo, offload, seq, label), (gib, _) in COMPILED.items():
        config = load_config(auto_argv(next(r["argv"] for r in rows if r["argv"] and (
            r["model"], r["topology"], r["offload"], r["max"]) == (model, topo, offload, seq))))
        est = next(c for c in planner.plan(config).ranked if c.label == label)
        groups.setdefault((model, topo, label.split()[0], offload, "compiled for this page"), []).append(
            est.memory_bytes / (gib * planner.GIB))
    lines = ["| model | topology | strategy | offload | kernel (or source) | probes | estimate / compiled | "
             "calibrated on |", "|---|---|---|---|---|---|---|---|"]
    for key, ratios in sorted(groups.items()):
        model, topo, strategy = key[:3]
        fitted = "yes" if (model, topo) == ("llama3-8b", "v5p-128") and strategy in ("p2p", "usp") and \
            key[4] == "blockwise" else "no"
        lines.append(f"| {' | '.join(key)} | {len(ratios)} | {min(ratios):.2f} - {max(ratios):.2f} | {fitted} |")
    return lines


def main() -> None:
    print("# Tables of docs/choosing_a_strategy.md\n\nWritten by `python3 benchmarks/choosing_a_strategy.py > "
          "benchmarks/choosing_a_strategy.md` (no compile; its docstring has the method).\n")
    print("## auto's choice for each fit-table row\n")
    print("\n".join(fit_table()))
    print("\n## auto's ranking on the shapes of MaxText's v5p measurements\n")
    print("\n".join(maxtext_table()))
    print("\nThe same with maxctx's ring backward (its sends wait: overlapped_backward=False):\n")
    print("\n".join(maxtext_table(overlap=False)))
    print("\n## The memory estimate against the compiled memory\n")
    print("\n".join(memory_table()))


if __name__ == "__main__":
    main()
