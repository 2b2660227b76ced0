"""One MoE block (router, experts, load sums), forward and backward, compiled for one v5p chip: its temporaries
against what the planner holds for it.

`python3 benchmarks/moe_block_compile.py [--tokens 16384] [--models qwen3-30b-a3b gpt-oss-20b]` builds each
model's expert block (maxctx.model.moe.layers.MoeBlock, maxctx.model.gpt_oss.layers.GptOssExperts) as the train
step does, on a one-chip mesh with libtpu (no TPU needed; moe_kernel=auto: megablox), compiles the gradient of
every parameter and the input over T tokens, and prints a markdown row per model: the compiled temporaries, and
the planner's `tile` (the family's bytes per token of its largest non-attention tile) times T.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

GIB = 2**30


def block_and_config(model: str, mesh):
    from flax import nnx

    from maxctx.loader import load_config
    from maxctx.model import families
    from maxctx.model.gpt_oss.layers import GptOssExperts
    from maxctx.model.layers import ModelConfig
    from maxctx.model.moe.layers import MoeBlock

    config = load_config(["configs/base.yml", f"model_name={model}", "moe_kernel=megablox"])
    family = families.for_config(config)
    cfg = ModelConfig.from_config(config)
    block = GptOssExperts if config.decoder_block == "gpt_oss" else MoeBlock
    return nnx.eval_shape(lambda: block(cfg, nnx.Rngs(0), mesh)), family.tile(family.shape(config), 1), cfg


def compile_block(model: str, tokens: int, mesh, vmem_kib: int) -> dict:
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    abstract, tile, cfg = block_and_config(model, mesh)
    graphdef, state = nnx.split(abstract)
    at = NamedSharding(mesh, P())
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=at), state)
    x = jax.ShapeDtypeStruct((1, tokens, cfg.emb_dim), jnp.bfloat16, sharding=at)
    seg = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=at)

    def loss(params, x, seg):
        y, sums = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(sums["moe_load"] * sums["moe_prob"])

    start = time.time()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, seg).compile(
        {"xla_tpu_scoped_vmem_limit_kib": vmem_kib})
    return {"temp": compiled.memory_analysis().temp_size_in_bytes, "tile": tile * tokens,
            "seconds": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    args = parser.parse_args()
    from jax.sharding import Mesh

    from maxctx.parallelism import MESH_AXES
    from maxctx.plan import topology

    target = topology.parse("v5p-8")
    device = topology.topology_devices(target)[0]
    mesh = Mesh(np.asarray([device]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    print("| model | tokens | temporaries (GiB) | planner tile x T (GiB) | compiled / tile | compile |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        r = compile_block(model, args.tokens, mesh, target.chip.scoped_vmem_kib)
        print(f"| {model} | {args.tokens:,} | {r['temp'] / GIB:.2f} | {r['tile'] / GIB:.2f} | "
              f"{r['temp'] / r['tile']:.2f} | {r['seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
