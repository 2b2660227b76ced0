"""Collective bytes of a compiled program, read from its HLO text (for tests and benchmarks): maxctx.plan.program's
count (its docstring says how), refusing a collective inside a loop whose trip count cannot be read."""

from __future__ import annotations

from collections import Counter

from maxctx.plan.program import COLLECTIVES, Program, shape_bytes  # noqa: F401 (re-exported)


def collective_bytes(hlo: str) -> Counter:
    """Bytes per collective kind per call of the entry computation."""
    program = Program(hlo)
    for ins, _ in program.instructions():
        kind = ins.op.removesuffix("-start")
        if kind in COLLECTIVES and ins.computation in program.under_uncounted_loop:
            raise ValueError(f"{kind} in computation {ins.computation} runs in a while loop without a known trip "
                             f"count")
    return Counter({k: int(v) if float(v).is_integer() else v for k, v in program.collective_bytes().items()})
