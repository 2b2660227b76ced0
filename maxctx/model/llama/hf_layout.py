"""Hugging Face Llama / Mistral <-> maxctx: the config keys and every parameter's name and layout.

Legend: L layers, D model width, H query heads, K kv heads, E head dim, F mlp width, V vocab.
An HF linear weight is [out, in] (`y = x W^T`); maxctx stores the same numbers as [in..., out...] (`x W`), so a
parameter is a transpose and a reshape away from its HF tensor, exact both ways. Per-layer HF tensors
(`model.layers.<i>.*`) are stacked on maxctx's leading `layers` axis.

RoPE needs no permutation: HF's checkpoints are in the rotate-half layout (HF's own converter permutes Meta's
interleaved q/k once), and maxctx.model.rope.rotary is rotate-half over the same head-dim order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from maxctx.config import Config
from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
DECODER_BLOCKS = {"llama": "llama2", "mistral": "mistral"}  # architecture -> maxctx's decoder_block
# Shape letters -> the maxctx key that sets them.
DIM_KEYS = {"D": "base_emb_dim", "H": "base_num_query_heads", "K": "base_num_kv_heads", "E": "head_dim",
            "F": "base_mlp_dim", "V": "vocab_size", "X": "num_experts", "M": "base_moe_mlp_dim"}
# maxctx key -> the config.json entry that gives it, required.
HF_SIZES = {"base_emb_dim": "hidden_size", "base_num_query_heads": "num_attention_heads",
            "base_mlp_dim": "intermediate_size", "base_num_decoder_layers": "num_hidden_layers",
            "vocab_size": "vocab_size"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One maxctx parameter and its HF tensor. `hf` is the HF shape in letters, [out, in] for a linear
    (`linear=True`: maxctx holds in + out); per-layer parameters have `layer` names with `{i}`."""

    path: tuple[str, ...]
    hf_name: str
    hf: tuple[str, ...]
    linear: bool
    per_layer: bool

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return tuple(math.prod(keys[DIM_KEYS[c]] for c in group) for group in self.hf)

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        """maxctx's shape of one layer's slice."""
        groups = (*self.hf[1:], self.hf[0]) if self.linear else self.hf
        return tuple(keys[DIM_KEYS[c]] for group in groups for c in group)

    def to_maxctx(self, w, keys: dict[str, Any]):
        return (w.T if self.linear else w).reshape(self.mx_shape(keys))

    def to_hf(self, x, keys: dict[str, Any]):
        out, *_ = shape = self.hf_shape(keys)
        if self.linear:
            return x.reshape(-1, out).T
        return x.reshape(shape)

    def layers(self, keys: dict[str, Any]) -> int:
        """Layers this per-layer tensor is stacked over (a family whose layers differ: maxctx.model.qwen35)."""
        return keys["base_num_decoder_layers"]

    def parts(self, keys: dict[str, Any]) -> int:
        """HF tensors that make one layer's slice, stacked on its first axis in maxctx (a MoE family's per-expert
        tensors, `{j}` in their names: maxctx.model.moe.hf_layout); 1 for a tensor of its own."""
        return 1

    def name(self, layer: int | None = None, part: int | None = None) -> str:
        return self.hf_name.format(i=layer, j=part)


_LAYER = "model.layers.{i}."
TENSORS = (
    Tensor(("embed",), "model.embed_tokens.weight", ("V", "D"), False, False),
    Tensor(("final_norm", "scale"), "model.norm.weight", ("D",), False, False),
    Tensor(("unembed",), "lm_head.weight", ("V", "D"), True, False),
    Tensor(("layers", "attn", "wq"), _LAYER + "self_attn.q_proj.weight", ("HE", "D"), True, True),
    Tensor(("layers", "attn", "wk"), _LAYER + "self_attn.k_proj.weight", ("KE", "D"), True, True),
    Tensor(("layers", "attn", "wv"), _LAYER + "self_attn.v_proj.weight", ("KE", "D"), True, True),
    Tensor(("layers", "attn", "wo"), _LAYER + "self_attn.o_proj.weight", ("D", "HE"), True, True),
    Tensor(("layers", "attn_norm", "scale"), _LAYER + "input_layernorm.weight", ("D",), False, True),
    Tensor(("layers", "mlp", "w_gate"), _LAYER + "mlp.gate_proj.weight", ("F", "D"), True, True),
    Tensor(("layers", "mlp", "w_up"), _LAYER + "mlp.up_proj.weight", ("F", "D"), True, True),
    Tensor(("layers", "mlp", "w_down"), _LAYER + "mlp.down_proj.weight", ("D", "F"), True, True),
    Tensor(("layers", "mlp_norm", "scale"), _LAYER + "post_attention_layernorm.weight", ("D",), False, True),
)


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    """The parameters of a model with these keys (no output projection when it is tied to the embedding)."""
    return tuple(t for t in TENSORS if not (t.path == ("unembed",) and keys["logits_via_embedding"]))


def architecture(hf_config: dict, where: str) -> str:
    """'llama' or 'mistral', from config.json's `architectures` (or `model_type`)."""
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _positive(value: Any, name: str, where: str, integer: bool = False) -> Any:
    """`value` when it is a positive JSON number (an integer where `integer`), else a ConfigError naming `name`."""
    what = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or \
            not math.isfinite(value) or value <= 0:
        problem = "is missing" if value is None else f"is {value!r}, not {what}"
        raise ConfigError(f"{where}: {name} {problem}; write it as the model's card gives it ({what}), or download "
                          f"config.json again")
    return value


def _rope_keys(hf: dict, where: str) -> dict[str, Any]:
    """RoPE keys as transformers reads the config (modeling_rope_utils): a missing original_max_position_embeddings
    falls back to max_position_embeddings (llama3 and yarn alike), and YaRN's attention factor, when not given, is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set (DeepSeek's form), otherwise
    0.1 ln(factor) + 1. The resolved factor is what maxctx keeps (rope_attention_factor) and exports."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get(field) or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: {field}={scaling!r} is not a JSON object; write it as the model's card gives "
                          f"it (e.g. {{\"rope_type\": \"linear\", \"factor\": 2.0}}), or null for plain RoPE")
    theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    keys: dict[str, Any] = {"rope_max_timescale": float(_positive(theta, "rope_theta", where)), "rope_type": kind}
    if kind in ("llama3", "linear", "yarn"):
        for key in ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",):
            _positive(scaling.get(key), f"{field} '{kind}' {key}", where)
    original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if kind in ("llama3", "yarn") and not original:
        raise ConfigError(f"{where}: rope_scaling type '{kind}' needs original_max_position_embeddings (in "
                          f"rope_scaling) or max_position_embeddings; add the context length the model was "
                          f"pretrained at")
    if kind == "llama3":
        keys.update(rope_factor=scaling["factor"], rope_low_freq_factor=scaling["low_freq_factor"],
                    rope_high_freq_factor=scaling["high_freq_factor"], original_max_position_embeddings=original)
    elif kind == "linear":
        keys.update(rope_linear_scaling_factor=scaling["factor"])
    elif kind == "yarn":
        keys.update(rope_factor=scaling["factor"], original_max_position_embeddings=original,
                    beta_fast=scaling.get("beta_fast") or 32.0, beta_slow=scaling.get("beta_slow") or 1.0,
                    rope_truncate=scaling.get("truncate", True),
                    rope_attention_factor=_yarn_attention_factor(scaling))
    elif kind != "default":
        raise ConfigError(f"{where}: rope_scaling type '{kind}' is not one maxctx has; maxctx has default, linear, "
                          f"llama3 and yarn (maxctx.model.rope)")
    return keys


def _yarn_attention_factor(scaling: dict) -> float:
    """attention_factor as given, or DeepSeek's mscale ratio; 0.0 (maxctx's 'the default 0.1 ln(factor) + 1')
    otherwise."""
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return 0.0
    factor = float(scaling["factor"])

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return get_mscale(float(mscale)) / get_mscale(float(mscale_all_dim))


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """maxctx's model keys (config.MODEL_KEYS) for an HF config.json; refuses what maxctx cannot run exactly."""
    architecture(hf, where)
    for key, fine in (("hidden_act", ("silu", None)), ("attention_bias", (False, None)), ("mlp_bias", (False, None))):
        if hf.get(key) not in fine:
            raise ConfigError(f"{where}: {key}={hf.get(key)!r} is not something maxctx's model has (it needs "
                              f"{' or '.join(map(str, fine))}); this checkpoint cannot be converted")
    # Mistral's sliding window (q - W < k <= q in every layer) is maxctx's with every layer local (pattern L).
    window = hf.get("sliding_window") if architecture(hf, where) == "mistral" else None
    sizes = {key: _positive(hf.get(name), name, where, integer=True) for key, name in HF_SIZES.items()}
    heads = sizes["base_num_query_heads"]
    for key, name, default in (("base_num_kv_heads", "num_key_value_heads", heads),
                               ("head_dim", "head_dim", sizes["base_emb_dim"] // heads)):
        sizes[key] = _positive(hf.get(name) or default, name, where, integer=True)
    eps = hf.get("rms_norm_eps")
    return {**sizes,
            "normalization_layer_epsilon": float(Config.normalization_layer_epsilon if eps is None else
                                                 _positive(eps, "rms_norm_eps", where)),
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)), "sliding_window_size": window or 0,
            "attention_layer_pattern": "L" if window else "", **_rope_keys(hf, where)}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys: `extra` (the imported model's own entries: token ids, max positions)
    first, the model's shape and RoPE over it."""
    rope: dict[str, Any] | None = None
    if keys["rope_type"] == "llama3":
        rope = {"rope_type": "llama3", "factor": keys["rope_factor"], "low_freq_factor": keys["rope_low_freq_factor"],
                "high_freq_factor": keys["rope_high_freq_factor"],
                "original_max_position_embeddings": keys["original_max_position_embeddings"]}
    elif keys["rope_type"] == "linear":
        rope = {"rope_type": "linear", "factor": keys["rope_linear_scaling_factor"]}
    elif keys["rope_type"] == "yarn":
        rope = {"rope_type": "yarn", "factor": keys["rope_factor"], "beta_fast": keys["beta_fast"],
                "beta_slow": keys["beta_slow"], "truncate": keys["rope_truncate"],
                "original_max_position_embeddings": keys["original_max_position_embeddings"]}
        if keys["rope_attention_factor"] > 0:
            rope["attention_factor"] = keys["rope_attention_factor"]
    architecture_name = {v: k for k, v in ARCHITECTURES.items()}[arch]
    window = keys.get("sliding_window_size", 0)
    if window and (arch != "mistral" or keys.get("attention_layer_pattern", "").strip("L")):
        raise ConfigError(f"sliding_window_size={window} with attention_layer_pattern="
                          f"'{keys.get('attention_layer_pattern', '')}' has no Hugging Face {architecture_name} "
                          f"equivalent (only Mistral's sliding_window, every layer local); export with "
                          f"--architecture mistral and every layer local, or train without the window")
    positions = extra.get("max_position_embeddings") or (
        int(keys["original_max_position_embeddings"] * keys["rope_factor"]) if rope and "factor" in rope and
        keys["rope_type"] != "linear" else keys["original_max_position_embeddings"])
    drop = ("rope_scaling", "rope_parameters", "architectures", "model_type", "dtype", "torch_dtype")
    mistral = {"sliding_window": window or None} if arch == "mistral" else {}
    return {**{k: v for k, v in extra.items() if k not in drop}, **mistral,
            "architectures": [architecture_name], "model_type": arch, "hidden_act": "silu",
            "hidden_size": keys["base_emb_dim"], "intermediate_size": keys["base_mlp_dim"],
            "num_attention_heads": keys["base_num_query_heads"], "num_key_value_heads": keys["base_num_kv_heads"],
            "head_dim": keys["head_dim"], "num_hidden_layers": keys["base_num_decoder_layers"],
            "vocab_size": keys["vocab_size"], "rms_norm_eps": keys["normalization_layer_epsilon"],
            "rope_theta": keys["rope_max_timescale"], "rope_scaling": rope,
            "tie_word_embeddings": keys["logits_via_embedding"], "max_position_embeddings": positions,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}
