"""The GPU check: cuDNN attention against the reference, every CP strategy on the machine's GPUs, and a ~1B Llama's
training throughput at 32K tokens. For a session lent a GPU machine (one command, its output kept):

    python3 benchmarks/gpu_check.py > benchmarks/gpu.md

1. Kernels, one GPU, bf16 inputs: `cudnn` (maxctx.attention.kernels.cudnn: the call chosen on the device, named in
   brackets: cuDNN's causal mask type for one-document rows, its packed layout with per-document offsets and
   lengths for packed rows, or the boolean mask) and `cudnn, boolean mask` (the boolean-mask call alone, the only
   one before) against `dot_product` in fp32 on the same inputs: out, the log-sum-exp the calls return for ring
   hops (its layout is an assumption of cudnn.py for the packed call in particular), and dq, dk, dv of
   sum(out * cotangent). Cases: causal GQA, packed documents (GQA and MHA), a sliding window alone and over packed
   documents, a row with more documents than the packed call takes (cudnn.MAX_DOCUMENTS: the boolean mask), 8K
   tokens (the fp32 reference materialises the scores: 8.6 GB at 8K with 32 heads, four times that at 16K).
   Each error is max |x - ref| / max |ref|; the tolerance is bf16's (3e-2 for values, 5e-2 for gradients).
   Blockwise against the reference: benchmarks/gpu.md (and --cpu-check).
2. Strategies: all_gather, p2p, a2a and usp over every GPU of the machine (C = GPUs; usp as 2 x C/2), kernel cudnn,
   out and gradients against the one-device reference. A machine with one GPU has no context axis to split, so
   this part then says so and runs nothing (the strategies' collectives are checked on CPU devices by the tests).
3. Training: `python train.py configs/base.yml` with Llama 3.2 1B's shapes (16 layers, D 2048, 32 query and 8 kv
   heads of 64, MLP 8192, vocabulary 128256, tied embeddings), 32,768 tokens per sequence, one sequence per GPU,
   synthetic data, remat_policy=full, the loss in 8 chunks; once with attention=flash (cuDNN on GPU for bf16)
   and once with attention=blockwise. Tokens/s and MFU are the logger's (maxctx.metrics: 6 P t + attention FLOPs
   over the device's peak), over the total time of the logged steps after the first.

4. (`--parts speed`, not in the default parts) Kernel speed: one layer's attention forward and backward at the 1B
   model's shape (32K tokens), on a one-document row, a packed row (the synthetic data's first) and a
   one-document row under a 4K sliding window: `cudnn` (the call chosen on the device), `cudnn, boolean mask`,
   cuDNN's causal mask type through jax.nn with no path test (one-document rows), and blockwise (not under the
   window). A call that fails prints its error in its row and the others go on.

`--parts` picks the parts to run (default kernels,strategies,train). `--cpu-check` runs the same script on 4 CPU
devices: cuDNN's calls through jax.nn's XLA implementation and an XLA stand-in for the packed call (the same
path test, offsets, lengths and residual layout), blockwise in place of cuDNN for the strategies and training,
small shapes and a tiny model at 1,024 tokens: it checks the script, not a GPU (its output says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CHECK = "--cpu-check" in sys.argv
if CPU_CHECK:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
# This process allocates GPU memory as it goes and gives it back (the fp32 references take tens of GB), so that the
# training runs of part 3, subprocesses with JAX's default preallocation, find the GPU free.
TRAIN_ENV = dict(os.environ)
os.environ.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from maxctx.attention.cp.load_balance import zigzag_permutation  # noqa: E402
from maxctx.attention.dispatch import AttentionSpec, attend  # noqa: E402
from maxctx.attention.kernels import cudnn  # noqa: E402
from maxctx.attention.kernels.local import make_local  # noqa: E402
from maxctx.parallelism import MESH_AXES  # noqa: E402

VALUE_TOL, GRAD_TOL = 3e-2, 5e-2
TRAIN_TIMEOUT_S = 200  # one training run; a hung one must not take the whole lease
# The kernels and speed parts each run in a process of their own, so that a GPU error that poisons a process
# (a CUDA context left in error) cannot take the next part with it; each within its time (about half of it is
# expected on an H200), so that both fit a 5-minute call.
PART_TIMEOUT_S = {part: (4 if CPU_CHECK else 1) * limit for part, limit in (("kernels", 170), ("speed", 130))}
# (name, B, S, H, K, D, documents, window)
# The packed call (JAX's private API) last, so that whatever it does cannot cost the others their rows.
CASES = [("causal, GQA 32/8", 1, 4096, 32, 8, 128, 1, 0), ("sliding window 1024", 1, 4096, 16, 4, 128, 1, 1024),
         ("causal, 8K", 1, 8192, 32, 8, 128, 1, 0),
         ("packed: 24 documents (over the bound)", 1, 4096, 16, 4, 128, 24, 0),
         ("packed: 3 documents, MHA", 2, 4096, 16, 16, 128, 3, 0), ("packed: 3 documents", 2, 4096, 16, 4, 128, 3, 0),
         ("packed: 3 documents, window 512", 2, 4096, 16, 4, 128, 3, 512)]
CPU_CASES = [("causal, GQA 4/2", 1, 256, 4, 2, 32, 1, 0), ("sliding window 64", 1, 256, 4, 2, 32, 1, 64),
             ("packed: 24 documents (over the bound)", 1, 256, 4, 2, 32, 24, 0),
             ("packed: 3 documents, MHA", 2, 256, 4, 4, 32, 3, 0), ("packed: 3 documents", 2, 256, 4, 2, 32, 3, 0),
             ("packed: 3 documents, window 32", 2, 256, 4, 2, 32, 3, 32)]
# cuDNN's calls (maxctx.attention.kernels.cudnn); --cpu-check runs them through jax.nn's XLA implementation
CUDNN_IMPLEMENTATION = "xla" if CPU_CHECK else "cudnn"
CUDNN = "cudnn"  # the path chosen on the device (the call's queries and keys are the whole sequence, in order)
CUDNN_MASKED = "cudnn, boolean mask"  # the boolean-mask call alone, as before the fast paths
CUDNN_UNPACKED = "cudnn, no packed call"  # after a failure of CUDNN: its causal and masked calls alone
LLAMA_1B = ["base_emb_dim=2048", "base_num_decoder_layers=16", "base_num_query_heads=32", "base_num_kv_heads=8",
            "head_dim=64", "base_mlp_dim=8192", "vocab_size=128256", "logits_via_embedding=true",
            "rope_max_timescale=500000.0", "max_target_length=32768", "num_vocab_tiling=8"]
TINY = ["model_name=tiny", "max_target_length=1024"]


def inputs(b: int, s: int, h: int, k: int, d: int, documents: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, kk, v, cot = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
                     for shape in ((b, s, h, d), (b, s, k, d), (b, s, k, d), (b, s, h, d)))
    bounds = np.sort(rng.choice(np.arange(1, s), documents - 1, replace=False)) if documents > 1 else []
    seg = np.zeros((b, s), np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    for start in bounds:
        seg[:, start:] += 1
        pos[:, start:] -= pos[:, start:start + 1]
    return q, kk, v, cot, jnp.asarray(pos), jnp.asarray(seg)


def kernel_call(kernel: str, group: int, window: int):
    """f(q, k, v, pos, seg, return_lse) -> (out, lse fp32 or None) of `kernel`: a LocalKernel's name, CUDNN or
    CUDNN_MASKED, for queries and keys that are the same tokens in natural order."""
    if kernel in (CUDNN, CUDNN_MASKED, CUDNN_UNPACKED):
        def call(q, k, v, pos, seg, return_lse):
            return cudnn.cudnn_attention(q, k, v, pos, seg, pos, seg, return_lse, window,
                                         natural=kernel != CUDNN_MASKED,
                                         max_documents=1 if kernel == CUDNN_UNPACKED else cudnn.MAX_DOCUMENTS,
                                         implementation=CUDNN_IMPLEMENTATION)
        return call
    local = make_local(kernel, 512, 512, group=group, window=window)

    def call(q, k, v, pos, seg, return_lse):
        if return_lse:
            return local.block_forward(0, q, k, v, pos, seg, pos, seg)
        return local.attend(0, q, k, v, pos, seg, pos, seg)
    return call


def cudnn_path(pos, seg, packed: bool = True) -> str:
    """The call maxctx.attention.kernels.cudnn takes for these tokens, as its device test picks it."""
    packed = packed and cudnn.packed_supported(CUDNN_IMPLEMENTATION)
    return cudnn.PATHS[int(cudnn.choose_path(pos, seg, pos, seg, cudnn.MAX_DOCUMENTS, packed))]


def run_kernel(kernel: str, q, k, v, cot, pos, seg, window: int, f32: bool = False):
    """(out, lse, dq, dk, dv) of one kernel on one device; `f32` runs it on fp32 copies (the reference)."""
    fn = kernel_call(kernel, q.shape[2] // k.shape[2], window)
    cast = (lambda x: x.astype(jnp.float32)) if f32 else (lambda x: x)

    def loss(q, k, v):
        out, _ = fn(cast(q), cast(k), cast(v), pos, seg, False)
        return (out.astype(jnp.float32) * cot.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _, lse = jax.jit(lambda q, k, v: fn(cast(q), cast(k), cast(v), pos, seg, True))(q, k, v)
    return (out, lse, *grads)


def failure(e: Exception, width: int = 300) -> str:
    text = str(e).strip().splitlines()[0][:width] if str(e).strip() else ""
    return f"failed: {type(e).__name__}: {text}".replace("|", "/")


def error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(x)):
        return float("inf")
    scale = np.abs(ref[finite]).max() if finite.any() else 1.0
    return float(np.abs(x[finite] - ref[finite]).max() / max(scale, 1e-30))


def residual_layouts(q, k, v, pos, seg, window: int, ref_lse) -> str:
    """The packed call's raw residual [B * M, H, S] read in each layout it might have, against the reference lse:
    the row shows which one cuDNN writes (cudnn.packed_residual_index assumes the first)."""
    m = cudnn.MAX_DOCUMENTS
    offsets, lengths = cudnn.packed_layout(seg, m)
    call = cudnn._packed_cudnn if CUDNN_IMPLEMENTATION == "cudnn" else cudnn._packed_xla
    _, res = jax.jit(lambda *a: call(*a, window=window, return_lse=True))(q, k, v, offsets, lengths)
    res = np.asarray(res, np.float64)
    b, s, h = q.shape[0], q.shape[1], q.shape[2]
    sequence, local = (np.asarray(x) for x in cudnn.packed_residual_index(seg, m))
    run = sequence - sequence[:, :1]
    flat = res.reshape(-1)
    candidates = {"per document [d, h, t] (cudnn.py)": res[sequence, :, local].transpose(0, 2, 1),
                  "per row slot [b M + m, h, t]": res[np.arange(b)[:, None] * m + run, :, local].transpose(0, 2, 1),
                  "tokens, heads minor [b S + i, h]": flat[:b * s * h].reshape(b, s, h).transpose(0, 2, 1),
                  "as unpacked [b, h, i]": res[:b]}
    return "; ".join(f"{name}: {error(x, ref_lse):.1e}" for name, x in candidates.items())


def kernels_table():
    """Yields the table's lines as they come."""
    yield "| case | kernel | out | lse | dq | dk | dv | within tolerance | compile + run |"
    yield "|---|---|---|---|---|---|---|---|---|"
    notes = ["", "The packed call's residual read in each layout it might have, against the reference lse:", ""]
    for name, b, s, h, k, d, documents, window in CPU_CASES if CPU_CHECK else CASES:
        case = f"{name} (B {b}, S {s}, H {h}, K {k}, D {d})"
        q, kk, v, cot, pos, seg = inputs(b, s, h, k, d, documents)
        try:
            ref = run_kernel("dot_product", q, kk, v, cot, pos, seg, window, f32=True)
        except Exception as e:  # the case's failure is a result of the check, not its end
            yield f"| {case} | dot_product (fp32 reference) | {failure(e)} | | | | | NO | |"
            continue
        variants = [CUDNN_MASKED] + (["blockwise"] if CPU_CHECK else []) + [CUDNN]
        for kernel in variants:
            label = kernel
            start = time.perf_counter()
            try:
                if kernel in (CUDNN, CUDNN_UNPACKED):
                    label = f"{kernel} ({cudnn_path(pos, seg, packed=kernel == CUDNN)})"
                got = run_kernel(kernel, q, kk, v, cot, pos, seg, window)
                jax.block_until_ready(got)
            except Exception as e:  # one kernel's failure is a result of the check, not its end
                yield f"| {case} | {label} | {failure(e)} | | | | | NO | |"
                if kernel == CUDNN:  # the packed call is compiled into every natural-order call: try without it
                    variants.append(CUDNN_UNPACKED)
                continue
            seconds = time.perf_counter() - start
            errs = [error(g, r) for g, r in zip(got, ref)]
            ok = all(e <= VALUE_TOL for e in errs[:2]) and all(e <= GRAD_TOL for e in errs[2:])
            yield (f"| {case} | {label} | " + " | ".join(f"{e:.1e}" for e in errs)
                         + f" | {'yes' if ok else 'NO'} | {seconds:.1f} s |")
        if documents > 1 and cudnn_path(pos, seg) == "packed":
            try:
                notes.append(f"- {case}: {residual_layouts(q, kk, v, pos, seg, window, ref[1])}")
            except Exception as e:
                notes.append(f"- {case}: {failure(e)}")
        del ref
    if len(notes) > 3:
        yield from notes


def run_strategy(strategy: str, ring: int, a2a: int, kernel: str, q, k, v, cot, pos, seg) -> list[np.ndarray]:
    """(out, dq, dk, dv) of `strategy` over ring x a2a devices, in the original token order."""
    mesh = Mesh(np.asarray(jax.devices()).reshape(1, 1, ring, a2a, 1), MESH_AXES)
    spec = AttentionSpec(kernel=kernel, strategy=strategy, load_balance=True)
    acts = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a"), "tensor", None))
    ids = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    # zig-zag: the strategies take the tokens in their stored order (maxctx.attention.cp.load_balance)
    perm = zigzag_permutation(q.shape[1], ring * a2a)
    cot_stored = cot[:, perm].astype(jnp.float32)

    def loss(q, k, v, pos, seg):
        out = attend(q, k, v, pos, seg, spec, mesh)
        return (out.astype(jnp.float32) * cot_stored).sum(), out

    placed = [jax.device_put(x[:, perm], acts) for x in (q, k, v)] + [jax.device_put(x[:, perm], ids)
                                                                       for x in (pos, seg)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*placed)
    inverse = np.argsort(perm)
    return [np.asarray(x)[:, inverse] for x in (out, *grads)]


def strategies_table(fast: str) -> list[str]:
    n = len(jax.devices())
    if n < 2:
        return [f"One {jax.devices()[0].device_kind} here: no context axis to split, so no strategy ran "
                "(their collectives are checked on CPU devices by tests/test_context_parallel*.py)."]
    layouts = {"all_gather": (n, 1), "p2p": (n, 1), "a2a": (1, n)}
    if n >= 4 and n % 2 == 0:
        layouts["usp"] = (2, n // 2)
    b, s, h, k, d = (1, 1024, 8, 2, 32) if CPU_CHECK else (1, 8192, 32, 8, 128)
    q, kk, v, cot, pos, seg = inputs(b, s, h, k, d, documents=2)
    ref = run_kernel("dot_product", q, kk, v, cot, pos, seg, 0, f32=True)
    ref = (ref[0], *ref[2:])
    lines = [f"C = {n} ({jax.devices()[0].device_kind}), B {b}, S {s}, H {h}, K {k}, D {d}, 2 packed documents, "
             f"zig-zag load balance, kernel {fast}:", "",
             "| strategy | ring x a2a | out | dq | dk | dv | within tolerance |", "|---|---|---|---|---|---|---|"]
    for strategy, (ring, a2a) in layouts.items():
        got = run_strategy(strategy, ring, a2a, fast, q, kk, v, cot, pos, seg)
        errs = [error(g, r) for g, r in zip(got, ref)]
        ok = errs[0] <= VALUE_TOL and all(e <= GRAD_TOL for e in errs[1:])
        lines.append(f"| {strategy} | {ring} x {a2a} | " + " | ".join(f"{e:.1e}" for e in errs)
                     + f" | {'yes' if ok else 'NO'} |")
    return lines


def train(attention: str, steps: int) -> dict:
    """One train.py run; the mean tokens/s and MFU of its logged steps after the first."""
    with tempfile.TemporaryDirectory() as out:
        model = TINY if CPU_CHECK else LLAMA_1B
        cmd = [sys.executable, "train.py", "configs/base.yml", *model, f"attention={attention}",
               "per_device_batch_size=1", f"steps={steps}", "log_period=1", "dataset_type=synthetic",
               "enable_checkpointing=false", "remat_policy=full", f"base_output_directory={out}",
               f"run_name=gpu_{attention}"]
        env = dict(TRAIN_ENV)
        if CPU_CHECK:
            env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=4", "")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-600:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {"command": " ".join(cmd[1:]), "error": f"{tail}\nstopped after {TRAIN_TIMEOUT_S} s"}
        wall = time.perf_counter() - start
        if proc.returncode:
            print(f"--- {' '.join(cmd[1:])} failed:\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
            return {"command": " ".join(cmd[1:]), "error": (proc.stderr or proc.stdout).strip()[-600:]}
        records = [json.loads(line) for line in open(os.path.join(out, f"gpu_{attention}", "metrics.jsonl"))]
        logged = [r for r in records if "tokens_per_s" in r][1:]
        # over the steps' total time, not the mean of their rates (one short step would lift a mean of rates)
        seconds = sum(r["step_time_s"] for r in logged)
        rate = lambda key: sum(r[key] * r["step_time_s"] for r in logged) / seconds  # noqa: E731
        return {"command": " ".join(cmd[1:]), "steps averaged": len(logged), "tokens_per_s": rate("tokens_per_s"),
                "mfu": rate("mfu"), "step_s": seconds / len(logged), "loss": logged[-1].get("loss"), "wall_s": wall}


def timed_ms(fn, *args, repeats: int = 5) -> float:
    """Best of `repeats` timed calls of a jitted `fn` (after one for compile), in ms."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def speed_rows(b: int, s: int) -> dict:
    """row name -> (positions, segment ids, window): one document, a packed row (the synthetic data's first), and
    one document under a sliding window."""
    from maxctx.data.synthetic import SyntheticSource
    packed = SyntheticSource(128256, s, b, seed=0).batch(0)
    pos, one = jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1)), jnp.ones((b, s), jnp.int32)
    window = s // 8
    return {"one document": (pos, one, 0), f"one document, window {window}": (pos, one, window),
            "packed (synthetic row 0)": (jnp.asarray(packed["positions"]), jnp.asarray(packed["segment_ids"]), 0)}


def speed_table():
    """Forward + backward time of one layer's attention at the 1B model's training shape: each cuDNN call chosen
    on the device (the call's path in brackets), the boolean-mask call alone, cuDNN's causal mask type called
    directly (no path test), and blockwise. TFLOP/s over the causal pairs of whole rows (MaxText's MFU) and over
    the pairs the mask keeps (documents, window)."""
    from maxctx.metrics.flops import attention_pairs
    b, s, h, k, d = (1, 1024, 4, 2, 32) if CPU_CHECK else (1, 32768, 32, 8, 64)
    q, kk, v, cot, _, _ = inputs(b, s, h, k, d, documents=1)
    yield from [f"B {b}, S {s}, H {h}, K {k}, D {d}; best of 5 (blockwise: 3) after a compile; TFLOP/s counted as "
                "12 H D pairs (forward and backward, no recompute):", "",
                "| row | kernel | fwd+bwd ms | TFLOP/s on causal pairs | TFLOP/s on kept pairs |",
                "|---|---|---|---|---|"]

    def grad_fn(kernel: str, window: int):
        fn = kernel_call(kernel, h // k, window)

        def loss(q, k_, v_, pos, seg):
            out, _ = fn(q, k_, v_, pos, seg, False)
            return (out.astype(jnp.float32) * cot.astype(jnp.float32)).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def direct(window: int):  # cuDNN's own causal mask type, called as jax.nn offers it: what the causal path costs
        def loss(q, k_, v_, pos, seg):
            out = jax.nn.dot_product_attention(q, k_, v_, is_causal=True, implementation=CUDNN_IMPLEMENTATION,
                                               local_window_size=(window - 1, 0) if window else None)
            return (out.astype(jnp.float32) * cot.astype(jnp.float32)).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    for row, (p, g, window) in speed_rows(b, s).items():
        causal = attention_pairs(b, s)
        kept = attention_pairs(b, s, segment_ids=np.asarray(g), window=window)
        variants = [CUDNN_MASKED] + ([] if window else ["blockwise"])
        variants += ["cudnn is_causal, no path test"] if row.startswith("one") else []
        variants.append(CUDNN)  # last: see CASES
        for name in variants:
            label = name
            try:
                if name in (CUDNN, CUDNN_UNPACKED):
                    label = f"{name} ({cudnn_path(p, g, packed=name == CUDNN)})"
                fn = direct(window) if name.endswith("no path test") else grad_fn(name, window)
                ms = timed_ms(fn, q, kk, v, p, g, repeats=3 if name == "blockwise" else 5)
            except Exception as e:  # a failure is a result of the check
                yield f"| {row} | {label} | {failure(e, 200)} | | |"
                if name == CUDNN:  # try without the packed call, compiled into every natural-order call
                    variants.append(CUDNN_UNPACKED)
                continue
            yield (f"| {row} | {label} | {ms:.1f} | {12 * h * d * causal / ms / 1e9:.1f} | "
                   f"{12 * h * d * kept / ms / 1e9:.1f} |")


def run_part(part: str) -> None:
    """Prints the `part` table (kernels or speed) from a child process; if the child dies or hangs, says so."""
    sys.stdout.flush()
    cmd = [sys.executable, os.path.abspath(__file__), f"--part-child={part}"] + (["--cpu-check"] if CPU_CHECK else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=PART_TIMEOUT_S[part])
    except subprocess.TimeoutExpired:
        print(f"\n(the {part} part was stopped after {PART_TIMEOUT_S[part]} s; the rows above are what it had "
              "printed)")
        return
    if proc.returncode:
        tail = " / ".join(proc.stderr.strip().splitlines()[-3:])[-600:]
        print(f"\n(the {part} part stopped with exit code {proc.returncode}: {tail})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-check", action="store_true", help="4 CPU devices, blockwise for cuDNN, tiny model")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--parts", default="kernels,strategies,train",
                        help="comma-separated: kernels, speed, strategies, train")
    parser.add_argument("--part-child", choices=("kernels", "speed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part_child:
        for line in kernels_table() if args.part_child == "kernels" else speed_table():
            print(line, flush=True)
        return
    parts = set(args.parts.split(","))
    fast = "blockwise" if CPU_CHECK else "cudnn"
    print("# GPU check\n")
    print(f"Written by `python3 benchmarks/gpu_check.py{' --cpu-check' if CPU_CHECK else ''}` on "
          f"{len(jax.devices())} x {jax.devices()[0].device_kind} (jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')})." + (" A CPU check of the script: no GPU number below." if CPU_CHECK
                                                else ""))
    if "kernels" in parts:
        print("\n## Kernels against dot_product in fp32 (max |x - ref| / max |ref|)\n")
        run_part("kernels")
    if "speed" in parts:
        print("\n## Kernel speed: one layer's attention, forward and backward\n")
        run_part("speed")
    if "strategies" in parts:
        print("\n## Strategies against the one-device reference\n")
        print("\n".join(strategies_table(fast)), flush=True)
    if "train" not in parts:
        return
    print("\n## Training throughput\n")
    print("| attention | s/step | tokens/s | MFU | last loss | steps averaged | wall | command |\n"
          "|---|---|---|---|---|---|---|---|")
    for attention in ("flash", "blockwise"):
        r = train(attention, args.steps)
        if "error" in r:
            print(f"| {attention} | failed: {r['error'].splitlines()[-1][:200]} | | | | | | `{r['command']}` |")
        else:
            print(f"| {attention} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                  f"{r['loss']:.4f} | "
                  f"{r['steps averaged']} | {r['wall_s']:.0f} s | `{r['command']}` |", flush=True)


if __name__ == "__main__":
    main()
