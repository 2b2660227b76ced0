"""Collective bytes of a compiled program, read from its HLO text (for tests and benchmarks).

Counted per device, as the strategies' docstrings count them: the result of all-gather, all-to-all and
collective-permute, the operand of reduce-scatter (all-reduce separately, by its result).
"""

from __future__ import annotations

import math
import re
from collections import Counter

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a shape or a tuple of shapes)."""
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def collective_bytes(hlo: str) -> Counter:
    """Bytes per collective kind in an HLO module's text (async -start ops counted once, -done ignored)."""
    results: dict[str, str] = {}
    totals: Counter = Counter()
    for line in hlo.splitlines():
        match = _INSTR.match(line)
        if not match:
            continue
        name, result, op, rest = match.groups()
        results[name] = result
        kind = op.removesuffix("-start")
        if kind not in COLLECTIVES or op.endswith("-done"):
            continue
        if kind == "reduce-scatter":
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            totals[kind] += sum(shape_bytes(results.get(o, "")) for o in operands)
        else:
            totals[kind] += shape_bytes(result)
    return totals
