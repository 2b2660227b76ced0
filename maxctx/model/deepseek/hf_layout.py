"""Hugging Face DeepseekV2ForCausalLM / DeepseekV3ForCausalLM <-> maxctx: the MLA projections, the dense first
layers, and the MoE layers' router, per-expert and shared-expert tensors as the released checkpoints hold them
(transformers 5 fuses the experts in memory and writes them back per expert).

Legend: D model, H heads, q = Dn + Dr q/k head dim, p = Dr its RoPE part, v value head dim, u = Dn + Dv, r KV LoRA
rank, a query LoRA rank, w = r + p, F dense width, X experts, M an expert's width, s = shared experts x M; i the HF
layer, j the expert. maxctx's dense stack is `layers`, the MoE stack `layers_1` (`layers` with no dense layer).

    self_attn.q_proj                 [Hq, D]    attn/wq [D, H, q]          (q_lora_rank 0)
    self_attn.q_a_proj / q_b_proj    [a, D] / [Hq, a]   attn/wq_a [D, a], attn/wq_b [a, H, q]; q_a_layernorm [a]
    self_attn.kv_a_proj_with_mqa     [w, D]     attn/wkv_a [D, w]          (the latent, then the shared RoPE key)
    self_attn.kv_a_layernorm         [r]        attn/kv_norm/scale
    self_attn.kv_b_proj              [Hu, r]    attn/wkv_b [r, H, u]       (each head's k without RoPE, then v)
    self_attn.o_proj                 [D, Hv]    attn/wo [H, v, D]
    mlp.gate                         [X, D]     moe/router [D, X]
    mlp.gate.e_score_correction_bias [X]        moe/bias [X]               (V3: routed_bias, sigmoid router)
    mlp.experts.{j}.*_proj           [M, D] ... moe/w_gate, w_up [X, D, M], w_down [X, M, D]
    mlp.shared_experts.*_proj        [s, D] ... moe/shared/w_gate, w_up [D, s], w_down [s, D]

RoPE: the released checkpoints rotate interleaved pairs (transformers' complex rotation in V2, rope_interleave in
V3, whose de-interleaved output gives the same scores), which the layer does (maxctx.model.deepseek.layers);
nothing is permuted; V3's rope_interleave false is refused. YaRN as in maxctx.model.llama.hf_layout, with
rope_scaling's mscale_all_dim as maxctx's `mscale` (the softmax scale's factor). V3's multi-token prediction layers
(num_nextn_predict_layers) are refused in one line: maxctx does not train them; from_hf --skip_mtp_layers converts
the main model without them (`without_mtp`). FP8 block-quantised releases are dequantised on import
(`quantization`); the export is the dequantised model, without quantization_config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import DIM_KEYS, Tensor

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
DECODER_BLOCKS = {"deepseek_v2": "deepseek", "deepseek_v3": "deepseek"}


def _dim(keys: dict[str, Any], c: str) -> int:
    if c in DIM_KEYS and c != "M":
        return keys[DIM_KEYS[c]]
    n, p, v = keys["qk_nope_head_dim"], keys["qk_rope_head_dim"], keys["v_head_dim"]
    m = keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]
    return {"q": n + p, "p": p, "v": v, "u": n + v, "r": keys["kv_lora_rank"], "a": keys["q_lora_rank"],
            "w": keys["kv_lora_rank"] + p, "M": m, "s": keys["shared_experts"] * m}[c]


@dataclasses.dataclass(frozen=True)
class StackTensor(Tensor):
    """A per-layer tensor of the dense stack (`moe` False: HF layers 0 .. Ld - 1) or the MoE stack (HF layers
    Ld ..); with `experts`, one of X per-expert tensors per layer, stacked as maxctx's [X, ...]."""

    moe: bool = False
    experts: bool = False
    first: int = 0  # the HF index of the stack's first layer

    def _one(self, keys: dict[str, Any]) -> tuple[int, ...]:
        groups = (*self.hf[1:], self.hf[0]) if self.linear else self.hf
        return tuple(_dim(keys, c) for group in groups for c in group)

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return tuple(math.prod(_dim(keys, c) for c in group) for group in self.hf)

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return ((keys["num_experts"],) if self.experts else ()) + self._one(keys)

    def to_maxctx(self, w, keys: dict[str, Any]):
        return (w.T if self.linear else w).reshape(self._one(keys))

    def to_hf(self, x, keys: dict[str, Any]):
        out = self.hf_shape(keys)[0]
        return x.reshape(-1, out).T if self.linear else x.reshape(self.hf_shape(keys))

    def parts(self, keys: dict[str, Any]) -> int:
        return keys["num_experts"] if self.experts else 1

    def name(self, layer: int | None = None, part: int | None = None) -> str:
        return self.hf_name.format(i=layer + self.first, j=part)

    def layers(self, keys: dict[str, Any]) -> int:
        dense = _dense(keys)
        return keys["base_num_decoder_layers"] - dense if self.moe else dense


def _dense(keys: dict[str, Any]) -> int:
    return min(keys["first_num_dense_layers"], keys["base_num_decoder_layers"])


def _attention(stack: str, moe: bool, keys: dict[str, Any]) -> list[StackTensor]:
    at = "model.layers.{i}.self_attn."
    rows = [(("attn", "wkv_a"), at + "kv_a_proj_with_mqa.weight", ("w", "D"), True),
            (("attn", "kv_norm", "scale"), at + "kv_a_layernorm.weight", ("r",), False),
            (("attn", "wkv_b"), at + "kv_b_proj.weight", ("Hu", "r"), True),
            (("attn", "wo"), at + "o_proj.weight", ("D", "Hv"), True),
            (("attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", ("D",), False),
            (("mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", ("D",), False)]
    if keys["q_lora_rank"]:
        rows += [(("attn", "wq_a"), at + "q_a_proj.weight", ("a", "D"), True),
                 (("attn", "q_norm", "scale"), at + "q_a_layernorm.weight", ("a",), False),
                 (("attn", "wq_b"), at + "q_b_proj.weight", ("Hq", "a"), True)]
    else:
        rows.append((("attn", "wq"), at + "q_proj.weight", ("Hq", "D"), True))
    return [StackTensor((stack, *path), name, dims, linear, True, moe=moe, first=_dense(keys) if moe else 0)
            for path, name, dims, linear in rows]


def _mlp(stack: str, keys: dict[str, Any]) -> list[StackTensor]:
    mlp = "model.layers.{i}.mlp."
    rows = [(("mlp", w), mlp + f"{n}_proj.weight", dims) for w, n, dims in
            (("w_gate", "gate", ("F", "D")), ("w_up", "up", ("F", "D")), ("w_down", "down", ("D", "F")))]
    return [StackTensor((stack, *path), name, dims, True, True) for path, name, dims in rows]


def _moe(stack: str, keys: dict[str, Any]) -> list[StackTensor]:
    mlp, names = "model.layers.{i}.mlp.", (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))
    dims = {"w_gate": ("M", "D"), "w_up": ("M", "D"), "w_down": ("D", "M")}
    shared = {"w_gate": ("s", "D"), "w_up": ("s", "D"), "w_down": ("D", "s")}
    first = _dense(keys)
    out = [StackTensor((stack, "moe", "router"), mlp + "gate.weight", ("X", "D"), True, True, moe=True, first=first)]
    if keys["routed_bias"]:
        out.append(StackTensor((stack, "moe", "bias"), mlp + "gate.e_score_correction_bias", ("X",), False, True,
                               moe=True, first=first))
    out += [StackTensor((stack, "moe", w), mlp + f"experts.{{j}}.{n}_proj.weight", dims[w], True, True, moe=True,
                        experts=True, first=first) for w, n in names]
    if keys["shared_experts"]:
        out += [StackTensor((stack, "moe", "shared", w), mlp + f"shared_experts.{n}_proj.weight", shared[w], True, True,
                            moe=True, first=first) for w, n in names]
    return out


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    dense = _dense(keys)
    moe_stack = "layers_1" if dense else "layers"
    head = [t for t in llama.tensors(keys) if not t.per_layer]
    layers = []
    if dense:
        layers += _attention("layers", False, keys) + _mlp("layers", keys)
    if dense < keys["base_num_decoder_layers"]:
        layers += _attention(moe_stack, True, keys) + _moe(moe_stack, keys)
    return (*head, *layers)


def architecture(hf_config: dict, where: str) -> str:
    """'deepseek_v2' or 'deepseek_v3', from config.json's `architectures` (or `model_type`)."""
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _refuse(hf: dict, arch: str, where: str) -> None:
    if arch == "deepseek_v3":
        if hf.get("rope_interleave") is False:
            raise ConfigError(f"{where}: rope_interleave=false is not how the released DeepSeek-V3 models rotate; "
                              f"maxctx converts rope_interleave true (the default)")
        if hf.get("num_nextn_predict_layers"):
            raise ConfigError(f"{where}: num_nextn_predict_layers={hf['num_nextn_predict_layers']}: maxctx does not "
                              f"train multi-token prediction layers; convert the main model without them (their "
                              f"tensors model.layers.{hf.get('num_hidden_layers')}.* left out) with from_hf "
                              f"--skip_mtp_layers")
        return
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{where}: attention_bias or mlp_bias true is not a DeepSeek-V2 layout maxctx converts; "
                          f"released DeepSeek-V2 models have both false")
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"{where}: topk_method={method!r} is not DeepSeek-V2's router; maxctx converts greedy "
                          f"and group_limited_greedy (DeepSeek-V3's noaux_tc is not converted yet)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf.get('hidden_act')!r}: maxctx's experts are SwiGLU; give a "
                          f"checkpoint with silu")


def without_mtp(hf: dict) -> tuple[dict, tuple[str, ...]]:
    """(config.json without V3's multi-token prediction layers, their tensors' name prefixes): the released
    checkpoint holds them after the main model's layers, model.layers.<num_hidden_layers + i>.* (embed_tokens,
    enorm, hnorm, eh_proj, shared_head and a whole decoder layer each)."""
    count, first = hf.get("num_nextn_predict_layers") or 0, hf.get("num_hidden_layers")
    if not (isinstance(count, int) and isinstance(first, int)):
        return hf, ()  # model_keys names the bad entry
    return {**hf, "num_nextn_predict_layers": 0}, tuple(f"model.layers.{first + i}." for i in range(count))


def quantization(hf: dict, where: str) -> tuple[int, int] | None:
    """The [b0, b1] blocks of an FP8 block-quantised release (DeepSeek-V3, Kimi K2: config.json's
    quantization_config), whose float8 weights from_hf dequantises with their `<name>_scale_inv`; None without
    quantization_config. Any other quantization is refused, naming its entry."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    wanted = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    bad = ([f"{k}={q.get(k)!r}" for k, v in wanted.items() if q.get(k, v) != v] if isinstance(q, dict) else [repr(q)])
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        bad.append(f"weight_block_size={block!r}")
    if bad:
        raise ConfigError(f"{where}: quantization_config {bad[0]} is not a quantization maxctx dequantises; it "
                          f"converts FP8 block-quantised releases (quant_method 'fp8', fmt 'e4m3', activation_scheme "
                          f"'dynamic', weight_block_size [b0, b1], as DeepSeek-V3 ships) and bf16 or fp32 ones")
    return block[0], block[1]


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys for the shared entries (sizes, norms, RoPE with YaRN), and MLA's and the experts'."""
    arch = architecture(hf, where)
    _refuse(hf, arch, where)
    keys = llama.model_keys({**hf, "architectures": ["LlamaForCausalLM"], "attention_bias": None,
                             "mlp_bias": None, "head_dim": None}, where)
    size = _sizer(where)
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    v3 = arch == "deepseek_v3"
    grouped = hf.get("topk_method") == "group_limited_greedy" or (v3 and (hf.get("n_group") or 1) > 1)
    keys.update(
        head_dim=size(hf.get("qk_nope_head_dim"), "qk_nope_head_dim") + size(hf.get("qk_rope_head_dim"),
                                                                             "qk_rope_head_dim"),
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=size(hf.get("kv_lora_rank"), "kv_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=size(hf.get("v_head_dim"), "v_head_dim"),
        mscale=float(scaling.get("mscale_all_dim") or 0.0) if keys["rope_type"] == "yarn" else 0.0,
        first_num_dense_layers=hf.get("first_k_dense_replace", 0),
        num_experts=size(hf.get("n_routed_experts"), "n_routed_experts"),
        num_experts_per_tok=size(hf.get("num_experts_per_tok"), "num_experts_per_tok"),
        base_moe_mlp_dim=size(hf.get("moe_intermediate_size"), "moe_intermediate_size"),
        shared_experts=hf.get("n_shared_experts") or 0, norm_topk_prob=bool(v3 and hf.get("norm_topk_prob")),
        routed_score_func="sigmoid" if v3 else "softmax", routed_bias=v3,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_routing_groups=hf.get("n_group") if grouped else -1, topk_routing_group=hf.get("topk_group") if grouped
        else -1)
    return keys


def _sizer(where: str):
    def size(value, name: str) -> int:
        return llama._positive(value, name, where, integer=True)

    return size


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys: Llama's entries as DeepSeek names them, MLA's, the experts'."""
    if keys["sliding_window_size"]:
        raise ConfigError(f"sliding_window_size={keys['sliding_window_size']} has no DeepseekV2ForCausalLM "
                          f"equivalent; train without the window (sliding_window_size=0)")
    config = llama.hf_config({**keys, "head_dim": keys["qk_rope_head_dim"]}, "llama", dtype, extra)
    for key in ("mlp_bias", "head_dim", "quantization_config"):  # the export is the dequantised model
        config.pop(key, None)
    if config.get("rope_scaling") and keys["mscale"]:
        config["rope_scaling"] = {**config["rope_scaling"], "mscale_all_dim": keys["mscale"]}
    grouped = keys["n_routing_groups"] > 0
    if keys["routed_score_func"] == "sigmoid" or keys["routed_bias"]:
        return _v3_config(config, keys)
    return {**config, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "q_lora_rank": keys["q_lora_rank"] or None, "kv_lora_rank": keys["kv_lora_rank"],
            "qk_nope_head_dim": keys["qk_nope_head_dim"], "qk_rope_head_dim": keys["qk_rope_head_dim"],
            "v_head_dim": keys["v_head_dim"], "first_k_dense_replace": keys["first_num_dense_layers"],
            "n_routed_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"],
            "n_shared_experts": keys["shared_experts"] or None, "norm_topk_prob": False,
            "routed_scaling_factor": keys["routed_scaling_factor"],
            "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": keys["n_routing_groups"] if grouped else None,
            "topk_group": keys["topk_routing_group"] if grouped else None}


def _v3_config(config: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """DeepseekV3ForCausalLM's config.json: the sigmoid router always with its correction bias."""
    if keys["routed_score_func"] != "sigmoid" or not keys["routed_bias"]:
        raise ConfigError(f"routed_score_func={keys['routed_score_func']} routed_bias={keys['routed_bias']} has no "
                          f"Hugging Face equivalent: DeepseekV2ForCausalLM is softmax without a bias, "
                          f"DeepseekV3ForCausalLM sigmoid with one; train with one of them")
    grouped = keys["n_routing_groups"] > 0
    return {**config, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "q_lora_rank": keys["q_lora_rank"] or None, "kv_lora_rank": keys["kv_lora_rank"],
            "qk_nope_head_dim": keys["qk_nope_head_dim"], "qk_rope_head_dim": keys["qk_rope_head_dim"],
            "v_head_dim": keys["v_head_dim"], "first_k_dense_replace": keys["first_num_dense_layers"],
            "n_routed_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"],
            "n_shared_experts": keys["shared_experts"] or None, "norm_topk_prob": keys["norm_topk_prob"],
            "routed_scaling_factor": keys["routed_scaling_factor"], "rope_interleave": True,
            "n_group": keys["n_routing_groups"] if grouped else 1,
            "topk_group": keys["topk_routing_group"] if grouped else 1, "num_nextn_predict_layers": 0}
