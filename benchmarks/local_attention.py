"""Local (sliding-window) against global attention layers under every CP strategy, on 8 simulated CPU devices.

    python3 benchmarks/local_attention.py [--seq 32768] [--window 1024] [--doc 1024] [--repeats 1]

One attention layer, forward and backward (jit of the VJP), one sequence, H=8 query heads, K=2 kv heads, D=32,
fp32, blockwise kernel with 512-token blocks, C = 8 (usp: ring 2 x a2a 4), zig-zag load balance. Rows: each
strategy's global layer, its local layer (window W), and its global layer on a packed sequence of --doc-token
documents (document-aware skipping: ring hops and kernel blocks whose queries and keys share no document are
skipped). Columns: collective bytes per device from the compiled HLO (tests/support/hlo.py), against the strategy's
`comm_volume` formula (maxctx.attention.cp.base); XLA's compiled FLOP count (its cost analysis counts a loop's body
once, not per iteration, and a `lax.cond`'s compute branch whether or not it runs: comparable between the rows of one
strategy only where the loops are the same; block and hop skipping show in the step time); step time (median of
--repeats runs after a warm-up) and its ratio to the global layer. CPU step times say little about accelerators;
the bytes are what the compiled program does anywhere. Prints a Markdown table.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from maxctx.attention.cp import strategies  # noqa: E402
from maxctx.attention.cp.cost import AttentionShape  # noqa: E402
from maxctx.attention.cp.load_balance import zigzag_permutation  # noqa: E402
from maxctx.attention.dispatch import AttentionSpec, attend  # noqa: E402
from maxctx.parallelism import MESH_AXES  # noqa: E402
from tests.support.hlo import collective_bytes  # noqa: E402

LAYOUTS = {"all_gather": (8, 1), "p2p": (8, 1), "a2a": (1, 8), "usp": (2, 4)}
H, K, D = 8, 2, 32


def measure(strategy: str, seq: int, window: int, doc: int, repeats: int) -> dict:
    ring, a2a = LAYOUTS[strategy]
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 1, ring, a2a, 1), MESH_AXES)
    spec = AttentionSpec(kernel="blockwise", strategy=strategy, load_balance=True, block_q=512, block_kv=512,
                         window=window)

    def step(q, k, v, pos, seg):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, pos, seg, spec, mesh), q, k, v)
        return pullback(out)

    rng = np.random.default_rng(0)
    perm = zigzag_permutation(seq, 8)
    shard = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    q, k, v = (jax.device_put(rng.normal(size=(1, seq, n, D)).astype(np.float32)[:, perm], shard) for n in (H, K, K))
    positions = np.arange(seq) % doc if doc else np.arange(seq)
    segments = np.arange(seq) // doc + 1 if doc else np.ones(seq)
    pos = jax.device_put(positions.astype(np.int32)[None, perm], shard)
    seg = jax.device_put(segments.astype(np.int32)[None, perm], shard)
    compiled = jax.jit(step).lower(q, k, v, pos, seg).compile()
    jax.block_until_ready(compiled(q, k, v, pos, seg))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, pos, seg))
        times.append(time.perf_counter() - start)
    comm = collective_bytes(compiled.as_text())
    shape = AttentionShape(batch=1, seq=seq, heads=H, kv_heads=K, head_dim=D, itemsize=4, cp=8, a2a=a2a,
                           window=window)
    fwd, bwd = strategies.get(strategy).comm_volume(shape)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"step_s": statistics.median(times), "comm": sum(comm.values()),
            "formula": sum(c.bytes for c in fwd + bwd), "kinds": ", ".join(k for k, v in sorted(comm.items()) if v),
            "gflop": (cost or {}).get("flops", float("nan")) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--doc", type=int, default=1024)
    parser.add_argument("--strategies", default=",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"8 simulated CPU devices, C=8, S={args.seq}, one sequence, H={H} K={K} D={D}, fp32, blockwise kernel, "
          f"attention forward + backward; local: W={args.window}; packed: documents of {args.doc} tokens\n")
    print("| strategy | layer | collectives MiB/device (HLO) | formula MiB | HLO ops | compiled GFLOP/device | "
          "step s | x global |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for strategy in args.strategies.split(","):
        base = None
        for label, window, doc in (("global", 0, 0), (f"local W={args.window}", args.window, 0),
                                   (f"global, packed {args.doc}-token docs", 0, args.doc)):
            r = measure(strategy, args.seq, window, doc, args.repeats)
            base = base or r["step_s"]
            print(f"| {strategy} | {label} | {r['comm'] / 2 ** 20:.3f} | {r['formula'] / 2 ** 20:.3f} | {r['kinds']} | "
                  f"{r['gflop']:.1f} | {r['step_s']:.2f} | {r['step_s'] / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
