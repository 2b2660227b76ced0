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
    context      Nv Dv b                            the delta rule's output; its chunked FLOPs
                                                    (`delta_rule_flops`, chunk L = 64), which a recompute reruns
    out_proj     D b        2 Nv Dv D (and 2 D (Nv Dv + 2 Nv) for z, b, a, which no remat name keeps)

and the full layer's are Llama's with the query's output gate (q twice as wide). `tile`: the larger of the
SwiGLU's and the delta rule's fp32 operands per token: the chunk terms 4 Nv (5 Dk + 2 Dv + 3 L), the convolution's
output and q, k (repeated to the value heads) and v 4 (X + 2 Nv Dk + Nv Dv), and the states the scan keeps for the
backward, once per checkpointed group of G = 16 chunks (maxctx.model.qwen35.gdn._scan_chunks), with under CP the
run's map (A, U): 4 Nv (2 Dk Dv + Dk Dk) / (L G). Compiled for one v5p chip at 65,536 tokens, Qwen3.5-9B's layer
(forward and backward) holds 255 KiB of temporaries per token against this tile's 222 KiB (benchmarks/gdn_speed.md;
488 KiB before the groups, when the scan kept every chunk's terms). The calibrated `work` is Llama's, fitted on
llama3-8b, not on this family.

The time model (maxctx.plan.step_time) reads the shape's `linear_flops` (the delta rule, forward and backward, at
the matmul rate) and `linear_exchange` (the CP prefix scan's bytes and its steps, each with the link's latency,
none hidden behind compute), and prices the CP strategy's collectives for the `attention_layers` only.
"""

from __future__ import annotations

import dataclasses
import math

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

    @property
    def attention_layers(self) -> int:
        return self.full_layers

    def linear_flops(self, tokens: float, cp: int = 1) -> float:
        """Forward + backward FLOPs of the linear layers' delta rule over `tokens` tokens: 4 x `delta_rule_flops`
        (the backward runs each checkpointed group's forward again: maxctx.model.qwen35.gdn._scan_chunks)."""
        return 4.0 * (self.num_layers - self.full_layers) * tokens * delta_rule_flops(self.linear_dims, cp)

    def linear_exchange(self, batch: float, cp: int, zigzag: bool) -> tuple[float, int]:
        nk, nv, dk, dv = self.linear_dims
        return (exchange_bytes(batch, nv, dk, dv, 2 * nk * dk + nv * dv, self.conv_width, self.itemsize, cp, zigzag),
                exchange_steps(cp, zigzag))


CHUNK, GROUP = 64, 16  # maxctx.model.qwen35.gdn.CHUNK and GROUP (that module needs JAX)


def delta_rule_flops(linear_dims: tuple[int, int, int, int], cp: int = 1) -> float:
    """Forward FLOPs per token of one linear layer's chunked delta rule (maxctx.model.qwen35.gdn, chunk L), 2 a
    multiply-add, per value head: within a chunk k k^T and q k^T (2 L K), the two unit-triangular solves (L K / 2 +
    L V / 2) and the scores times the corrected values (L V); per token with the state w M, q M, k^T v (3 K V).
    Under CP (cp > 1) each rank also builds its run's map (gdn.transition): k^T w, k^T u (K K + K V) and the
    chunk-to-chunk products a_c A, a_c U ((K K K + K K V) / L)."""
    _, nv, dk, dv = linear_dims
    macs = CHUNK * (2.5 * dk + 1.5 * dv) + 3 * dk * dv
    if cp > 1:
        macs += dk * (dk + dv) * (1 + dk / CHUNK)
    return 2.0 * nv * macs


def exchange_steps(cp: int, zigzag: bool) -> int:
    """Collective-permutes one linear layer's forward waits for in turn (maxctx.model.qwen35.cp): the halo, the
    prefix scan's ceil(log2 C) steps and the shift of its result; under the zig-zag the second scan's steps too."""
    if cp == 1:
        return 0
    steps = math.ceil(math.log2(cp))
    return 2 + steps * (2 if zigzag else 1)


def exchange_bytes(batch: float, heads: int, key_dim: int, value_dim: int, channels: int, width: int,
                   itemsize: int, cp: int, zigzag: bool = False) -> float:
    """Bytes one rank receives by collective-permute in one linear layer's forward (maxctx.model.qwen35.cp's module
    doc: the halo and the fp32 states of the prefix scan, whatever the sequence length); the backward's transposed
    permutes move as many, less the segment ids' 4 (W - 1) B (compiled for 4 and 8 CPU devices)."""
    if cp == 1:
        return 0
    steps = math.ceil(math.log2(cp))
    state = 4 * batch * heads * ((steps - 1) * (key_dim * key_dim + key_dim * value_dim) + 2 * key_dim * value_dim)
    return (2 if zigzag else 1) * ((width - 1) * batch * (channels * itemsize + 4) + state)


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
              "context": Tensor(nv * dv * b, delta_rule_flops(shape.linear_dims)),
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


def delta_rule_tile(linear_dims: tuple[int, int, int, int]) -> float:
    """Bytes per token of the delta rule's fp32 operands and kept states (module doc)."""
    nk, nv, dk, dv = linear_dims
    chunk_terms = nv * (5 * dk + 2 * dv + 3 * CHUNK)
    inputs = 2 * nk * dk + nv * dv + 2 * nv * dk + nv * dv  # the convolution's output, q and k per value head, v
    return 4 * (chunk_terms + inputs + nv * (2 * dk * dv + dk * dk) / (CHUNK * GROUP))


def tile(shape: Qwen35Shape, tp: int) -> float:
    return max(llama.tile(shape, tp), delta_rule_tile(shape.linear_dims))


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
