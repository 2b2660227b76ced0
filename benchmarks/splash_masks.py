"""Host time to build one splash kernel's block tables (mask info) for an all_gather device at long context.

    python benchmarks/splash_masks.py [--seq 262144] [--context 16] [--group 4] [--block 512]

Splash walks its mask block by block on the host when a kernel is made (forward, dQ and dK/dV tables), once per
distinct mask: all_gather under zig-zag has C of them per layer trace. maxctx's mask answers a block that is all
visible or all hidden from the block's cached index range (maxctx/attention/kernels/splash_masks.py); the
baseline answers every block with the elementwise comparison, as the mask did before. Both run side by side in
this process, with splash's mask cache cleared before each; prints seconds per kernel and the ratio. No TPU needed.
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
    parser.add_argument("--seq", type=int, default=262144)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head (llama3-8b: 4)")
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args()

    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
        splash_attention_mask_info as info_lib,
    )

    from maxctx.attention.cp.load_balance import stored_order
    from maxctx.attention.kernels.splash_masks import ordered_causal_mask

    order = stored_order(args.seq, args.context, True)
    rows = args.seq // args.context
    q_orig, kv_orig = order[3 * rows:4 * rows], order  # device 3: two zig-zag chunks against the whole sequence
    fast = ordered_causal_mask(q_orig, kv_orig)

    class Elementwise(type(fast)):
        def __getitem__(self, idx):
            return np.atleast_1d(self.kv_orig[idx[1]])[None, :] <= np.atleast_1d(self.q_orig[idx[0]])[:, None]

        def __eq__(self, other):  # never equal to the fast mask, so splash's cache cannot serve one for the other
            return type(other) is Elementwise and other._key == self._key

        def __hash__(self):
            return hash(("elementwise", self._key))

    slow = Elementwise.__new__(Elementwise)
    slow.__dict__.update(fast.__dict__)
    b = args.block
    sizes = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    blocks = (rows // b) * (args.seq // b)
    times = {}
    for name, mask in (("range-answered", fast), ("elementwise", slow), ("range-answered", fast)):
        info_lib._process_mask.cache_clear()
        start = time.perf_counter()
        kernel_lib.make_splash_mqa(mask_lib.MultiHeadMask([mask] * args.group), block_sizes=sizes, head_shards=1,
                                   q_seq_shards=1, interpret=True)
        times.setdefault(name, []).append(time.perf_counter() - start)
    fast_s, slow_s = min(times["range-answered"]), min(times["elementwise"])
    print(f"S={args.seq:,} C={args.context}: one device's [{rows:,} x {args.seq:,}] mask, {blocks:,} blocks of {b}, "
          f"{args.group} heads")
    print(f"  elementwise blocks:    {slow_s:7.2f} s per kernel")
    print(f"  range-answered blocks: {fast_s:7.2f} s per kernel (best of 2)")
    print(f"  ratio {slow_s / fast_s:.1f}x; all_gather builds {args.context} such kernels per trace: "
          f"{args.context * slow_s:.0f} s vs {args.context * fast_s:.0f} s")


if __name__ == "__main__":
    main()
