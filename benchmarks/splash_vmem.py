"""Splash's VMEM per pass: maxctx.plan.vmem's window formula against libtpu's own allocation list.

Each probe compiles one layer of the record model's attention (16 query and 4 kv heads of head_dim D, 32K tokens,
v5p-8) with splash at the given blocks, for v5p with libtpu on this CPU machine (`python -m maxctx.compile`), with
partial blocks computed in the kernel (today's default for these calls) or loaded ("stored", splash_masks'
COMPUTED_RUNS set to 0 for the probe). Where a kernel overflows the chip's VMEM, libtpu lists its allocations: the
windows (block spec buffers, double-buffered) are compared with the formula, the rest (spill slots, temporaries)
is shown as it is. Run: `python3 benchmarks/splash_vmem.py > benchmarks/splash_vmem.md` (about a minute per
probe on the 2-core VM).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

PROBE = ("configs/base.yml", "compile_topology=v5p-8", "attention=splash", "base_num_decoder_layers=1",
         "base_emb_dim=1024", "base_num_query_heads=16", "base_num_kv_heads=4", "base_mlp_dim=2048",
         "vocab_size=1024", "max_target_length=32768", "per_device_batch_size=1")
MIB = 2 ** 20
# (label, head_dim, forward blocks, dK/dV blocks, dQ blocks, stored masks)
CASES = [("fwd 2048, loaded mask", 256, 2048, 2048, 2048, True),
         ("fwd 2048, computed mask", 256, 2048, 2048, 2048, False),
         ("fwd 1024, loaded mask", 256, 1024, 1024, 1024, True),
         ("fwd 4096, computed mask", 256, 4096, 1024, 1024, False),
         ("fwd 4096, computed mask, D 128", 128, 4096, 1024, 1024, False),
         ("dK/dV 4096, computed mask", 256, 1024, 4096, 1024, False),
         ("dQ 4096, computed mask", 256, 1024, 1024, 4096, False)]


def probe_argv(head_dim: int, fwd: int, dkv: int, dq: int) -> list[str]:
    return [*PROBE, f"head_dim={head_dim}", f"flash_block_q={fwd}", f"flash_block_kv={fwd}",
            f"flash_block_q_dkv={dkv}", f"flash_block_kv_dkv={dkv}", f"flash_block_q_dq={dq}",
            f"flash_block_kv_dq={dq}"]


def one(argv: list[str], stored: bool) -> None:
    """In a child process: the compile, with loaded partial blocks if `stored`."""
    from maxctx import compile as compile_module
    from maxctx.attention.kernels import splash_masks

    if stored:
        splash_masks.COMPUTED_RUNS = 0
    sys.exit(compile_module.main(argv))


def allocations(text: str) -> list[tuple[float, str]]:
    """libtpu's listed VMEM allocations: (MiB, what) with what = 'window <shape> (N buffers)' or the label."""
    out = []
    for entry in re.split(r"\n\s*\d+\. Size: ", text)[1:]:
        size = re.match(r"([\d.]+)([KMG])", entry)
        mib = float(size[1]) * {"K": 1 / 1024, "M": 1, "G": 1024}[size[2]]
        window = re.search(r"Tag: (input|output) window allocation for operator (\w+ \d+)\. The window shape is "
                           r"(\S+),.*?(\d+) buffering levels", entry)
        label = re.search(r"XLA label: ([^\n]+)", entry)
        out.append((mib, f"{window[2]} {window[3]}" if window else (label[1] if label else "?")))
    return out


def row(label: str, head_dim: int, fwd: int, dkv: int, dq: int, stored: bool) -> str:
    from maxctx.plan.vmem import window_bytes

    proc = subprocess.run([sys.executable, __file__, "--one", str(int(stored)), *probe_argv(head_dim, fwd, dkv, dq)],
                          capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    formula = {p: window_bytes(p, b, b, head_dim, stored) / MIB for p, b in (("fwd", fwd), ("dkv", dkv), ("dq", dq))}
    cells = " / ".join(f"{formula[p]:.2f}" for p in ("fwd", "dkv", "dq"))
    if proc.returncode == 0:
        return f"| {label} | {cells} | compiles, {report['total_size_in_bytes'] / 2 ** 30:.2f} GiB HBM | - | - | - |"
    op = report.get("xla_overflow_op", "?")
    if report.get("xla_overflow_limit") != "capacity":
        return f"| {label} | {cells} | does not compile: {report.get('xla_error', proc.stderr[-300:])[:200]} | | | |"
    listed = allocations(report["xla_error_text"])
    windows = sum(mib for mib, what in listed if what.startswith(("input", "output")))
    rest = "; ".join(f"{mib:.2f} {what[:60]}" for mib, what in listed if not what.startswith(("input", "output")))
    kernel_pass = "dkv" if "dkv" in op else "dq" if "dq" in op else "fwd"
    used = report["xla_overflow_need_bytes"] / MIB
    return (f"| {label} | {cells} | {op}: uses {used:.2f} MiB of {report['xla_overflow_limit_bytes'] / MIB:.2f} | "
            f"{windows:.3f} (formula {formula[kernel_pass]:.3f}) | {rest} | {len(listed)} listed |")


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[3:], sys.argv[2] == "1")
        return
    import jax

    print("# Splash's VMEM per pass: the window formula against libtpu\n")
    print(f"Written by `python3 benchmarks/splash_vmem.py > benchmarks/splash_vmem.md` (jax {jax.__version__}); "
          f"the probe: `python -m maxctx.compile {' '.join(PROBE)} head_dim=D flash_block_*=B`. Formula: "
          "maxctx.plan.vmem.window_bytes per pass (forward / dK/dV / dQ), MiB, double-buffered windows only. "
          "Where a kernel overflows the chip, libtpu's allocation list: its windows summed, and the rest "
          "(spill slots, temporaries) as listed.\n")
    print("| probe | formula fwd / dkv / dq (MiB) | compile | listed windows (MiB) | other allocations | entries |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        print(row(*case), flush=True)


if __name__ == "__main__":
    main()
