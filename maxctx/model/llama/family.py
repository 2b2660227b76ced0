"""The Llama / Mistral family as maxctx.model.family states a family (no JAX).

Legend: D model, H query heads, K kv heads, Dh head dim, F mlp, T tensor parallelism, b bytes per activation.
Per token and device, each remat name (maxctx.config.REMAT_NAMES; maxctx.model.layers tags them):

    decoder_layer_input  D b
    query_proj           H/T Dh b      forward 2 D H/T Dh FLOPs
    key_proj, value_proj K/T Dh b      each 2 D K/T Dh      (K/T at least 1: kv heads repeat past K)
    context              (c H/T Dh + 2 H/T) b   c copies of the attention output, and the ring's fp32 log-sum-exp
    out_proj             D b           2 H/T Dh D
    mlpwi                2 F/T b       4 D F/T              (gate and up)
    mlpwo                D b           2 F/T D
"""

from __future__ import annotations

from maxctx.config import Config, ConfigError, layer_windows
from maxctx.model.family import LayerWork, ModelFamily, Stack, Tensor
from maxctx.model.llama import hf_layout
from maxctx.model.shape import ModelShape


def tensors(shape: ModelShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    d, hd, b = shape.emb_dim, shape.head_dim, shape.itemsize
    h, k, f = shape.num_heads // tp, max(1, shape.num_kv_heads // tp), shape.mlp_dim // tp
    return {"decoder_layer_input": Tensor(d * b),
            "query_proj": Tensor(h * hd * b, 2 * d * h * hd), "key_proj": Tensor(k * hd * b, 2 * d * k * hd),
            "value_proj": Tensor(k * hd * b, 2 * d * k * hd), "context": Tensor((context_copies * h * hd + 2 * h) * b),
            "out_proj": Tensor(d * b, 2 * h * hd * d), "mlpwi": Tensor(2 * f * b, 4 * d * f),
            "mlpwo": Tensor(d * b, 2 * f * d)}


def activation(shape: ModelShape, tp: int) -> float:
    """Bytes per token of one layer's forward through HBM: every matmul operand and result written and read once
    (six [t, D] around the norms and residuals, q/k/v, the SwiGLU's three [t, F])."""
    heads, kv = shape.num_heads, shape.num_kv_heads
    return 2 * shape.itemsize * (6 * shape.emb_dim + (2 * heads + 2 * kv) * shape.head_dim / tp
                                 + 3 * shape.mlp_dim / tp)


def tile(shape: ModelShape, tp: int) -> float:
    """Bytes per token of the SwiGLU's gate, up and product [t, F / T] live at once."""
    return 3 * shape.mlp_dim / tp * shape.itemsize


def check(config: Config) -> None:
    if config.base_num_query_heads % config.base_num_kv_heads:
        raise ConfigError(f"base_num_query_heads={config.base_num_query_heads} is not divisible by "
                          f"base_num_kv_heads={config.base_num_kv_heads}; grouped-query attention needs a multiple")
    if config.head_dim % 2:
        raise ConfigError(f"head_dim={config.head_dim} must be even for rotary embeddings")


def stacks(config: Config) -> tuple[Stack, ...]:
    """One stack: every layer the same block, local or global by the attention layer pattern."""
    return (Stack("llama", config.base_num_decoder_layers, layer_windows(config)),)


# The residual stream's working set in a layer's backward (norms, residuals, out_proj and the MLP's [t, D] ends
# and their gradients), bytes per token and model width, the same wherever the layer inputs are: calibrated on the
# fit table's llama3-8b p2p and usp rows on v5p-128 (compiled memory minus the rest of maxctx.plan.memory's
# estimate; docs/choosing_a_strategy.md). The inputs kept in HBM are charged at memory.KEPT_ON_DEVICE x their bytes,
# which is what the separate constant for them was (64 against 38 before the attention's and the MLP's terms
# were their own).
WORK = LayerWork(offloaded=32, on_device=32)

LLAMA = ModelFamily(
    name="llama2", shape=ModelShape.from_config, tensors=tensors,
    remat_groups=(("input", ("decoder_layer_input",)), ("qkv", ("query_proj", "key_proj", "value_proj")),
                  ("context", ("context",)), ("out_proj", ("out_proj",)), ("mlpwi", ("mlpwi",)),
                  ("mlpwo", ("mlpwo",))),
    activation=activation, tile=tile, work=WORK, check=check, stacks=stacks, hf_layout=hf_layout,
    logical_axes=("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers"),
)
