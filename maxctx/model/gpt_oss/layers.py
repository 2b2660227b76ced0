"""The gpt_oss layer kind (`gpt_oss` in maxctx.model.stacks), as transformers' GptOssDecoderLayer computes it: a
pre-norm block, x + attn(norm(x)), then + experts(norm(x)).

Legend: B batch, S sequence, D model width, H query heads, K kv heads, E head dim, X experts, k experts per token,
M an expert's width, T one device's tokens of one chunk.

Attention: Qwen 2's (q, k, v biases; maxctx.model.qwen.layers) with an output bias bo[D] and attention sinks
sinks[H] (maxctx.attention.kernels.sinks: a logit per head in every row's softmax denominator), which the
attention's kernels and CP strategies merge once per row.

Experts (per device, its own tokens, as maxctx.model.moe.layers.MoeBlock runs them):

    router    logits[T, X] = x W_r + b_r; (l, i)[T, k] = top-k of the logits; w = softmax(l) over the k
    experts   gate, up [T k, M] = x W_gate + b_gate, x W_up + b_up (grouped_swiglu's ragged_dot, its bias hook)
              h = (clip(up, -c, c) + 1) * g sigmoid(alpha g), g = min(gate, c)    (alpha 1.702, c 7.0)
    combine   y[T, D] = sum over k of w (h W_down + b_down)

The load-balancing loss is the MoE families' (transformers' load_balancing_loss_func, which GptOssForCausalLM uses
on the router's logits, bias included: softmax over all X, top-k of it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from maxctx.attention.cp.sharded import shard_map
from maxctx.attention.dispatch import attend
from maxctx.model.layers import ModelConfig, param
from maxctx.model.moe import kernels
from maxctx.model.moe.layers import (
    MoeLayer,
    device_sums,
    expert_axes,
    gathered,
    load_sums,
    router_logits,
    swiglu_for,
)
from maxctx.model.qwen.layers import QwenAttention, zeros
from maxctx.model.tiling import map_chunks, sum_chunks
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES, EXPERT_AXES, TENSOR_AXIS


class GptOssAttention(QwenAttention):
    """Qwen's attention with biases (cfg.options.bias: bq, bk, bv and bo[D]) and sinks[H], split by heads with wq
    under attention_head_chunks; no QK-norm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        if cfg.options.bias:
            self.bo = zeros((cfg.emb_dim,), ("embed",), cfg.weight_dtype)
        self.sinks = zeros((cfg.num_heads,), ("heads",), cfg.weight_dtype)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        out_BSD = super().__call__(x_BSD, positions_BS, segment_ids_BS, window)
        # Once, outside the head groups, whose outputs add up to the projection.
        return out_BSD + self.bo[...].astype(out_BSD.dtype) if self.cfg.options.bias else out_BSD

    def head_weights(self):
        return (*super().head_weights(), (self.sinks, 0))

    def _heads(self, x_BSD, positions_BS, segment_ids_BS, spec, wq, wk, wv, wo, *extra):
        *biases, sinks_H = extra
        q, k, v = self.qkv(x_BSD, positions_BS, spec, wq, wk, wv, *biases)
        out_BSHE = checkpoint_name(attend(q, k, v, positions_BS, segment_ids_BS, spec, self.mesh, sinks_H=sinks_H),
                                   "context")
        return jnp.einsum("BSHE,HED->BSD", out_BSHE, wo.astype(self.cfg.dtype))


def route(x_TD, router_DX, bias_X, top_k: int, dtype):
    """(weights [..., k] fp32, experts [..., k] int32): the top-k logits, softmaxed over the k."""
    logits, experts = jax.lax.top_k(router_logits(x_TD, router_DX, dtype, bias_X), top_k)
    return jax.nn.softmax(logits, axis=-1), experts


def clamped_glu(gate, up, alpha: float, limit: float):
    """GPT-OSS's gated activation of the experts (module doc)."""
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(alpha * gate)


class GptOssExperts(nnx.Module):
    """router [D, X], router_bias [X], w_gate_up [X, D, M, 2], b_gate_up [X, M, 2] (gate [..., 0], up [..., 1]:
    the release's fused, interleaved layout, maxctx.model.gpt_oss.hf_layout), w_down [X, M, D], b_down [X, D];
    returns (y[B, S, D], maxctx.model.moe.layers.load_sums)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d, x, m, wd = cfg.emb_dim, cfg.options.num_experts, cfg.options.mlp_dim, cfg.weight_dtype
        self.router = param(rngs, (d, x), ("embed", "expert"), wd)
        self.router_bias = zeros((x,), ("expert",), wd)
        self.w_gate_up = param(rngs, (x, d, m, 2), ("expert", "embed", "mlp", None), wd, scale=d**-0.5)
        self.b_gate_up = zeros((x, m, 2), ("expert", "mlp", None), wd)
        self.w_down = param(rngs, (x, m, d), ("expert", "mlp", "embed"), wd, scale=m**-0.5)
        self.b_down = zeros((x, d), ("expert", "embed"), wd)
        self.cfg, self.mesh = cfg, mesh
        self.ep_axes = expert_axes(cfg, mesh, self.w_gate_up)

    def __call__(self, x_BSD, segment_ids_BS):
        cfg, opts, keep = self.cfg, self.cfg.options, self.ep_axes
        chunked = cfg.mlp_sequence_chunks > 1
        router, = gathered(self.mesh, cfg.dtype, chunked, self.router)
        w_gate_up, w_down = gathered(self.mesh, cfg.dtype, chunked, self.w_gate_up, self.w_down, keep=keep)
        bias, b_down = gathered(self.mesh, None, chunked, self.router_bias, self.b_down)  # whole: the combine's
        b_gate_up, = gathered(self.mesh, None, chunked, self.b_gate_up, keep=keep)
        weights = (w_gate_up, w_down, b_gate_up, b_down)
        y = map_chunks(lambda x: self._experts(x, router, bias, *weights), cfg.mlp_sequence_chunks, self.mesh,
                       x_BSD)
        z_loss = opts.router_z_loss_weight > 0

        def count(x, seg, router, bias):
            return load_sums(x, seg, router, opts.top_k, cfg.dtype, z_loss, bias)

        sums = sum_chunks(lambda x, seg: device_sums(count, self.mesh, x, seg, router, bias),
                          cfg.mlp_sequence_chunks, self.mesh, x_BSD, segment_ids_BS)
        return checkpoint_name(y, "mlpwo"), sums

    def _experts(self, x_BSD, router, bias, w_gate_up, w_down, b_gate_up, b_down):
        opts, mesh, dt = self.cfg.options, self.mesh, self.cfg.dtype
        tp = mesh.shape[TENSOR_AXIS] if mesh is not None else 1
        split = tp > 1 and opts.mlp_dim % tp == 0
        glu = functools.partial(clamped_glu, alpha=opts.swiglu_alpha, limit=opts.swiglu_limit)
        matmul = kernels.for_mesh(self.cfg.moe_kernel, mesh, dt)

        def local(x, router, bias, w_gate_up, w_down, b_gate_up, b_down):
            if mesh is not None:  # each device's copy of the gathered experts (moe.gathered)
                router, bias, w_gate_up, w_down, b_gate_up, b_down = (
                    w[0] for w in (router, bias, w_gate_up, w_down, b_gate_up, b_down))
            w_gate_up, w_down = w_gate_up.astype(dt), w_down.astype(dt)
            b, s, d = x.shape
            x_TD = x.reshape(b * s, d)
            weights, experts = route(x_TD, router, bias, opts.top_k, dt)
            y = swiglu_for(self.cfg, mesh, self.ep_axes, matmul)(
                x_TD, weights, experts, w_gate_up[..., 0], w_gate_up[..., 1], w_down, glu=glu,
                gate_up_bias=(b_gate_up[..., 0], b_gate_up[..., 1]))
            if split:  # each tensor shard ran M / T of every expert: its down projection is a partial sum
                y = jax.lax.psum(y, TENSOR_AXIS)
            # The down projection's bias after the sum over tensor shards, so that it is added once.
            # As [T, X] routing weights times the biases [X, D]: no [T, k, D] copy of the biases rows.
            per_expert = jnp.einsum("TK,TKX->TX", weights, jax.nn.one_hot(experts, b_down.shape[0]))
            y = y + jnp.einsum("TX,XD->TD", per_expert, b_down.astype(jnp.float32))
            return y.astype(dt).reshape(b, s, d)

        if mesh is None:
            return local(x_BSD, router, bias, w_gate_up, w_down, b_gate_up, b_down)
        act, m, e = P(BATCH_AXES, CONTEXT_AXES, None), TENSOR_AXIS if split else None, EXPERT_AXES
        specs = (act, P(e, None, None), P(e, None), P(e, None, None, m, None), P(e, None, m, None),
                 P(e, None, m, None), P(e, None, None))
        return shard_map(local, mesh, specs, act)(x_BSD, router, bias, w_gate_up, w_down, b_gate_up, b_down)


class GptOssLayer(MoeLayer):
    """Pre-norm block: x + attn(norm(x)), then + experts(norm(x)); returns (x, the layer's `load_sums`)."""

    attention = GptOssAttention
    block = GptOssExperts
