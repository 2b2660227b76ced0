"""Peak host memory (RSS) of `python -m maxctx.convert from_hf` (and `to_hf`) on a synthetic Hugging Face
directory whose tensors total about N bytes.

    python benchmarks/convert_memory.py [--gib 4] [--dir /tmp/convert_memory] [--weight_dtype bfloat16] [--to_hf]

The directory holds a Llama-shaped model in bf16 (width 2048, MLP 5632, 16 heads, vocab 32000: about 103 MB a
layer), with as many layers as make N, in 2 GB shards with an index, as released models come; its values are
random. Each conversion runs as a child process and its peak RSS is read from the kernel (`wait4`'s ru_maxrss),
which counts every resident page the process had, file-backed ones included. Printed: N, the largest stacked
parameter, the peak RSS, the issue's bound 0.5 N + 1 GiB, and the time. The directories are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxctx.convert import safetensors  # noqa: E402
from maxctx.model.shape import dtype_bytes  # noqa: E402

D, F, HEADS, VOCAB = 2048, 5632, 16, 32000
SHARD = 2 * 10**9


def synthetic_model(directory: str, gib: float) -> tuple[int, int]:
    """Writes the directory; returns (N bytes of tensors, bytes of the largest per-layer tensor)."""
    layer = {"self_attn.q_proj.weight": (D, D), "self_attn.k_proj.weight": (D, D), "self_attn.v_proj.weight": (D, D),
             "self_attn.o_proj.weight": (D, D), "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D),
             "mlp.down_proj.weight": (D, F), "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    per_layer = 2 * sum(int(np.prod(s)) for s in layer.values())
    fixed = {"model.embed_tokens.weight": (VOCAB, D), "lm_head.weight": (VOCAB, D), "model.norm.weight": (D,)}
    layers = max(1, round((gib * 2**30 - 2 * sum(int(np.prod(s)) for s in fixed.values())) / per_layer))
    specs = [(n, s) for n, s in fixed.items()]
    specs += [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in layer.items()]
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": F,
              "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": layers,
              "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    shards, size = [[]], 0
    for name, shape in specs:
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    rng, weight_map = np.random.default_rng(0), {}
    block = rng.standard_normal(2**22).astype(ml_dtypes.bfloat16)  # 8 MB of values, tiled (fast to write)
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = (np.resize(block, shape) for _, shape in shard)
        safetensors.write(os.path.join(directory, file), [(n, block.dtype, s) for n, s in shard], arrays)
        weight_map.update({n: file for n, _ in shard})
    total = sum(2 * int(np.prod(s)) for _, s in specs)
    with open(os.path.join(directory, safetensors.INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, 2 * F * D


def peak_rss(command: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of a child process."""
    start = time.time()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed ({os.waitstatus_to_exitcode(status)})")
    return usage.ru_maxrss * 1024, time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="N, the tensors' total size (GiB)")
    parser.add_argument("--dir", default="/tmp/convert_memory")
    parser.add_argument("--weight_dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--to_hf", action="store_true", help="also measure the export back to HF (bf16)")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, ckpt, out = (os.path.join(args.dir, d) for d in ("hf", "ckpt", "out"))
    try:
        start = time.time()
        total, largest = synthetic_model(hf, args.gib)
        print(f"synthetic HF directory: N = {total / 2**30:.2f} GiB of bf16 tensors, written in "
              f"{time.time() - start:.0f}s")
        layers = json.load(open(os.path.join(hf, "config.json")))["num_hidden_layers"]
        print(f"largest stacked parameter in weight_dtype={args.weight_dtype}: "
              f"{layers * largest // 2 * dtype_bytes(args.weight_dtype) / 2**30:.2f} GiB ({layers} layers)")
        bound = 0.5 * total + 2**30
        runs = [("from_hf", ["from_hf", "--hf_path", hf, "--output_path", ckpt, f"weight_dtype={args.weight_dtype}"])]
        if args.to_hf:
            runs.append(("to_hf", ["to_hf", "--checkpoint_path", ckpt, "--output_path", out, "--dtype", "bf16"]))
        for name, command in runs:
            rss, seconds = peak_rss([sys.executable, "-m", "maxctx.convert", *command])
            print(f"{name}: peak RSS {rss / 2**30:.2f} GiB = {rss / total:.2f} N (bound 0.5 N + 1 GiB = "
                  f"{bound / 2**30:.2f} GiB: {'under' if rss < bound else 'OVER'}), {seconds:.0f}s")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
