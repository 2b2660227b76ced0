"""The Gated DeltaNet's chunked form against its recurrent reference on CPU, and one layer's compiled cost on TPU
against a softmax attention layer's (issue 44, item 6).

    python3 benchmarks/gdn_speed.py [--lengths 4096 16384 65536] [--repeats 3] [--no-tpu] > benchmarks/gdn_speed.md

CPU: maxctx.model.qwen35.gdn.chunked (the WY / UT form, chunk 64) and gdn.recurrent (token by token, lax.scan) on
one sequence of B = 1, N = 2 value heads of K = V = 64 (tiny, so the reference's backward, which keeps the state
of every token, fits in memory), fp32, one document; forward and forward + backward (jit of the gradient of the
outputs' sum with respect to q, k, v, g and beta), each jitted, the least CPU time of --repeats runs after a
warm-up (XLA's CPU matmuls on one thread), side by side in one process. CPU seconds say how the two forms scale,
not what an accelerator does.

TPU: one layer's token mixing compiled for one v5p chip with libtpu on this machine (no TPU needed), Qwen3.5-9B's
sizes: the linear layer's (maxctx.model.qwen35.cp.mix: the convolution, the L2 norms, the gates and the chunked
delta rule; 16 key heads, 32 value heads of 128, bf16 inputs, fp32 state) against the full layer's attention
(splash, 16 query heads and 4 kv heads of 256, causal). Columns: executed FLOPs (maxctx.plan.program, splash's own
block tables; "-" for the linear layer, whose batched matmuls libtpu writes as convolutions whose batch dimensions
program.dot_flops reads as contracted, 32 to 131,072 times too many), the formula (the linear layer's
maxctx.model.qwen35.family.delta_rule_flops, the attention's 4 H D S^2 / 2; x3 with the backward), XLA's cost
analysis (its FLOPs and bytes accessed count a loop's body once and leave out Pallas kernels: shown as XLA gives
them), and the temporaries' HBM.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One thread: the CPU times then count the work, not a thread pool's waits on a machine whose cores are shared.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from maxctx.model.qwen35 import gdn  # noqa: E402
from maxctx.model.qwen35.family import delta_rule_flops  # noqa: E402

CPU_HEADS, CPU_DIM = 2, 64
TPU_DIMS = (16, 32, 128, 128)  # Qwen3.5-9B's linear layers: Nk, Nv, Dk, Dv
TPU_ATTENTION = (16, 4, 256)  # its full layers: H, K, head dim
GIB = 2 ** 30


def operands(seq: int, heads: int, dim: int, seed: int = 0) -> tuple:
    """q, k (L2-normalised), v, g (log decays in (-0.7, 0)), beta in (0, 1), starts: one document."""
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)  # noqa: E731
    q, k = (gdn.l2_normalize(f(1, seq, heads, dim)) for _ in range(2))
    g = jax.nn.log_sigmoid(f(1, seq, heads) + 3.0)
    beta = jax.nn.sigmoid(f(1, seq, heads))
    starts = jnp.zeros((1, seq), bool).at[:, 0].set(True)
    return q * dim ** -0.5, k, f(1, seq, heads, dim), g, beta, starts


def best_of(fn, args: tuple, repeats: int) -> float:
    """The least CPU time of `repeats` runs after a warm-up: CPU time, not wall time, since this machine's cores are
    shared with other work and a wall clock would time that work too."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        jax.block_until_ready(fn(*args))
        times.append(time.process_time() - start)
    return min(times)


def programs(form) -> tuple:
    """(forward, forward + backward) of one form, jitted."""
    def loss(q, k, v, g, beta, starts):
        return jnp.sum(form(q, k, v, g, beta, starts)[0])

    return (jax.jit(lambda *x: form(*x)[0]),
            jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))))


def cpu_table(lengths: list[int], repeats: int) -> None:
    print(f"## CPU: chunked against recurrent (B = 1, N = {CPU_HEADS}, K = V = {CPU_DIM}, fp32; "
          f"min of {repeats} runs; jax {jax.__version__}, {os.cpu_count()} cores)\n")
    print("| tokens | chunked fwd (CPU s) | recurrent fwd (CPU s) | recurrent / chunked | chunked fwd+bwd (CPU s) "
          "| recurrent fwd+bwd (CPU s) | recurrent / chunked | max abs diff of o |")
    print("|---|---|---|---|---|---|---|---|")
    chunked, recurrent = programs(gdn.chunked), programs(gdn.recurrent)
    for seq in lengths:
        args = operands(seq, CPU_HEADS, CPU_DIM)
        diff = float(jnp.max(jnp.abs(chunked[0](*args) - recurrent[0](*args))))
        fwd = [best_of(p[0], args, repeats) for p in (chunked, recurrent)]
        both = [best_of(p[1], args, repeats) for p in (chunked, recurrent)]
        print(f"| {seq:,} | {fwd[0]:.4f} | {fwd[1]:.4f} | {fwd[1] / fwd[0]:.2f}x | {both[0]:.4f} | {both[1]:.4f} "
              f"| {both[1] / both[0]:.2f}x | {diff:.1e} |", flush=True)


def _linear_layer(seq: int, mesh):
    """(function, abstract arguments) of one linear layer's token mixing on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxctx.model.qwen35 import cp

    nk, nv, dk, dv = TPU_DIMS
    x = 2 * nk * dk + nv * dv
    one = NamedSharding(mesh, P())
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    args = (arg((1, seq, x)), arg((1, seq, nv)), arg((1, seq, nv)), arg((1, seq), jnp.int32), arg((x, 4)),
            arg((nv,), jnp.float32), arg((nv,), jnp.float32))

    def mix(qkv, b, a, seg, conv, a_log, dt_bias):
        return cp.mix(qkv, b, a, seg, conv, a_log, dt_bias, (nk, dk, dv)).astype(jnp.bfloat16)

    return mix, args, 3


def _attention_layer(seq: int, mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxctx.attention.dispatch import AttentionSpec, attend

    h, kv, d = TPU_ATTENTION
    one = NamedSharding(mesh, P())
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    args = (arg((1, seq, h, d)), arg((1, seq, kv, d)), arg((1, seq, kv, d)), arg((1, seq), jnp.int32),
            arg((1, seq), jnp.int32))
    spec = AttentionSpec(kernel="splash", strategy="all_gather")

    def layer(q, k, v, positions, seg):
        return attend(q, k, v, positions, seg, spec, mesh)

    return layer, args, 3


def compiled_costs(build, seq: int, mesh, backward: bool) -> dict:
    from maxctx.plan import program

    layer, args, differentiable = build(seq, mesh)
    fn = layer
    if backward:
        def loss(*x):
            return jnp.sum(layer(*x).astype(jnp.float32))

        fn = jax.grad(loss, argnums=tuple(range(differentiable)))
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    read = program.read(compiled, 1)
    return {"executed": read["executed_flops"], "xla_flops": cost.get("flops", 0.0),
            "xla_bytes": cost.get("bytes accessed", 0.0), "temp": compiled.memory_analysis().temp_size_in_bytes}


def tpu_table(lengths: list[int]) -> None:
    from jax.sharding import Mesh

    from maxctx.parallelism import MESH_AXES
    from maxctx.plan import topology

    devices = topology.topology_devices(topology.parse("v5p-8"))
    mesh = Mesh(np.array(devices[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    h, _, d = TPU_ATTENTION
    print("\n## TPU v5p (compiled with libtpu, one chip): Qwen3.5-9B's linear layer against its attention\n")
    print("| tokens | layer | pass | executed FLOPs | formula FLOPs | XLA cost FLOPs | XLA bytes accessed (GiB) "
          "| temporaries (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in lengths:
        formulas = {"linear (GDN)": seq * delta_rule_flops(TPU_DIMS), "attention (splash)": 2 * h * d * seq * seq}
        for label, build in (("linear (GDN)", _linear_layer), ("attention (splash)", _attention_layer)):
            for backward in (False, True):
                c = compiled_costs(build, seq, mesh, backward)
                formula = formulas[label] * (3 if backward else 1)
                executed = f"{c['executed']:.3e}" if build is _attention_layer else "-"
                print(f"| {seq:,} | {label} | {'fwd+bwd' if backward else 'fwd'} | {executed} | "
                      f"{formula:.3e} | {c['xla_flops']:.3e} | {c['xla_bytes'] / GIB:.2f} | {c['temp'] / GIB:.2f} |",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-tpu", action="store_true", help="leave out the TPU compiles (libtpu)")
    parser.add_argument("--no-cpu", action="store_true", help="leave out the CPU timings")
    args = parser.parse_args()
    print("# Gated DeltaNet: chunked against recurrent, and its compiled cost on TPU\n")
    print(f"Written by `python3 benchmarks/gdn_speed.py {' '.join(sys.argv[1:])}` (module doc).\n")
    if not args.no_cpu:
        cpu_table(args.lengths, args.repeats)
    if not args.no_tpu:
        tpu_table(args.lengths)


if __name__ == "__main__":
    main()
