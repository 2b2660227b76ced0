"""What a compiled step does, read from its optimized HLO text (`jax.stages.Compiled.as_text()`), per device and
per step: the time model's inputs wherever the program gives them (maxctx.plan.step_time), reported by
`python -m maxctx.compile`.

Every count weighs an instruction by how often its computation runs per step: a while loop's body times its trip
count (XLA's `known_trip_count`, or, in TPU programs that state none, the bound its condition compares the
counter with, less the counter's constant start), a fusion's or call's computation as often as its caller, and
the branches of a conditional 1 / (their number) each per call (one runs, chosen by data: a device's own kernel;
their average stands for it), leaving out branches that run no matmul, kernel or collective (a skipped ring hop,
which the load-balanced ring never takes). A loop whose trips cannot be read counts once and is listed in
`uncounted_loops`.

- attention forwards per layer: executions of the attention forward kernel (Pallas: a `tpu_custom_call` whose
  kernel is a forward, splash's `splash_mqa_fwd*`; blockwise: the matmuls of the computations holding ops of
  maxctx.attention.kernels.flash's `attention_forward` scope, since a fused matmul may carry no op_name) over those in
  the forward pass (op_name outside autodiff's `transpose(...)`): 1 when the backward reuses the forward's
  outputs, 2 when it recomputes them (remat). The ratio holds with the layer scan rolled or unrolled, and with a
  ring's conditional hops, since both passes run the same structure.
- host transfers: bytes moved between HBM and pinned host memory (memory space S(5)): a copy, dynamic-slice or
  dynamic-update-slice (or its async -start) whose operand is on the host and result on the device (to device),
  or the reverse (to host, the device operand's bytes).
- collective bytes per kind, counted as the strategies' docstrings count them: the result of all-gather,
  all-to-all and collective-permute, the operand of reduce-scatter, all-reduce by its result; a ragged all-to-all
  (expert parallelism's dispatch) by the smaller of its operand and output, what a device sends when balanced.
- executed FLOPs: 2 x result x contraction of every dot, plus the Pallas kernels' own from the block tables
  maxctx.attention.kernels.splash states in each call's scope (`pallas_macs=N`: query-key products of the visited
  blocks, times the head dim) x the kernel's matmuls (forward 2: QK and PV; dQ 3; dK/dV 4; the fused backward 5),
  2 FLOPs per product. XLA's own cost analysis (reported beside) leaves out custom calls and, for a loop, its trips.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

from maxctx.attention.kernels.scopes import ATTENTION_FORWARD_SCOPE, PALLAS_MACS_SCOPE

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce", "ragged-all-to-all")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
          "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)", re.S)
_COMPUTATION = re.compile(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_TRUE_FALSE = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# replica groups of one device each (shard_map's transposes sum over mesh axes of size 1): nothing moves
_ALONE = re.compile(r"replica_groups=(\{(\{\d+\},?)+\}|\[\d+,1\]<=)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")


def _alone(rest: str) -> bool:
    """Whether a collective's replica groups are one device each, in either of XLA's ways of writing them."""
    if _ALONE.search(rest):
        return True
    m = _MESH_GROUPS.search(rest)
    if m is None:
        return False
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes.get(a, 0)) for a in re.findall(r"'([^']+)'", m.group(2))) == 1
HOST = "S(5)"  # TPU's memory space of pinned host memory in a layout
# Matmuls per query-key product of each splash kernel (module doc).
_KERNEL_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "fused": 5}


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a shape or a tuple of shapes)."""
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims, _ in _SHAPE.findall(text))


def _device_bytes(text: str) -> int:
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims, layout in _SHAPE.findall(text) if HOST not in (layout or "") and dims)


class Instruction:
    __slots__ = ("name", "result", "op", "rest", "computation")

    def __init__(self, name: str, result: str, op: str, rest: str, computation: str):
        self.name, self.result, self.op, self.rest, self.computation = name, result, op, rest, computation

    @property
    def operands(self) -> list[str]:
        depth, out = 0, []
        for i, ch in enumerate(self.rest):
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    return re.findall(r"%([\w.\-]+)", self.rest[:i])
                depth -= 1
        return out

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ""


def _logical_lines(hlo: str) -> list[str]:
    """The text's lines with an instruction's continuation lines (Pallas kernels' metadata) joined to it."""
    lines: list[str] = []
    for line in hlo.splitlines():
        new = (not lines or re.match(r"\s+(ROOT )?%", line) or line.startswith(("ENTRY", "HloModule"))
               or line.rstrip() == "}" or _COMPUTATION.match(line) or not line.strip())
        if new:
            lines.append(line)
        else:
            lines[-1] += "\n" + line
    return lines


class Program:
    """A compiled program's instructions and how many times each computation runs per step (module doc)."""

    def __init__(self, hlo: str):
        self.computations: dict[str, list[Instruction]] = defaultdict(list)
        self.defs: dict[str, Instruction] = {}
        self.entry, computation = "", ""
        for line in _logical_lines(hlo):
            header = _COMPUTATION.match(line)
            if header and " = " not in line.split("(")[0]:
                computation = header.group(1)
                self.entry = computation if line.startswith("ENTRY") else self.entry
                continue
            match = _INSTR.match(line)
            if match and computation:
                ins = Instruction(*match.groups(), computation)
                self.computations[computation].append(ins)
                self.defs[ins.name] = ins
        self.uncounted_loops: list[str] = []
        self.under_uncounted_loop: set[str] = set()  # computations inside a loop of unknown trips
        self.runs = self._runs()

    def _trips(self, loop: Instruction) -> int | None:
        known = _TRIP_COUNT.search(loop.rest)
        if known:
            return int(known.group(1))
        cond = _CONDITION.search(loop.rest)
        root = next((i for i in self.computations.get(cond.group(1), []) if i.op == "compare"), None) if cond else None
        if root is None or "direction=LT" not in root.rest:
            return None
        bound = [self.defs.get(o) for o in root.operands]
        if len(bound) != 2 or bound[1] is None or bound[1].op != "constant":
            return None
        counter = self.defs.get(root.operands[0])
        index = re.search(r"index=(\d+)", counter.rest) if counter is not None else None
        start = self._tuple_element(loop.operands[0], int(index[1]) if index else 0)
        return int(re.match(r"(-?\d+)", bound[1].rest)[1]) - start

    def _tuple_element(self, tuple_name: str, index: int) -> int:
        """The constant start of a loop's counter (0 when it is not a constant)."""
        tup = self.defs.get(tuple_name)
        if tup is None or tup.op != "tuple" or index >= len(tup.operands):
            return 0
        ins = self.defs.get(tup.operands[index])
        while ins is not None and ins.op in ("copy", "bitcast"):
            ins = self.defs.get(ins.operands[0])
        return int(re.match(r"(-?\d+)", ins.rest)[1]) if ins is not None and ins.op == "constant" else 0

    def _works(self, comp: str, seen: frozenset = frozenset()) -> bool:
        """Whether a computation (or one it calls) runs a matmul, a custom call (a kernel) or a collective: a
        conditional's branch that does not (a skipped ring hop) is left out of its average."""
        for ins in self.computations.get(comp, ()):
            if ins.op in ("dot", "convolution", "custom-call") or ins.op.removesuffix("-start") in COLLECTIVES:
                return True
            callees = _CALLED.findall(ins.rest) + _BODY.findall(ins.rest) + _TRUE_FALSE.findall(ins.rest) + [
                c.strip().lstrip("%") for b in _BRANCHES.findall(ins.rest) for c in b.split(",") if c.strip()]
            if any(c not in seen and self._works(c, seen | {comp}) for c in callees):
                return True
        return False

    def _runs(self) -> Counter:
        calls: dict[str, list[tuple[str, float, str]]] = defaultdict(list)  # callee, times per call, its loop
        for comp, instructions in self.computations.items():
            for ins in instructions:
                branches = [c.strip().lstrip("%") for b in _BRANCHES.findall(ins.rest) for c in b.split(",")
                            if c.strip()] + _TRUE_FALSE.findall(ins.rest)
                working = [c for c in branches if self._works(c)] or branches
                calls[comp] += [(c, 1, "") for c in _CALLED.findall(ins.rest)] + [(c, 1 / len(working), "")
                                                                                 for c in working]
                if ins.op == "while":
                    trips = self._trips(ins)
                    if trips is None:
                        self.uncounted_loops.append(ins.name)
                    calls[comp] += [(b, 1 if trips is None else trips, ins.name) for b in _BODY.findall(ins.rest)]
        runs: Counter = Counter()
        uncounted = set(self.uncounted_loops)

        def visit(comp: str, times: float, counted: bool) -> None:
            runs[comp] += times
            if not counted:
                self.under_uncounted_loop.add(comp)
            for callee, factor, loop in calls.get(comp, ()):
                visit(callee, times * factor, counted and loop not in uncounted)

        visit(self.entry, 1, True)
        return runs

    def instructions(self):
        """(instruction, times it runs per step) for every instruction reached from the entry."""
        for comp, instructions in self.computations.items():
            times = self.runs.get(comp, 0)
            if times:
                for ins in instructions:
                    yield ins, times

    def attention_forwards(self) -> tuple[float, float]:
        """(attention forward kernels run per step, of which in the forward pass); module doc. Blockwise: the
        matmuls (alone or in a fusion) of every computation holding ops of its forward's scope (a fusion's own
        instruction may carry no op_name: CPU's), in the forward pass unless those ops are autodiff's."""
        total = forward = 0.0
        for comp, instructions in self.computations.items():
            times = self.runs.get(comp, 0)
            kernels = [i for i in instructions if 'custom_call_target="tpu_custom_call"' in i.rest
                       and _kernel_kind(i) == "fwd"]
            for ins in kernels:
                total += times
                forward += times * ("transpose(" not in ins.op_name)
            scoped = [i.op_name for i in instructions if ATTENTION_FORWARD_SCOPE in i.op_name]
            if scoped and times:
                n = sum(self._matmul(i) for i in instructions)
                total += times * n
                forward += times * n * (not any("transpose(" in name for name in scoped))
        return total, forward

    def _matmul(self, ins: Instruction) -> bool:
        if ins.op in ("dot", "convolution"):
            return True
        fused = _CALLED.search(ins.rest) if ins.op == "fusion" else None
        return fused is not None and any(i.op in ("dot", "convolution") for i in self.computations.get(fused[1], ()))

    def host_transfer_bytes(self) -> tuple[int, int]:
        """(host-to-device, device-to-host) bytes per step (module doc)."""
        to_device = to_host = 0
        for ins, times in self.instructions():
            op = ins.op.removesuffix("-start")
            if op not in ("copy", "dynamic-slice", "dynamic-update-slice") or not ins.operands:
                continue
            source = self.defs.get(ins.operands[0])
            on_host = source is not None and HOST in source.result
            if op == "dynamic-update-slice":
                update = self.defs.get(ins.operands[1]) if len(ins.operands) > 1 else None
                if on_host and update is not None and HOST not in update.result:
                    to_host += times * _device_bytes(update.result)
            elif on_host:
                to_device += times * shape_bytes(_output(ins).replace(HOST, "")) * (HOST not in _output(ins))
            elif source is not None and HOST in _output(ins):
                to_host += times * _device_bytes(source.result)
        return to_device, to_host

    def collective_bytes(self) -> Counter:
        """Bytes per collective kind per step (async -start counted once, -done ignored, groups of one device
        left out; module doc)."""
        totals: Counter = Counter()
        for ins, times in self.instructions():
            kind = ins.op.removesuffix("-start")
            if kind not in COLLECTIVES or ins.op.endswith("-done") or _alone(ins.rest):
                continue
            if kind == "reduce-scatter":
                size = sum(shape_bytes(self.defs[o].result) for o in ins.operands if o in self.defs)
            elif kind == "ragged-all-to-all":  # what one device sends when balanced (maxctx.model.moe.experts)
                operand = self.defs.get(ins.operands[0]) if ins.operands else None
                size = min(shape_bytes(ins.result), shape_bytes(operand.result)) if operand else shape_bytes(ins.result)
            elif ins.op.endswith("-start") and kind == "collective-permute":
                size = shape_bytes(_output(ins))
            else:
                size = shape_bytes(ins.result if not ins.op.endswith("-start") else _output(ins))
            totals[kind] += times * size
        return totals

    def dot_flops(self) -> float:
        """2 x result elements x contracted size, over every dot and convolution (TPU programs write matmuls as
        convolutions) run per step."""
        total = 0.0
        for ins, times in self.instructions():
            if ins.op in ("dot", "convolution"):
                out = _SHAPE.search(ins.result)
                contracted = self._contracted(ins)
                if out is not None and contracted:
                    total += times * 2.0 * math.prod(int(d) for d in out.group(2).split(",") if d) * contracted
        return total

    def _contracted(self, ins: Instruction) -> int:
        """A dot's contracted size; a convolution's input features x the window positions each output sums (a
        window padded by its size - 1 and reversed is XLA's way of writing a batch dimension: one position)."""
        side, labels = (0, None) if ins.op == "dot" else (1, re.search(r"dim_labels=(\w+)_(\w+)->", ins.rest))
        operand = self.defs.get(ins.operands[side]) if len(ins.operands) > side else None
        shape = _SHAPE.search(operand.result) if operand is not None else None
        if shape is None:
            return 0
        sizes = [int(d) for d in shape.group(2).split(",") if d]
        if ins.op == "dot":
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
            return math.prod(sizes[int(d)] for d in dims.group(1).split(",") if d) if dims else 0
        if labels is None or len(labels.group(2)) != len(sizes):
            return 0
        window = re.search(r"window=\{([^}]*)\}", ins.rest)
        spatial = 1
        if window:
            win = window.group(1)
            sizes_w = [int(x) for x in re.search(r"size=([\dx]+)", win).group(1).split("x")]
            pads = re.search(r"pad=([\d_x\-]+)", win)
            pads = pads.group(1).split("x") if pads else ["0_0"] * len(sizes_w)
            batch = "rhs_reversal=1" in win
            spatial = math.prod(1 if batch and pad == f"{w - 1}_{w - 1}" else w for w, pad in zip(sizes_w, pads))
        return sizes[labels.group(2).index("i")] * spatial

    def pallas_flops(self) -> tuple[float, int]:
        """(FLOPs the Pallas kernels run per step from their scopes' block counts, kernels run without one)."""
        total, unknown = 0.0, 0
        for ins, times in self.instructions():
            if 'custom_call_target="tpu_custom_call"' not in ins.rest:
                continue
            macs = re.search(PALLAS_MACS_SCOPE + r"(\d+)", ins.op_name)
            kind = _kernel_kind(ins)
            if macs is None or kind is None:
                unknown += times
                continue
            total += times * 2.0 * _KERNEL_MATMULS[kind] * int(macs.group(1))
        return total, unknown


def _output(ins: Instruction) -> str:
    """The result an async -start produces (the element after its operands' tuple, or after its one operand: a
    collective-permute-start's (operand, output, u32[], u32[])), else the instruction's result."""
    if not ins.op.endswith("-start") or not ins.result.startswith("("):
        return ins.result
    if not ins.result.startswith("(("):
        parts = _top_level(ins.result[1:-1])
        return parts[1] if len(parts) > 1 else ins.result
    depth = 0
    for i, ch in enumerate(ins.result[1:], 1):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return ins.result[i + 1:].lstrip(", ").split(", ")[0]
    return ins.result


def _top_level(text: str) -> list[str]:
    """The comma-separated elements of a tuple's inside, nested tuples and layouts kept whole."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def _kernel_kind(ins: Instruction) -> str | None:
    name = ins.name + " " + ins.op_name.rsplit("/", 2)[-2] if "/" in ins.op_name else ins.name
    if "_fwd" in name:
        return "fwd"
    if "_dkv" in name:
        return "fused" if '\\"use_fused_bwd_kernel\\": true' in ins.rest else "dkv"
    return "dq" if "_dq" in name else None




def read(compiled, num_layers: int) -> dict:
    """The program's counts (module doc) as the compile report's fields."""
    program = Program(compiled.as_text())
    total, forward = program.attention_forwards()
    to_device, to_host = program.host_transfer_bytes()
    pallas, unknown = program.pallas_flops()
    dots = program.dot_flops()
    return {"attention_forwards_per_layer": total / forward if forward else None,
            "attention_forward_calls": total, "host_to_device_bytes": to_device, "device_to_host_bytes": to_host,
            "collective_bytes": dict(program.collective_bytes()), "executed_dot_flops": dots,
            "executed_pallas_flops": pallas, "executed_flops": dots + pallas, "pallas_calls_uncounted": unknown,
            "uncounted_loops": len(program.uncounted_loops), "num_layers": num_layers}
