"""What a compiled program holds in device memory at its peak, read from XLA's dumps: which buffers are live at
the moment the temporaries are largest, with their shapes and the JAX operations that made them.

    XLA_FLAGS=--xla_dump_to=/tmp/dump python -m maxctx.compile configs/base.yml compile_topology=v5p-128 ...
    python3 benchmarks/peak_buffers.py /tmp/dump [--module train_step] [--top 40]

XLA (libtpu too) writes, per module, the buffer assignment (`*after_optimizations-buffer-assignment.txt`: every
value's allocation, offset and size), the live ranges (`*after_optimizations-live-range.txt`: each value's first
and last position in the flattened schedule) and the optimised HLO (`*after_optimizations.txt`, whose metadata
names the JAX operation). The memory-usage report beside them lists the temporary allocation's slots by offset,
not by time, so it cannot tell what coexists. Here the temporary allocation's bytes in use at each schedule
position are the union of the live values' [offset, offset + size) (values sharing a slot, as a loop's carried
buffers do, count once), and the values live at the largest are grouped by what made them.

Used to find where the planner's HBM estimate (maxctx.plan.memory) misses what the compiler keeps: issue 45's
HBM-within-5% item. Prints text; no JAX needed.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re

VALUE = re.compile(r"^ value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):$")
LIVE = re.compile(r"^    (\S+?)(\{[\d,]*\}):(\d+)-(\d+)$")
OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"")


def _module_file(dump: str, module: str, suffix: str) -> str:
    """The largest dump file ending in `suffix` of a module whose name contains `module`."""
    files = [f for f in glob.glob(os.path.join(dump, f"*{suffix}")) if module in os.path.basename(f)]
    if not files:
        raise SystemExit(f"no *{suffix} for a module matching {module!r} in {dump}: compile with "
                         f"XLA_FLAGS=--xla_dump_to={dump}")
    return max(files, key=os.path.getsize)


def temp_values(path: str) -> tuple[int, list[tuple[str, int, int, str]]]:
    """(size, [(value, size, offset, shape)]) of the largest preallocated-temp allocation in HBM (no color)."""
    allocations, values = [], None  # (size, values) of each such allocation; the current one's values
    with open(path) as f:
        for line in f:
            m = ALLOCATION.match(line)
            if m:
                temp = "preallocated-temp" in m.group(3) and "color" not in m.group(3)
                values = [] if temp else None
                if temp:
                    allocations.append((int(m.group(2)), values))
                continue
            v = VALUE.match(line)
            if v and values is not None:
                values.append((v.group(1), int(v.group(2)), int(v.group(3)), v.group(4)))
    return max(allocations, key=lambda a: a[0], default=(0, []))


def live_ranges(path: str) -> dict[str, tuple[int, int]]:
    """value name (with its tuple index when not {}) -> (first, last) schedule position."""
    ranges = {}
    with open(path) as f:
        for line in f:
            m = LIVE.match(line)
            if m:
                name = m.group(1) + ("" if m.group(2) == "{}" else m.group(2))
                ranges[name] = (int(m.group(3)), int(m.group(4)))
    return ranges


def op_names(path: str) -> dict[str, str]:
    """instruction -> the JAX operation in its metadata."""
    names = {}
    with open(path) as f:
        for line in f:
            m = OP_NAME.match(line)
            if m:
                names[m.group(1)] = m.group(2)
    return names


def in_use(live: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of [offset, offset + size) intervals."""
    total, end = 0, -1
    for start, stop in sorted(live):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def peak(values, ranges) -> tuple[int, int, list]:
    """(position, bytes in use, the values live there) at the schedule position where most bytes are in use (a
    value's first position is where the bytes in use can grow)."""
    spans = [(ranges[v[0]], v) for v in values if v[0] in ranges]
    best = (0, -1, [])
    for t in sorted({first for (first, _), _ in spans}):
        live = [v for (a, b), v in spans if a <= t <= b]
        used = in_use([(v[2], v[2] + v[1]) for v in live])
        if used > best[1]:
            best = (t, used, live)
    return best


def _source(op: str) -> str:
    """An op_name shortened to what tells layers apart: its last few path parts without jit/jvp wrappers."""
    parts = [p for p in op.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose(", "checkpoint"))]
    return "/".join(parts[-4:]) or op


def report(dump: str, module: str, top: int) -> list[str]:
    ba = _module_file(dump, module, "after_optimizations-buffer-assignment.txt")
    prefix = ba[:-len("-buffer-assignment.txt")]  # the same module's other files
    size, values = temp_values(ba)
    ranges = live_ranges(prefix + "-live-range.txt")
    ops = op_names(prefix + ".txt")
    t, used, live = peak(values, ranges)
    lines = [f"module: {os.path.basename(ba).split('.after_')[0]}",
             f"temporary allocation: {size / 2**30:.3f} GiB; most in use at schedule position {t}: "
             f"{used / 2**30:.3f} GiB ({used:,} bytes) in {len(live)} values", "",
             "| GiB | values | shape | made by |", "|---:|---:|---|---|"]
    groups = collections.defaultdict(lambda: [0, 0])
    for name, nbytes, _, shape in live:
        key = (shape.split("{")[0], _source(ops.get(name.split("{")[0], name)))
        groups[key][0] += nbytes
        groups[key][1] += 1
    for (shape, src), (nbytes, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {nbytes / 2**30:.3f} | {count} | {shape} | {src} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", help="the --xla_dump_to directory")
    parser.add_argument("--module", default="", help="part of the module's name (default: the largest module)")
    parser.add_argument("--top", type=int, default=40, help="groups to list")
    args = parser.parse_args()
    print("\n".join(report(args.dump, args.module, args.top)))


if __name__ == "__main__":
    main()
