"""Hugging Face Qwen3_5ForCausalLM (text weights, transformers 5) <-> maxctx.

Legend: H query heads, K kv heads, E head dim, D model; lower case the linear layers': n value heads, v value head
dim, x convolution channels (2 Nk Dk + n v), w kernel; o is 1 and t is 2. HF layer i is period i // P, place
i % P of maxctx's `qwen3_5` stack (P = full_attention_interval): places 0 .. P - 2 linear, P - 1 full.

    linear_attn.in_proj_qkv [x, D]      -> linear_<j>/mixer/w_qkv [D, x]   (q | k | v along x)
    linear_attn.in_proj_z [n v, D]      -> w_z [D, n, v];  in_proj_b, in_proj_a [n, D] -> w_b, w_a [D, n]
    linear_attn.conv1d.weight [x, 1, w] -> conv [x, 1, w];  A_log, dt_bias [n];  norm.weight [v]
    linear_attn.out_proj [D, n v]       -> w_out [n, v, D]
    self_attn.q_proj [H 2 E, D]         -> full/attn/wq [D, H, 2, E]   (per head: the query, then its output gate)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import DIM_KEYS, Tensor

ARCHITECTURES = {"Qwen3_5ForCausalLM": "qwen3_5_text"}
DECODER_BLOCKS = {"qwen3_5_text": "qwen3_5"}
LINEAR_KEYS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _dim(keys: dict[str, Any], c: str) -> int:
    if c in DIM_KEYS:
        return keys[DIM_KEYS[c]]
    nk, nv, dk, dv = (keys[k] for k in tuple(LINEAR_KEYS)[:4])
    return {"n": nv, "v": dv, "x": 2 * nk * dk + nv * dv, "w": keys["linear_conv_kernel_dim"], "o": 1, "t": 2}[c]


@dataclasses.dataclass(frozen=True)
class PlacedTensor(Tensor):
    """A tensor of place `place` in each period of `period` HF layers (stacked over the periods)."""

    place: int = 0
    period: int = 1

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return tuple(math.prod(_dim(keys, c) for c in group) for group in self.hf)

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        groups = (*self.hf[1:], self.hf[0]) if self.linear else self.hf
        return tuple(_dim(keys, c) for group in groups for c in group)

    def name(self, layer: int | None = None, part: int | None = None) -> str:
        return self.hf_name.format(i=self.period * layer + self.place)

    def layers(self, keys: dict[str, Any]) -> int:
        return keys["base_num_decoder_layers"] // self.period


_LINEAR = (("mixer", "w_qkv"), "linear_attn.in_proj_qkv.weight", ("x", "D"), True), \
    (("mixer", "w_z"), "linear_attn.in_proj_z.weight", ("nv", "D"), True), \
    (("mixer", "w_b"), "linear_attn.in_proj_b.weight", ("n", "D"), True), \
    (("mixer", "w_a"), "linear_attn.in_proj_a.weight", ("n", "D"), True), \
    (("mixer", "conv"), "linear_attn.conv1d.weight", ("x", "o", "w"), False), \
    (("mixer", "a_log"), "linear_attn.A_log", ("n",), False), \
    (("mixer", "dt_bias"), "linear_attn.dt_bias", ("n",), False), \
    (("mixer", "norm", "scale"), "linear_attn.norm.weight", ("v",), False), \
    (("mixer", "w_out"), "linear_attn.out_proj.weight", ("D", "nv"), True)
_FULL = (("attn", "wq"), "self_attn.q_proj.weight", ("HtE", "D"), True), \
    (("attn", "wk"), "self_attn.k_proj.weight", ("KE", "D"), True), \
    (("attn", "wv"), "self_attn.v_proj.weight", ("KE", "D"), True), \
    (("attn", "wo"), "self_attn.o_proj.weight", ("D", "HE"), True), \
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", ("E",), False), \
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", ("E",), False)
_BLOCK = (("attn_norm", "scale"), "input_layernorm.weight", ("D",), False), \
    (("mlp", "w_gate"), "mlp.gate_proj.weight", ("F", "D"), True), \
    (("mlp", "w_up"), "mlp.up_proj.weight", ("F", "D"), True), \
    (("mlp", "w_down"), "mlp.down_proj.weight", ("D", "F"), True), \
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", ("D",), False)


def place_name(place: int, period: int) -> str:
    """The block's attribute of a place: linear_<j>, or full for the last."""
    return "full" if place == period - 1 else f"linear_{place}"


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    period = keys["full_attention_interval"]
    shared = tuple(t for t in llama.tensors(keys) if not t.per_layer)
    placed = []
    for place in range(period):
        own = _FULL if place == period - 1 else _LINEAR
        for path, name, hf, linear in (*own, *_BLOCK):
            placed.append(PlacedTensor(("layers", place_name(place, period), *path), "model.layers.{i}." + name,
                                       hf, linear, True, place, period))
    return (*shared, *placed)


def architecture(hf_config: dict, where: str) -> str:
    names = hf_config.get("architectures") or []
    if "Qwen3_5ForCausalLM" in names or (not names and hf_config.get("model_type") == "qwen3_5_text"):
        return "qwen3_5_text"
    raise ConfigError(f"{where}: architecture {names or hf_config.get('model_type')} is not a Qwen3.5 one maxctx "
                      f"converts; give a Qwen3_5ForCausalLM checkpoint (text weights; for a "
                      f"Qwen3_5ForConditionalGeneration release, its text_config and model.language_model tensors)")


MTP_PREFIX = "mtp."  # the released checkpoints' multi-token prediction layers (mtp_num_hidden_layers of them)


def without_mtp(hf: dict) -> tuple[dict, tuple[str, ...]]:
    """(config.json without its multi-token prediction layers, their tensors' name prefix): from_hf
    --skip_mtp_layers converts the main model without them (Qwen3.5's and Qwen3-Next's alike)."""
    return {**hf, "mtp_num_hidden_layers": 0}, (MTP_PREFIX,)


def refuse_mtp(hf: dict, where: str) -> None:
    """One line where config.json has multi-token prediction layers, which maxctx does not train."""
    count = hf.get("mtp_num_hidden_layers") or 0
    if count:
        raise ConfigError(f"{where}: mtp_num_hidden_layers={count}: the checkpoint's multi-token prediction layers "
                          f"({MTP_PREFIX}* tensors) are not something maxctx trains; convert the main model without "
                          f"them with from_hf --skip_mtp_layers")


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys, the linear layers' and the layer pattern; refuses a layer_types that is not P - 1 linear layers
    then one full, repeated, and multi-token prediction layers (`refuse_mtp`)."""
    architecture(hf, where)
    refuse_mtp(hf, where)
    rope = dict(hf.get("rope_parameters") or {})
    factor = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    keys = llama.model_keys({**hf, "architectures": ["LlamaForCausalLM"], "rope_parameters": rope,
                             "attention_bias": None}, where)
    types = hf.get("layer_types") or []
    interval = types.index("full_attention") + 1 if "full_attention" in types else 0
    want = ["linear_attention"] * (interval - 1) + ["full_attention"]
    if not interval or len(types) != keys["base_num_decoder_layers"] or types != want * (len(types) // interval):
        raise ConfigError(f"{where}: layer_types {types} is not maxctx's Qwen3.5 pattern (N - 1 linear_attention "
                          f"layers then one full_attention, repeated over num_hidden_layers); convert a released "
                          f"Qwen3.5 checkpoint")
    linear = {k: llama._positive(hf.get(k, d), k, where, integer=True) for k, d in LINEAR_KEYS.items()}
    return {**keys, **linear, "full_attention_interval": interval, "partial_rotary_factor": factor}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    config = llama.hf_config(keys, "llama", dtype, extra)
    theta = config.pop("rope_theta")
    for key in ("rope_scaling", "mlp_bias"):
        config.pop(key, None)
    period, layers = keys["full_attention_interval"], keys["base_num_decoder_layers"]
    types = ["full_attention" if (i + 1) % period == 0 else "linear_attention" for i in range(layers)]
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": keys["partial_rotary_factor"]}
    return {**config, **{k: keys[k] for k in LINEAR_KEYS}, "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text", "layer_types": types, "rope_parameters": rope}
