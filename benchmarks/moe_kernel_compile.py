"""One MoE layer's experts compiled for one v5p chip under each `moe_kernel`: temporaries and XLA's cost FLOPs.

`python3 benchmarks/moe_kernel_compile.py [--tokens 16384] [--kernels ragged_dot megablox]` compiles, with libtpu
on any machine (no TPU), the forward and backward of Qwen3-30B-A3B's experts (D 2048, X 128 experts, top k 8,
M 768) over T tokens: the router, the sort by expert, gate / up / down as grouped matmuls of the kernel, the
combine (maxctx.model.moe.layers.route and grouped_swiglu). It prints a markdown row per kernel against the
matmuls' 3 x 6 T k D M FLOPs, and how many Mosaic kernels (tpu_custom_call) the program runs;
docs/long_context.md has the numbers and what XLA:TPU makes of jax.lax.ragged_dot.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

D, X, K, M = 2048, 128, 8, 768  # Qwen3-30B-A3B's experts
GIB = 2**30


def compile_experts(kernel: str, tokens: int, device, vmem_kib: int) -> dict:
    from jax.sharding import SingleDeviceSharding

    from maxctx.model.moe import kernels
    from maxctx.model.moe.layers import grouped_swiglu, route

    at = SingleDeviceSharding(device)
    shapes = ((tokens, D), (D, X), (X, D, M), (X, D, M), (X, M, D))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=at) for s in shapes]
    matmul = kernels.grouped_matmul(kernel, "tpu")

    def loss(x, router, w_gate, w_up, w_down):
        _, weights, experts = route(x, router, K, True, jnp.bfloat16)
        return jnp.sum(grouped_swiglu(x, weights, experts, w_gate, w_up, w_down, matmul=matmul))

    start = time.time()
    # The scoped VMEM limit the train step compiles with for the chip (maxctx.train_step).
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile(
        {"xla_tpu_scoped_vmem_limit_kib": vmem_kib})
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"temp": compiled.memory_analysis().temp_size_in_bytes, "flops": cost.get("flops", 0.0),
            "bytes": cost.get("bytes accessed", 0.0), "mosaic": compiled.as_text().count("tpu_custom_call"),
            "seconds": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--kernels", nargs="+", default=["ragged_dot", "megablox"])
    args = parser.parse_args()
    from maxctx.plan import topology

    target = topology.parse("v5p-8")
    device = topology.topology_devices(target)[0]
    formula = 3 * 6 * args.tokens * K * D * M
    print(f"| moe_kernel | temporaries (GiB) | XLA cost FLOPs | / 3 x 6 T k D M ({formula:.3g}) | bytes accessed | "
          "Mosaic kernels | compile |")
    print("|---|---|---|---|---|---|---|")
    for kernel in args.kernels:
        r = compile_experts(kernel, args.tokens, device, target.chip.scoped_vmem_kib)
        print(f"| {kernel} | {r['temp'] / GIB:.2f} | {r['flops']:.3e} | {r['flops'] / formula:.2f}x | "
              f"{r['bytes']:.3e} | {r['mosaic']} | {r['seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
