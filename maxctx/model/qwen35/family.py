"""The Qwen3.5 family as maxctx.model.family states a family (no JAX): `full_attention_interval` = P layers a period,
the first P - 1 Gated DeltaNet (linear attention), the last gated full attention; each with Llama's SwiGLU MLP and
(1 + w) RMSNorms (Gemma's form, as transformers' Qwen3_5RMSNorm).

Legend: D model, H query heads, K kv heads, E head dim, F mlp, L layers, Nk / Nv linear key / value heads, Dk / Dv
their head dims, X = 2 Nk Dk + Nv Dv convolution channels, W kernel. Parameters per layer besides the MLP (3 D F)
and the two norms (2 D):

    full     q (with its output gate) [D, H, 2, E], k, v [D, K, E], o [H, E, D], q_norm, k_norm [E]
    linear   qkv [D, X], z [D, Nv, Dv], b, a [D, Nv], conv [X, W], A_log, dt_bias [Nv], norm [Dv], out [Nv, Dv, D]

The planner's view is per layer, so `tensors` and `activation` are the average over a period of (P - 1) linear
layers and one full one. A linear layer's tensors per token and device (its heads are not split over tensor
parallelism: maxctx.model.qwen35.cp runs them whole):

    query_proj   X b        forward 2 D X           q | k | v before the convolution
    context      Nv Dv b                            the delta rule's output; its chunked FLOPs, about
                                                    2 Nv (2 L (Dk + Dv) + 3 Dk Dv) with chunk L = 64, counted here
    out_proj     D b        2 Nv Dv D (and 2 D (Nv Dv + 2 Nv) for z, b, a, which no remat name keeps)

and the full layer's are Llama's with the query's output gate (q twice as wide). `tile`: the larger of the
SwiGLU's and the delta rule's fp32 chunk operands per token, 4 Nv (5 Dk + 2 Dv + 3 L). The calibrated `work` is
Llama's, fitted on llama3-8b, not on this family.
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config, ConfigError
from maxctx.model.family import DecoderOptions, Stack, Tensor
from maxctx.model.llama import family as llama
from maxctx.model.qwen35 import hf_layout
from maxctx.model.shape import ModelShape


@dataclasses.dataclass(frozen=True)
class Qwen35Options(DecoderOptions):
    """What the qwen3_5 layer kind reads (ModelConfig.options), besides the decoder's (1 + w) final norm."""

    interval: int = 4
    linear_dims: tuple[int, int, int, int] = (16, 32, 128, 128)  # Nk, Nv, Dk, Dv
    conv_width: int = 4
    rotary_dims: int = 64  # of each full-attention head's E, the first rotary_dims rotate


@dataclasses.dataclass(frozen=True)
class Qwen35Shape(ModelShape):
    interval: int = 4
    linear_dims: tuple[int, int, int, int] = (16, 32, 128, 128)
    conv_width: int = 4

    @property
    def full_layers(self) -> int:
        return self.num_layers // self.interval

    @property
    def full_matmul_params(self) -> int:
        return self.emb_dim * self.head_dim * (3 * self.num_heads + 2 * self.num_kv_heads) + self.mlp_params

    @property
    def linear_matmul_params(self) -> int:
        nk, nv, dk, dv = self.linear_dims
        return self.emb_dim * (2 * nk * dk + 3 * nv * dv + 2 * nv) + self.mlp_params

    @property
    def matmul_params(self) -> int:
        linear = self.num_layers - self.full_layers
        return (self.full_layers * self.full_matmul_params + linear * self.linear_matmul_params
                + self.output_params)

    @property
    def num_params(self) -> int:
        nk, nv, dk, dv = self.linear_dims
        linear_extra = (2 * nk * dk + nv * dv) * self.conv_width + 2 * nv + dv
        norms = 2 * self.emb_dim * self.num_layers + self.full_layers * 2 * self.head_dim
        return (self.matmul_params + (self.num_layers - self.full_layers) * linear_extra + norms
                + self.output_params * (0 if self.tied_embedding else 1) + self.emb_dim)

    def attention_flops(self, pairs: float) -> float:
        """Only the full layers attend: `pairs` summed over every layer, so their share."""
        return super().attention_flops(pairs) * self.full_layers / self.num_layers


CHUNK = 64  # maxctx.model.qwen35.gdn.CHUNK (that module needs JAX)


def _average(shape: Qwen35Shape, full: dict[str, Tensor], linear: dict[str, Tensor]) -> dict[str, Tensor]:
    share = shape.full_layers / shape.num_layers
    return {name: Tensor(share * full[name].bytes + (1 - share) * linear.get(name, Tensor(0.0)).bytes,
                         share * full[name].flops + (1 - share) * linear.get(name, Tensor(0.0)).flops)
            for name in full}


def tensors(shape: Qwen35Shape, tp: int, context_copies: int) -> dict[str, Tensor]:
    """Per token and device, averaged over a period (module doc)."""
    full = llama.tensors(shape, tp, context_copies)
    d, b = shape.emb_dim, shape.itemsize
    q = full["query_proj"]
    full["query_proj"] = Tensor(2 * q.bytes, 2 * q.flops)
    nk, nv, dk, dv = shape.linear_dims
    x = 2 * nk * dk + nv * dv
    linear = {"decoder_layer_input": full["decoder_layer_input"], "query_proj": Tensor(x * b, 2 * d * x),
              "context": Tensor(nv * dv * b, 2 * nv * (2 * CHUNK * (dk + dv) + 3 * dk * dv)),
              "out_proj": Tensor(d * b, 2 * nv * dv * d + 2 * d * (nv * dv + 2 * nv)),
              "mlpwi": full["mlpwi"], "mlpwo": full["mlpwo"]}
    return _average(shape, full, linear)


def activation(shape: Qwen35Shape, tp: int) -> float:
    """Bytes per token of one layer's forward through HBM, averaged over a period: a linear layer writes and reads
    its six [t, D], q | k | v before and after the convolution, z, b, a, the delta rule's output, the SwiGLU's."""
    nk, nv, dk, dv = shape.linear_dims
    linear = 2 * shape.itemsize * (6 * shape.emb_dim + 2 * (2 * nk * dk + nv * dv) + 2 * nv * dv + 2 * nv
                                   + 3 * shape.mlp_dim / tp)
    full = llama.activation(shape, tp) + 2 * shape.itemsize * shape.num_heads * shape.head_dim / tp
    share = shape.full_layers / shape.num_layers
    return share * full + (1 - share) * linear


def tile(shape: Qwen35Shape, tp: int) -> float:
    nk, nv, dk, dv = shape.linear_dims
    return max(llama.tile(shape, tp), 4 * nv * (5 * dk + 2 * dv + 3 * CHUNK))


def _linear_dims(config: Config) -> tuple[int, int, int, int]:
    return (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim)


def shape(config: Config) -> Qwen35Shape:
    base = ModelShape.from_config(config)
    return Qwen35Shape(**dataclasses.asdict(base), interval=config.full_attention_interval,
                       linear_dims=_linear_dims(config), conv_width=config.linear_conv_kernel_dim)


def options(config: Config) -> Qwen35Options:
    return Qwen35Options(norm_offset=1.0, interval=config.full_attention_interval, linear_dims=_linear_dims(config),
                         conv_width=config.linear_conv_kernel_dim,
                         rotary_dims=2 * int(config.head_dim * config.partial_rotary_factor // 2))


def check(config: Config) -> None:
    llama.check(config)
    layers, interval = config.base_num_decoder_layers, config.full_attention_interval
    if interval < 1 or layers % interval:
        raise ConfigError(f"full_attention_interval={interval} must divide base_num_decoder_layers={layers} (the "
                          f"layers run in periods of interval - 1 linear layers and one full one; Qwen3.5: 4)")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ConfigError(f"linear_num_value_heads={config.linear_num_value_heads} must be a multiple of "
                          f"linear_num_key_heads={config.linear_num_key_heads} (each key head serves a group)")
    if not 0 < config.partial_rotary_factor <= 1:
        raise ConfigError(f"partial_rotary_factor={config.partial_rotary_factor} must be in (0, 1] (Qwen3.5: 0.25)")
    cp = config.ici_context_parallelism * config.dcn_context_parallelism
    if cp > 1 and config.context_parallel_load_balance not in (True, False):
        raise ConfigError(f"context_parallel_load_balance={config.context_parallel_load_balance} places each "
                          f"batch's documents on the context ranks, and decoder_block={config.decoder_block}'s linear "
                          f"layers scan the sequence in a fixed rank order (maxctx.model.qwen35.cp); set "
                          f"context_parallel_load_balance=true (the zig-zag) or false")


def stacks(config: Config) -> tuple[Stack, ...]:
    return (Stack("qwen3_5", config.base_num_decoder_layers // config.full_attention_interval),)


QWEN3_5 = dataclasses.replace(
    llama.LLAMA, name="qwen3_5", shape=shape, tensors=tensors, activation=activation, tile=tile, check=check,
    stacks=stacks, hf_layout=hf_layout, options=options)
