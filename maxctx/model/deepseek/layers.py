"""The DeepSeek layer kinds (`deepseek_dense`, `deepseek` in maxctx.model.stacks): multi-head latent attention (MLA)
with a dense SwiGLU, or with a routed MoE and shared experts, as transformers' DeepseekV2 modeling computes them.

Legend: B batch, S sequence, D model width, H heads, N head dim without RoPE (Dn), P with (Dr), Q = N + P, V value
head dim, R the KV latent (kv_lora_rank), A the query LoRA rank, T tokens, X experts, k experts per token.

MLA: q = x wq (or norm(x wq_a) wq_b) [B, S, H, Q]; the latent and shared key [B, S, R + P] = x wkv_a; the latent
RMSNormed and expanded per head, [B, S, H, N + V] = norm(c) wkv_b, into k's first N dims and v; k's last P dims are
the one RoPE key, broadcast over the heads; q's last P dims are rotated at the same positions. The rotation is on
interleaved pairs (dims 2i, 2i + 1, transformers' complex form, as the released checkpoints were trained), with
YaRN's frequencies and attention factor (maxctx.model.rope). With YaRN's `mscale` the softmax scale is
Q^-1/2 (0.1 mscale ln(factor) + 1)^2: q is multiplied by the square, the kernels apply Q^-1/2. Then any kernel and
CP strategy (maxctx.attention.attend) with V narrower than Q, and out [B, S, H, V] wo. Under a strategy that moves
the latent (context_parallel_strategy=latent_all_gather or latent_p2p, maxctx.attention.cp.latent and latent_ring) the
layer hands it q, the normed latent and the rotated key [B, S, R + P] and wkv_b instead, and the strategy builds K
and V from the latent it gathers or receives.

DeepSeek-V3's sequence-wise balance loss (sequence_balance_loss_weight > 0; off, the layer's program is unchanged):
each MoE layer adds per-row sums over the global arrays (`row_sums`, the same under any mesh and sequence order)
and its rows' terms (`sequence_balance_sums`) to MoeBlock's load-balancing sums; `aux_terms` averages them.

DeepSeek-V3's auxiliary-loss-free balancing (routed_bias_update_rate > 0): after each step, every MoE layer's
correction bias moves against that layer's load over the step's tokens, b_x -= rate sign(load_x - mean load), outside
the gradient. The layer's load reaches the step as the gradient of its bias (`load_signal`: a term of value 0 whose
derivative in b is load - mean, scaled by the step's positive token weight, which leaves the sign as it is), so each
layer of a scanned stack gets its own; maxctx.train_step takes those gradients out of the optimizer's (and of the
clipping and the logged gradient norm) and applies the signed step to the parameters tagged
maxctx.model.layers.SIGN_UPDATE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from maxctx.attention.cp.sharded import shard_map
from maxctx.attention.dispatch import attend, attend_latent, moves_latent
from maxctx.model.layers import MLP, SIGN_UPDATE, ModelConfig, RMSNorm, param
from maxctx.model.llama.layers import DecoderLayer
from maxctx.model.moe import kernels, layers as moe
from maxctx.model.moe.layers import MoeBlock
from maxctx.model.rope import RopeSpec, inverse_frequencies
from maxctx.model.tiling import sum_chunks
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES, EXPERT_AXES, TENSOR_AXIS


def rotary_interleaved(x_BSNP, positions_BS, rope: RopeSpec):
    """RoPE on interleaved pairs (x[2i], x[2i + 1]) rotated by position x frequency i, times YaRN's attention factor;
    fp32 inside."""
    angles = positions_BS[..., None].astype(jnp.float32) * inverse_frequencies(rope, x_BSNP.shape[-1])
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    if rope.attention_scaling != 1.0:
        sin, cos = sin * rope.attention_scaling, cos * rope.attention_scaling
    pairs = x_BSNP.astype(jnp.float32).reshape(*x_BSNP.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.reshape(x_BSNP.shape).astype(x_BSNP.dtype)


class MlaAttention(nnx.Module):
    """Multi-head latent attention (module doc); cfg.options is a DeepseekOptions."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        o, d, h, wd = cfg.options, cfg.emb_dim, cfg.num_heads, cfg.weight_dtype
        q = o.nope_dim + o.rope_dim
        if o.q_lora_rank:
            # wq_a's rank is `head_dim` (replicated; its embed is sharded), not `norm`: these matrices get weight
            # decay. wq_b's and wkv_b's rank is `lora`, sharded like an embed: replicated, they held 3.3B of
            # DeepSeek-V3's parameters whole on every device.
            self.wq_a = param(rngs, (d, o.q_lora_rank), ("embed", "head_dim"), wd)
            self.q_norm = RMSNorm(o.q_lora_rank, cfg.norm_eps, wd, rngs)
            self.wq_b = param(rngs, (o.q_lora_rank, h, q), ("lora", "heads", "head_dim"), wd)
        else:
            self.wq = param(rngs, (d, h, q), ("embed", "heads", "head_dim"), wd)
        self.wkv_a = param(rngs, (d, o.kv_lora_rank + o.rope_dim), ("embed", "head_dim"), wd)
        self.kv_norm = RMSNorm(o.kv_lora_rank, cfg.norm_eps, wd, rngs)
        self.wkv_b = param(rngs, (o.kv_lora_rank, h, o.nope_dim + o.v_dim), ("lora", "heads", "head_dim"), wd)
        self.wo = param(rngs, (h, o.v_dim, d), ("heads", "head_dim", "embed"), wd, scale=(h * o.v_dim) ** -0.5)
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        spec = dataclasses.replace(self.cfg.attention, window=window)
        if moves_latent(spec, self.mesh):  # the strategy moves the latent and rebuilds K and V itself
            q, latent = self.q_and_latent(x_BSD, positions_BS)
            out_BSHV = attend_latent(q, latent, self.wkv_b[...].astype(self.cfg.dtype), positions_BS,
                                     segment_ids_BS, spec, self.mesh)
        else:
            q, k, v = self.qkv(x_BSD, positions_BS)
            out_BSHV = attend(q, k, v, positions_BS, segment_ids_BS, spec, self.mesh)
        out_BSHV = checkpoint_name(out_BSHV, "context")
        out = jnp.einsum("BSHV,HVD->BSD", out_BSHV, self.wo[...].astype(self.cfg.dtype))
        return checkpoint_name(out, "out_proj")

    def qkv(self, x_BSD, positions_BS):
        """(q[B, S, H, Q], k[B, S, H, Q], v[B, S, H, V]), rotated, q times YaRN's mscale^2."""
        o = self.cfg.options
        q, c, k_rope = self._projections(x_BSD, positions_BS)
        kv = jnp.einsum("BSR,RHU->BSHU", c, self.wkv_b[...].astype(self.cfg.dtype))
        k_nope, v = kv[..., :o.nope_dim], checkpoint_name(kv[..., o.nope_dim:], "value_proj")
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], o.rope_dim))], axis=-1)
        return q, checkpoint_name(k, "key_proj"), v

    def q_and_latent(self, x_BSD, positions_BS):
        """(q[B, S, H, Q] as `qkv`'s, [normed latent, rotated RoPE key] [B, S, R + P]): what a strategy that moves
        the latent takes in place of K and V (maxctx.attention.cp.latent)."""
        q, c, k_rope = self._projections(x_BSD, positions_BS)
        return q, checkpoint_name(jnp.concatenate([c, k_rope[:, :, 0]], axis=-1), "key_proj")

    def _projections(self, x_BSD, positions_BS):
        """(q rotated and scaled [B, S, H, Q], the normed latent [B, S, R], the rotated RoPE key [B, S, 1, P])."""
        cfg, o, dt = self.cfg, self.cfg.options, self.cfg.dtype
        if o.q_lora_rank:
            small = self.q_norm(jnp.einsum("BSD,DA->BSA", x_BSD, self.wq_a[...].astype(dt)))
            q = jnp.einsum("BSA,AHQ->BSHQ", small, self.wq_b[...].astype(dt))
        else:
            q = jnp.einsum("BSD,DHQ->BSHQ", x_BSD, self.wq[...].astype(dt))
        q = checkpoint_name(q, "query_proj")
        latent = jnp.einsum("BSD,DR->BSR", x_BSD, self.wkv_a[...].astype(dt))
        c, k_rope = latent[..., :o.kv_lora_rank], latent[..., o.kv_lora_rank:]
        k_rope = rotary_interleaved(k_rope[:, :, None], positions_BS, cfg.rope)
        q = jnp.concatenate([q[..., :o.nope_dim], rotary_interleaved(q[..., o.nope_dim:], positions_BS, cfg.rope)],
                            axis=-1)
        if o.query_scale != 1.0:
            q = q * jnp.asarray(o.query_scale, q.dtype)
        return q, self.kv_norm(c), k_rope


class DeepseekDenseLayer(DecoderLayer):
    """Llama's pre-norm block with MLA: the dense first layers."""

    attention = MlaAttention


def route(x_TD, router_DX, o, dtype, bias_X=None):
    """(scores [T, X] fp32, the top-k weights times routed_scaling_factor [T, k], their experts). Scores are the
    softmax (V2) or the sigmoid (V3, `o.sigmoid`) of the logits; the experts are chosen by the scores plus the
    correction bias (V3; no gradient flows into it), their weights are the scores (renormalised to sum 1 where
    `o.renormalize`). With groups, the choice is among the experts of each token's `top_groups` best groups, a
    group scored by its best expert (V2's group_limited_greedy) or its best two (V3's noaux_tc)."""
    logits = jnp.einsum("TD,DX->TX", x_TD, router_DX.astype(dtype), preferred_element_type=jnp.float32)
    scores = jax.nn.sigmoid(logits) if o.sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias_X is None else scores + jax.lax.stop_gradient(bias_X.astype(jnp.float32))
    if o.groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], o.groups, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1) if o.sigmoid else grouped.max(-1)
        _, best = jax.lax.top_k(group_scores, o.top_groups)
        keep = jnp.sum(jax.nn.one_hot(best, o.groups, dtype=jnp.int32), axis=-2) > 0
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(scores.shape)
    _, experts = jax.lax.top_k(choice, o.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if o.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return scores, weights * o.routed_scaling_factor, experts


def row_sums(x_BSD, segment_ids_BS, router_DX, o, dtype, bias_X=None) -> dict:
    """Per row of the batch, over its tokens (segment id 0, padding, left out): how many of them route to each
    expert (the choice `route` makes, with the bias and groups) [B, X], their normalised affinities s_x / sum s
    summed [B, X], and the tokens [B]."""
    b, s, d = x_BSD.shape
    scores, _, experts = route(x_BSD.reshape(b * s, d), router_DX, o, dtype, bias_X)
    mask = (segment_ids_BS != 0).astype(jnp.float32)
    affinity = (scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(b, s, -1)
    chosen = jnp.sum(jax.nn.one_hot(experts, o.num_experts, dtype=jnp.float32), axis=-2).reshape(b, s, -1)
    return {"count": jnp.einsum("BSX,BS->BX", chosen, mask), "affinity": jnp.einsum("BSX,BS->BX", affinity, mask),
            "tokens": jnp.sum(mask, axis=-1)}


def sequence_balance_sums(rows: dict, o) -> dict:
    """One layer's share of DeepSeek-V3's sequence-wise balance loss (paper eq. 17-20) from its `row_sums`: per
    row of T tokens, f_x = X / (k T) x its tokens routed to x, P_x = its mean normalised affinity to x, and the
    row's term sum_x f_x P_x (1 when balanced); returned as the rows' terms summed and the rows counted (rows
    without tokens left out), which add over layers. With packing, a row holds several documents and is one
    sequence here: the balance is asked of what a device computes together, as in the paper's batches."""
    tokens = jnp.maximum(rows["tokens"], 1.0)
    per_row = o.num_experts / (o.top_k * tokens * tokens) * jnp.sum(rows["count"] * rows["affinity"], axis=-1)
    real = rows["tokens"] > 0
    return {"moe_seq_balance": jnp.sum(jnp.where(real, per_row, 0.0)), "moe_seq_rows": jnp.sum(real, dtype=jnp.float32)}


SIGNAL_TERM = "_bias_load_signal"  # a leading "_": a term maxctx.train_step does not log


def aux_terms(sums: dict, cfg: ModelConfig) -> dict:
    """The MoE layer's terms (maxctx.model.moe.layers.aux_terms), and with sequence_balance_loss_weight > 0 the
    sequence-wise balance loss: the mean over rows and MoE layers of `sequence_balance_sums`' term."""
    terms = moe.aux_terms(sums, cfg)
    if "moe_seq_balance" in sums:
        value = sums["moe_seq_balance"] / jnp.maximum(sums["moe_seq_rows"], 1.0)
        terms["sequence_balance_loss"] = (cfg.options.sequence_balance_loss_weight, value)
    if "moe_bias_signal" in sums:  # 0 with weight 1: in the objective for its gradient only (module doc)
        terms[SIGNAL_TERM] = (1.0, sums["moe_bias_signal"])
    return terms


@jax.custom_vjp
def load_signal(bias_X, load_X):
    """0, whose gradient in the bias is load_X - mean(load_X) (module doc): the layer's imbalance, carried to the
    step's update of the bias by autodiff, layer by layer."""
    del bias_X, load_X
    return jnp.zeros((), jnp.float32)


def _signal_forward(bias_X, load_X):
    return load_signal(bias_X, load_X), (load_X, bias_X)


def _signal_backward(res, g):
    load_X, bias_X = res
    return (g * (load_X - jnp.mean(load_X))).astype(bias_X.dtype), jnp.zeros_like(load_X)


load_signal.defvjp(_signal_forward, _signal_backward)


class DeepseekMoe(MoeBlock):
    """The MoE layer's routed experts (MoeBlock's parameters, load counts and grouped matmuls) under DeepSeek's
    router (`route`, with V3's correction bias [X]), and the shared experts: one SwiGLU of shared_experts x M that
    every token runs."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        super().__init__(cfg, rngs, mesh)
        o = cfg.options
        if o.routed_bias:
            self.bias = nnx.Param(jnp.zeros((o.num_experts,), jnp.float32), axes=("norm",),
                                  **{SIGN_UPDATE: o.bias_update_rate > 0})
        if o.shared_experts:
            self.shared = MLP(dataclasses.replace(cfg, mlp_dim=o.shared_experts * o.mlp_dim), rngs, mesh)

    def __call__(self, x_BSD, segment_ids_BS):
        y, sums = super().__call__(x_BSD, segment_ids_BS)
        return (y + self.shared(x_BSD) if self.cfg.options.shared_experts else y), sums

    def more_sums(self, x_BSD, segment_ids_BS, router, sums: dict) -> dict:
        o, dt = self.cfg.options, self.cfg.dtype
        # MoeBlock counts the softmax top-k's experts; a sigmoid, biased or group-limited router chooses others.
        own_choice = o.sigmoid or o.routed_bias or o.groups > 1
        if o.sequence_balance_loss_weight or own_choice:
            # Per-row sums (each device's tokens, added over devices as MoeBlock's counts), added over the chunks
            # before the per-row products, so the terms are the same whatever the mesh and order of the sequence.
            bias = self.bias[...] if o.routed_bias else None

            def count(x, seg, router):
                return row_sums(x, seg, router, o, dt, bias)

            rows = sum_chunks(lambda x, seg: moe.device_sums(count, self.mesh, x, seg, router, rows=True),
                              self.cfg.mlp_sequence_chunks, self.mesh, x_BSD, segment_ids_BS)
            if own_choice:  # the load (metrics, load balancing) of the experts this router chose
                sums = {**sums, "moe_load": jnp.sum(rows["count"], axis=0)}
            if o.bias_update_rate > 0:
                signal = load_signal(self.bias[...], jax.lax.stop_gradient(jnp.sum(rows["count"], axis=0)))
                sums = {**sums, "moe_bias_signal": signal}
            if o.sequence_balance_loss_weight:
                sums = {**sums, **sequence_balance_sums(rows, o)}
        return sums

    def _experts(self, x_BSD, router, w_gate, w_up, w_down):
        """MoeBlock's experts (per device in a shard_map, M split over tensor) under `route`."""
        opts, mesh, dt = self.cfg.options, self.mesh, self.cfg.dtype
        split = mesh is not None and mesh.shape[TENSOR_AXIS] > 1 and opts.mlp_dim % mesh.shape[TENSOR_AXIS] == 0
        matmul = kernels.for_mesh(self.cfg.moe_kernel, mesh, dt)

        def local(x, router, bias, w_gate, w_up, w_down):
            b, s, d = x.shape
            x_TD = x.reshape(b * s, d)
            if mesh is not None:  # each device's copy of the gathered experts (moe.gathered)
                router, w_gate, w_up, w_down = (w[0].astype(dt) for w in (router, w_gate, w_up, w_down))
            _, weights, experts = route(x_TD, router, opts, dt, bias if opts.routed_bias else None)
            y = self.swiglu(matmul)(x_TD, weights, experts, w_gate, w_up, w_down)
            if split:  # each tensor shard ran M / T of every expert: its down projection is a partial sum
                y = jax.lax.psum(y, TENSOR_AXIS)
            return y.astype(dt).reshape(b, s, d)

        bias = self.bias[...] if opts.routed_bias else jnp.zeros((), jnp.float32)
        if mesh is None:
            return local(x_BSD, router, bias, *(w.astype(dt) for w in (w_gate, w_up, w_down)))
        act, m = P(BATCH_AXES, CONTEXT_AXES, None), TENSOR_AXIS if split else None
        specs = (act, P(EXPERT_AXES, None, None), P(), P(EXPERT_AXES, None, None, m), P(EXPERT_AXES, None, None, m),
                 P(EXPERT_AXES, None, m, None))
        return shard_map(local, mesh, specs, act)(x_BSD, router, bias, w_gate, w_up, w_down)


class DeepseekLayer(moe.MoeLayer):
    """Pre-norm block: x + mla(norm(x)), then + moe(norm(x)); returns (x, the MoE layer's load counts)."""

    attention = MlaAttention
    block = DeepseekMoe
    aux_terms = staticmethod(aux_terms)
