"""Hugging Face GptOssForCausalLM <-> maxctx, the released bf16 layout: Llama's names and transposes for the
embedding, norms and q/k/v/o weights (maxctx.model.llama.hf_layout), Qwen 2's q/k/v biases
(maxctx.model.qwen.hf_layout), and GPT-OSS's own tensors, its experts fused as the release holds them.

Legend: D model width, H query heads, X experts, M an expert's width (config.json's intermediate_size).

    self_attn.o_proj.bias                [D]           attn/bo [D]
    self_attn.sinks                      [H]           attn/sinks [H]
    mlp.router.weight, .bias             [X, D], [X]   moe/router [D, X], moe/router_bias [X]
    mlp.experts.gate_up_proj             [X, D, 2M]    moe/w_gate_up [X, D, M, 2]  (gate and up columns interleaved:
    mlp.experts.gate_up_proj_bias        [X, 2M]       moe/b_gate_up [X, M, 2]      gate_up[..., ::2] is the gate)
    mlp.experts.down_proj, _bias         [X, M, D], [X, D]   moe/w_down [X, M, D], moe/b_down [X, D]

The experts are stored as y = x W (no transpose), and the fused pairs as a reshape: exact both ways. layer_types
(sliding_attention / full_attention per layer) and sliding_window are attention_layer_pattern (L / G) and
sliding_window_size. config.json's router_aux_loss_coef is load_balance_loss_weight. MXFP4 releases
(quantization_config, `_blocks` / `_scales` experts) are refused: transformers dequantises them to this layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor
from maxctx.model.qwen.hf_layout import BIASES

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
DECODER_BLOCKS = {"gpt_oss": "gpt_oss"}
AUX_LOSS_COEF = 0.001  # transformers' GptOssConfig default for a missing router_aux_loss_coef
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # maxctx.model.gpt_oss.family's constants
LAYER_TYPES = {"sliding_attention": "L", "full_attention": "G"}


@dataclasses.dataclass(frozen=True)
class ExpertTensor(Tensor):
    """An experts tensor [X, ...] stored as y = x W (`linear` False); `fused`: its last HF axis 2M holds gate and
    up interleaved, maxctx's [..., M, 2]."""

    fused: bool = False

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        shape = super().hf_shape(_widths(keys))
        return (*shape[:-1], 2 * shape[-1]) if self.fused else shape

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        shape = super().mx_shape(_widths(keys))
        return (*shape, 2) if self.fused else shape

    def to_maxctx(self, w, keys: dict[str, Any]):
        return w.reshape(self.mx_shape(keys))

    def to_hf(self, x, keys: dict[str, Any]):
        return x.reshape(self.hf_shape(keys))


def _widths(keys: dict[str, Any]) -> dict[str, Any]:
    return {**keys, "base_moe_mlp_dim": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]}


_LAYER = "model.layers.{i}."
OWN = (
    Tensor(("layers", "attn", "sinks"), _LAYER + "self_attn.sinks", ("H",), False, True),
    Tensor(("layers", "moe", "router"), _LAYER + "mlp.router.weight", ("X", "D"), True, True),
    Tensor(("layers", "moe", "router_bias"), _LAYER + "mlp.router.bias", ("X",), False, True),
    ExpertTensor(("layers", "moe", "w_gate_up"), _LAYER + "mlp.experts.gate_up_proj", ("X", "D", "M"), False, True,
                 fused=True),
    ExpertTensor(("layers", "moe", "b_gate_up"), _LAYER + "mlp.experts.gate_up_proj_bias", ("X", "M"), False, True,
                 fused=True),
    ExpertTensor(("layers", "moe", "w_down"), _LAYER + "mlp.experts.down_proj", ("X", "M", "D"), False, True),
    ExpertTensor(("layers", "moe", "b_down"), _LAYER + "mlp.experts.down_proj_bias", ("X", "D"), False, True),
)
OUT_BIAS = Tensor(("layers", "attn", "bo"), _LAYER + "self_attn.o_proj.bias", ("D",), False, True)


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    attention = tuple(t for t in llama.tensors(keys) if t.path[:2] != ("layers", "mlp"))
    return (*attention, *((*BIASES, OUT_BIAS) if keys["attention_bias"] else ()), *OWN)


def architecture(hf_config: dict, where: str) -> str:
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _refuse(hf: dict, where: str) -> None:
    """One line for each layout maxctx does not read."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"{where}: quantization_config quant_method={method!r} (the MXFP4 release's "
                          f"*_blocks / *_scales experts) is not a layout maxctx reads; dequantise it with "
                          f"transformers first (GptOssForCausalLM.from_pretrained(path, quantization_config="
                          f"Mxfp4Config(dequantize=True)).save_pretrained(out)) and convert that bf16 copy")
    for key, value in SWIGLU.items():
        if hf.get(key, value) != value:
            raise ConfigError(f"{where}: {key}={hf[key]} is not GPT-OSS's {value}, the experts' activation maxctx "
                              f"has; this checkpoint cannot be converted")


def _pattern(hf: dict, where: str) -> str:
    """attention_layer_pattern from layer_types (transformers' default: sliding first, then in turn)."""
    layers = hf.get("num_hidden_layers") or 0
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types) or len(types) != layers:
        raise ConfigError(f"{where}: layer_types is {types!r}, not num_hidden_layers={layers} entries of "
                          f"{' or '.join(LAYER_TYPES)}; write it as the model's card gives it")
    return "".join(LAYER_TYPES[t] for t in types)


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys for the same config.json, the windows, the attention's biases and the experts'."""
    architecture(hf, where)
    _refuse(hf, where)
    pattern = _pattern(hf, where)
    window = llama._positive(hf.get("sliding_window"), "sliding_window", where, integer=True) if "L" in pattern else 0
    dense = {**hf, "architectures": ["LlamaForCausalLM"], "attention_bias": None, "sliding_window": None}
    keys = llama.model_keys(dense, where)
    coef = hf.get("router_aux_loss_coef", AUX_LOSS_COEF)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise ConfigError(f"{where}: router_aux_loss_coef is {coef!r}, not a number >= 0; write the load-balancing "
                          f"loss's weight (transformers' default: {AUX_LOSS_COEF}), or download config.json again")
    return {**keys, "sliding_window_size": window, "attention_layer_pattern": pattern if window else "",
            "attention_bias": bool(hf.get("attention_bias", True)), "use_qk_norm": False,
            "num_experts": llama._positive(hf.get("num_local_experts"), "num_local_experts", where, integer=True),
            "num_experts_per_tok": llama._positive(hf.get("num_experts_per_tok"), "num_experts_per_tok", where,
                                                   integer=True),
            "base_moe_mlp_dim": keys["base_mlp_dim"], "load_balance_loss_weight": float(coef)}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys: GptOssConfig's entries over Llama's."""
    if keys["use_qk_norm"]:
        raise ConfigError("use_qk_norm=true has no GptOssForCausalLM equivalent; train with use_qk_norm=false")
    window, layers = keys["sliding_window_size"], keys["base_num_decoder_layers"]
    pattern = keys["attention_layer_pattern"] or ("L" if window else "G")
    config = llama.hf_config({**keys, "sliding_window_size": 0}, "llama", dtype, extra)
    config.pop("mlp_bias", None)
    return {**config, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "intermediate_size": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"],
            "num_local_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "router_aux_loss_coef": keys["load_balance_loss_weight"], "attention_bias": keys["attention_bias"],
            "sliding_window": window or None,
            "layer_types": [{v: k for k, v in LAYER_TYPES.items()}[pattern[i % len(pattern)]] for i in range(layers)],
            **SWIGLU}
