"""Hugging Face MixtralForCausalLM / Qwen3MoeForCausalLM <-> maxctx: Llama's layout (maxctx.model.llama.hf_layout)
for the attention and norms (with Qwen 3's q_norm, k_norm), and the MoE layer's per-expert tensors as the released
checkpoints hold them (transformers 5 fuses them in memory and writes them back per expert).

Legend: D model width, X experts, M an expert's width; j the expert.

    Mixtral                                          Qwen3-MoE                               maxctx
    block_sparse_moe.gate.weight      [X, D]         mlp.gate.weight                [X, D]   moe/router [D, X]
    block_sparse_moe.experts.{j}.w1   [M, D]         mlp.experts.{j}.gate_proj      [M, D]   moe/w_gate [X, D, M]
    block_sparse_moe.experts.{j}.w3   [M, D]         mlp.experts.{j}.up_proj        [M, D]   moe/w_up [X, D, M]
    block_sparse_moe.experts.{j}.w2   [D, M]         mlp.experts.{j}.down_proj      [D, M]   moe/w_down [X, M, D]

Mixtral's experts are intermediate_size wide; Qwen3-MoE's moe_intermediate_size. Qwen3-MoE's dense layers
(decoder_sparse_step, mlp_only_layers: maxctx's interleave_moe_layer_step, mlp_only_layers; none in the released
models) hold mlp.{gate,up,down}_proj of intermediate_size, as Qwen 3's; each run of like layers is a stack of its
own (`runs` below), HF layer first + i its layer i. config.json's router_aux_loss_coef is maxctx's
load_balance_loss_weight (the same term: transformers' load_balancing_loss_func).
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
class RunTensor(Tensor):
    """A per-layer tensor of one run's stack (`path` under its stack's name): its `count` layers are HF layers
    `first` .. first + count - 1."""

    first: int = 0
    count: int = 0

    def layers(self, keys: dict[str, Any]) -> int:
        return self.count

    def name(self, layer: int | None = None, part: int | None = None) -> str:
        return self.hf_name.format(i=layer + self.first, j=part)


@dataclasses.dataclass(frozen=True)
class ExpertTensor(RunTensor):
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


# The MoE and dense layers (Llama 4's and Qwen3-MoE's placement): layer i is MoE when (i + 1) %
# interleave_moe_layer_step == 0 (HF's decoder_sparse_step) and i is not in mlp_only_layers; the others a dense
# SwiGLU of base_mlp_dim. The family's stacks (maxctx.model.moe.family) and this layout both read the layers as runs
# of like layers, so the scan runs over each run, named `layers`, `layers_1`, ... in run order
# (maxctx.model.decoder); released models have step 1 and no dense layer: one run, `layers`.
@dataclasses.dataclass(frozen=True)
class Run:
    """`count` consecutive layers from layer `first`, all MoE (`moe`) or all dense."""

    moe: bool
    first: int
    count: int


def dense_indices(text: str, layers: int) -> tuple[int, ...]:
    """mlp_only_layers' layer indices, each in [0, layers); a ConfigError naming the key otherwise."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    indices = [int(p) for p in parts if p.lstrip("-").isdigit()]
    bad = [p for p in parts if not p.lstrip("-").isdigit()] + [str(i) for i in indices if not 0 <= i < layers]
    if bad:
        raise ConfigError(f"mlp_only_layers={text!r}: {bad[0]} is not a layer index in [0, {layers}) "
                          f"(base_num_decoder_layers={layers}); give comma-separated layer indices, e.g. 0,3")
    return tuple(sorted(set(indices)))


def runs(keys: dict[str, Any]) -> tuple[Run, ...]:
    """The layers as runs of like layers, from model keys (config.MODEL_KEYS: base_num_decoder_layers,
    interleave_moe_layer_step, mlp_only_layers)."""
    layers, step = keys["base_num_decoder_layers"], keys["interleave_moe_layer_step"]
    if step < 1:
        raise ConfigError(f"interleave_moe_layer_step={step} must be >= 1 (1: every layer MoE; 2: every second)")
    dense = set(dense_indices(keys["mlp_only_layers"], layers))
    kinds = [(i + 1) % step == 0 and i not in dense for i in range(layers)]
    out: list[Run] = []
    for i, moe in enumerate(kinds):
        if out and out[-1].moe == moe:
            out[-1] = dataclasses.replace(out[-1], count=out[-1].count + 1)
        else:
            out.append(Run(moe, i, 1))
    return tuple(out)


def moe_layers(keys: dict[str, Any]) -> int:
    return sum(r.count for r in runs(keys) if r.moe)


def stack_names(count: int) -> list[str]:
    """maxctx.model.decoder's names of `count` stacks: `layers`, then `layers_<i>`."""
    return ["layers" if i == 0 else f"layers_{i}" for i in range(count)]


def _widths(keys: dict[str, Any]) -> dict[str, Any]:
    return {**keys, "base_moe_mlp_dim": keys["base_moe_mlp_dim"] or keys["base_mlp_dim"]}


def _moe(arch: str, stack: str, run: Run) -> tuple[Tensor, ...]:
    layer = "model.layers.{i}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    at = dict(first=run.first, count=run.count)
    return (RunTensor((stack, "moe", "router"), layer + "gate.weight", ("X", "D"), True, True, **at),
            *(ExpertTensor((stack, "moe", path), layer + f"experts.{{j}}.{name}.weight", dims, True, True, **at)
              for path, name, dims in zip(("w_gate", "w_up", "w_down"), names, (("M", "D"), ("M", "D"), ("D", "M")))))


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    """The head's tensors, then each run's (`runs`): attention and norms, and the experts or,
    in a dense run, Llama's MLP."""
    arch, layer_runs = keys["decoder_block"], runs(keys)
    per_layer = [t for t in (*llama.tensors(keys), *(QK_NORMS if keys["use_qk_norm"] else ())) if t.per_layer]
    out = [t for t in llama.tensors(keys) if not t.per_layer]
    for stack, run in zip(stack_names(len(layer_runs)), layer_runs):
        out += [RunTensor((stack, *t.path[1:]), t.hf_name, t.hf, t.linear, True, run.first, run.count)
                for t in per_layer if not run.moe or t.path[:2] != ("layers", "mlp")]
        out += _moe(arch, stack, run) if run.moe else []
    return tuple(out)


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
    return {**keys, **sizes, **_sparse_layers(hf, keys["base_num_decoder_layers"], where), "base_moe_mlp_dim": width,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "use_qk_norm": True, "attention_bias": False}


def _sparse_layers(hf: dict, layers: int, where: str) -> dict[str, Any]:
    """interleave_moe_layer_step and mlp_only_layers from Qwen3-MoE's decoder_sparse_step and mlp_only_layers."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(type(i) is int and 0 <= i < layers for i in dense)):
        raise ConfigError(f"{where}: mlp_only_layers is {dense!r}, not a list of layer indices in [0, {layers}) "
                          f"(num_hidden_layers={layers}); write it as the model's card gives it (e.g. [] or "
                          f"[0, 3]), or download config.json again")
    return {"interleave_moe_layer_step": llama._positive(step, "decoder_sparse_step", where, integer=True),
            "mlp_only_layers": ",".join(str(i) for i in dense)}


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
    if arch == "mixtral" and len(runs(keys)) > 1:
        raise ConfigError(f"interleave_moe_layer_step={keys['interleave_moe_layer_step']} mlp_only_layers="
                          f"{keys['mlp_only_layers']!r}: MixtralForCausalLM has no dense layers; export "
                          f"decoder_block=qwen3_moe, or train with every layer MoE (1 and \"\")")
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
            "attention_bias": False, "use_sliding_window": False,
            "decoder_sparse_step": keys["interleave_moe_layer_step"],
            "mlp_only_layers": list(dense_indices(keys["mlp_only_layers"], keys["base_num_decoder_layers"]))}
