"""TPU without a TPU: every strategy with attention=splash compiles (fwd + bwd) for an abstract v5p-8 topology, for
global and for local (sliding-window) layers, and so does a call split into row chunks (splash.MAX_TABLE_ENTRIES
lowered so 2K tokens need them; ring hops loop one kernel over them), and splash's backward on other blocks than
the forward's (MaxText's sa_block_*), fused or not, and each strategy under the documents placement; and splash at
the recipes' 2048-token blocks with head_dim 256 under v5p's scoped VMEM limit.

Runs in a subprocess: the TPU plugin must load, which JAX_PLATFORMS=cpu (set by conftest) forbids. Needs libtpu
(CI installs `jax[tpu]==<jax version>`); without it the test fails and says so, it does not skip.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.support.processes import ROOT, tpu_env

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from maxctx.attention.kernels import splash
from maxctx.attention.dispatch import AttentionSpec, attend
from maxctx.parallelism import MESH_AXES

devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices  # v5p-8: 4 chips
B, S, H, K, D = 1, 2048, 8, 2, 128
results = {}


sys.path.insert(0, "benchmarks")
from compiled_schedule import computations, permutes as all_permutes


def permutes(hlo):
    # The program's fp32 collective-permutes (the ring backward's dK/dV), in schedule order: for each, whether a
    # conditional (a ring hop's kernel call) runs between its start and its done (benchmarks/compiled_schedule.py
    # reads the train step's program the same way).
    return [overlaps for shape, overlaps in all_permutes(computations(hlo)) if shape.startswith("f32[")]


default_table = splash.MAX_TABLE_ENTRIES
part, parts = int(sys.argv[1]), int(sys.argv[2])  # this process compiles every parts-th case from the part-th
for case, (strategy, ring, a2a, balance, table, window, *blocks) in enumerate([
        ("all_gather", 4, 1, True, None, 0), ("p2p", 4, 1, True, None, 0), ("p2p", 4, 1, False, None, 0),
        ("a2a", 1, 4, True, None, 0), ("usp", 2, 2, True, None, 0),
        ("a2a", 1, 4, True, 16, 0),  # 8 x 8 blocks per call, at most 16 per kernel: 4 row chunks
        ("p2p", 4, 1, True, 2, 0),  # ring hops of 2 x 2 blocks, 1 per kernel: one kernel looped over 2 row chunks
        # splash's backward on its own blocks (MaxText's sa_block_*_dkv/dq), and the fused backward kernel
        ("a2a", 1, 4, True, None, 0, dict(q_dkv=512, kv_dkv=1024, kv_dkv_compute=256, q_dq=1024, kv_dq=512)),
        ("all_gather", 4, 1, True, None, 0, dict(kv_compute=128, q_dkv=512, fused_backward=True)),
        # Local layers (sliding window): the halo's band kernel, a2a's windowed mask, a ring with windowed hops.
        ("all_gather", 4, 1, True, None, 256), ("p2p", 4, 1, True, None, 256), ("p2p", 4, 1, False, None, 256),
        ("a2a", 1, 4, True, None, 256), ("usp", 2, 2, True, None, 256), ("p2p", 4, 1, True, None, 1024),
        # A window shorter than a block (GPT-OSS's 128): the halo's 128 + 256 keys take 128-key blocks, not 192.
        ("all_gather", 4, 1, True, None, 128),
        # The ring backward software-pipelined (AttentionSpec.ring_backward_overlap).
        ("p2p", 4, 1, True, None, 0, dict(overlap=True)), ("usp", 2, 2, True, None, 0, dict(overlap=True)),
        # context_parallel_load_balance=documents: q_sequence and tables derived per call from the ids (one row at
        # a time), gathered keys sorted back into document order; ring hops in row chunks too.
        ("p2p", 4, 1, "documents", None, 0), ("all_gather", 4, 1, "documents", None, 256),
        ("p2p", 4, 1, "documents", 2, 0)]):
    if case % parts != part:
        continue
    splash.MAX_TABLE_ENTRIES = table or default_table
    mesh = Mesh(np.asarray(devices).reshape(1, 1, ring, a2a, 1), MESH_AXES)
    opts = dict(blocks[0]) if blocks else {}
    overlap = opts.pop("overlap", False)
    spec = AttentionSpec(kernel="splash", strategy=strategy, load_balance=balance, block_q=256, block_kv=256,
                         window=window, splash_blocks=splash.Blocks(**opts), ring_backward_overlap=overlap)
    seq = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    heads = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a"), "tensor", None))
    args = [jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((B, S, K, D), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((B, S, K, D), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=seq),
            jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=seq)]

    def loss(q, k, v, pos, seg):
        return attend(q, k, v, pos, seg, spec, mesh).astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    hlo = compiled.as_text()
    order = "documents" if balance == "documents" else "zigzag" if balance else "natural"
    results[f"{strategy}/{order}" + ("/chunked" if table else "")
            + (f"/window{window}" if window else "") + ("/overlap" if overlap else "/blocks" if opts else "")] = {
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "pallas_calls": hlo.count("tpu_custom_call"), "fp32_permutes": permutes(hlo)}

# Splash at the recipes' 2048-token blocks and head_dim 256 (16 query, 4 kv heads) on one v5p chip, fwd + bwd,
# under the scoped VMEM limit maxctx gives v5p (tpu_scoped_vmem_limit_kib=-1): its partial blocks computed in the
# kernel, the kernels fit (loaded, the forward needed 70.59 MiB of the chip's 63.94: tests/test_out_of_memory.py).
from maxctx.plan.topology import CHIPS

if part != parts - 1:
    print("RESULT " + json.dumps(results))
    sys.exit(0)
splash.MAX_TABLE_ENTRIES = default_table
mesh = Mesh(np.asarray(devices[:1]).reshape(1, 1, 1, 1, 1), MESH_AXES)
spec = AttentionSpec(kernel="splash", strategy="all_gather", block_q=2048, block_kv=2048)
big = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [((1, 4096, 16, 256), jnp.bfloat16),
       ((1, 4096, 4, 256), jnp.bfloat16), ((1, 4096, 4, 256), jnp.bfloat16), ((1, 4096), jnp.int32),
       ((1, 4096), jnp.int32)]]
grad = jax.jit(jax.grad(lambda q, k, v, pos, seg: attend(q, k, v, pos, seg, spec, mesh).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2)))
hlo = grad.lower(*big).compile({"xla_tpu_scoped_vmem_limit_kib": CHIPS["v5p"].scoped_vmem_kib}).as_text()
results["recipe_blocks_head_dim_256"] = {"temp_bytes": 0, "pallas_calls": hlo.count("tpu_custom_call"),
                                         "fp32_permutes": []}
print("RESULT " + json.dumps(results))
"""


def test_splash_compiles_for_v5p_under_every_strategy():
    assert importlib.util.find_spec("libtpu") is not None, (
        "libtpu is not installed: the splash kernels cannot be compiled for an abstract TPU. Install it with "
        "pip install 'jax[tpu]==<the installed jax version>' (CI does).")
    # ALLOW_MULTIPLE_LIBTPU_LOAD: other test processes may hold libtpu's lockfile.
    env = tpu_env(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    # The cases in two processes at once (each compile is mostly single-threaded).
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(part), "2"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for part in range(2)]
    results = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"compile for v5p failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        results.update(json.loads(lines[-1].removeprefix("RESULT ")))
    assert len(results) == 22
    # The ring backward's dK/dV sends: in the hop loop (p2p, R = 4) none overlaps a hop's kernel by default; when
    # software-pipelined every one does but the last, which brings the dK/dV home after the last hop (usp, R = 2,
    # has no loop: XLA overlaps even the plain backward's one send there).
    plain = results["p2p/zigzag"]["fp32_permutes"]
    assert plain and not any(plain), plain
    for ring in ("p2p", "usp"):
        piped = results[f"{ring}/zigzag/overlap"]["fp32_permutes"]
        assert any(piped) and sum(piped) >= len(piped) - 1, (ring, piped)
    # Row chunks are separate kernels (forward, dQ, dK/dV each): 4 chunks make at least 3 x 3 more Pallas calls.
    assert results["a2a/zigzag/chunked"]["pallas_calls"] >= results["a2a/zigzag"]["pallas_calls"] + 9, results
    # Ring hops' row chunks are one kernel in a loop (splash.RowLoop): no more Pallas calls than unchunked.
    assert results["p2p/zigzag/chunked"]["pallas_calls"] <= results["p2p/zigzag"]["pallas_calls"], results
    for name, stats in results.items():
        assert stats["pallas_calls"] > 0, f"{name}: no Pallas (splash) kernel in the compiled TPU program"
        assert stats["temp_bytes"] < 1 << 30, f"{name}: {stats['temp_bytes']} temp bytes for 2K tokens"
