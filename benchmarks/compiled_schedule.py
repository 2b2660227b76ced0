"""What the program compiled for a TPU does with context parallelism's collectives: which overlap compute, and what
the TPU compiler estimates the rest of a layer costs, per strategy. No TPU needed (libtpu compiles for the
topology); no number here is a measurement on hardware.

    python3 benchmarks/compiled_schedule.py > benchmarks/compiled_schedule.md

The shape is MaxText's llama2-7b measurement (PR #4687: v5p-128, 32K tokens per sequence, C = 16, fsdp 4, 2M tokens
per step, splash) with 2 decoder layers instead of 32 (the layers are one scanned body, so its schedule is the
32-layer model's), `remat_policy=full`. For each strategy the step is compiled (`maxctx.train_step`) and the
optimized, scheduled HLO (`Compiled.as_text()`) is read:

- collectives: each kind, and whether it is asynchronous (`-start` / `-done` pairs, which XLA can overlap with
  the ops scheduled between them) or synchronous (nothing overlaps it);
- ring sends (collective-permutes) in the layer bodies: for each, whether a conditional (a ring hop's attention
  call, `lax.cond` in maxctx.attention.cp.ring) is scheduled between its start and done, i.e. overlaps it;
- the TPU compiler's own cost estimate (`estimated_cycles` in each fusion's backend config, at v5p's 1.75 GHz)
  of the forward and backward layer bodies, split into copies (layout changes) and the rest. Pallas kernels
  (splash) and collectives carry no estimate, so this is the layer's work outside attention and communication;
- temp memory per device (memory_analysis).

A second table compiles all_gather, a2a and usp again with MaxText's async collective fusion flags in
`LIBTPU_INIT_ARGS` (MAXTEXT_FLAGS: CF_FOR_ALL_GATHER and the all-reduce ones of MaxText's
benchmarks/xla_flags_library.py; maxctx sets none by default), in a subprocess since libtpu reads them once. There
a collective can become an async collective fusion (`async-collective-start` / `-done` around other ops): for each
context-parallel collective of the layer bodies (its group inside the context axis), whether it is async, and the
compiler's estimate of the compute scheduled between its start and done (what can hide it).

The ring strategies run once with the ring hops' backward through splash's own kernels
(splash_backward.hop_backward, every hop here) and p2p once more with the blockwise backward
(`splash.Blocks(ring_backward=False)`), whose fusions carry the attention backward's work in the estimate; p2p and
usp once more with the software-pipelined ring backward (`AttentionSpec(ring_backward_overlap=True)`). Neither has
a config key (docs/long_context.md: the decisions and their numbers): this benchmark sets them on the AttentionSpec
the model is built with.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.pop("JAX_PLATFORMS", None)

CLOCK_HZ = 1.75e9  # v5p TensorCore: 459 TFLOP/s bf16 = 2 cores x 4 MXUs x 128 x 128 x 2 FLOPs x 1.75 GHz
SHAPE = ["compile_topology=v5p-128", "model_name=llama2-7b", "max_target_length=32768", "ici_context_parallelism=16",
         "ici_fsdp_parallelism=4", "per_device_batch_size=1", "remat_policy=full", "attention=splash",
         "base_num_decoder_layers=2"]
USP = "context_parallel_a2a_degree=4"
OVERLAP = "ring_backward_overlap=true"  # the software-pipelined ring backward (AttentionSpec.ring_backward_overlap)
# (strategy, extra keys (OVERLAP: set on the AttentionSpec, not a config key), ring hops' backward blockwise:
# splash.Blocks(ring_backward=False), as for every hop before splash_backward.hop_backward)
RUNS = [("all_gather", [], False), ("a2a", [], False), ("p2p", [], True), ("p2p", [], False),
        ("p2p", [OVERLAP], False), ("usp", [USP], False), ("usp", [USP, OVERLAP], False)]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# MaxText's CF_FOR_ALL_GATHER and CF_FOR_ALL_REDUCE (benchmarks/xla_flags_library.py), as its launch scripts set them.
MAXTEXT_FLAGS = " ".join([
    "--xla_tpu_enable_async_collective_fusion=true", "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true", "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true", "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
    "--xla_enable_async_all_reduce=true"])
FLAG_RUNS = [("all_gather", []), ("a2a", []), ("usp", [USP])]
CONTEXT = 16  # ici_context_parallelism of SHAPE: collectives over at most this many devices are context-parallel


def computations(hlo: str) -> dict[str, list[str]]:
    out, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line).group(1)
            out[name] = []
        elif line.startswith("  ") and name:
            out[name].append(line)
    return out


def opcode(line: str) -> str:
    m = re.match(r"\s+(?:ROOT )?%[\w.\-]+ = .*?[\]})] ([a-z][a-z0-9\-]*)\(", line)
    return m.group(1) if m else ""


def cycles(comps: dict, name: str, kinds: collections.Counter, lines: list[str] | None = None) -> int:
    """Estimated cycles of one execution of computation `name` (or of `lines` of it): its ops, the costliest branch
    of a conditional, the bodies of calls, and of loops times their known trip count."""
    total = 0
    for line in comps[name] if lines is None else lines:
        op = opcode(line)
        est = re.search(r'"estimated_cycles":"(\d+)"', line)
        if est:
            total += int(est.group(1))
            kinds["copy" if op == "copy" else "other"] += int(est.group(1))
        if op == "conditional":
            names = [b.strip().lstrip("%") for b in re.search(r"branch_computations=\{([^}]*)\}", line)[1].split(",")]
            best = max(names, key=lambda b: cycles(comps, b, collections.Counter()))
            total += cycles(comps, best, kinds)
        elif op in ("while", "call"):
            n = trip_count(comps, lines_of(comps, name), line) if op == "while" else 1
            for key in ("body", "to_apply"):
                m = re.search(key + r"=%?([\w.\-]+)", line)
                if m and m.group(1) in comps:
                    inner = collections.Counter()
                    total += cycles(comps, m.group(1), inner) * n
                    for k, v in inner.items():
                        kinds[k] += v * n
    return total


def lines_of(comps: dict, name: str) -> dict[str, str]:
    return {re.match(r"\s+(?:ROOT )?%([\w.\-]+) ", x).group(1): x for x in comps[name]
            if re.match(r"\s+(?:ROOT )?%([\w.\-]+) ", x)}


def trip_count(comps: dict, defs: dict[str, str], line: str) -> int:
    """A counted loop's trips (the TPU HLO states none): the condition's `i < N` against the counter's initial
    value in the loop's operand tuple."""
    cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
    bound = next(int(m[1]) for x in comps[cond] if (m := re.search(r"s32\[\]\S* constant\((-?\d+)\)", x)))
    operand = re.search(r" while\(%([\w.\-]+)\)", line).group(1)
    first = re.search(r" tuple\(%([\w.\-]+)", defs[operand]).group(1)
    start = re.search(r"constant\((-?\d+)\)", defs[first])
    return bound - int(start[1]) if start else bound


def permutes(comps: dict) -> list[tuple[str, bool]]:
    """(shape, overlaps a conditional) for every collective-permute-start of a loop or layer body."""
    out = []
    for lines in comps.values():
        for i, line in enumerate(lines):
            if opcode(line) != "collective-permute-start":
                continue
            name = re.match(r"\s+%([\w.\-]+) ", line).group(1)
            done = next(j for j, x in enumerate(lines)
                        if re.search(rf"collective-permute-done\(%{re.escape(name)}\)", x))
            shape = re.search(r"= \(?([a-z0-9]+\[[\d,]*\])", line).group(1)
            out.append((shape, any(opcode(x) == "conditional" for x in lines[i + 1:done])))
    return out


def group_size(line: str) -> int:
    """Devices per replica group of a collective: `{{0,1,..},..}` lists, or `mesh['axis_0'=64,..] {'axis_0'}`."""
    listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", line))
    named = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line).group(1)
    return math.prod(int(sizes[a.strip().strip("'")]) for a in named.split(","))


def activations(line: str) -> bool:
    """A context-parallel collective of floating-point activations (K/V, their gradients, all-to-all's q/k/v/out)."""
    return group_size(line) <= CONTEXT and re.search(r"= \(?(bf16|f32)\[", line) is not None


def context_collectives(comps: dict) -> list[tuple[str, str, bool, int]]:
    """(layer body, kind, async, estimated cycles scheduled between start and done) for every context-parallel
    collective of activations (a group of at most CONTEXT devices, not the weights' fsdp x context; floating point,
    not the segment ids' small gathers) of the layer bodies; an async one is an async collective fusion
    (`async-collective-start.N` calls a fusion holding the collective)."""
    out = []
    for name, lines in comps.items():
        if not name.startswith("wide."):
            continue
        starts = {}
        for i, line in enumerate(lines):
            m = re.match(r"\s+%async-collective-(start|done)(\.\d+)? = ", line)
            if m and m.group(1) == "start":
                starts[m.group(2)] = i
            elif m:
                i0 = starts.pop(m.group(2))
                inner = next(x for x in comps[re.search(r"calls=%?([\w.\-]+)", lines[i0]).group(1)]
                             if opcode(x) in COLLECTIVES)
                if activations(inner):
                    between = cycles(comps, name, collections.Counter(), lines[i0 + 1:i])
                    out.append((name, opcode(inner), True, between))
            elif opcode(line) in COLLECTIVES[:4] and activations(line):
                out.append((name, opcode(line), False, 0))
            elif opcode(line) == "fusion" and not re.search(r"calls=%?async_collective_fusion", line):
                # A collective fused with its neighbours (all-reduce + dynamic-slice), synchronous.
                fused = comps[re.search(r"calls=%?([\w.\-]+)", line).group(1)]
                out += [(name, opcode(x), False, 0) for x in fused if opcode(x) in COLLECTIVES[:4] and activations(x)]
    return out


def analyse(hlo: str) -> dict:
    comps = computations(hlo)
    ops = collections.Counter(opcode(line) for lines in comps.values() for line in lines)
    kinds = {c: (ops[c], ops[c + "-start"]) for c in COLLECTIVES if ops[c] or ops[c + "-start"]}
    bodies = {}
    for name in comps:  # the layer scans' bodies: XLA names them wide.*; the backward's is the costlier
        if name.startswith("wide.") and any(opcode(x) for x in comps[name]):
            split = collections.Counter()
            total = cycles(comps, name, split)
            if total:
                bodies[name] = (total, split["copy"])
    return {"collectives": kinds, "permutes": permutes(comps), "bodies": sorted(bodies.values())}


def compile_run(strategy: str, extra: list[str], blockwise: bool = False):
    """(compiled train step, seconds) for SHAPE with this strategy, for the topology through libtpu. OVERLAP in
    `extra` and `blockwise` are set on the model's AttentionSpec (code paths without a config key)."""
    from maxctx.attention.dispatch import AttentionSpec
    from maxctx.loader import load_config
    from maxctx.mesh import create_mesh
    from maxctx.plan import topology as topo
    from maxctx.train_step import compile_train_step, make_setup

    overlap = OVERLAP in extra
    config = load_config(["configs/base.yml", *SHAPE, f"context_parallel_strategy={strategy}",
                          *(x for x in extra if x != OVERLAP)])
    mesh = create_mesh(config, topo.topology_devices(topo.parse(config.compile_topology), 1))
    original = AttentionSpec.from_config

    def spec(config):
        s = original(config)
        blocks = dataclasses.replace(s.splash_blocks, ring_backward=not blockwise)
        return dataclasses.replace(s, ring_backward_overlap=overlap, splash_blocks=blocks)

    start = time.perf_counter()
    with mock.patch.object(AttentionSpec, "from_config", spec):
        setup = make_setup(config, mesh)
    compiled = compile_train_step(setup)
    return compiled, time.perf_counter() - start


def ms(c: int) -> float:
    return c / CLOCK_HZ * 1e3


def label(strategy: str, extra: list[str]) -> str:
    return strategy + (f" ({', '.join(extra)})" if extra else "")


def main() -> None:
    print(__doc__.split("\n\n")[0].replace("\n", " "), "\n")
    print("Written by `python3 benchmarks/compiled_schedule.py > benchmarks/compiled_schedule.md` (libtpu "
          f"{_libtpu_version()}); the shape: `{' '.join(SHAPE)}`.\n")
    print("| strategy | temp GiB | collectives: synchronous / asynchronous | ring sends overlapping a hop's "
          "attention | layer body outside attention and collectives, forward / backward (TPU compiler's estimate) "
          "| of which copies | compile |")
    print("|---|---|---|---|---|---|---|")
    for strategy, extra, blockwise in RUNS:
        compiled, seconds = compile_run(strategy, extra, blockwise)
        a = analyse(compiled.as_text())
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 30
        coll = ", ".join(f"{k} {s}/{n}" for k, (s, n) in a["collectives"].items())
        sends, dkv = a["permutes"], [o for s, o in a["permutes"] if s.startswith("f32")]
        overlap = (f"{sum(o for _, o in sends)} of {len(sends)} (fp32 dK/dV: {sum(dkv)} of {len(dkv)})"
                   if sends else "-")
        fwd, bwd = a["bodies"][-2], a["bodies"][-1]  # the layer scans' bodies, the costliest two
        name = label(strategy, extra) + (", blockwise ring backward" if blockwise else "")
        print(f"| {name} | {temp:.2f} | {coll} | {overlap} | {ms(fwd[0]):.1f} / {ms(bwd[0]):.1f} ms | "
              f"{ms(fwd[1]):.1f} / {ms(bwd[1]):.1f} ms | {seconds:.0f} s |", flush=True)
    print("\nWith MaxText's async collective fusion flags (`LIBTPU_INIT_ARGS` = MAXTEXT_FLAGS): the context-parallel "
          "collectives of the two layer bodies (forward; backward with the forward's recompute), and the compute the "
          "compiler scheduled between each async one's start and done (its estimate).\n")
    print("| strategy | temp GiB | context-parallel collectives: synchronous / async | compute under the async ones, "
          "forward / backward (TPU compiler's estimate) | compile |")
    print("|---|---|---|---|---|")
    env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {MAXTEXT_FLAGS}".strip()}
    subprocess.run([sys.executable, __file__, "--flagged"], env=env, check=True)


def flagged() -> None:
    """The second table's rows; run with MAXTEXT_FLAGS in LIBTPU_INIT_ARGS."""
    for strategy, extra in FLAG_RUNS:
        compiled, seconds = compile_run(strategy, extra)
        found = context_collectives(computations(compiled.as_text()))
        counts = collections.Counter((kind, asynchronous) for _, kind, asynchronous, _ in found)
        kinds = ", ".join(f"{k} {counts[(k, False)]}/{counts[(k, True)]}" for k in COLLECTIVES
                          if counts[(k, False)] or counts[(k, True)])
        under = collections.Counter()
        for body, _, _, between in found:
            under[body] += between
        fwd, bwd = sorted(under.values())  # the backward body holds more of them
        temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 30
        print(f"| {label(strategy, extra)} | {temp:.2f} | {kinds} | {ms(fwd):.1f} / {ms(bwd):.1f} ms | "
              f"{seconds:.0f} s |", flush=True)


def _libtpu_version() -> str:
    from importlib.metadata import version

    return version("libtpu")


if __name__ == "__main__":
    flagged() if sys.argv[1:] == ["--flagged"] else main()
