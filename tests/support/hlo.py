"""Collective bytes of a compiled program, read from its HLO text (for tests and benchmarks).

Counted per device, as the strategies' docstrings count them: the result of all-gather, all-to-all and
collective-permute, the operand of reduce-scatter (all-reduce separately, by its result). A collective inside a
while loop's body (the ring's hop loop) counts once per iteration: XLA states the trip count of the loops it can
analyse (`known_trip_count` in the while's backend_config); one it cannot count raises.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)")
_COMPUTATION = re.compile(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_CALLED = re.compile(r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a shape or a tuple of shapes)."""
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def collective_bytes(hlo: str) -> Counter:
    """Bytes per collective kind in an HLO module's text (async -start ops counted once, -done ignored), each
    times the number of times its computation runs per call of the entry computation."""
    results: dict[str, str] = {}
    calls: dict[str, list[tuple[str, int | None]]] = defaultdict(list)  # computation -> (callee, times per call)
    found: list[tuple[str, str, int]] = []  # (computation, kind, bytes)
    computation, entry = "", ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("(")[0]:
            computation = header.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        match = _INSTR.match(line)
        if not match:
            continue
        name, result, op, rest = match.groups()
        results[name] = result
        callees = _CALLED.findall(rest) + [c.strip().lstrip("%") for b in _BRANCHES.findall(rest)
                                           for c in b.split(",") if c.strip()]
        calls[computation] += [(c, 1) for c in callees]
        if op == "while":
            trips = _TRIP_COUNT.search(rest)
            calls[computation] += [(b, int(trips.group(1)) if trips else None) for b in _BODY.findall(rest)]
        kind = op.removesuffix("-start")
        if kind not in COLLECTIVES or op.endswith("-done"):
            continue
        if kind == "reduce-scatter":
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            found.append((computation, kind, sum(shape_bytes(results.get(o, "")) for o in operands)))
        else:
            found.append((computation, kind, shape_bytes(result)))

    runs: Counter = Counter()  # computation -> times it runs; None-free: unknown trip counts are kept apart
    unknown: set[str] = set()

    def visit(comp: str, times: int, counted: bool) -> None:
        if counted:
            runs[comp] += times
        else:
            unknown.add(comp)
        for callee, factor in calls.get(comp, ()):
            visit(callee, times * (factor or 1), counted and factor is not None)

    visit(entry, 1, True)
    totals: Counter = Counter()
    for comp, kind, size in found:
        if comp in unknown:
            raise ValueError(f"{kind} in computation {comp} runs in a while loop without a known trip count")
        totals[kind] += runs[comp] * size
    return totals
