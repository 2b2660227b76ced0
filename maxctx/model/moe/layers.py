"""The dropless routed MoE layer and the `mixtral` / `qwen3_moe` layer kinds (maxctx.model.stacks), as transformers'
MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock compute them.

Legend: B batch, S sequence, D model width, X experts, k experts per token, M an expert's SwiGLU width,
T one device's tokens of one chunk.

Per device, its own tokens only (a shard_map over the mesh; the expert weights gathered whole, M split over tensor):

    router    p[T, X] = softmax(x W_r), (w, i)[T, k] = top-k of p, w / sum(w) where renormalised
    sort      the T k (token, slot) pairs sorted by expert; group sizes [X] = tokens per expert
    experts   jax.lax.ragged_dot over the sorted copy xs[T k, D]: gate, up [T k, M], down [T k, D]
    combine   y[T, D] = sum over k of w x the slot's output, unsorted

No capacity by default: every token reaches its k experts (a skewed router only makes one group larger); with
capacity_factor > 0 an expert takes at most its capacity of each sequence's pairs (maxctx.model.moe.capacity).
The layer runs over mlp_sequence_chunks chunks of each device's tokens (maxctx.model.tiling), so its [T k, D] and
[T k, M] buffers exist for one chunk at a time. The load-balancing sums run over the global [B, S] arrays (plain
reductions under jit), so they count every token of the batch whatever the mesh.

The grouped matmul is moe_kernel's (maxctx.model.moe.kernels): megablox on TPU by default, jax.lax.ragged_dot
elsewhere. On GPU, XLA (jax 0.11.2, H100) lowers jax.lax.ragged_dot densely, through a [T k, X, D] buffer: exact
(3e-7), but one Qwen3-30B-A3B layer at T = 2048 tokens ran at 5 TFLOP/s with 8.5 GiB of forward temporaries, and
T = 8192 did not compile; a GPU grouped-matmul kernel is not here yet.

Load balancing (Switch Transformer eq. 4-6, transformers' load_balancing_loss_func): with f_x the share of the
(token, slot) assignments to expert x and P_x its mean router probability, both over every MoE layer's tokens
(padding, segment id 0, left out), the term is X sum_x f_x P_x (k when balanced); `aux_terms` forms it from the
layers' summed counts. The router z-loss (ST-MoE eq. 5, router_z_loss_weight > 0) is the mean of
logsumexp(router logits)^2 over the same tokens and layers. Logged beside them, not in the loss: each expert's
share f_x (`moe_expert_load`, summing to 1) and the busiest expert's load over the mean (1 when balanced).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from maxctx.attention.cp.sharded import shard_map
from maxctx.errors import ConfigError
from maxctx.mesh import logical_to_spec
from maxctx.model.layers import Attention, ModelConfig, RMSNorm, param
from maxctx.model.moe import capacity, dispatch, kernels
from maxctx.model.qwen.layers import QwenAttention
from maxctx.model.tiling import map_chunks, sum_chunks
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES, EXPERT_AXES, TENSOR_AXIS, entry_axes, ep_axes


def router_logits(x_TD, router_DX, dtype, bias_X=None):
    """The router's logits [..., X] fp32 for tokens x[..., D], plus the router's bias where it has one (GPT-OSS)."""
    logits = jnp.einsum("...D,DX->...X", x_TD, router_DX.astype(dtype), preferred_element_type=jnp.float32)
    return logits if bias_X is None else logits + bias_X.astype(jnp.float32)


def route(x_TD, router_DX, top_k: int, renormalize: bool, dtype):
    """(p[..., X] fp32, the top-k weights [..., k] fp32, their experts [..., k] int32) for tokens x[..., D]."""
    probs = jax.nn.softmax(router_logits(x_TD, router_DX, dtype), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def grouped_swiglu(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, glu=swiglu, gate_up_bias=None,
                   matmul=jax.lax.ragged_dot):
    """sum over k of weights x expert(x) for tokens x[T, D]: the (token, slot) pairs sorted by expert, each expert's
    SwiGLU a group of `matmul` (maxctx.model.moe.kernels.grouped_matmul: moe_kernel's); w_gate, w_up [X, D, M],
    w_down [X, M, D] in the compute dtype. A family's hooks (GPT-OSS, maxctx.model.gpt_oss.layers): `glu(gate, up)`
    the gated activation; `gate_up_bias` (b_gate, b_up [X, M]) each row's expert's biases, added to gate and up."""
    t, k = experts_TK.shape
    flat = experts_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair (token t, slot j) is entry t k + j
    sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    xs = jnp.take(x_TD, order // k, axis=0)  # [T k, D], grouped by expert
    gate = checkpoint_name(matmul(xs, w_gate, sizes), "mlpwi")
    up = checkpoint_name(matmul(xs, w_up, sizes), "mlpwi")
    if gate_up_bias is not None:
        row_experts = jnp.take(flat, order)
        gate, up = (h + jnp.take(b.astype(h.dtype), row_experts, axis=0) for h, b in zip((gate, up), gate_up_bias))
    ys = matmul(glu(gate, up), w_down, sizes)
    y_TKD = jnp.take(ys, jnp.argsort(order), axis=0).reshape(t, k, -1)
    return jnp.einsum("TKD,TK->TD", y_TKD, weights_TK.astype(ys.dtype), preferred_element_type=jnp.float32)


def load_sums(x_BSD, segment_ids_BS, router_DX, top_k: int, dtype, z_loss: bool = False, router_bias_X=None) -> dict:
    """The load-balancing counts of one layer over every token given (segment id 0, padding, left out):
    moe_load[X] (assignments), moe_prob[X] (router probabilities), moe_tokens (tokens); with `z_loss`, moe_z
    (the sum of logsumexp(logits)^2). Every MoeBlock runs it, DeepSeek's (maxctx.model.deepseek.layers) and GPT-OSS's
    (with its router's bias) too."""
    logits = router_logits(x_BSD, router_DX, dtype, router_bias_X)
    probs = jax.nn.softmax(logits, axis=-1)
    experts = jax.lax.top_k(probs, top_k)[1]
    mask = (segment_ids_BS != 0).astype(jnp.float32)
    assigned = jnp.sum(jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32), axis=-2)
    sums = {"moe_load": jnp.einsum("BSX,BS->X", assigned, mask),
            "moe_prob": jnp.einsum("BSX,BS->X", probs, mask), "moe_tokens": jnp.sum(mask)}
    if z_loss:
        sums["moe_z"] = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask)
    return sums


def aux_terms(sums: dict, cfg: ModelConfig) -> dict:
    """{name: (weight, value)} over every MoE layer's tokens: the load-balancing loss (weight
    load_balance_loss_weight), the router z-loss where its sums are there (router_z_loss_weight), and, logged only,
    each expert's share of the assignments [X] and the busiest expert's load over the mean."""
    rows = jnp.maximum(sums["moe_tokens"], 1.0)
    load, prob = sums["moe_load"], sums["moe_prob"]
    balance = cfg.options.num_experts * jnp.sum(load / rows * (prob / rows))
    peak = jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
    terms = {"load_balance_loss": (cfg.options.load_balance_loss_weight, balance), "moe_max_load_ratio": (0.0, peak),
             "moe_expert_load": (0.0, load / jnp.maximum(jnp.sum(load), 1e-9))}
    if "moe_z" in sums:  # each layer saw every token, so this is the mean over tokens and layers
        terms["router_z_loss"] = (cfg.options.router_z_loss_weight, sums["moe_z"] / rows)
    if "moe_dropped" in sums:  # a capacity's dropped share of the real (token, slot) pairs, over the layers
        terms["moe_dropped_fraction"] = (0.0, sums["moe_dropped"] / (rows * cfg.options.top_k))
    return terms


def gathered(mesh, dtype, chunked: bool, *params, keep: tuple[str, ...] = ()) -> list:
    """Each expert parameter (an nnx.Param with logical axes) in the compute dtype, gathered from the devices its
    experts are sharded across (maxctx.mesh.logical_to_spec: `expert` over fsdp and the context axes) by one
    explicit all-gather per layer, as one copy per device: [G, ...] over EXPERT_AXES (G devices), the tensor split
    (`mlp`) kept; a shard_map takes it with `copy_spec` and reads its [0]. A copy that is the device's own keeps
    the experts' shard_map from summing the weights' gradients over the devices (an all-reduce of every expert's
    gradient): the backward's only collective for them is the gather's transpose, a reduce-scatter in the compute
    dtype (left to XLA, the gathers ran in fp32 and the gradients as a full all-reduce: tests/test_expert_comm.py).
    `chunked` (mlp_sequence_chunks > 1): the copies in fp32, so that the chunks' gradients add up in fp32. `dtype`
    None: the parameters' own (biases). `keep`: mesh axes of the first (experts') dimension not gathered, its
    leading ones (expert parallelism, maxctx.model.moe.dispatch: each copy holds its EP rank's experts)."""
    def cast(p):
        return p[...] if dtype is None else p[...].astype(dtype)

    if mesh is None:
        return [p[...] if chunked else cast(p) for p in params]
    out = []
    for p in params:
        value = cast(p)
        spec = logical_to_spec(tuple(p.get_metadata()["axes"]), value.shape, mesh)
        gather = functools.partial(_gather, spec=spec, keep=keep)
        copies = shard_map(gather, mesh, (spec,), copy_spec(spec))(value)
        out.append(copies.astype(jnp.float32) if chunked else copies)
    return out


def copy_spec(spec: P) -> P:
    """The layout of `gathered`'s copies of a parameter laid out as `spec`: [G, ...] over EXPERT_AXES, the tensor
    axis kept where it was."""
    return P(EXPERT_AXES, *(TENSOR_AXIS if entry in (TENSOR_AXIS, (TENSOR_AXIS,)) else None for entry in spec))


def _gather(value, spec, keep=()):
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        if dim == 0 and keep:  # the EP rank's experts: the leading axes stay split
            axes = axes[len(keep):]
        if axes:
            value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
    return value[None]


def device_sums(fn, mesh, x_BSD, segment_ids_BS, *copies, rows: bool = False) -> dict:
    """fn(x, segment ids, *weights) -> sums over the tokens given, run on each device's own tokens with its copy of
    the gathered weights (`gathered`, none split over tensor) and added across devices: left to XLA, a sum over the
    global arrays gathered the [B, S, X] router outputs over the context axes (O(S) bytes a layer). `rows`: fn's
    sums keep the batch dimension first ([B, ...], per row)."""
    if mesh is None:
        return fn(x_BSD, segment_ids_BS, *copies)
    spread = P(CONTEXT_AXES, BATCH_AXES) if rows else P((*BATCH_AXES, *CONTEXT_AXES))

    def local(x, seg, *copies):
        return jax.tree.map(lambda v: v[None], fn(x, seg, *(c[0] for c in copies)))

    specs = (P(BATCH_AXES, CONTEXT_AXES, None), P(BATCH_AXES, CONTEXT_AXES))
    specs += tuple(P(EXPERT_AXES, *([None] * (c.ndim - 1))) for c in copies)
    parts = shard_map(local, mesh, specs, spread)(x_BSD, segment_ids_BS, *copies)
    return jax.tree.map(lambda v: jnp.sum(v, axis=0), parts)


def expert_axes(cfg: ModelConfig, mesh, w_gate) -> tuple[str, ...]:
    """The mesh axes of expert parallelism (maxctx.parallelism.ep_axes) for the experts' weight `w_gate`
    [X, D, M] as stored; () without it."""
    degree = cfg.expert_parallelism
    if degree == 1:
        return ()
    if mesh is None:
        raise ConfigError(f"expert_parallelism={degree} needs a mesh of at least {degree} devices; set 1")
    dispatch.local_experts(cfg.options.num_experts, degree)
    spec = logical_to_spec(tuple(w_gate.get_metadata()["axes"]), w_gate.shape, mesh)
    return ep_axes(spec[0], dict(mesh.shape), degree)


def swiglu_for(cfg: ModelConfig, mesh, axes: tuple[str, ...], matmul):
    """grouped_swiglu over a device's copy of every expert, or under expert parallelism (EP mesh `axes`) over its
    rank's experts with the pairs dispatched to them (maxctx.model.moe.dispatch)."""
    if not axes:
        return functools.partial(grouped_swiglu, matmul=matmul)
    platform = mesh.devices.flat[0].platform
    return functools.partial(dispatch.dispatched_swiglu, axes=axes, matmul=matmul, platform=platform,
                             dispatch=dispatch.resolve(cfg.expert_dispatch, platform))


class MoeBlock(nnx.Module):
    """router [D, X], w_gate, w_up [X, D, M], w_down [X, M, D]; returns (y[B, S, D], `load_sums`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        d, x, m, wd = cfg.emb_dim, cfg.options.num_experts, cfg.options.mlp_dim, cfg.weight_dtype
        self.router = param(rngs, (d, x), ("embed", "expert"), wd)
        self.w_gate = param(rngs, (x, d, m), ("expert", "embed", "mlp"), wd, scale=d**-0.5)
        self.w_up = param(rngs, (x, d, m), ("expert", "embed", "mlp"), wd, scale=d**-0.5)
        self.w_down = param(rngs, (x, m, d), ("expert", "mlp", "embed"), wd, scale=m**-0.5)
        self.cfg, self.mesh = cfg, mesh
        self.ep_axes = expert_axes(cfg, mesh, self.w_gate)

    def __call__(self, x_BSD, segment_ids_BS):
        cfg, opts = self.cfg, self.cfg.options
        chunked = cfg.mlp_sequence_chunks > 1
        router, = gathered(self.mesh, cfg.dtype, chunked, self.router)
        weights = gathered(self.mesh, cfg.dtype, chunked, self.w_gate, self.w_up, self.w_down, keep=self.ep_axes)
        if opts.capacity_factor:  # maxctx.model.moe.capacity; without it the program is the dropless one
            y, dropped = map_chunks(lambda x, seg: self._experts(x, router, *weights, seg), cfg.mlp_sequence_chunks,
                                    self.mesh, x_BSD, segment_ids_BS)
        else:
            y = map_chunks(lambda x: self._experts(x, router, *weights), cfg.mlp_sequence_chunks, self.mesh, x_BSD)
        # The router once more for the counts: 2 D X FLOPs a token, against the experts' 6 k D M.
        z_loss = opts.router_z_loss_weight > 0
        count = functools.partial(load_sums, top_k=opts.top_k, dtype=cfg.dtype, z_loss=z_loss)
        sums = sum_chunks(lambda x, seg: device_sums(count, self.mesh, x, seg, router), cfg.mlp_sequence_chunks,
                          self.mesh, x_BSD, segment_ids_BS)
        if opts.capacity_factor:
            sums["moe_dropped"] = jnp.sum(dropped)
        return checkpoint_name(y, "mlpwo"), self.more_sums(x_BSD, segment_ids_BS, router, sums)

    def swiglu(self, matmul):
        return swiglu_for(self.cfg, self.mesh, self.ep_axes, matmul)

    def more_sums(self, x_BSD, segment_ids_BS, router, sums: dict) -> dict:
        """A family's sums besides the load counts, from the gathered router (DeepSeek's router: its own)."""
        return sums

    def _experts(self, x_BSD, router, w_gate, w_up, w_down, segment_ids_BS=None):
        """y[B, S, D]; with `segment_ids_BS` (a capacity) also each token's dropped pairs [B, S]."""
        cfg, opts, mesh = self.cfg, self.cfg.options, self.mesh
        dt = cfg.dtype
        tp = mesh.shape[TENSOR_AXIS] if mesh is not None else 1
        split = tp > 1 and opts.mlp_dim % tp == 0
        matmul = kernels.for_mesh(cfg.moe_kernel, mesh, dt)

        def local(x, router, w_gate, w_up, w_down, *seg):
            b, s, d = x.shape
            x_TD = x.reshape(b * s, d)
            _, weights, experts = route(x_TD, router, opts.top_k, opts.renormalize, dt)
            if seg:  # the pairs past their expert's capacity weigh 0
                kept, dropped = capacity.kept_and_dropped(experts.reshape(b, s, -1), seg[0], opts.capacity_factor,
                                                          opts.num_experts)
                weights = jnp.where(kept.reshape(b * s, -1), weights, 0.0)
            y = self.swiglu(matmul)(x_TD, weights, experts, w_gate, w_up, w_down)
            if split:  # each tensor shard ran M / T of every expert: its down projection is a partial sum
                y = jax.lax.psum(y, TENSOR_AXIS)
            y = y.astype(dt).reshape(b, s, d)
            return (y, dropped) if seg else y

        seg = () if segment_ids_BS is None else (segment_ids_BS,)
        if mesh is None:
            return local(x_BSD, router, *(w.astype(dt) for w in (w_gate, w_up, w_down)), *seg)

        def own(x, router, w_gate, w_up, w_down, *seg):  # each device's copy of the gathered experts
            return local(x, router[0], *(w[0].astype(dt) for w in (w_gate, w_up, w_down)), *seg)

        act, m = P(BATCH_AXES, CONTEXT_AXES, None), TENSOR_AXIS if split else None
        specs = (act, P(EXPERT_AXES, None, None), P(EXPERT_AXES, None, None, m), P(EXPERT_AXES, None, None, m),
                 P(EXPERT_AXES, None, m, None))
        tokens = P(BATCH_AXES, CONTEXT_AXES)
        out = (act, tokens) if seg else act
        return shard_map(own, mesh, specs + (tokens,) * len(seg), out)(x_BSD, router, w_gate, w_up, w_down, *seg)


class MoeLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + moe(norm(x)); returns (x, the MoE layer's `load_sums`). Mixtral's
    (Llama's attention); Qwen3MoeLayer swaps in Qwen 3's attention (QK-norm), GPT-OSS and DeepSeek swap both the
    attention and the expert block (the attribute names, and so the parameter paths, stay the same)."""

    attention = Attention
    block = MoeBlock
    aux_terms = staticmethod(aux_terms)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.attn_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.attn = self.attention(cfg, rngs, mesh)
        self.mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.moe = self.block(cfg, rngs, mesh)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        y_BSD, sums = self.moe(self.mlp_norm(x_BSD), segment_ids_BS)
        return x_BSD + y_BSD, sums


class Qwen3MoeLayer(MoeLayer):
    attention = QwenAttention
