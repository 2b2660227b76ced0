"""Input pipeline throughput beside the train step's, for the tiny model on 8 simulated CPU devices.

    python benchmarks/input_pipeline.py [--steps 30] [--workers 0] [--out benchmarks/input_pipeline.md]

Builds a generated corpus in a temporary folder (a sentencepiece model, raw-text and token-id ArrayRecord
shards, a jsonl file), then measures tokens/s of
  - the pipeline alone, per source (next() until the global arrays are ready; text sources tokenize on the fly),
  - the compiled train step alone, on one batch held on device,
  - the loop (next batch + step) with the pipeline feeding it,
and prints the ratio pipeline / step: above 1 means the pipeline keeps ahead of the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxctx.data.pipeline import create_data_iterator  # noqa: E402
from maxctx.data.prepare import prepare_shards  # noqa: E402
from maxctx.loader import load_config  # noqa: E402
from maxctx.mesh import create_mesh  # noqa: E402
from tests.support import fixtures as F  # noqa: E402


def build_corpus(root: str, documents: int) -> dict[str, list[str]]:
    docs = F.make_documents(documents, seed=0, min_words=20, max_words=400)
    tok = F.tiny_tokenizer(os.path.join(root, "sp.model"), docs[:5000], vocab_size=256)
    for k in range(4):
        F.write_arrayrecord(os.path.join(root, f"text-{k}.array_record"), [d.encode() for d in docs[k::4]])
    F.write_jsonl(os.path.join(root, "docs.jsonl"), docs)
    prepare_shards(os.path.join(root, "docs.jsonl"), tok, os.path.join(root, "tokens"), 4, progress=False)
    return {
        "arrayrecord text (tokenized on the fly)": ["dataset_type=arrayrecord",
                                                    f"grain_train_files={root}/text-*", f"tokenizer_path={tok}"],
        "arrayrecord token ids": ["dataset_type=arrayrecord", f"grain_train_files={root}/tokens-*"],
        "jsonl text (tokenized on the fly)": ["dataset_type=text", f"grain_train_files={root}/docs.jsonl",
                                              f"tokenizer_path={tok}"],
    }


def pipeline_tokens_per_s(config, mesh, steps: int) -> tuple[float, float]:
    """(tokens/s, fraction of tokens that carry loss weight, i.e. are not padding)."""
    it = create_data_iterator(config, mesh, "train")
    for _ in range(3):
        jax.block_until_ready(next(it))
    start = time.perf_counter()
    weights = []
    for _ in range(steps):
        batch = jax.block_until_ready(next(it))
        weights.append(batch["weights"])
    seconds = time.perf_counter() - start
    it.close()
    return steps * batch["inputs"].size / seconds, float(np.mean([np.asarray(w).mean() for w in weights]))


def step_tokens_per_s(config, mesh, steps: int) -> tuple[float, float]:
    """(step alone, loop with the pipeline feeding it) tokens/s."""
    from maxctx.train_step import compile_train_step, init_state, make_setup

    setup = make_setup(config, mesh)
    compiled = compile_train_step(setup)
    state = init_state(setup)
    it = create_data_iterator(config, mesh, "train")
    batch = next(it)
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    alone = steps * batch["inputs"].size / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, next(it))
    jax.block_until_ready(metrics)
    fed = steps * batch["inputs"].size / (time.perf_counter() - start)
    it.close()
    return alone, fed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=0, help="grain_worker_count")
    parser.add_argument("--out", default="", help="also write the results as markdown here")
    args = parser.parse_args(argv)
    overrides = [f"grain_worker_count={args.workers}"]
    with tempfile.TemporaryDirectory() as root:
        sources = build_corpus(root, args.documents)
        base = load_config(overrides)
        mesh = create_mesh(base)
        rows, seq = base.global_batch_size(mesh.devices.size), base.max_target_length
        step_alone, step_fed = step_tokens_per_s(load_config([*overrides, *sources["arrayrecord text (tokenized "
                                                                                    "on the fly)"]]), mesh, args.steps)
        results = [(name, pipeline_tokens_per_s(load_config([*overrides, *keys]), mesh, args.steps))
                   for name, keys in sources.items()]
    lines = [f"tiny model ({base.model_name}), {mesh.devices.size} simulated CPU devices, mesh {dict(mesh.shape)}, "
             f"global batch {rows} x {seq} tokens, packing={base.packing}, grain_worker_count={args.workers}, "
             f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end; the loop's prefetch "
             f"thread competes with XLA's threads for these cores)", "",
             "| what | tokens/s | pipeline / step | tokens not padding |", "| --- | ---: | ---: | ---: |",
             f"| train step alone (one batch held on device) | {step_alone:,.0f} | | |"]
    lines += [f"| pipeline alone: {name} | {tps:,.0f} | {tps / step_alone:.1f}x | {real:.1%} |"
              for name, (tps, real) in results]
    lines.append(f"| loop: pipeline (arrayrecord text) feeding the step | {step_fed:,.0f} | "
                 f"{step_fed / step_alone:.2f} of the step alone | |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "python benchmarks/input_pipeline.py " + " ".join(argv)
        with open(args.out, "w") as f:
            f.write(f"# Input pipeline vs train step throughput\n\nCommand: `{command.strip()}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
