"""The planner's HBM estimate per device beside the compiled program's, for every compiled row of the fit table's
single compiles (benchmarks/fit_table_keys.jsonl): no compile, the estimate `python -m maxctx.compile <keys> --plan`
prints for that command's own strategy and remat placement.

    python3 benchmarks/hbm_estimate.py [--out benchmarks/hbm_estimate.md]
    python3 benchmarks/hbm_estimate.py --leave-one-out   # maxctx.plan.memory.XLA_HEAP's fit, each row held out

Compiled: XLA's memory analysis per device (argument + output - alias + temporaries: `total_size_in_bytes`);
rows whose compile left no report (an abort) are left out. A row compiled with `auto` is estimated at what auto
chose then (RESOLVED). The estimate's three moments (maxctx.plan.memory.Peak: always held, the top layer's
backward, the loss) are shown beside it. docs/choosing_a_strategy.md ("The memory estimate against the fit
table's compiles") has the table and the method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
KEYS = os.path.join(ROOT, "benchmarks", "fit_table_keys.jsonl")
BASE = os.path.join(ROOT, "configs", "base.yml")
GIB = 1024 ** 3


def compiled_rows(path: str = KEYS) -> list[dict]:
    """The fit table's single compiles with XLA's memory figures (a compile that left none is skipped)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if (r.get("report") or {}).get("total_size_in_bytes")]


# What `context_parallel_strategy=auto remat_policy=auto` resolved to when these rows compiled (the planner of
# then; the compiled host bytes, 94.17 and 32.25 GiB, are the placements'): the estimate is for the program that
# compiled, which auto no longer chooses for gemma3-27b (its memory estimate changed).
RESOLVED = {
    "gemma3-27b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=16", "remat_policy=custom",
                   "decoder_layer_input=device", "context=device", "out_proj=device", "mlpwi=offload",
                   "mlpwo=offload"],
    "qwen3-32b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=8", "remat_policy=custom",
                  "decoder_layer_input=device", "context=offload"],
    # The MoE rows at 1M (docs/long_context.md: usp, input=offload context=offload).
    "qwen3-30b-a3b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=4", "remat_policy=custom",
                      "decoder_layer_input=offload", "context=offload"],
    "gpt-oss-20b attention=blockwise": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=8",
                                        "remat_policy=custom", "decoder_layer_input=offload", "context=offload"],
    "gpt-oss-20b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=16", "remat_policy=custom",
                    "decoder_layer_input=offload", "context=offload", "mlpwo=offload"],
    "deepseek2-16b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=16", "remat_policy=custom",
                      "decoder_layer_input=offload", "context=offload"],
    # qwen3.5-9b at 4,194,304 tokens (docs/linear_attention.md): auto's usp 16x4, input and context offloaded.
    "qwen3.5-9b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=4", "remat_policy=custom",
                   "decoder_layer_input=offload", "context=offload"],
    # deepseek3-671b at 128K on v5p-1024 (docs/mixture_of_experts.md): auto's first candidate compiled.
    "deepseek3-671b": ["context_parallel_strategy=usp", "context_parallel_a2a_degree=32", "remat_policy=custom",
                       "decoder_layer_input=offload", "context=offload"],
}
AUTO = ("context_parallel_strategy=auto", "remat_policy=auto")


def compiled_keys(row: dict) -> list[str]:
    """The row's keys with auto's choices replaced by what they resolved to when the row compiled (RESOLVED, by
    model, and attention kernel where a model has rows of two)."""
    if not any(k in AUTO for k in row["keys"]):
        return row["keys"]
    blockwise = " attention=blockwise" if "attention=blockwise" in row["keys"] else ""
    return [k for k in row["keys"] if k not in AUTO] + RESOLVED[row["model"] + blockwise]


def estimate_bytes(keys: list[str]) -> float:
    """The planner's HBM estimate per device for `python -m maxctx.compile configs/base.yml <keys>`: auto's choice
    when the keys leave the strategy or the placement to it, else the one candidate of the config's own."""
    return estimate(keys)[0]


def estimate(keys: list[str]):
    """(estimate_bytes, its maxctx.plan.memory.Peak: what the estimate holds at which moment)."""
    from maxctx.attention.cp import strategies
    from maxctx.loader import load
    from maxctx.parallelism import TENSOR_AXIS
    from maxctx.plan import memory, planner

    loaded = load([BASE, *keys])
    config = loaded.config
    if loaded.plan is not None:
        cand = loaded.plan.choice
    else:
        name = strategies.resolve(config.context_parallel_strategy)
        only = (name, strategies.get(name).a2a_degree(config, planner.mesh_plan(config).cp))
        cand = planner.plan(config, only=only).choice
    mesh = planner.mesh_plan(config)
    shards = mesh.num_devices // mesh.sizes["data"]
    return cand.memory_bytes, memory.device_bytes(config, mesh.sizes[TENSOR_AXIS], shards, cand.attention_bytes)


def _short(keys: list[str]) -> str:
    """The keys that tell the rows apart (the topology, model, length and what the row varies)."""
    same = ("ici_fsdp_parallelism=1", "per_device_batch_size=", "ici_context_parallelism=", "remat_policy=custom",
            "override_model_config=", "use_tokamax_splash=false", "use_jax_splash=false", "ici_tensor_parallelism=1",
            "context_parallel_load_balance=true")
    return " ".join(k.replace("compile_topology=", "").replace("model_name=", "")
                    for k in keys if not k.startswith(same))


def table(rows: list[dict]) -> list[str]:
    lines = ["| keys | status | estimate (GiB) | of which always / layer / loss | compiled (GiB) | "
             "estimate / compiled |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        est, peak = estimate(compiled_keys(r))
        got = r["report"]["total_size_in_bytes"]
        parts = " / ".join(f"{x / GIB:.1f}" for x in (peak.always, peak.layer, peak.loss))
        lines.append(f"| `{_short(r['keys'])}` | {r['status']} | {est / GIB:.2f} | {parts} | {got / GIB:.2f} | "
                     f"{est / got:.3f} |")
    return lines


def probe_rows() -> list[dict]:
    """The fit table's searched rows that the working-set constant was calibrated on (llama3-8b on v5p-128, p2p
    and usp, the blockwise kernel: tests/test_planner.py), as rows like compiled_rows' (keys, report)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_table", os.path.join(ROOT, "benchmarks", "fit_table.py"))
    fit_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_table)
    rows = []
    for (model, topo, strategy, offload, seq, kernel), probe in sorted(fit_table.load_results().items(), key=str):
        report = probe.get("report") or {}
        if ((model, topo) != ("llama3-8b", "v5p-128") or kernel == "splash" or strategy not in ("p2p", "usp")
                or "total_size_in_bytes" not in report):
            continue
        a2a = [f"context_parallel_a2a_degree={report['mesh']['context_a2a']}"] if strategy == "usp" else []
        rows.append({"keys": fit_table.command(model, topo, strategy, offload, seq, kernel)[4:] + a2a,
                     "report": report, "status": "fits", "model": model})
    return rows


def heap_ratios(rows: list[dict]) -> list[tuple[dict, object, float]]:
    """Per row: (row, the estimate's Peak, XLA's temporaries / the temporaries the estimate holds live)."""
    out = []
    for r in rows:
        peak = estimate(compiled_keys(r))[1]
        got = r["report"]["total_size_in_bytes"]
        out.append((r, peak, (got - peak.args) / (peak.live - peak.args)))
    return out


def _fitted_on(r: dict) -> bool:
    """The rows XLA_HEAP is fitted on: one generation's, v5p's."""
    return dict(k.split("=", 1) for k in r["keys"])["compile_topology"].startswith("v5p-")


def fit_heap(ratios: list[tuple[dict, object, float]], leave_out: dict | None = None) -> float:
    """XLA_HEAP: the median of the v5p rows' ratios (heap_ratios), without `leave_out`."""
    import statistics

    return statistics.median(x for r, _, x in ratios if _fitted_on(r) and r is not leave_out)


def leave_one_out(ratios: list[tuple[dict, object, float]] | None = None) -> list[str]:
    """Each row's estimate with XLA_HEAP fitted on the other v5p rows of both tables (`ratios`: heap_ratios of
    them, computed when not given), beside the compiled figure and beside what the estimate holds live."""
    ratios = ratios or heap_ratios(compiled_rows() + probe_rows())
    lines = [f"XLA_HEAP fitted on all {sum(_fitted_on(r) for r, _, _ in ratios)} v5p rows: {fit_heap(ratios):.3f}",
             "", "| keys | XLA_HEAP without the row | live / compiled | held-out estimate / compiled |",
             "|---|---:|---:|---:|"]
    within = [0, 0]
    for r, peak, _ in ratios:
        f = fit_heap(ratios, r)
        got = r["report"]["total_size_in_bytes"]
        held_out = (peak.args + f * (peak.live - peak.args)) / got
        within = [within[0] + (abs(peak.live / got - 1) <= 0.05), within[1] + (abs(held_out - 1) <= 0.05)]
        lines.append(f"| `{_short(r['keys'])}` | {f:.3f} | {peak.live / got:.3f} | {held_out:.3f} |")
    lines.append(f"\nwithin 5% of the compiled figure: {within[0]} of {len(ratios)} rows with what is live, "
                 f"{within[1]} held out")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--leave-one-out", action="store_true", help="XLA_HEAP's fit, each row held out")
    args = parser.parse_args()
    lines = leave_one_out() if args.leave_one_out else table(compiled_rows())
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
