"""Hugging Face Qwen2ForCausalLM / Qwen3ForCausalLM <-> maxctx: Llama's layout (maxctx.model.llama.hf_layout:
names, transposes, RoPE keys in transformers 4.x and 5 forms) and the attention's own tensors.

Legend: H query heads, K kv heads, E head dim.

    self_attn.{q,k,v}_proj.bias   [HE], [KE]   -> attn/bq [H, E], attn/bk, attn/bv [K, E]   (Qwen 2 / 2.5)
    self_attn.{q,k}_norm.weight   [E]          -> attn/q_norm/scale, attn/k_norm/scale [E]  (Qwen 3)

Qwen2ForCausalLM always has the biases and no norm, Qwen3ForCausalLM the norms (and, with its attention_bias, an
output-projection bias too, which no released Qwen 3 has and maxctx refuses).
"""

from __future__ import annotations

from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
DECODER_BLOCKS = {"qwen2": "qwen2", "qwen3": "qwen3"}
# architecture -> (attention_bias, use_qk_norm) its checkpoints have
FEATURES = {"qwen2": (True, False), "qwen3": (False, True)}
_ATTN = "model.layers.{i}.self_attn."
BIASES = tuple(Tensor(("layers", "attn", f"b{n}"), _ATTN + f"{n}_proj.bias", (dims,), False, True)
               for n, dims in (("q", "HE"), ("k", "KE"), ("v", "KE")))
QK_NORMS = tuple(Tensor(("layers", "attn", f"{n}_norm", "scale"), _ATTN + f"{n}_norm.weight", ("E",), False, True)
                 for n in ("q", "k"))


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    return (*llama.tensors(keys), *(BIASES if keys["attention_bias"] else ()),
            *(QK_NORMS if keys["use_qk_norm"] else ()))


def architecture(hf_config: dict, where: str) -> str:
    """'qwen2' or 'qwen3', from config.json's `architectures` (or `model_type`)."""
    return hf_architecture(ARCHITECTURES, hf_config, where)


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys for the same config.json, and the attention's features; refuses Qwen's sliding window (no
    released Qwen 2.5 / 3 uses it) and Qwen 3's output-projection bias."""
    arch = architecture(hf, where)
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true (windows from layer max_window_layers on) is not a "
                          f"layout maxctx runs; convert a checkpoint with use_sliding_window false")
    if arch == "qwen3" and hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true (Qwen 3 with q, k, v and output-projection biases) is not "
                          f"a model maxctx has; convert a Qwen 3 checkpoint with attention_bias false")
    keys = llama.model_keys({**hf, "architectures": ["LlamaForCausalLM"], "attention_bias": None}, where)
    bias, qk_norm = FEATURES[arch]
    return {**keys, "attention_bias": bias, "use_qk_norm": qk_norm}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys (Llama's, as Qwen names them); the architecture is the checkpoint's, or
    its decoder_block's."""
    arch = arch if arch in FEATURES else keys["decoder_block"]
    name = {v: k for k, v in ARCHITECTURES.items()}[arch]
    features = (keys["attention_bias"], keys["use_qk_norm"])
    if features != FEATURES[arch]:
        raise ConfigError(f"attention_bias={features[0]} use_qk_norm={features[1]} has no Hugging Face {name} "
                          f"equivalent: Qwen2ForCausalLM has biases and no QK-norm (decoder_block=qwen2 "
                          f"attention_bias=true), Qwen3ForCausalLM QK-norm and no biases (decoder_block=qwen3 "
                          f"use_qk_norm=true); train with one of them")
    if keys["sliding_window_size"]:
        raise ConfigError(f"sliding_window_size={keys['sliding_window_size']} has no {name} equivalent maxctx "
                          f"exports; train without the window (sliding_window_size=0)")
    config = llama.hf_config(keys, "llama", dtype, extra)
    del config["mlp_bias"]
    if arch == "qwen2":
        del config["attention_bias"]
    return {**config, "architectures": [name], "model_type": arch, "use_sliding_window": False}
