"""Hugging Face Gemma2ForCausalLM / Gemma3ForCausalLM (text) <-> maxctx: the config keys and every parameter.

Legend: L layers, D model width, H query heads, K kv heads, E head dim, F mlp width, V vocab.
Llama's tensors (maxctx.model.llama.hf_layout: the same linear layouts) with Gemma's norms: input_layernorm and
post_attention_layernorm around the attention, pre_ and post_feedforward_layernorm around the MLP, and Gemma 3's
q_norm, k_norm [E]; every norm weight w kept as stored (the layers scale by 1 + w).

config.json in either form: transformers 4.x (rope_theta, rope_scaling, Gemma 3's rope_local_base_freq and
sliding_window_pattern) or 5 (rope_parameters, per layer type for Gemma 3, and layer_types). Exports are written in
the 4.x form with layer_types, which both read.
"""

from __future__ import annotations

from typing import Any

from maxctx.errors import ConfigError
from maxctx.model.llama import hf_layout as llama
from maxctx.model.llama.hf_layout import Tensor

# Gemma3ForConditionalGeneration (Gemma 3 4B and up, with the vision tower) is known only to be refused in one line.
ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                 "Gemma3ForConditionalGeneration": "gemma3"}
DECODER_BLOCKS = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
_EXPORTS = {"gemma2": ("Gemma2ForCausalLM", "gemma2"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# transformers' defaults where config.json leaves an entry out: (Gemma 2, Gemma 3).
_DEFAULTS = {"final_logit_softcapping": (30.0, None), "attn_logit_softcapping": (50.0, None),
             "query_pre_attn_scalar": (256, 256), "rope_theta": (10000.0, 1e6)}
_LAYER = "model.layers.{i}."
_NORMS = (
    Tensor(("layers", "post_attn_norm", "scale"), _LAYER + "post_attention_layernorm.weight", ("D",), False, True),
    Tensor(("layers", "mlp_norm", "scale"), _LAYER + "pre_feedforward_layernorm.weight", ("D",), False, True),
    Tensor(("layers", "post_mlp_norm", "scale"), _LAYER + "post_feedforward_layernorm.weight", ("D",), False, True),
)
_QK_NORMS = (
    Tensor(("layers", "attn", "q_norm", "scale"), _LAYER + "self_attn.q_norm.weight", ("E",), False, True),
    Tensor(("layers", "attn", "k_norm", "scale"), _LAYER + "self_attn.k_norm.weight", ("E",), False, True),
)


def tensors(keys: dict[str, Any]) -> tuple[Tensor, ...]:
    """Llama's parameters (its mlp_norm is Gemma's post-attention norm, placed here as post_attn_norm), Gemma's
    norms, and Gemma 3's QK-norms."""
    common = tuple(t for t in llama.tensors(keys) if t.path != ("layers", "mlp_norm", "scale"))
    return common + _NORMS + (_QK_NORMS if keys["decoder_block"] == "gemma3" else ())


def architecture(hf_config: dict, where: str) -> str:
    """'gemma2' or 'gemma3_text', from config.json's `architectures` (or `model_type`)."""
    names = hf_config.get("architectures") or [hf_config.get("model_type")]
    known = [ARCHITECTURES.get(n, n) for n in names if n in ARCHITECTURES or n in ARCHITECTURES.values()]
    if "gemma3" in known:
        raise ConfigError(f"{where}: {names[0]} is Gemma 3 with its vision tower; maxctx converts the text model: "
                          f"give a Gemma3ForCausalLM checkpoint (gemma-3-1b, or the language model saved on its own)")
    if not known:
        raise ConfigError(f"{where}: architecture {names} is not one maxctx converts as Gemma; give a "
                          f"Gemma2ForCausalLM or Gemma3ForCausalLM checkpoint")
    return known[0]


def _pattern(hf: dict, arch: str, layers: int, where: str) -> str:
    """attention_layer_pattern from layer_types (or transformers' rule without them): its shortest period."""
    period = 2 if arch == "gemma2" else hf.get("sliding_window_pattern") or 6
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % period else "full_attention"
                                      for i in range(layers)]
    letters = "".join({"sliding_attention": "L", "full_attention": "G"}.get(t, "?") for t in types)
    if "?" in letters or len(letters) != layers:
        raise ConfigError(f"{where}: layer_types={types} is not one of sliding_attention / full_attention per layer "
                          f"({layers} layers); write it as transformers does, or leave it out")
    p = next(p for p in range(1, layers + 1) if letters == (letters[:p] * layers)[:layers])
    return "" if "L" not in letters else letters[:p]


def _rope(hf: dict, arch: str, where: str) -> tuple[dict, float]:
    """(config.json as Llama's layout reads its global RoPE, the local layers' theta or -1)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = dict(params.get("full_attention") or {}), params.get("sliding_attention") or {}
        full.setdefault("rope_theta", hf.get("rope_theta", _DEFAULTS["rope_theta"][arch != "gemma2"]))
        view = {"rope_scaling": None, "rope_parameters": full}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters.sliding_attention is rope_type '{local['rope_type']}'; "
                              f"maxctx's local layers take only default RoPE (a theta)")
        local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    else:
        view = {k: hf[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in hf}
        if "rope_theta" not in hf and "rope_theta" not in (params if isinstance(params, dict) else {}):
            view["rope_theta"] = _DEFAULTS["rope_theta"][arch != "gemma2"]
        local_theta = hf.get("rope_local_base_freq", 10000.0)
    return view, (-1.0 if arch == "gemma2" else float(local_theta))


def model_keys(hf: dict, where: str) -> dict[str, Any]:
    """maxctx's model keys (config.MODEL_KEYS) for a Gemma config.json; refuses what maxctx cannot run exactly."""
    arch = architecture(hf, where)
    for key, fine in (("hidden_activation", ("gelu_pytorch_tanh", None)), ("attention_bias", (False, None)),
                      ("use_bidirectional_attention", (False, None))):
        if hf.get(key) not in fine:
            raise ConfigError(f"{where}: {key}={hf.get(key)!r} is not something maxctx's Gemma has (it needs "
                              f"{' or '.join(map(str, fine))}); this checkpoint cannot be converted")
    gemma3 = arch != "gemma2"
    rope, local_theta = _rope(hf, arch, where)
    view = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    view.update(rope, architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False, mlp_bias=False)
    view.setdefault("rms_norm_eps", 1e-6)
    view.setdefault("tie_word_embeddings", True)
    keys = llama.model_keys(view, where)
    pattern = _pattern(hf, arch, keys["base_num_decoder_layers"], where)
    window = llama._positive(hf.get("sliding_window"), "sliding_window", where, integer=True) if pattern else 0
    caps = {key: hf.get(key, _DEFAULTS[key][gemma3]) or 0.0
            for key in ("final_logit_softcapping", "attn_logit_softcapping")}
    scalar = llama._positive(hf.get("query_pre_attn_scalar", _DEFAULTS["query_pre_attn_scalar"][gemma3]),
                             "query_pre_attn_scalar", where)
    return {**keys, "sliding_window_size": window, "attention_layer_pattern": pattern,
            "query_pre_attn_scalar": float(scalar), "local_rope_max_timescale": local_theta,
            "final_logits_soft_cap": float(caps["final_logit_softcapping"]),
            "attn_logits_soft_cap": float(caps["attn_logit_softcapping"])}


def hf_config(keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json for maxctx model keys (the architecture is the decoder_block's): `extra` (the imported model's
    own entries) first, Llama's RoPE entries, then Gemma's."""
    name, model_type = _EXPORTS[keys["decoder_block"]]
    base = llama.hf_config({**keys, "sliding_window_size": 0, "attention_layer_pattern": ""}, "llama", dtype,
                           {k: v for k, v in extra.items() if k not in ("layer_types", "sliding_window_pattern")})
    local, gemma3 = keys["local_rope_max_timescale"], keys["decoder_block"] == "gemma3"
    if local > 0 and not gemma3 or local <= 0 and gemma3 and base["rope_scaling"]:
        raise ConfigError(f"local_rope_max_timescale={local} with decoder_block={keys['decoder_block']} and "
                          f"rope_type={keys['rope_type']} has no {name} config.json form; set local_rope_max_timescale "
                          f"{'-1' if not gemma3 else '(Gemma 3: 10000)'}")
    windows = (keys["attention_layer_pattern"] or "L") if keys["sliding_window_size"] else "G"  # "": every layer
    types = [("sliding_attention" if c == "L" else "full_attention") for c in windows]
    layers, scalar = keys["base_num_decoder_layers"], keys["query_pre_attn_scalar"] or keys["head_dim"]
    config = {k: v for k, v in base.items() if k not in ("hidden_act", "mlp_bias")}
    config.update(architectures=[name], model_type=model_type, hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # an int in 5.x
                  final_logit_softcapping=keys["final_logits_soft_cap"] or None,
                  attn_logit_softcapping=keys["attn_logits_soft_cap"] or None,
                  sliding_window=keys["sliding_window_size"] or None, layer_types=(types * layers)[:layers])
    if gemma3:
        config["rope_local_base_freq"] = local if local > 0 else keys["rope_max_timescale"]
        if windows.endswith("G") and windows[:-1] == "L" * (len(windows) - 1):
            config["sliding_window_pattern"] = len(windows)
    return config
