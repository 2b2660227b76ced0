"""Hugging Face Olmo2ForCausalLM / Olmo3ForCausalLM <-> maxctx: Llama's layout (maxctx.model.llama.hf_layout)
with OLMo's norms, and OLMo 3's layer types as maxctx's window keys.

Legend: H query heads, K kv heads, E head dim, D model width.

    post_attention_layernorm.weight     [D]    -> post_attn_norm/scale
    post_feedforward_layernorm.weight   [D]    -> post_mlp_norm/scale
    self_attn.q_norm.weight, k_norm     [HE], [KE] -> attn/q_norm/scale [H, E], attn/k_norm/scale [K, E]

config.json's `layer_types` (sliding_attention, full_attention per layer; OLMo 3's default: every fourth layer
full) becomes attention_layer_pattern (L, G; its shortest period) and `sliding_window` sliding_window_size: both
mask keys q - W < k <= q. RoPE: transformers 4.x writes rope_theta and rope_scaling (the full-attention layers'),
5 rope_parameters per layer type; the sliding layers' must be plain RoPE of the same theta (maxctx.model.olmo.layers).
"""

from __future__ import annotations

from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor

ARCHITECTURES = {"Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3"}
DECODER_BLOCKS = {"olmo2": "olmo2", "olmo3": "olmo3"}
LAYER_TYPES = {"sliding_attention": "L", "full_attention": "G"}
_LAYER = "model.layers.{i}."
NORMS = (
    Tensor(("layers", "post_attn_norm", "scale"), _LAYER + "post_attention_layernorm.weight", ("D",), False, True),
    Tensor(("layers", "post_mlp_norm", "scale"), _LAYER + "post_feedforward_layernorm.weight", ("D",), False, True),
)
QK_NORMS = tuple(Tensor(("layers", "attn", f"{n}_norm", "scale"), _LAYER + f"self_attn.{n}_norm.weight", (dims,),
                        False, True) for n, dims in (("q", "HE"), ("k", "KE")))


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    shared = tuple(t for t in llama.tensors(keys) if t.path[1:2] not in (("attn_norm",), ("mlp_norm",)))
    return (*shared, *NORMS, *(QK_NORMS if keys["use_qk_norm"] else ()))


def architecture(hf_config: dict, where: str) -> str:
    """'olmo2' or 'olmo3', from config.json's `architectures` (or `model_type`)."""
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _global_rope(hf: dict, where: str) -> dict:
    """config.json with the full-attention layers' RoPE where Llama's reader looks; refuses sliding layers whose
    RoPE is not plain RoPE of the same theta."""
    per_type = hf.get("rope_parameters")
    if not (isinstance(per_type, dict) and "full_attention" in per_type):
        return hf
    full, sliding = per_type.get("full_attention") or {}, per_type.get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default" or sliding.get("rope_theta") != full.get("rope_theta"):
        raise ConfigError(f"{where}: rope_parameters sliding_attention={sliding} is not plain RoPE of the full "
                          f"layers' rope_theta={full.get('rope_theta')}, the only local RoPE maxctx's OLMo has")
    return {**hf, "rope_parameters": full, "rope_scaling": None}


def _windows(hf: dict, arch: str, layers: int, where: str) -> dict[str, Any]:
    """sliding_window_size and attention_layer_pattern from layer_types and sliding_window (OLMo 3)."""
    if arch == "olmo2":
        return {"sliding_window_size": 0, "attention_layer_pattern": ""}
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                      for i in range(layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != layers:
        raise ConfigError(f"{where}: layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                          f"{layers} layers; it has {unknown or len(types)}: download config.json again")
    letters = "".join(LAYER_TYPES[t] for t in types)
    if "L" not in letters:
        return {"sliding_window_size": 0, "attention_layer_pattern": ""}
    window = llama._positive(hf.get("sliding_window"), "sliding_window", where, integer=True)
    period = next(p for p in range(1, layers + 1) if layers % p == 0 and letters == letters[:p] * (layers // p))
    return {"sliding_window_size": window, "attention_layer_pattern": letters[:period]}


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    arch = architecture(hf, where)
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not an OLMo maxctx has (no released OLMo 2 / 3 has "
                          f"biases); convert a checkpoint with attention_bias false")
    keys = llama.model_keys({**_global_rope(hf, where), "architectures": ["LlamaForCausalLM"],
                             "attention_bias": None}, where)
    return {**keys, **_windows(hf, arch, keys["base_num_decoder_layers"], where), "attention_bias": False,
            "use_qk_norm": True}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys, in transformers 4.x's form (rope_theta, rope_scaling, layer_types)."""
    arch = arch if arch in DECODER_BLOCKS else keys["decoder_block"]
    name = {v: k for k, v in ARCHITECTURES.items()}[arch]
    window, layers = keys["sliding_window_size"], keys["base_num_decoder_layers"]
    pattern = keys["attention_layer_pattern"] or ("L" if window else "G")
    if not keys["use_qk_norm"] or keys["attention_bias"]:
        raise ConfigError(f"use_qk_norm={keys['use_qk_norm']} attention_bias={keys['attention_bias']} has no "
                          f"{name} equivalent (it has QK-norm and no biases); train with use_qk_norm=true "
                          f"attention_bias=false")
    if window and arch == "olmo2":
        raise ConfigError(f"sliding_window_size={window} has no Olmo2ForCausalLM equivalent; export an "
                          f"Olmo3ForCausalLM (decoder_block=olmo3) or train without the window")
    config = llama.hf_config({**keys, "sliding_window_size": 0}, "llama", dtype, extra)
    del config["mlp_bias"]
    config.update(architectures=[name], model_type=arch)
    if arch == "olmo3":
        config.update(sliding_window=window or extra.get("sliding_window") or 4096, layer_types=[
            "sliding_attention" if window and pattern[i % len(pattern)] == "L" else "full_attention"
            for i in range(layers)])
    return config

