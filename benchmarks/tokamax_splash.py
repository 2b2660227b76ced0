"""maxctx's splash (JAX's Pallas kernel) against tokamax's (use_tokamax_splash=true), compiled for a TPU topology on
this CPU machine: memory and the compiler's cost, side by side, at blocks of 512, 1024 and 2048.

Each probe is `python -m maxctx.compile` of one decoder layer (the record model's attention: 16 query and 4 kv
heads of head_dim 256) at 32K tokens, one sequence over a v5p-8 ring (p2p, C = 4: every ring hop runs the kernel's
forward with its lse, and its backward from the merged out and lse), flash_block_q/kv (and the backward's blocks,
derived) = B. maxctx's splash runs its separate dQ and dK/dV kernels (splash_fused_backward=false, the default),
tokamax its fused one (its only backward). Figures are the compiled program's: memory_analysis per device, the
TPU compiler's cost analysis (XLA FLOPs, Pallas kernels at their own cost estimates), the FLOPs of the blocks the
kernels visit (maxctx.plan.program, from each call's tables), and maxctx's step-time estimate (a model, not a
measurement). No number here was measured on a TPU.

Run: `PYTHONPATH=.:<tokamax site> python3 benchmarks/tokamax_splash.py > benchmarks/tokamax_splash.md` (about
70 s per probe on the 2-core VM); needs libtpu and tokamax (pip install maxctx[tokamax]).
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = ("configs/base.yml", "compile_topology=v5p-8", "attention=splash", "base_num_decoder_layers=1",
         "base_emb_dim=1024", "base_num_query_heads=16", "base_num_kv_heads=4", "head_dim=256", "base_mlp_dim=2048",
         "vocab_size=1024", "max_target_length=32768", "per_device_batch_size=0.25", "ici_fsdp_parallelism=1",
         "ici_context_parallelism=4", "context_parallel_strategy=p2p")
BLOCKS = (512, 1024, 2048)
GIB = 2 ** 30


def probe_argv(block: int, tokamax: bool) -> list[str]:
    return [*PROBE, f"flash_block_q={block}", f"flash_block_kv={block}", f"use_tokamax_splash={str(tokamax).lower()}"]


def row(block: int, tokamax: bool) -> str:
    proc = subprocess.run([sys.executable, "-m", "maxctx.compile", *probe_argv(block, tokamax)], capture_output=True,
                          text=True, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    kernel = "tokamax" if tokamax else "maxctx splash"
    if "total_size_in_bytes" not in report:
        why = report.get("xla_error") or (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"| {kernel} | {block} | does not compile: {why[:200]} | | | | | |"
    cells = [report["total_size_in_bytes"] / GIB, report["temp_size_in_bytes"] / GIB,
             report["xla_flops_per_device"] / 1e12, report["executed_pallas_flops"] / 1e12]
    return (f"| {kernel} | {block} | " + " | ".join(f"{c:.3f}" for c in cells)
            + f" | {report['estimate_step_time_s'] * 1e3:.1f} | {report['compile_time_s']:.0f} |")


def main() -> None:
    import jax

    from maxctx.attention.kernels import tokamax_splash

    if not tokamax_splash.installed():
        sys.exit("tokamax is not installed: pip install maxctx[tokamax]")
    from importlib.metadata import version

    print("# maxctx's splash and tokamax's, compiled for v5p-8\n")
    print(f"Written by `python3 benchmarks/tokamax_splash.py > benchmarks/tokamax_splash.md` (jax {jax.__version__}, "
          f"tokamax {version('tokamax')}, libtpu {version('libtpu')}); each row is `python -m maxctx.compile "
          f"{' '.join(PROBE)} flash_block_q=B flash_block_kv=B use_tokamax_splash=true|false`. Per device: memory "
          "from memory_analysis (GiB), the TPU compiler's cost analysis (XLA TFLOP, Pallas kernels at their own "
          "estimates), the TFLOP of the blocks the kernels' tables visit (maxctx.plan.program), maxctx's step-time "
          "estimate (a model, ms) and the compile time (s, this VM).\n")
    print("| kernel | block | total GiB | temp GiB | XLA cost TFLOP | visited-block TFLOP | est. step ms | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for block in BLOCKS:
        for tokamax in (False, True):
            print(row(block, tokamax), flush=True)


if __name__ == "__main__":
    main()
