"""Hugging Face Qwen3NextForCausalLM <-> maxctx: Qwen3.5's layout (maxctx.model.qwen35.hf_layout) with the linear
layers' projections fused per key head and every layer's MLP a routed MoE with a gated shared expert, as the
released checkpoints (and transformers 5's save_pretrained) hold them.

Legend: D model, X experts, M an expert's width, S the shared expert's (shared_experts x M); lower case the linear
layers': k key heads, c = 2 Dk + 2 (n / k) v one key head's group, g = 2 n / k. HF layer i is period i // P, place
i % P of maxctx's `qwen3_next` stack.

    linear_attn.in_proj_qkvz [k c, D]            -> linear_<j>/mixer/w_qkvz [D, k, c]   (per group q | k | v | z)
    linear_attn.in_proj_ba [k g, D]              -> mixer/w_ba [D, k, g]                (per group b | a)
    mlp.gate.weight [X, D]                       -> moe/routed/router [D, X]
    mlp.experts.{j}.gate_proj, up_proj [M, D]    -> moe/routed/w_gate, w_up [X, D, M];  down_proj [D, M] -> w_down
    mlp.shared_expert.gate_proj, up_proj [S, D]  -> moe/shared/w_gate, w_up [D, S];      down_proj [D, S] -> w_down
    mlp.shared_expert_gate.weight [1, D]         -> moe/shared_gate [D, 1]

The rest (conv1d, A_log, dt_bias, the gated norm, out_proj, the gated full attention, the (1 + w) norms) is
Qwen3.5's. Dense MLP layers (decoder_sparse_step > 1, mlp_only_layers) and multi-token prediction layers are refused
in one line; from_hf --skip_mtp_layers converts a release without its mtp.* tensors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.family import hf_architecture
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor
from maxctx.model.moe.hf_layout import _aux_loss_coef
from maxctx.model.qwen35 import hf_layout as qwen35
from maxctx.model.qwen35.hf_layout import PlacedTensor, place_name, refuse_mtp

without_mtp = qwen35.without_mtp  # from_hf --skip_mtp_layers: the releases' mtp.* tensors, as Qwen3.5's

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next"}
DECODER_BLOCKS = {"qwen3_next": "qwen3_next"}


def _width(keys: dict[str, Any]) -> int:
    """An expert's width M (base_moe_mlp_dim, 0: base_mlp_dim)."""
    return keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]


def _dim(keys: dict[str, Any], c: str) -> int:
    nk, nv, dk, dv = (keys[k] for k in tuple(qwen35.LINEAR_KEYS)[:4])
    own = {"k": nk, "c": 2 * dk + 2 * (nv // nk) * dv, "g": 2 * nv // nk, "M": _width(keys),
           "S": keys["shared_experts"] * _width(keys)}
    return own[c] if c in own else qwen35._dim(keys, c)


@dataclasses.dataclass(frozen=True)
class NextTensor(PlacedTensor):
    """A placed tensor with Qwen3-Next's letters (module doc); `experts`: one of X per-expert HF tensors."""

    experts: bool = False

    def hf_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return tuple(math.prod(_dim(keys, c) for c in group) for group in self.hf)

    def mx_shape(self, keys: dict[str, Any]) -> tuple[int, ...]:
        return ((keys["num_experts"],) if self.experts else ()) + self._one(keys)

    def _one(self, keys: dict[str, Any]) -> tuple[int, ...]:
        groups = (*self.hf[1:], self.hf[0]) if self.linear else self.hf
        return tuple(_dim(keys, c) for group in groups for c in group)

    def to_maxctx(self, w, keys: dict[str, Any]):
        return (w.T if self.linear else w).reshape(self._one(keys))

    def parts(self, keys: dict[str, Any]) -> int:
        return keys["num_experts"] if self.experts else 1

    def name(self, layer: int | None = None, part: int | None = None) -> str:
        return self.hf_name.format(i=self.period * layer + self.place, j=part)


_FUSED = ((("mixer", "w_qkvz"), "linear_attn.in_proj_qkvz.weight", ("kc", "D"), True),
          (("mixer", "w_ba"), "linear_attn.in_proj_ba.weight", ("kg", "D"), True))
_SEPARATE = ("w_qkv", "w_z", "w_b", "w_a")
_MOE = ((("moe", "routed", "router"), "mlp.gate.weight", ("X", "D"), True, False),
        *((("moe", "routed", p), f"mlp.experts.{{j}}.{n}_proj.weight", hf, True, True)
          for p, n, hf in (("w_gate", "gate", ("M", "D")), ("w_up", "up", ("M", "D")), ("w_down", "down", ("D", "M")))),
        *((("moe", "shared", p), f"mlp.shared_expert.{n}_proj.weight", hf, True, False)
          for p, n, hf in (("w_gate", "gate", ("S", "D")), ("w_up", "up", ("S", "D")), ("w_down", "down", ("D", "S")))),
        (("moe", "shared_gate"), "mlp.shared_expert_gate.weight", ("o", "D"), True, False))


def _entries(linear: bool) -> tuple[tuple, ...]:
    """(path, HF name, HF shape, linear, per expert) of a place's tensors: its mixer's (Qwen3.5's, the linear
    layer's projections fused), Qwen3.5's two norms, the MoE layer's."""
    mixer = (*_FUSED, *(t for t in qwen35._LINEAR if t[0][1] not in _SEPARATE)) if linear else qwen35._FULL
    norms = tuple(t for t in qwen35._BLOCK if t[0][0] != "mlp")
    return (*((*t, False) for t in (*mixer, *norms)), *_MOE)


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    period = keys["full_attention_interval"]
    shared = tuple(t for t in llama.tensors(keys) if not t.per_layer)
    placed = (NextTensor(("layers", place_name(place, period), *path), "model.layers.{i}." + name, hf, linear, True,
                         place, period, experts)
              for place in range(period) for path, name, hf, linear, experts in _entries(place < period - 1))
    return (*shared, *placed)


def architecture(hf_config: dict, where: str) -> str:
    return hf_architecture(ARCHITECTURES, hf_config, where)


def _refuse(hf: dict, where: str) -> None:
    """One line for each layout the released Qwen3-Next models do not have and maxctx does not run."""
    refuse_mtp(hf, where)
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step', 1)} mlp_only_layers="
                          f"{hf.get('mlp_only_layers')} (dense MLP layers between the MoE ones) is not a layout "
                          f"maxctx runs yet; released Qwen3-Next models have 1 and []")
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not a Qwen3-Next layout maxctx converts; released "
                          f"Qwen3-Next models have false")


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """Qwen3.5's keys (the layer pattern from layer_types, else full_attention_interval as transformers builds it)
    and the experts': the shared expert as shared_experts experts of moe_intermediate_size."""
    architecture(hf, where)
    _refuse(hf, where)
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if isinstance(interval, int) and (i + 1) % interval == 0
                                      else "linear_attention" for i in range(hf.get("num_hidden_layers") or 0)]
    keys = qwen35.model_keys({**hf, "architectures": ["Qwen3_5ForCausalLM"], "layer_types": types}, where)
    sizes = {key: llama._positive(hf.get(name), name, where, integer=True) for key, name in (
        ("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
        ("base_moe_mlp_dim", "moe_intermediate_size"))}
    shared = llama._positive(hf.get("shared_expert_intermediate_size"), "shared_expert_intermediate_size", where,
                             integer=True)
    if shared % sizes["base_moe_mlp_dim"]:
        raise ConfigError(f"{where}: shared_expert_intermediate_size={shared} is not a multiple of "
                          f"moe_intermediate_size={sizes['base_moe_mlp_dim']}, which maxctx's shared experts are; "
                          f"released Qwen3-Next models have both 512")
    return {**keys, **sizes, "shared_experts": shared // sizes["base_moe_mlp_dim"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "load_balance_loss_weight": _aux_loss_coef(hf, where)}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    config = qwen35.hf_config(keys, "qwen3_5_text", dtype, extra)
    return {**config, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "num_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": _width(keys), "norm_topk_prob": keys["norm_topk_prob"],
            "shared_expert_intermediate_size": keys["shared_experts"] * _width(keys),
            "router_aux_loss_coef": keys["load_balance_loss_weight"], "decoder_sparse_step": 1, "mlp_only_layers": []}
