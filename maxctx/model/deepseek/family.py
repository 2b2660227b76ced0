"""The DeepSeek-V2 / V3 family (decoder_block=deepseek) as maxctx.model.family states a family (no JAX): multi-head
latent attention in every layer, a dense SwiGLU in the first `first_num_dense_layers`, a routed MoE with shared
experts in the rest (two stacks: `deepseek_dense`, then `deepseek`).

Legend: D model, H heads, Dn / Dr q/k head dims without / with RoPE (Dq = Dn + Dr), Dv value head dim, Rq query
LoRA rank (0: none), Rkv KV LoRA rank, F dense MLP width, X experts, k per token, M an expert's width, s shared
experts, Ld dense layers, Lm MoE layers, T tensor parallelism, b bytes per activation. Per layer:

    attention   query  D H Dq, or D Rq + Rq H Dq (and the Rq norm)
                latent D (Rkv + Dr) (the KV latent and the one shared RoPE key), its Rkv norm
                expand Rkv H (Dn + Dv), output H Dv D
    dense MLP   3 D F                              (Ld layers)
    MoE         router D X (and V3's correction bias X), routed 3 X D M, shared 3 D s M   (Lm layers; a token
                runs k routed and the shared)

Attention FLOPs per (query, key) pair: 2 H Dq for QK^T and 2 H Dv for PV, x3 for forward and backward. Per token and
device, the remat names: query_proj H/T Dq, key_proj H/T Dq (the latent and RoPE key, Rkv + Dr, are counted with
it), value_proj H/T Dv, context c H/T Dv + 2 H/T, out_proj D; mlpwi / mlpwo as the MoE family's with the shared
experts' s M added (the MoE layers', which are all but Ld). The layer's working set is Llama's fit, not yet
calibrated on a compiled DeepSeek step.
"""

from __future__ import annotations

import dataclasses
import math

from maxctx.config import Config, ConfigError
from maxctx.model.deepseek import hf_layout
from maxctx.model.family import Stack, Tensor
from maxctx.model.llama import family as llama
from maxctx.model.moe import family as moe
from maxctx.model.shape import ModelShape


@dataclasses.dataclass(frozen=True)
class DeepseekOptions(moe.MoeOptions):
    """What the deepseek layer kinds read (ModelConfig.options): MLA's sizes and the router's settings."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    nope_dim: int = 128
    rope_dim: int = 64
    v_dim: int = 128
    query_scale: float = 1.0  # YaRN's mscale^2 on q (the kernels scale by Dq^-1/2 themselves)
    shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    groups: int = 1
    top_groups: int = 1
    sigmoid: bool = False  # V3's router: sigmoid scores (else softmax)
    routed_bias: bool = False  # V3's correction bias on the scores for the choice
    sequence_balance_loss_weight: float = 0.0  # V3's sequence-wise balance loss (layers.sequence_balance_sums)
    bias_update_rate: float = 0.0  # V3's load-driven bias update (layers.load_signal; maxctx.train_step applies it)


@dataclasses.dataclass(frozen=True)
class DeepseekShape(ModelShape):
    """ModelShape with MLA and the dense-then-MoE layers; head_dim is Dq, `v_head_dim` Dv."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    rope_dim: int = 64
    v_head_dim: int = 128
    dense_layers: int = 0
    num_experts: int = 1
    top_k: int = 1
    moe_mlp_dim: int = 1
    shared_experts: int = 0
    routed_bias: bool = False

    @classmethod
    def from_config(cls, config: Config) -> DeepseekShape:
        base = ModelShape.from_config(config)
        return cls(**{**dataclasses.asdict(base), "head_dim": config.qk_nope_head_dim + config.qk_rope_head_dim,
                      "num_kv_heads": config.base_num_query_heads},
                   q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   rope_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                   dense_layers=min(config.first_num_dense_layers, config.base_num_decoder_layers),
                   num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   moe_mlp_dim=moe.expert_width(config), shared_experts=config.shared_experts,
                   routed_bias=config.routed_bias)

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def attention_params(self) -> int:
        d, h, dq, rq, rkv = self.emb_dim, self.num_heads, self.head_dim, self.q_lora_rank, self.kv_lora_rank
        query = d * rq + rq * h * dq if rq else d * h * dq
        nope = dq - self.rope_dim
        return query + d * (rkv + self.rope_dim) + rkv * h * (nope + self.v_head_dim) + h * self.v_head_dim * d

    def _moe_mlp(self, experts: int) -> int:
        return self.emb_dim * self.num_experts + 3 * (experts + self.shared_experts) * self.emb_dim * self.moe_mlp_dim

    @property
    def mlp_params(self) -> int:
        """What a token multiplies in the MLPs, averaged over the layers (dense, or router, k routed and shared)."""
        dense = 3 * self.emb_dim * self.mlp_dim
        return (self.dense_layers * dense + self.moe_layers * self._moe_mlp(self.top_k)) // self.num_layers

    @property
    def layer_matmul_params(self) -> int:
        return self.attention_params + self.mlp_params

    @property
    def matmul_params(self) -> int:
        dense = 3 * self.emb_dim * self.mlp_dim
        return (self.num_layers * self.attention_params + self.dense_layers * dense
                + self.moe_layers * self._moe_mlp(self.top_k) + self.output_params)

    @property
    def idle_params(self) -> int:
        """The routed experts a token does not run, over the MoE layers."""
        return self.moe_layers * 3 * (self.num_experts - self.top_k) * self.emb_dim * self.moe_mlp_dim

    @property
    def num_params(self) -> int:
        norms = 2 * self.emb_dim + self.kv_lora_rank + self.q_lora_rank
        bias = self.moe_layers * self.num_experts * self.routed_bias
        return (self.matmul_params + self.idle_params + self.num_layers * norms + bias
                + self.output_params * (0 if self.tied_embedding else 1) + self.emb_dim)

    @property
    def active_params(self) -> int:
        return self.num_params - self.idle_params

    def attention_flops(self, pairs: float) -> float:
        return 6.0 * self.num_heads * (self.head_dim + self.v_head_dim) * pairs


def tensors(shape: DeepseekShape, tp: int, context_copies: int) -> dict[str, Tensor]:
    d, b, h = shape.emb_dim, shape.itemsize, shape.num_heads // tp
    dq, dv, rkv, rq = shape.head_dim, shape.v_head_dim, shape.kv_lora_rank, shape.q_lora_rank
    k, m = shape.top_k + shape.shared_experts, shape.moe_mlp_dim / tp
    query = 2 * d * rq + 2 * rq * h * dq if rq else 2 * d * h * dq
    expand = 2 * rkv * h * (dq - shape.rope_dim + dv)
    router = 2 * d * shape.num_experts + moe.ROUTER_FLOPS * shape.num_experts
    return {"decoder_layer_input": Tensor(d * b),
            "query_proj": Tensor(h * dq * b, query),
            "key_proj": Tensor((h * dq + rkv + shape.rope_dim) * b, 2 * d * (rkv + shape.rope_dim) + expand / 2),
            "value_proj": Tensor(h * dv * b, expand / 2),
            "context": Tensor((context_copies * h * dv + 2 * h) * b), "out_proj": Tensor(d * b, 2 * h * dv * d),
            "mlpwi": Tensor(2 * k * m * b, 4 * k * d * m + router),
            "mlpwo": Tensor(d * b, 2 * k * m * d + 2 * shape.top_k * d)}


def latent_tensors(shape: DeepseekShape, tp: int, named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Under a strategy that moves the latent (maxctx.attention.cp.latent): `key_proj` names the latent and the
    rotated RoPE key [t, Rkv + Dr] (its down projection's FLOPs; the strategy's rebuild of K and V is its own,
    Strategy.rebuild_flops) and `value_proj` is not formed."""
    width = shape.kv_lora_rank + shape.rope_dim
    return {**named, "key_proj": Tensor(width * shape.itemsize, 2 * shape.emb_dim * width),
            "value_proj": Tensor(0.0, 0.0)}


def activation(shape: DeepseekShape, tp: int) -> float:
    """Bytes per token of one MoE layer's forward: six [t, D], the latent and RoPE key, q, k (Dq), v and the output
    (Dv), the experts' [k M / T] three times with the shared ones, the sorted copy and the slots' outputs [k D], the
    router's probabilities [X] fp32, each written and read."""
    h, b = shape.num_heads / tp, shape.itemsize
    k = shape.top_k + shape.shared_experts
    attention = shape.kv_lora_rank + shape.rope_dim + 2 * h * shape.head_dim + 2 * h * shape.v_head_dim
    experts = 3 * k * shape.moe_mlp_dim / tp + 2 * shape.top_k * shape.emb_dim
    return 2 * (b * (6 * shape.emb_dim + attention + experts) + 4 * shape.num_experts)


def tile(shape: DeepseekShape, tp: int) -> float:
    """The MoE tile (the experts' gate, up and product with the shared ones', the sorted copy, the router's
    probabilities), or the dense layers' SwiGLU tile where wider."""
    k, b = shape.top_k + shape.shared_experts, shape.itemsize
    experts = b * (3 * k * shape.moe_mlp_dim / tp + 2 * shape.top_k * shape.emb_dim) + 4 * shape.num_experts
    return max(experts, 3 * shape.mlp_dim / tp * b if shape.dense_layers else 0)


def check(config: Config) -> None:
    if config.base_num_kv_heads != config.base_num_query_heads:
        raise ConfigError(f"base_num_kv_heads={config.base_num_kv_heads}: decoder_block=deepseek's latent attention "
                          f"expands keys and values per query head; set base_num_kv_heads="
                          f"{config.base_num_query_heads} (base_num_query_heads)")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(config, key) < 1 or (key == "qk_rope_head_dim" and config.qk_rope_head_dim % 2):
            raise ConfigError(f"{key}={getattr(config, key)} must be a positive{' even' * (key[3] == 'r')} "
                              f"integer (DeepSeek-V2: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, "
                              f"v_head_dim 128)")
    if config.attention_head_chunks > 1:
        raise ConfigError(f"attention_head_chunks={config.attention_head_chunks}: decoder_block=deepseek's latent "
                          f"attention runs its heads at once; set attention_head_chunks=1")
    if config.first_num_dense_layers < config.base_num_decoder_layers:
        moe.check(dataclasses.replace(config, decoder_block="deepseek", norm_topk_prob=True))
    if config.routed_score_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"routed_score_func={config.routed_score_func!r} is not softmax (DeepSeek-V2) or sigmoid "
                          f"(DeepSeek-V3)")
    if config.sequence_balance_loss_weight < 0:
        raise ConfigError(f"sequence_balance_loss_weight={config.sequence_balance_loss_weight} must be >= 0 "
                          f"(DeepSeek-V3: 0.0001; 0: off)")
    rate = config.routed_bias_update_rate
    if not rate >= 0 or (rate > 0 and not config.routed_bias):
        raise ConfigError(f"routed_bias_update_rate={rate} must be >= 0 and moves the correction bias of "
                          f"routed_bias=true (DeepSeek-V3: routed_bias=true routed_bias_update_rate=0.001; 0: the bias "
                          f"stays as loaded)")
    groups, top = config.n_routing_groups, config.topk_routing_group
    if groups > 0 and (config.num_experts % groups or not 0 < top <= groups):
        raise ConfigError(f"n_routing_groups={groups} topk_routing_group={top}: the groups must divide num_experts="
                          f"{config.num_experts} and 1 <= topk_routing_group <= n_routing_groups; or set both -1")


def options(config: Config) -> DeepseekOptions:
    mscale = config.mscale if config.rope_type == "yarn" and config.rope_factor > 1 else 0.0
    factor = (0.1 * mscale * math.log(config.rope_factor) + 1.0) if mscale else 1.0
    grouped = config.n_routing_groups > 0
    return DeepseekOptions(
        num_experts=config.num_experts, top_k=config.num_experts_per_tok, mlp_dim=moe.expert_width(config),
        renormalize=config.norm_topk_prob, load_balance_loss_weight=config.load_balance_loss_weight,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, nope_dim=config.qk_nope_head_dim,
        rope_dim=config.qk_rope_head_dim, v_dim=config.v_head_dim, query_scale=factor * factor,
        shared_experts=config.shared_experts, routed_scaling_factor=config.routed_scaling_factor,
        groups=config.n_routing_groups if grouped else 1, top_groups=config.topk_routing_group if grouped else 1,
        sigmoid=config.routed_score_func == "sigmoid", routed_bias=config.routed_bias,
        sequence_balance_loss_weight=config.sequence_balance_loss_weight,
        bias_update_rate=config.routed_bias_update_rate, router_z_loss_weight=config.router_z_loss_weight)


def stacks(config: Config) -> tuple[Stack, ...]:
    """The dense layers, then the MoE layers (either may be empty)."""
    dense = min(config.first_num_dense_layers, config.base_num_decoder_layers)
    both = (Stack("deepseek_dense", dense), Stack("deepseek", config.base_num_decoder_layers - dense))
    return tuple(s for s in both if s.count)


DEEPSEEK = dataclasses.replace(
    llama.LLAMA, name="deepseek", shape=DeepseekShape.from_config, tensors=tensors, activation=activation, tile=tile,
    check=check, stacks=stacks, hf_layout=hf_layout, options=options, latent_tensors=latent_tensors,
    logical_axes=(*llama.LLAMA.logical_axes, "expert"))
