"""A model family: everything maxctx asks of one kind of decoder, in one frozen value, and the registry keyed by
`decoder_block` (MaxText's key and names).

Without JAX, so the planner, the roofline, the step-time model and the FLOPs read a family's shape and tensors
below the layers themselves (tests/test_layering.py). A family states:

    shape         its sizes from the config, once (maxctx.model.shape.ModelShape: parameters, FLOPs per token)
    tensors       each remat name's bytes and forward FLOPs per token and device at tensor parallelism T
    remat_groups  the names the remat search (maxctx.plan.remat) places together, each group's short label
    activation    bytes per token one layer's matmul operands and results take per forward (maxctx.plan.roofline)
    tile          bytes of the largest per-layer tile besides attention and the loss (the SwiGLU's [t, 3F / T])
    work          the layer's working set per token and model width, calibrated (maxctx.plan.planner)
    check         its config checks (a ConfigError naming the key), run by maxctx.validate
    stacks        its layers as stacks (layer kind, count, window pattern), which maxctx.model.stacks runs
    hf_layout     its Hugging Face layout module (maxctx.convert reads it)
    options       its layers' own settings from the config (a frozen value it defines; ModelConfig.options)

maxctx.model.families is the registry keyed by `decoder_block`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from maxctx.config import Config, ConfigError
from maxctx.model.shape import ModelShape


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One named tensor of a layer, per token and device: its bytes, and the forward FLOPs that produce it (0 for
    a tensor no matmul writes, such as the layer input)."""

    bytes: float
    flops: float = 0.0


@dataclasses.dataclass(frozen=True)
class Stack:
    """`count` layers of one kind (a name maxctx.model.stacks builds), scanned together; layer i attends with
    window `windows[i % len(windows)]` (0: global). A `count` that is no multiple of the pattern's length ends with
    the pattern's first count % len(windows) layers (Gemma 3 1B: 26 layers of LLLLLG, the last two local)."""

    kind: str
    count: int
    windows: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """What a family changes around its stacks (maxctx.model.decoder reads it where the family's options are one):
    the embeddings times sqrt(D) in the activation dtype, and the final norm's offset (maxctx.model.layers.RMSNorm:
    Gemma's 1 + w)."""

    embed_scale: bool = False
    norm_offset: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerWork:
    """The layer's working set per token and byte of model width, fitted on compiled programs
    (maxctx.plan.planner's module doc): with the layer inputs offloaded (`offloaded`) or kept in HBM (`on_device`)."""

    offloaded: float
    on_device: float


class HfLayout(Protocol):
    """A family's Hugging Face layout (a module, such as maxctx.model.llama.hf_layout): config.json <-> model keys,
    HF tensor names <-> maxctx parameters."""

    ARCHITECTURES: dict[str, str]  # HF `architectures` entry -> its short name (config.json's model_type)
    DECODER_BLOCKS: dict[str, str]  # short name -> maxctx's decoder_block

    def tensors(self, keys: dict[str, Any]) -> tuple: ...

    def architecture(self, hf_config: dict, where: str) -> str: ...

    def model_keys(self, hf_config: dict, where: str) -> dict[str, Any]: ...

    def hf_config(self, keys: dict[str, Any], arch: str, dtype: str, extra: dict[str, Any]) -> dict[str, Any]: ...


def hf_architecture(architectures: dict[str, str], hf_config: dict, where: str) -> str:
    """The short name (a value of `architectures`, HF class -> short name) of config.json's architecture: the
    first of its `architectures` listed, else its `model_type`; a ConfigError naming `where` otherwise."""
    names = hf_config.get("architectures") or []
    known = [architectures[n] for n in names if n in architectures]
    if known:
        return known[0]
    if not names and hf_config.get("model_type") in architectures.values():
        return hf_config["model_type"]
    raise ConfigError(f"{where}: architecture {names or hf_config.get('model_type')} is not one this family "
                      f"converts; give a {' or '.join(architectures)} checkpoint")


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    shape: Callable[[Config], ModelShape]
    # (shape, tensor parallelism T, copies of the attention output the CP strategy keeps) -> {remat name: Tensor}
    tensors: Callable[[ModelShape, int, int], dict[str, Tensor]]
    remat_groups: tuple[tuple[str, tuple[str, ...]], ...]  # (short label, names placed together)
    activation: Callable[[ModelShape, int], float]  # (shape, T) -> bytes per token of one layer's forward
    tile: Callable[[ModelShape, int], float]  # (shape, T) -> bytes per token of the largest non-attention tile
    work: LayerWork
    check: Callable[[Config], None]
    stacks: Callable[[Config], tuple[Stack, ...]]
    hf_layout: HfLayout
    logical_axes: tuple[str, ...] = ()
    # config -> the family's own frozen layer settings (QK-norm, biases, soft-caps, ...), which its layer kinds
    # read as cfg.options (a DecoderOptions, or a subclass, for the decoder too); None for a family that needs none.
    options: Callable[[Config], Any] = lambda config: None
    # (shape, T, tensors) -> the tensors when the CP strategy moves MLA's latent (Strategy.moves, e.g.
    # latent_all_gather): the layer hands the strategy its latent and forms no per-head K or V; None for a family
    # without MLA.
    latent_tensors: Callable[[ModelShape, int, dict[str, Tensor]], dict[str, Tensor]] | None = None
