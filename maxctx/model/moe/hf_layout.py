"""Hugging Face MixtralForCausalLM / Qwen3MoeForCausalLM <-> maxctx: Llama's layout (maxctx.model.llama.hf_layout)
for the attention and norms (with Qwen 3's q_norm, k_norm), and the MoE layer's per-expert tensors as the released
checkpoints hold them (transformers 5 fuses them in memory and writes them back per expert).

Legend: D model width, X experts, M an expert's width; j the expert.

    Mixtral                                          Qwen3-MoE                               maxctx
    block_sparse_moe.gate.weight      [X, D]         mlp.gate.weight                [X, D]   moe/router [D, X]
    block_sparse_moe.experts.{j}.w1   [M, D]         mlp.experts.{j}.gate_proj      [M, D]   moe/w_gate [X, D, M]
    block_sparse_moe.experts.{j}.w3   [M, D]         mlp.experts.{j}.up_proj        [M, D]   moe/w_up [X, D, M]
    block_sparse_moe.experts.{j}.w2   [D, M]         mlp.experts.{j}.down_proj      [D, M]   moe/w_down [X, M, D]

Mixtral's experts are intermediate_size wide; Qwen3-MoE's moe_intermediate_size (its intermediate_size is the
dense MLP's, which no released Qwen3-MoE layer has: decoder_sparse_step 1, no mlp_only_layers). config.json's
router_aux_loss_coef is maxctx's load_balance_loss_weight (the same term: transformers' load_balancing_loss_func).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor
from maxctx.model.qwen.hf_layout import QK_NORMS

ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
DECODER_BLOCKS = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
# architecture -> config.json's name of the expert count
EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}
AUX_LOSS_COEF = 0.001  # transformers' MixtralConfig and Qwen3MoeConfig default for a missing router_aux_loss_coef


@dataclasses.dataclass(frozen=True)
class ExpertTensor(Tensor):
    """One of X per-expert HF tensors per layer (`hf` one expert's shape), stacked as maxctx's [X, ...]."""

    def parts(self, keys: dict[str, Any]) -> int:
        return keys["num_experts"]

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return super().hf_shape(_widths(keys))

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return (keys["num_experts"], *super().mx_shape(_widths(keys)))

    def to_maxctx(self, w, keys: dict[str, Any]):
        return w.T.reshape(super().mx_shape(_widths(keys)))

    def to_hf(self, x, keys: dict[str, Any]):
        return super().to_hf(x, _widths(keys))


def _widths(keys: dict[str, Any]) -> dict[str, Any]:
    return {**keys, "base_moe_mlp_dim": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]}


def _moe(arch: str) -> tuple[Tensor, ...]:
    layer = "model.layers.{i}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return (Tensor(("layers", "moe", "router"), layer + "gate.weight", ("X", "D"), True, True),
            *(ExpertTensor(("layers", "moe", path), layer + f"experts.{{j}}.{name}.weight", dims, True, True)
              for path, name, dims in zip(("w_gate", "w_up", "w_down"), names, (("M", "D"), ("M", "D"), ("D", "M")))))


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    arch = keys["decoder_block"]
    attention = tuple(t for t in llama.tensors(keys) if t.path[:2] != ("layers", "mlp"))
    return (*attention, *(QK_NORMS if keys["use_qk_norm"] else ()), *_moe(arch))


def architecture(hf_config: dict, where: str) -> str:
    """'mixtral' or 'qwen3_moe', from config.json's `architectures` (or `model_type`)."""
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _refuse(hf: dict, arch: str, where: str) -> None:
    """One line for each layout the released models do not have and maxctx does not run."""
    if arch == "mixtral" and hf.get("sliding_window"):
        raise ConfigError(f"{where}: sliding_window={hf['sliding_window']} (Mixtral with a window) is not a layout "
                          f"maxctx converts; released Mixtral models have sliding_window null")
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not something maxctx's "
                          f"router does; set it to 0.0 (released Mixtral models have 0.0)")
    if arch == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step', 1)} mlp_only_layers="
                              f"{hf.get('mlp_only_layers')} (dense MLP layers between the MoE ones) is not a layout "
                              f"maxctx runs yet; released Qwen3-MoE models have 1 and []")
        if hf.get("use_sliding_window") or hf.get("attention_bias"):
            raise ConfigError(f"{where}: use_sliding_window or attention_bias true is not a Qwen3-MoE layout "
                              f"maxctx converts; released Qwen3-MoE models have both false")


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys for the same config.json, and the experts'."""
    arch = architecture(hf, where)
    _refuse(hf, arch, where)
    experts = hf.get(EXPERTS_KEY[arch], hf.get("num_local_experts"))
    sizes = {"num_experts": llama._positive(experts, EXPERTS_KEY[arch], where, integer=True),
             "num_experts_per_tok": llama._positive(hf.get("num_experts_per_tok"), "num_experts_per_tok", where,
                                                    integer=True)}
    dense = {**hf, "architectures": ["LlamaForCausalLM"], "attention_bias": None, "sliding_window": None}
    keys = {**llama.model_keys(dense, where), "load_balance_loss_weight": _aux_loss_coef(hf, where)}
    if arch == "mixtral":
        return {**keys, **sizes, "base_moe_mlp_dim": keys["base_mlp_dim"], "norm_topk_prob": True,
                "use_qk_norm": False, "attention_bias": False}
    width = llama._positive(hf.get("moe_intermediate_size"), "moe_intermediate_size", where, integer=True)
    return {**keys, **sizes, "base_moe_mlp_dim": width, "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "use_qk_norm": True, "attention_bias": False}


def _aux_loss_coef(hf: dict, where: str) -> float:
    coef = hf.get("router_aux_loss_coef", AUX_LOSS_COEF)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise ConfigError(f"{where}: router_aux_loss_coef is {coef!r}, not a number >= 0; write the load-balancing "
                          f"loss's weight (transformers' default: {AUX_LOSS_COEF}), or download config.json again")
    return float(coef)


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys; the architecture is the decoder_block's."""
    arch = keys["decoder_block"]
    name = {v: k for k, v in ARCHITECTURES.items()}[arch]
    if keys["sliding_window_size"]:
        raise ConfigError(f"sliding_window_size={keys['sliding_window_size']} has no {name} equivalent maxctx "
                          f"exports; train without the window (sliding_window_size=0)")
    if keys["attention_bias"] or keys["use_qk_norm"] != (arch == "qwen3_moe"):
        raise ConfigError(f"attention_bias={keys['attention_bias']} use_qk_norm={keys['use_qk_norm']} has no "
                          f"{name} equivalent: Mixtral has neither, Qwen3-MoE QK-norm only; train with those")
    if arch == "mixtral" and not keys["norm_topk_prob"]:
        raise ConfigError("norm_topk_prob=false has no MixtralForCausalLM equivalent (it always renormalises); "
                          "train with norm_topk_prob=true, or export decoder_block=qwen3_moe")
    config = llama.hf_config(keys, "llama", dtype, extra)
    for key in ("mlp_bias", "attention_bias", EXPERTS_KEY["mixtral"], EXPERTS_KEY["qwen3_moe"]):
        config.pop(key, None)
    width = keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]
    config.update(architectures=[name], model_type=arch, num_experts_per_tok=keys["num_experts_per_tok"],
                  router_aux_loss_coef=keys["load_balance_loss_weight"])
    config[EXPERTS_KEY[arch]] = keys["num_experts"]
    if arch == "mixtral":
        return {**config, "intermediate_size": width, "sliding_window": None}
    return {**config, "moe_intermediate_size": width, "norm_topk_prob": keys["norm_topk_prob"],
            "attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
