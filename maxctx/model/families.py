"""The model families by `decoder_block` (MaxText's key and names): maxctx's own, and any a caller adds with
`register` (tests/test_family.py adds a toy one). No JAX.
"""

from __future__ import annotations

from maxctx.config import Config, ConfigError
from maxctx.model.deepseek.family import DEEPSEEK
from maxctx.model.family import ModelFamily
from maxctx.model.gemma.family import GEMMA2, GEMMA3
from maxctx.model.gpt_oss.family import GPT_OSS
from maxctx.model.llama.family import LLAMA
from maxctx.model.moe.family import MIXTRAL, QWEN3_MOE
from maxctx.model.olmo.family import OLMO
from maxctx.model.qwen.family import QWEN
from maxctx.model.qwen3_next.family import QWEN3_NEXT
from maxctx.model.qwen35.family import QWEN3_5
from maxctx.model.shape import ModelShape

_FAMILIES: dict[str, ModelFamily] = {"llama2": LLAMA, "mistral": LLAMA}
_FAMILIES.update(qwen2=QWEN, qwen3=QWEN, olmo2=OLMO, olmo3=OLMO)
_FAMILIES.update(gemma2=GEMMA2, gemma3=GEMMA3)
_FAMILIES.update(deepseek=DEEPSEEK)
_FAMILIES.update(qwen3_5=QWEN3_5, qwen3_next=QWEN3_NEXT)
_FAMILIES.update(mixtral=MIXTRAL, qwen3_moe=QWEN3_MOE)
_FAMILIES.update(gpt_oss=GPT_OSS)


def register(family: ModelFamily, *names: str) -> ModelFamily:
    """Makes `family` the decoder of `decoder_block` = each of `names` (its own name when none is given)."""
    for name in names or (family.name,):
        _FAMILIES[name] = family
    return family


def unregister(*names: str) -> None:
    for name in names:
        _FAMILIES.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get(decoder_block: str) -> ModelFamily:
    if decoder_block not in _FAMILIES:
        raise ConfigError(f"decoder_block={decoder_block!r} is not a model family; use one of "
                          f"{', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[decoder_block]


def for_config(config: Config) -> ModelFamily:
    return get(config.decoder_block)


def for_hf(hf_config: dict, where: str = "config.json") -> ModelFamily:
    """The family whose HF layout names this config.json's architecture (`architectures`, else `model_type`); a
    ConfigError naming `where` and every architecture maxctx converts when none does."""
    names = hf_config.get("architectures") or [hf_config.get("model_type")]
    for family in _FAMILIES.values():
        known = family.hf_layout.ARCHITECTURES
        if any(name in known or name in known.values() for name in names):
            return family
    every = sorted({name for family in _FAMILIES.values() for name in family.hf_layout.ARCHITECTURES})
    raise ConfigError(f"{where}: architecture {names} is not one maxctx converts; give one of {', '.join(every)}")


def shape(config: Config) -> ModelShape:
    """The config's model shape, as its family reads it."""
    return for_config(config).shape(config)

