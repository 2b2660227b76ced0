"""Host time and size of the splash kernels of one ring (p2p or usp) at long context, as the train step builds them.

    python benchmarks/ring_splash_tables.py [--seq 16777216] [--context 64] [--a2a 8] [--group 4] [--block 512]

A ring of R = C / U hops over blocks of S / R tokens (usp: U = --a2a; p2p: --a2a 1). Splash keeps one block table
per call in on-chip SMEM, so a hop whose table passes splash.MAX_TABLE_ENTRIES runs over row chunks; for ring hops
they are one kernel looped over the chunks with each chunk's tables as data (splash.RowLoop). Prints the seconds to
build every distinct hop kernel (maxctx.attention.kernels.local, the same call the model makes), and per kernel the
chunks, the distinct chunk tables and, per pass (forward, dQ, dK/dV), their MiB (these become
constants of the compiled program). No TPU needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2 ** 24)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--a2a", type=int, default=8, help="usp's A2A degree U (1: p2p)")
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head on a device (llama3-8b: 4)")
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args()

    from maxctx.attention.cp.load_balance import stored_order
    from maxctx.attention.kernels import splash
    from maxctx.attention.kernels.local import make_local

    ring = args.context // args.a2a
    order = stored_order(args.seq, args.context, True)
    start = time.perf_counter()
    local = make_local("splash", args.block, args.block, order=order, q_shards=ring, kv_blocks=ring,
                       group=args.group, ring=True)
    seconds = time.perf_counter() - start
    print(f"S={args.seq:,} C={args.context} U={args.a2a} R={ring}: ring blocks of {args.seq // ring:,} tokens, "
          f"{len(local.splash_kernels)} distinct hop kernels built in {seconds:.1f} s")
    for i, kernel in enumerate(local.splash_kernels):
        if isinstance(kernel, splash.RowLoop):
            passes = []
            for name, info in kernel.infos.items():  # forward, dQ, dK/dV
                mib = sum(np.asarray(t).nbytes for t in (info.data_next, info.mask_next, info.block_mask)
                          if t is not None) / 2 ** 20
                blocks = 0 if info.partial_mask_blocks is None else len(info.partial_mask_blocks)
                passes.append(f"{name.split('_')[0]} {mib:.2f} MiB + {blocks} partial blocks")
            print(f"  kernel {i}: one kernel looped over {kernel.chunks} row chunks of {kernel.rows:,} queries, "
                  f"{int(np.max(kernel.index)) + 1} distinct chunk tables; {', '.join(passes)}")
        else:
            print(f"  kernel {i}: {len(kernel)} call(s) of {kernel[0][1] - kernel[0][0]:,} queries")


if __name__ == "__main__":
    main()
