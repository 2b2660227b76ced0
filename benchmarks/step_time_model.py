"""maxctx.plan.step_time against MaxText's measured v5p-128 long-context rows: the calibration and the error on
every row. No TPU: the model's arithmetic only (--eup compiles for abstract TPUs, with libtpu).

    python3 benchmarks/step_time_model.py          # the table (docs/step_time_model.md)
    python3 benchmarks/step_time_model.py --fit    # the fitted constants from the FITTED rows
    python3 benchmarks/step_time_model.py --what-if    # MaxText's recomputing lengths with context offloaded
    python3 benchmarks/step_time_model.py --rankings   # every published MaxText measurement beside the model
    python3 benchmarks/step_time_model.py --ironwood   # tpu7x-128 predictions, before and with per-generation exps
    python3 benchmarks/step_time_model.py --eup        # each TPU generation's exp rate from libtpu (compiles)

The rows: tpu-recipes `training/v5p/Llama3.1-8B-LongContext-Maxtext/cluster_toolkit/README.md` (AI-Hypercomputer),
llama3.1-8b with head_dim=256, 16 query heads, 4 KV heads (its variant), ring CP with causal load balance, tokamax
splash at sa_block_*=1024, num_vocab_tiling=16, 459 TFLOP/s per device. MaxText's ring sends overlap the hops'
kernels in the backward as well as the forward (the ring strategies priced with `overlapped_backward=True`;
maxctx's own program sends its backward hops after their kernels, which the planner charges). Where the README
gives two step times (a UBench run and a second run) the second, whose MFU is the range's upper end, is the row's;
the UBench one is shown beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxctx.attention.cp import strategies  # noqa: E402
from maxctx.loader import load_config  # noqa: E402
from maxctx.parallelism import MeshPlan  # noqa: E402
from maxctx.plan import planner, step_time, topology  # noqa: E402

VARIANT = ["model_name=llama3.1-8b", "head_dim=256", "base_num_query_heads=16", "base_num_kv_heads=4",
           "num_vocab_tiling=16", "attention=splash", "flash_block_q=1024", "flash_block_kv=1024",
           "context_parallel_strategy=p2p", "context_parallel_load_balance=true", "compile_topology=v5p-128",
           "peak_tflops_per_device=459", "splash_fused_backward=true"]  # tokamax's one backward kernel (2 exps)
# (tokens, ici_context, ici_fsdp, per_device_batch, remat_policy, context, decoder_layer_input, measured step s,
#  the UBench run's step s or None, the README's measured MFU (the upper end of a range))
ROWS = [(65536, 4, 16, 0.5, "custom", "device", "device", 10.25, None, 0.673),
        (262144, 16, 4, 0.125, "custom", "offload", "offload", 26.31, None, 0.681),
        (1048576, 64, 1, 0.03125, "custom", "offload", "device", 90.30, 95.73, 0.687),
        (2097152, 64, 1, 0.03125, "custom", "offload", "offload", 346.18, 357.68, 0.699),
        (4194304, 64, 1, 0.03125, "custom", "offload", "offload", 1358.40, 1373.73, 0.703),
        (10485760, 64, 1, 0.015625, "full", None, None, 8056.40, None, 0.367),
        (14680064, 64, 1, 0.015625, "custom", "remat", "offload", 15623.09, None, 0.371)]
# Each constant is fitted on the row it dominates (the others predicted).
FITTED = {"XLA_MATMUL_EFFICIENCY": 65536, "SPLASH_EFFICIENCY": 4194304, "RECOMPUTE_ATTENTION": 10485760}
DEVICES = 64


@functools.cache
def config_of(row):
    seq, cp, fsdp, pdbs, policy, context, inputs = row[:7]
    keys = [f"max_target_length={seq}", f"ici_context_parallelism={cp}", f"ici_fsdp_parallelism={fsdp}",
            f"per_device_batch_size={pdbs}", f"remat_policy={policy}"]
    if policy == "custom":
        keys += [f"context={context}", f"decoder_layer_input={inputs}"]
    return load_config(["configs/base.yml", *VARIANT, *keys])


def predict(row) -> step_time.StepTime:
    config = config_of(row)
    mesh = MeshPlan.one_slice({"data": 1, "fsdp": row[2], "context": row[1], "context_a2a": 1, "tensor": 1})
    hw = step_time.hardware(config, DEVICES)
    with strategies.replaced(overlapped_backward=True):
        return step_time.estimate(config, mesh, row[3] * DEVICES, hw)


def _set(name: str, value: float) -> None:
    if name == "SPLASH_EFFICIENCY":
        step_time.SPLASH_EFFICIENCY = {**step_time.SPLASH_EFFICIENCY, 1024: value}
    else:
        setattr(step_time, name, value)


def fit() -> dict[str, float]:
    """Each constant bisected so its row's prediction meets the measurement (fit_on, one row each)."""
    rows = {r[0]: r for r in ROWS}
    return fit_on({name: [rows[seq]] for name, seq in FITTED.items()}, rounds=30, steps=60)


# The rows each constant dominates, for the leave-one-out fit: the matmuls at 64K-256K, splash's attention at
# 1M-4M (context kept), the recomputed attention at 10M-14M.
GROUPS = {"XLA_MATMUL_EFFICIENCY": (65536, 262144), "SPLASH_EFFICIENCY": (1048576, 2097152, 4194304),
          "RECOMPUTE_ATTENTION": (10485760, 14680064)}


def fit_on(rows: dict[str, list], rounds: int = 8, steps: int = 40) -> dict[str, float]:
    """Each constant bisected (`steps` halvings) so the mean log error over its rows (`rows[name]`, measured rows)
    is zero, in `rounds` turns until they settle (each prediction is monotone in every constant; a higher
    efficiency is faster, a higher recompute cost slower)."""
    values = {}
    for _ in range(rounds):
        for name, group in rows.items():
            lo, hi = (0.05, 1.0) if "EFFICIENCY" in name else (0.0, 20.0)
            for _ in range(steps):
                mid = (lo + hi) / 2
                _set(name, mid)
                too_slow = sum(math.log(predict(r).step_s / r[7]) for r in group) > 0
                lo, hi = ((mid, hi) if too_slow else (lo, mid)) if "EFFICIENCY" in name else \
                    ((lo, mid) if too_slow else (mid, hi))
            values[name] = (lo + hi) / 2
            _set(name, values[name])
    return values


def leave_one_out() -> list[str]:
    """Each v5p row held out in turn: the three constants fitted on the other rows of their groups (GROUPS), the
    held-out row predicted with them; the shipped constants are restored afterwards."""
    kept = (step_time.XLA_MATMUL_EFFICIENCY, dict(step_time.SPLASH_EFFICIENCY), step_time.RECOMPUTE_ATTENTION)
    by_seq = {r[0]: r for r in ROWS}
    lines = ["| held-out row | measured | predicted without it | error | matmul eff. / splash eff. / recompute "
             "fitted on the other rows |", "|---|---|---|---|---|"]
    try:
        for held in ROWS:
            rows = {n: [by_seq[s] for s in g if s != held[0]] for n, g in GROUPS.items()}
            values = fit_on(rows)
            est = predict(held).step_s
            lines.append(f"| {held[0]:,} | {held[7]:,.2f} s | {est:,.2f} s | {est / held[7] - 1:+.1%} | "
                         f"{values['XLA_MATMUL_EFFICIENCY']:.3f} / {values['SPLASH_EFFICIENCY']:.3f} / "
                         f"{values['RECOMPUTE_ATTENTION']:.2f} |")
    finally:
        step_time.XLA_MATMUL_EFFICIENCY, step_time.SPLASH_EFFICIENCY, step_time.RECOMPUTE_ATTENTION = kept
    return lines


def table() -> list[str]:
    lines = ["| tokens | CP x FSDP | policy (context, layer input) | measured | predicted | error | fitted? | "
             "matmul / attention / recompute / memory / exposed comm / exposed host | predicted MFU | "
             "MaxText's MFU / maxctx's model FLOPs at the measured time | model FLOPs x 4/3 at peak (the former "
             "roofline) | host bytes per step; GB/s that would expose them |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        seq, cp, fsdp, pdbs, policy, context, inputs, measured, ubench, mfu = row
        est = predict(row)
        err = est.step_s / measured - 1
        also = f" (UBench {ubench:,.2f} s: {est.step_s / ubench - 1:+.1%})" if ubench else ""
        terms = " / ".join(f"{x:,.1f}" for x in (est.matmul_s, est.attention_s, est.recompute_s, est.memory_s,
                                                 est.exposed_collective_s, est.exposed_host_s))
        where = f"{policy}" + (f" ({context}, {inputs})" if policy == "custom" else "")
        lines.append(f"| {seq:,} | {cp} x {fsdp} | {where} | {measured:,.2f} s{also} | {est.step_s:,.2f} s | "
                     f"{err:+.1%} | {'fitted' if seq in FITTED.values() else 'predicted'} | {terms} s | "
                     f"{est.model_flops / est.step_s / 459e12:.1%} | {mfu:.1%} / "
                     f"{est.model_flops / measured / 459e12:.1%} | {est.model_flops * 4 / 3 / 459e12:,.0f} s | "
                     f"{est.host_bytes / 1e9:,.0f} GB; {est.host_bytes / 2 / (est.compute_s / 3) / 1e9:.2f} |")
    return lines


# What the model predicts when attention's outputs are kept on the host at MaxText's recomputing lengths (no
# measurement exists): the rows' shapes with remat_policy=custom context=offload decoder_layer_input=offload.
WHAT_IF = [(10485760, 64, 1, 0.015625, "custom", "offload", "offload"),
           (14680064, 64, 1, 0.015625, "custom", "offload", "offload"),
           (16777216, 64, 1, 0.015625, "custom", "offload", "offload")]
HOST_RAM_PER_VM = 4 * topology.CHIPS["v5p"].host_bytes  # a v5p VM: 4 chips, 448 GB RAM (maxctx.plan.topology)


def what_if() -> list[str]:
    lines = ["| tokens | policy | predicted step | predicted MFU | host bytes held per VM (4 chips) | of its RAM |",
             "|---|---|---|---|---|---|"]
    for row in WHAT_IF:
        est = predict(row)
        held = est.host_bytes / 2 * 4
        lines.append(f"| {row[0]:,} | custom (context={row[5]}, decoder_layer_input={row[6]}) | {est.step_s:,.0f} s | "
                     f"{est.model_flops / est.step_s / 459e12:.1%} | {held / 1e9:,.0f} GB | "
                     f"{held / HOST_RAM_PER_VM:.0%} |")
    return lines


# The Ironwood shapes (issue 45): the variant on tpu7x-128 (64 chips, 128 devices), ring CP over every device
# with causal load balance, 2048-token splash blocks, one sequence, attention's output and the layer input on the
# host (the Ironwood 16M recipe's placement, docs/long_context.md). Predictions only: no Ironwood measurement is
# read or fitted here.
IRONWOOD = ["compile_topology=tpu7x-128", "ici_context_parallelism=128", "ici_fsdp_parallelism=1",
            "per_device_batch_size=0.0078125", "flash_block_q=2048", "flash_block_kv=2048", "remat_policy=custom",
            "context=offload", "decoder_layer_input=offload"]
IRONWOOD_TOKENS = [2 ** 16, 2 ** 17, 2 ** 18, 2 ** 19, 2 ** 20, 2 ** 21, 2 ** 22, 2 ** 23, 12 * 2 ** 20, 14 * 2 ** 20,
                   2 ** 24]
# The model before the exps were priced per generation (the v5p fit of commit 9a5ce45; the host link not shared by
# a chip's two devices): matmul efficiency, splash efficiency at 1024, recompute factor
BEFORE = (0.875, 0.710, 2.80)


def ironwood_estimate(tokens: int, before: bool) -> step_time.StepTime:
    variant = [k for k in VARIANT if not k.startswith(("compile_topology", "peak_tflops", "flash_block"))]
    config = load_config(["configs/base.yml", *variant, *IRONWOOD, f"max_target_length={tokens}"])
    mesh = MeshPlan.one_slice({"data": 1, "fsdp": 1, "context": 128, "context_a2a": 1, "tensor": 1})
    hw = step_time.hardware(config, 128)
    kept = (step_time.XLA_MATMUL_EFFICIENCY, dict(step_time.SPLASH_EFFICIENCY), step_time.RECOMPUTE_ATTENTION)
    if before:
        hw = dataclasses.replace(hw, transcendentals_per_s=0.0, host_bytes_per_s=step_time.HOST_BYTES_PER_S)
        step_time.XLA_MATMUL_EFFICIENCY, step_time.RECOMPUTE_ATTENTION = BEFORE[0], BEFORE[2]
        step_time.SPLASH_EFFICIENCY = {1024: BEFORE[1]}
    try:
        with strategies.replaced(overlapped_backward=True):
            return step_time.estimate(config, mesh, 1, hw)
    finally:
        step_time.XLA_MATMUL_EFFICIENCY, step_time.SPLASH_EFFICIENCY, step_time.RECOMPUTE_ATTENTION = kept


def ironwood() -> list[str]:
    lines = ["| tokens | per device | before: step, MFU | now: step, MFU | now: attention (of which exps) | change |",
             "|---|---|---|---|---|---|"]
    peak = 2307e12 / 2
    for tokens in IRONWOOD_TOKENS:
        old, new = ironwood_estimate(tokens, True), ironwood_estimate(tokens, False)
        exps = new.attention_s - old.attention_s * BEFORE[1] / step_time.SPLASH_EFFICIENCY[1024]  # less the MXU side
        lines.append(f"| {tokens:,} | {tokens // 128:,} | {old.step_s:,.2f} s, "
                     f"{old.model_flops / old.step_s / peak:.1%} | {new.step_s:,.2f} s, "
                     f"{new.model_flops / new.step_s / peak:.1%} | {new.attention_s:,.2f} s "
                     f"({exps:,.2f} s) | {new.step_s / old.step_s - 1:+.1%} |")
    return lines


# libtpu's cost model for a chain of exps, VMEM-resident (maxctx.plan.topology.EUP_SOURCE); one process per
# generation, since libtpu reads the accelerator type once.
EUP_SCRIPT = """
import sys, jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
shape, config = sys.argv[1], sys.argv[2]
device = topologies.get_topology_desc(shape, "tpu", chip_config_name=config).devices[0]
chain = jax.jit(lambda x: __import__("functools").reduce(lambda y, _: jnp.exp(y), range(512), x))
arg = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=SingleDeviceSharding(device))
cost = chain.lower(arg).compile().cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
print("EUP", cost["transcendentals"] / cost["optimal_seconds"])
"""


def eup() -> list[str]:
    import subprocess

    lines = ["| generation | exps per second per device (libtpu's cost model) | per chip | MXU peak FLOPs per exp |",
             "|---|---|---|---|"]
    for gen, chip in topology.CHIPS.items():
        topo = topology.parse(f"{gen}:{'x'.join(['2'] * (chip.dims - 1) + ['1' if chip.dims == 3 else '2'])}")
        env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
               "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": topo.accelerator_type}
        out = subprocess.run([sys.executable, "-c", EUP_SCRIPT, topo.libtpu_name,
                              "megacore" if chip.megacore else "default"], env=env, capture_output=True, text=True)
        rate = float(next(x for x in out.stdout.splitlines() if x.startswith("EUP")).split()[1])
        from maxctx.metrics.peaks import lookup_peak

        peak = lookup_peak(chip.device_kind).tflops * 1e12
        lines.append(f"| {chip.name} | {rate:.4e} | {rate * chip.devices_per_chip:.4e} | "
                     f"{peak / (rate * chip.devices_per_chip):,.0f} |")
    return lines


# MaxText's strategy measurements on v5p-128, 2M tokens per step, splash, `remat_policy=custom context=device`
# (PR #4687's setting): (name, model, length, C, fsdp, {maxctx label: measured step s}, or the label measured
# fastest where only that is published (PRs #4836 / #4893 as issue 17 summarises them)).
STRATEGY_ROWS = [
    ("PR #4687", "llama2-7b", 32768, 16, 4, {"all_gather": 8.83, "a2a": 8.90, "p2p": 16.38}),
    ("PRs #4836/#4893", "llama3-8b", 65536, 64, 1, "usp 16x4"),
    ("PRs #4836/#4893", "llama3-8b", 262144, 64, 1, "usp 8x8"),
]
TERMS = ("matmul_s", "attention_s", "recompute_s", "memory_s", "exposed_collective_s", "exposed_host_s")


def strategy_estimates(model: str, length: int, cp: int, fsdp: int) -> dict[str, tuple[planner.Candidate,
                                                                                    step_time.StepTime]]:
    """Every valid candidate MaxText can run too (its Ulysses needs U to divide the kv heads), with the step-time
    model's terms, the rings' backward sends overlapped as MaxText's are."""
    argv = ["configs/base.yml", "compile_topology=v5p-128", f"model_name={model}", f"max_target_length={length}",
            f"ici_context_parallelism={cp}", f"ici_fsdp_parallelism={fsdp}",
            f"per_device_batch_size={2 ** 21 / DEVICES / length}", "attention=splash", "flash_block_q=1024",
            "flash_block_kv=1024", "remat_policy=custom", "context=device", "context_parallel_strategy=auto"]
    from maxctx.loader import parse_config

    config = parse_config(argv)
    with strategies.replaced(overlapped_backward=True):
        plan = planner.plan(config)
    out = {}
    for c in plan.ranked:
        if not c.valid or config.base_num_kv_heads % c.a2a:
            continue
        cand = planner.candidate_config(config, c.strategy, c.a2a)
        mesh = MeshPlan.one_slice({"data": 1, "fsdp": fsdp, "context": cp // c.a2a, "context_a2a": c.a2a,
                                   "tensor": 1})
        hw = step_time.hardware(cand, DEVICES)
        with strategies.replaced(overlapped_backward=True):
            out[c.label] = (c, step_time.estimate(cand, mesh, 2 ** 21 / length, hw))
    return out


def planner_layers(model: str) -> int:
    from maxctx.loader import parse_config

    return parse_config(["configs/base.yml", f"model_name={model}"]).base_num_decoder_layers


def rankings() -> list[str]:
    lines = ["| source | shape | measured | model's prediction (step s) | ranking agrees? | where it disagrees: the "
             "term that would have to change |", "|---|---|---|---|---|---|"]
    for source, model, length, cp, fsdp, measured in STRATEGY_ROWS:
        est = strategy_estimates(model, length, cp, fsdp)
        order = sorted(est, key=lambda k: est[k][1].step_s)
        predicted = ", ".join(f"{k} {est[k][1].step_s:.2f}" for k in order)
        shape = f"{model}, {length // 1024}K, C={cp}, fsdp {fsdp}"
        layers = planner_layers(model)
        if isinstance(measured, dict):
            got = ", ".join(f"{k} {v:.2f} s (predicted {est[k][1].step_s:.2f}, {est[k][1].step_s / v - 1:+.0%})"
                            for k, v in sorted(measured.items(), key=lambda kv: kv[1]))
            first, second = sorted(measured, key=measured.get)[:2]
            model_order = [k for k in order if k in measured]
            agrees = model_order[-1] == max(measured, key=measured.get)
            tie = measured[second] / measured[first] - 1
            a, b = est[first][1], est[second][1]
            gap = a.step_s - b.step_s * (1 + tie)
            diff = {t: getattr(a, t) - getattr(b, t) for t in TERMS}
            term = max(diff, key=diff.get)
            note = (f"last place agrees ({model_order[-1]}); the measured tie of {first} and {second} "
                    f"({tie:+.1%}) the model puts {a.step_s / b.step_s - 1:+.1%} apart: {first}'s "
                    f"{term.removesuffix('_s').replace('_', ' ')} ({getattr(a, term):.2f} s against "
                    f"{getattr(b, term):.2f} s) would have to fall by {gap:.2f} s per step "
                    f"({gap / layers * 1e3:.0f} ms per layer, {gap / getattr(a, term):.0%} of it)")
            lines.append(f"| {source} | {shape} | {got} | {predicted} | "
                         f"{'order of the two ahead: no; ring last: yes' if agrees else 'no'} | {note} |")
        else:
            best = order[0]
            ok = best == measured
            a, b = est[measured][1], est[best][1]
            diff = {t: getattr(a, t) - getattr(b, t) for t in TERMS}
            term = max(diff, key=diff.get)
            note = "-" if ok else (
                f"{measured} is {a.step_s / b.step_s - 1:+.1%} behind {best}, almost all in "
                f"{term.removesuffix('_s').replace('_', ' ')} ({getattr(a, term):.2f} s against {getattr(b, term):.2f}"
                f" s): it would have to fall by {a.step_s - b.step_s:.2f} s per step "
                f"({(a.step_s - b.step_s) / getattr(a, term):.0%} of it) for {measured} to lead")
            lines.append(f"| {source} | {shape} | {measured} fastest | {predicted} | "
                         f"{'yes' if ok else 'no'} | {note} |")
    return lines


def lc_rankings() -> list[str]:
    """The long-context rows ordered by MFU, measured and predicted."""
    measured = sorted(ROWS, key=lambda r: r[9])
    mfu = {r[0]: predict(r).model_flops / predict(r).step_s / 459e12 for r in ROWS}
    predicted = sorted(ROWS, key=lambda r: mfu[r[0]])
    return [f"measured MFU order: {', '.join(f'{r[0]:,} ({r[9]:.1%})' for r in measured)}",
            f"predicted MFU order: {', '.join(f'{r[0]:,} ({mfu[r[0]]:.2%})' for r in predicted)}"]


def main() -> None:
    if sys.argv[1:] == ["--rankings"]:
        print("\n".join(lc_rankings() + rankings()))
        return
    if sys.argv[1:] == ["--leave-one-out"]:
        print("\n".join(leave_one_out()))
        return
    if sys.argv[1:] == ["--eup"]:
        print("\n".join(eup()))
        return
    if sys.argv[1:] == ["--ironwood"]:
        print("\n".join(ironwood()))
        return
    if sys.argv[1:] == ["--what-if"]:
        print("\n".join(what_if()))
        return
    if sys.argv[1:] == ["--fit"]:
        for name, value in fit().items():
            print(f"{name} = {value:.4f}  (fitted on the {FITTED[name]:,}-token row)")
        step_time.RECOMPUTE_ATTENTION = 1.0
        for row in ROWS[5:]:
            print(f"with RECOMPUTE_ATTENTION = 1 (a recomputed forward costs its FLOPs alone) the {row[0]:,}-token "
                  f"row would be predicted at {predict(row).step_s:,.0f} s (measured {row[7]:,.0f} s)")
        return
    print("\n".join(table()))


if __name__ == "__main__":
    main()
