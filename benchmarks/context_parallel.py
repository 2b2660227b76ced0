"""Context-parallel attention on 8 simulated CPU devices: every strategy x kernel at several sequence lengths.

    python3 benchmarks/context_parallel.py [--lengths 1024,2048,4096] [--kernels dot_product,flash] [--repeats 2]

One attention layer, forward and backward (jit of the VJP), one sequence, H=8 query heads, K=2 kv heads, D=32,
fp32, C = 8 (usp: ring 2 x a2a 4), zig-zag load balance. Per row: step time (median of --repeats runs after a
warm-up), tokens/s, temp memory per device (compiled.memory_analysis()) and collective bytes per device (forward +
backward, from the compiled HLO; see tests/support/hlo.py). CPU step times say little about accelerators; the
memory and byte columns are what the compiled program will do anywhere. Prints a Markdown table.
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

from maxctx.attention.cp.load_balance import zigzag_permutation  # noqa: E402
from maxctx.attention.dispatch import AttentionSpec, attend  # noqa: E402
from maxctx.parallelism import MESH_AXES  # noqa: E402
from tests.support.hlo import collective_bytes  # noqa: E402

LAYOUTS = {"all_gather": (8, 1), "a2a": (1, 8), "p2p": (8, 1), "usp": (2, 4)}
H, K, D = 8, 2, 32


def measure(strategy: str, kernel: str, seq: int, repeats: int) -> dict:
    ring, a2a = LAYOUTS[strategy]
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 1, ring, a2a, 1), MESH_AXES)
    spec = AttentionSpec(kernel=kernel, strategy=strategy, load_balance=True, block_q=128, block_kv=128)

    def step(q, k, v, pos, seg):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, pos, seg, spec, mesh), q, k, v)
        return pullback(out)

    rng = np.random.default_rng(0)
    perm = zigzag_permutation(seq, 8)
    shard = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    q, k, v = (jax.device_put(rng.normal(size=(1, seq, n, D)).astype(np.float32)[:, perm], shard) for n in (H, K, K))
    pos = jax.device_put(np.arange(seq, dtype=np.int32)[None, perm], shard)
    seg = jax.device_put(np.ones((1, seq), np.int32), shard)
    compiled = jax.jit(step).lower(q, k, v, pos, seg).compile()
    jax.block_until_ready(compiled(q, k, v, pos, seg))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, pos, seg))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    comm = collective_bytes(compiled.as_text())
    return {"strategy": strategy, "kernel": kernel, "seq": seq, "step_ms": 1e3 * seconds, "tokens_s": seq / seconds,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
            "comm_mib": sum(comm.values()) / 2 ** 20,
            "comm": ", ".join(f"{k} {v / 2 ** 20:.2f}" for k, v in sorted(comm.items()) if v)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--kernels", default="dot_product,flash")
    parser.add_argument("--strategies", default=",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"8 simulated CPU devices ({jax.devices()[0].device_kind}), C=8, one sequence, H={H} K={K} D={D}, fp32, "
          f"attention forward + backward\n")
    print("| strategy | kernel | S | step ms | tokens/s | temp MiB/device | x per 2x S | collectives MiB/device |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for strategy in args.strategies.split(","):
        for kernel in args.kernels.split(","):
            previous = None
            for seq in lengths:
                r = measure(strategy, kernel, seq, args.repeats)
                growth = f"{r['temp_mib'] / previous:.2f}" if previous else ""
                previous = r["temp_mib"]
                print(f"| {strategy} | {kernel} | {seq} | {r['step_ms']:.0f} | {r['tokens_s']:.0f} | "
                      f"{r['temp_mib']:.1f} | {growth} | {r['comm_mib']:.2f} ({r['comm']}) |", flush=True)


if __name__ == "__main__":
    main()
