"""The longest single sequence that fits, per CP strategy, with and without host offload of the layer inputs.

    python3 benchmarks/fit_table.py [--only llama3-8b/v5p-128] [--strategies p2p,usp] [--offload on,off]
                                    [--splash-check [--splash-again]] [--table-only] [--time-limit-s 1800]

One sequence per step, sharded over every chip of the slice (C = chips: 64 on v5p-128, 256 on v6e-256 and
v5p-512), fsdp = 1 (weights sharded over the context axis, as MaxText does), scan over layers, attention=blockwise
for the search (no block tables, so one setting serves every length), the loss tiled to <= 4,096 tokens and the
MLP to <= 16,384 tokens per chunk and device (num_vocab_tiling, mlp_sequence_chunks), and remat_policy=full, or
remat_policy=custom with decoder_layer_input=offload (the layer inputs in pinned host memory).

Every probe is one `python -m maxctx.compile ...` subprocess (the command printed in the table, so each row is
reproducible by copying it), compiled for the TPU topology on this machine with libtpu; XLA also dumps its
memory-usage report, whose buffers are sorted into the categories of BREAKDOWN (by their shapes) for the
breakdown column. Search per row: powers of two up from a start (jumping ahead by the memory per token the last
fit predicts) until one does not fit, then bisection between the largest fitting power of two P and 2P in steps
of P/8 (three more compiles). `--splash-check` compiles each row's maximum again with attention=splash.

Results: benchmarks/fit_table.jsonl (one line per probe; probes already there are not run again, so an
interrupted run resumes) and benchmarks/fit_table.md (rewritten after every probe; the first table, C = 16, is
kept in fit_table_c16.md and appended).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "fit_table.jsonl")
TABLE = os.path.join(ROOT, "benchmarks", "fit_table.md")
FIRST_TABLE = os.path.join(ROOT, "benchmarks", "fit_table_c16.md")
KEYS_RESULTS = os.path.join(ROOT, "benchmarks", "fit_table_keys.jsonl")  # compiles of --keys, one a line
GIB = 1024 ** 3

ROWS = {("llama3-8b", "v5p-128"): 64, ("llama3-8b", "v6e-256"): 256, ("llama3.1-70b", "v5p-512"): 256}
START_EXP = {("llama3-8b", "v5p-128"): 23, ("llama3-8b", "v6e-256"): 22, ("llama3.1-70b", "v5p-512"): 22}
STRATEGIES = ("p2p", "usp", "a2a", "all_gather")
MIN_EXP, MAX_EXP = 16, 27
LOSS_CHUNK, MLP_CHUNK = 4096, 16384  # tokens per device and chunk, at most
# name -> model shape (D, F, V, L, head dim), for sorting XLA's buffers by what they hold.
SHAPES = {"llama3-8b": (4096, 14336, 128256, 32, 128), "llama3.1-70b": (8192, 28672, 128256, 80, 128)}
BREAKDOWN = ("layer inputs", "logits", "output head", "mlp", "attention", "activations", "other")


def chunks(tokens: int, most: int) -> int:
    """The fewest chunks dividing `tokens` with at most `most` tokens each."""
    n = max(1, -(-tokens // most))
    while tokens % n:
        n += 1
    return n


def command(model: str, topology: str, strategy: str, offload: bool, seq: int, kernel: str = "blockwise") -> list[str]:
    """The row's `maxctx.compile` command; with splash, at the block size the step-time model picks (splash_block:
    rows compiled before it ran at splash's default blocks)."""
    c = ROWS[(model, topology)]
    remat = ["remat_policy=custom", "decoder_layer_input=offload"] if offload else ["remat_policy=full"]
    cmd = ["python", "-m", "maxctx.compile", "configs/base.yml", f"compile_topology={topology}",
           f"model_name={model}", f"max_target_length={seq}", f"ici_context_parallelism={c}",
           "ici_fsdp_parallelism=1", f"per_device_batch_size={1 / c:g}", f"context_parallel_strategy={strategy}",
           f"attention={kernel}", f"num_vocab_tiling={chunks(seq // c, LOSS_CHUNK)}",
           f"mlp_sequence_chunks={chunks(seq // c, MLP_CHUNK)}", *remat]
    if kernel == "splash":
        block = splash_block(cmd)
        cmd += [f"flash_block_q={block}", f"flash_block_kv={block}"]
    return cmd


def _config(cmd: list[str]):
    from maxctx.loader import load_config

    return load_config(cmd[3:])


def splash_block(cmd: list[str]) -> int:
    """The splash block maxctx.plan.step_time picks for this command's model on its chip."""
    from maxctx.plan import step_time, topology

    config = _config(cmd)
    chip = topology.parse(config.compile_topology).chip
    return step_time.splash_block(config, step_time.scoped_vmem_bytes(chip))


def estimate(cmd: list[str]) -> str:
    """maxctx.plan.step_time's step time and MFU for the command (the policy's counts: no program here)."""
    from maxctx.parallelism import MeshPlan
    from maxctx.plan import step_time

    config = _config(cmd)
    n = ROWS[(config.model_name, config.compile_topology)]
    mesh = MeshPlan.one_slice({"data": 1, "fsdp": 1, "context": n, "context_a2a": 1, "tensor": 1})
    if config.context_parallel_strategy == "usp":
        from maxctx.parallelism import mesh_plan

        mesh = mesh_plan(config, n, step_time.strategies.get("usp").a2a_degree(config, n))
    hw = step_time.hardware(config, n)
    est = step_time.estimate(config, mesh, config.per_device_batch_size * n, hw)
    return f"{est.step_s:.0f} s, {est.model_flops / est.step_s / hw.peak_flops:.0%}"


def categorise(dims: list[int], model: str | list[int]) -> str:
    d, f, v, layers, e = SHAPES[model] if isinstance(model, str) else model
    if v in dims:  # a [D, V] weight or its gradient; else logits of a chunk (whose token count may equal D)
        return "output head" if sorted(dims) == sorted((d, v)) else "logits"
    if dims and dims[-1] == e:  # [..., heads, head dim]: q, k, v, out and the kernels' blocks (whose count may equal F)
        return "attention"
    if f in dims:
        return "mlp"
    if len(dims) == 4 and dims[0] == layers and dims[-1] == d:
        return "layer inputs"
    if e in dims:
        return "attention"
    return "activations" if d in dims else "other"


_SHAPE = re.compile(r"(?:(\d+)×)?(\w+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}


def buffers(dump_dir: str) -> list[tuple[float, list[int]]]:
    """(GiB, dims of the largest value it holds) of every buffer in the device memory space (color 0) of XLA's
    memory-usage report."""
    reports = glob.glob(os.path.join(dump_dir, "*jit_step*memory-usage-report.txt"))
    if not reports:
        return []
    with open(reports[0]) as f:
        text = f.read().split("Memory Space:")[1]
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(";")]
        if len(parts) != 5 or not parts[1][:1].isdigit():
            continue
        unit = {"GiB": GIB, "MiB": 2 ** 20, "KiB": 1024}.get(re.sub(r"[\d.]+", "", parts[1]), 1)
        size = float(re.match(r"[\d.]+", parts[1]).group()) * unit / GIB
        values = [(t, [int(x) for x in dims.split(",") if x]) for _, t, dims in _SHAPE.findall(parts[4])]
        if values:
            found.append((round(size, 4), max(values, key=lambda x: math.prod(x[1]) * _BYTES.get(x[0], 4))[1]))
    return found


def breakdown(probe: dict) -> dict:
    """GiB per category of a probe's buffers (each counted by the largest value it holds). Buffers of different
    phases share memory, so the sum exceeds the peak."""
    if "buffers" not in probe:  # probes recorded before the raw buffers were kept
        return probe.get("breakdown") or {}
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    for size, dims in probe["buffers"]:
        totals[categorise(dims, probe.get("shape") or probe["model"])] += size
    return {k: round(v, 2) for k, v in totals.items() if v >= 0.005}


def run_probe(model: str, topology: str, strategy: str, offload: bool, seq: int, time_limit_s: float,
              kernel: str = "blockwise") -> dict:
    return run_command(command(model, topology, strategy, offload, seq, kernel), time_limit_s)


def run_command(cmd: list[str], time_limit_s: float) -> dict:
    """Compiles one `python -m maxctx.compile ...` command with XLA's memory-usage report dumped: its status,
    JSON report and buffers."""
    with tempfile.TemporaryDirectory() as dump:
        env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        env.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                   XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*jit_step.*")
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "wall_s": round(time.time() - start, 1)}
        wall = round(time.time() - start, 1)
        parts = buffers(dump)
    if proc.returncode == 2:  # a config error: one line on stderr
        return {"status": "config error", "error": proc.stderr.strip().splitlines()[-1][-400:], "wall_s": wall}
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report = None
    if report is None or proc.returncode not in (0, 3):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "error", "returncode": proc.returncode, "error": " | ".join(tail)[-800:], "wall_s": wall}
    status = "fits" if report["fits"] else "over"
    return {"status": status, "report": report, "buffers": parts, "wall_s": wall}


def load_results() -> dict:
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            for line in f:
                r = json.loads(line)
                # Probes from before the rename recorded the JAX kernel as "flash" (now: the platform's fast kernel).
                r["kernel"] = "blockwise" if r["kernel"] == "flash" else r["kernel"]
                results[(r["model"], r["topology"], r["strategy"], r["offload"], r["seq"], r["kernel"])] = r
    return results


def probe(key: tuple, results: dict, args) -> dict:
    if key in results:
        return results[key]
    model, topology, strategy, offload, seq, kernel = key
    print(f"[{time.strftime('%H:%M:%S')}] {model} {topology} {strategy} offload={offload} S={seq:,} {kernel} ...",
          flush=True)
    r = run_probe(model, topology, strategy, offload, seq, args.time_limit_s, kernel)
    r.update(model=model, topology=topology, strategy=strategy, offload=offload, seq=seq, kernel=kernel)
    print(f"    {r['status']} in {r['wall_s']} s" + (f": {r['error']}" if "error" in r else ""), flush=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(r) + "\n")
    results[key] = r
    write_table(results)
    return r


def need_bytes(report: dict) -> float | None:
    hbm, room = report.get("hbm_bytes_per_device"), report.get("headroom_bytes")
    return None if hbm is None or room is None else hbm - room


def predicted_exp(report: dict, seq: int) -> int:
    """Largest power of two whose memory, arguments fixed and the rest proportional to S, fits in 95% of HBM."""
    fixed = report.get("argument_size_in_bytes", 0)
    per_token = max(need_bytes(report) - fixed, 1) / seq
    return int(math.floor(math.log2(max(0.95 * report["hbm_bytes_per_device"] - fixed, 1) / per_token)))


def search(row: tuple, results: dict, args) -> None:
    """Doubling to the largest fitting power of two P, then bisection in steps of P/8. Above a fitting length, a
    compile that fails (XLA error, time-out) bounds the search like one that does not fit."""
    def at(seq):
        return probe((*row, seq, "blockwise"), results, args)

    exp, fit_exp, over_exp = START_EXP[row[:2]], None, None
    while fit_exp is None or over_exp is None or over_exp > fit_exp + 1:
        if not MIN_EXP <= exp <= MAX_EXP:
            return
        r = at(2 ** exp)
        if r["status"] not in ("fits", "over") and fit_exp is None:
            return
        if r["status"] == "fits":
            fit_exp = exp
            exp = max(exp + 1, predicted_exp(r["report"], 2 ** exp))
            exp = exp if over_exp is None else min(exp, over_exp - 1)
        else:
            over_exp = exp
            exp = exp - 1 if fit_exp is None else (fit_exp + over_exp) // 2
    if fit_exp is None or over_exp is None:
        return
    lo, hi = 0, 8  # eighths above P: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = at(2 ** fit_exp * (8 + mid) // 8)
        lo, hi = (mid, hi) if r["status"] == "fits" else (lo, mid)


def best(row: tuple, results: dict, kernel: str = "blockwise") -> dict | None:
    fits = [r for k, r in results.items() if k[:4] == row and k[5] == kernel and r["status"] == "fits"]
    return max(fits, key=lambda r: r["seq"], default=None)


def _tokens(n: int) -> str:
    return f"{n / 2 ** 20:.3g}M" if n >= 2 ** 20 else f"{n // 1024}K"


def splash_cell(row: tuple, results: dict) -> str:
    top = best(row, results)
    r = results.get((*row, top["seq"], "splash")) if top else None
    if r is None:
        return "not checked"
    if r["status"] not in ("fits", "over"):
        return f"{r['status']}: {r.get('error', '')[-160:]}".replace("|", "/")
    need = need_bytes(r["report"])
    return f"{'fits' if r['status'] == 'fits' else 'does not fit'}, {need / GIB:.1f} GiB ({r['wall_s']:.0f} s)"


def _xla_error(error: str) -> str:
    """The compiler's own words from a failed probe's last lines (its check message, else the last line)."""
    found = re.search(r"Check failed: ([^|]*)", error)
    return (f"XLA check failed: {found.group(1).strip()}" if found else error.split(" | ")[-1][-160:]).replace("|", "/")


def _short(error: str, most: int = 200) -> str:
    """An error for a table cell: whole if short, else cut at a word boundary."""
    return error if len(error) <= most else error[:most].rsplit(" ", 1)[0] + " ..."


def row_line(row: tuple, results: dict) -> str:
    model, topology, strategy, offload = row
    name = f"| {model} | {topology} | {strategy} | {'on' if offload else 'off'} |"
    mine = sorted((r for k, r in results.items() if k[:4] == row and k[5] == "blockwise"), key=lambda r: r["seq"])
    top = best(row, results)
    if top is None:
        note = "; ".join(f"S={_tokens(r['seq'])} {r['status']}" + (f" ({_short(r['error'])})" if "error" in r else "")
                         for r in mine) or "not run"
        return f"{name} - | - | - | - | - | - | - | - | {note.replace('|', '/')} |"
    rep, chips = top["report"], ROWS[(model, topology)]
    above = [r for r in mine if r["status"] != "fits" and r["seq"] > top["seq"]]
    first = min(above, key=lambda r: r["seq"], default=None)
    limit = ("; nothing longer probed" if first is None else f"; {_tokens(first['seq'])} does not fit"
             if first["status"] == "over" else f"; {_tokens(first['seq'])}: compile over the time limit "
             f"({first['wall_s']:.0f} s)" if first["status"] == "timeout" else f"; {_tokens(first['seq'])}: "
             f"{first['status']}, {_xla_error(first.get('error', ''))}")
    parts = breakdown(top)
    head = max(parts, key=parts.get) if parts else "-"
    host = rep.get("host_temp_size_in_bytes", 0) / GIB
    cmd = command(*row, top["seq"])
    return (f"{name} {top['seq']:,} ({_tokens(top['seq'])}{limit}) | {top['seq'] // chips:,} | "
            f"{need_bytes(rep) / GIB:.1f} / {rep['hbm_bytes_per_device'] / GIB:.0f}"
            + (f" (+{host:.0f} host)" if host else "") + f" | {head} ({parts.get(head, 0):.1f} GiB) | "
            f"{estimate(command(*row, top['seq'], 'splash'))} | {splash_cell(row, results)} | {splash_block(cmd)} | "
            f"{top['wall_s']:.0f} s | "
            f"`{' '.join(cmd)}` |")


def rows(args=None) -> list[tuple]:
    pairs = [tuple(p.split("/")) for p in args.only.split(",") if p] if args and args.only else list(ROWS)
    strategies = args.strategies.split(",") if args else STRATEGIES
    offloads = [o == "on" for o in args.offload.split(",")] if args else [False, True]
    return [(m, t, s, o) for m, t in pairs for s in strategies for o in offloads]


def write_table(results: dict) -> None:
    lines = [
        "# Longest single sequence that fits, per CP strategy",
        "",
        "Written by `python3 benchmarks/fit_table.py` (its docstring has the method); every command compiles the",
        "real train step for the TPU topology with libtpu on a CPU machine (`maxctx.compile`): the memory is XLA's",
        "own analysis. One sequence per step over every chip (C = 64 on v5p-128, 256 on v6e-256 and v5p-512),",
        "attention=blockwise (the JAX kernel), tiled loss and MLP; offload: remat_policy=custom",
        "decoder_layer_input=offload, else",
        "remat_policy=full. Max context: doubling, then bisection to 1/8 of the power of two. GiB per chip: what",
        "the program needs / HBM (+ pinned host memory). Largest part: the category of XLA's buffers",
        "(memory-usage report, sorted by shape) holding the most bytes. Estimate: maxctx.plan.step_time's step",
        "time and MFU for the command with attention=splash at the model's block (not a measurement; the policy's",
        "attention forwards, 2 per layer on every row here; docs/step_time_model.md). Splash: the same command with",
        "attention=splash (ring hops' backward through splash's own kernels, since 2026-12-03; where that is over,",
        "docs/long_context.md has the row with the blockwise hop backward), compiled at splash's default blocks.",
        "Splash block: the block the step-time model picks for the row (step_time.splash_block; a splash probe",
        "run from now on uses it). Compile: seconds on the 2-core development VM.",
        "",
        "| model | topology | strategy | offload | max tokens | tokens per chip | GiB per chip | largest part "
        "| estimate with splash (step, MFU) | splash at max | splash block | compile | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row_line(row, results) for row in rows()]
    lines += ["", "Memory breakdown at each row's maximum (GiB of XLA buffers per category):", "",
              "| model | topology | strategy | offload | tokens | " + " | ".join(BREAKDOWN) + " |",
              "|---|---|---|---|---|" + "---|" * len(BREAKDOWN)]
    for row in rows():
        top = best(row, results)
        parts = breakdown(top) if top else {}
        if parts:
            cells = " | ".join(f"{parts.get(k, 0):.1f}" for k in BREAKDOWN)
            lines.append(f"| {row[0]} | {row[1]} | {row[2]} | {'on' if row[3] else 'off'} | {top['seq']:,} | {cells} |")
    lines += keys_table()
    if os.path.exists(FIRST_TABLE):
        with open(FIRST_TABLE) as f:
            lines += ["", "#" + f.read()]
    with open(TABLE, "w") as f:
        f.write("\n".join(lines) + "\n")


def keys_table() -> list[str]:
    """The table of single compiles (`--keys`, fit_table_keys.jsonl): head chunks, host offload, MaxText's record
    shapes. Host: pinned host memory per chip, against the topology VM's RAM per chip (maxctx.plan.topology's
    sourced Chip.host_bytes); a row over it does not fit."""
    if not os.path.exists(KEYS_RESULTS):
        return []
    from maxctx.plan import topology

    lines = ["", "Single compiles (`python3 benchmarks/fit_table.py --keys <key=value ...>`, each `python -m "
             "maxctx.compile configs/base.yml <keys>`; host: pinned host memory per chip / the VM's "
             "RAM per chip; attention: the breakdown's attention category, GiB of buffers; step estimate: "
             "maxctx.plan.step_time's, fed the program's counts when it compiled, not a measurement):", "",
             "| keys | status | HBM per device (GiB) | host per chip | attention forwards per layer | attention | "
             "activations | step estimate, MFU | compile |", "|---|---|---|---|---|---|---|---|---|"]
    with open(KEYS_RESULTS) as f:
        for line in f:
            r = json.loads(line)
            report = r.get("report") or {}
            keys = " ".join(r["keys"])
            if "total_size_in_bytes" not in report:  # an error, or XLA's own out-of-memory before any analysis
                r.setdefault("error", report.get("xla_error", ""))
                error = _short(r.get("error", "")).replace("|", "/")
                lines.append(f"| `{keys}` | {r['status']}: {error} | - | - | - | - | - | - | "
                             f"{r.get('wall_s', 0):.0f} s |")
                continue
            chip = topology.parse(_config(["python", "-m", "maxctx.compile", "configs/base.yml", *r["keys"]])
                                  .compile_topology).chip
            host = report.get("host_temp_size_in_bytes", 0) * chip.devices_per_chip
            host_fits = chip.host_bytes and host <= chip.host_bytes
            status = "fits" if report["fits"] and host_fits else (
                "over HBM" if not report["fits"] else "over the host")
            per_layer = report.get("attention_forwards_per_layer")
            parts = breakdown(r)
            lines.append(
                f"| `{keys}` | {status} | {report['total_size_in_bytes'] / GIB:.2f} / "
                f"{report['hbm_bytes_per_device'] / GIB:.0f} | {host / GIB:.2f} / {chip.host_bytes / GIB:.1f} | "
                f"{'-' if per_layer is None else f'{per_layer:.2f}'} | {_part(parts, 'attention')} | "
                f"{_part(parts, 'activations')} | {_estimate(report)} | {r['wall_s']:.0f} s |")
    return lines


def _estimate(report: dict) -> str:
    step, mfu = report.get("estimate_step_time_s"), report.get("estimate_mfu")
    return "-" if step is None else f"{step:.1f} s, {100 * mfu:.1f}%"


def _part(parts: dict, name: str) -> str:
    """A breakdown category's GiB, or - for a compile recorded without XLA's buffer dump (run outside --keys)."""
    return f"{parts.get(name, 0):.1f}" if parts else "-"


def compile_keys(keys: list[str], time_limit_s: float) -> dict:
    """One compile of `python -m maxctx.compile configs/base.yml <keys>` (any keys: head chunks, host optimizer,
    MaxText's record shapes), recorded in KEYS_RESULTS with its breakdown (GiB per category)."""
    cmd = ["python", "-m", "maxctx.compile", "configs/base.yml", *keys]
    config = _config(cmd)
    shape = [config.base_emb_dim, config.base_mlp_dim, config.vocab_size, config.base_num_decoder_layers,
             config.head_dim]
    result = {"keys": keys, "shape": shape, "model": config.model_name, **run_command(cmd, time_limit_s)}
    result["breakdown"] = breakdown(result) if "buffers" in result else {}
    with open(KEYS_RESULTS, "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model/topology pairs, e.g. llama3-8b/v5p-128")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--offload", default="on,off", help="on, off or both")
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="per compile")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results file")
    parser.add_argument("--splash-check", action="store_true", help="compile each row's maximum with splash")
    parser.add_argument("--splash-again", action="store_true",
                        help="with --splash-check: compile it again even where the results have it (after a change)")
    parser.add_argument("--keys", nargs="+", help="compile configs/base.yml with these key=value overrides once, "
                        "print its report and breakdown and append them to fit_table_keys.jsonl")
    args = parser.parse_args()
    if args.keys:
        result = compile_keys(args.keys, args.time_limit_s)
        report = result.get("report") or {}
        print(json.dumps({k: result[k] for k in ("status", "wall_s", "breakdown") if k in result}
                         | {k: round(report[k] / GIB, 2) for k in ("total_size_in_bytes", "hbm_bytes_per_device",
                                                                  "host_temp_size_in_bytes") if k in report}
                         | {k: report[k] for k in ("fits", "compile_time_s", "attention_forwards_per_layer",
                                                   "xla_error") if k in report}
                         | ({"error": result["error"]} if "error" in result else {})))
        return
    results = load_results()
    if not args.table_only:
        for row in rows(args):
            search(row, results, args)
            top = best(row, results)
            if args.splash_check and top is not None:
                if args.splash_again:
                    results.pop((*row, top["seq"], "splash"), None)
                probe((*row, top["seq"], "splash"), results, args)
    write_table(results)


if __name__ == "__main__":
    main()
