"""The stack runner: builds a stack of layers (maxctx.model.family.Stack) and runs x through it, scanned or
unrolled, rematerialised by the remat policy, the layer input offloaded to the host for the first
`host_input_layers` layers, or kept only every `layer_input_stride` periods. A family describes its stacks; it
never branches this runner.

Legend: B batch, S sequence, D model width.
A stack's parameters are stacked on a leading `layers` axis (so checkpoints do not depend on `scan_layers`); with
a window pattern of period P > 1 the scan runs over the count / P groups, P layers each. Activations between layers
are laid out x[B_(data,fsdp), S_(context,context_a2a), D].

Auxiliary terms: a layer kind whose class has `aux_terms` (maxctx.model.moe) returns (x_BSD, aux), aux a dict of
float32 arrays that add over layers (counts and sums, never ratios); the runner carries their sum through the scan
and `run` returns (x, sums), which `aux_terms` turns into the loss's terms. Other kinds return x_BSD and carry an
empty dict, so their programs are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.model.deepseek.layers import DeepseekDenseLayer, DeepseekLayer
from maxctx.model.family import Stack
from maxctx.model.gemma.layers import GemmaLayer
from maxctx.model.gpt_oss.layers import GptOssLayer
from maxctx.model.layers import ModelConfig, constrain_activations, names_policy, remat_names
from maxctx.model.llama.layers import DecoderLayer
from maxctx.model.moe.layers import MoeLayer, Qwen3MoeLayer
from maxctx.model.olmo.layers import OlmoLayer
from maxctx.model.qwen.layers import QwenLayer
from maxctx.model.qwen3_next.layers import Qwen3NextPeriod
from maxctx.model.qwen35.layers import Qwen35Period
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES

# layer kind -> its constructor (cfg, rngs, mesh): an nnx.Module called as layer(x_BSD, positions_BS,
# segment_ids_BS, window) -> x_BSD. `register_layer` adds one (a test's toy family does).
_KINDS: dict[str, Callable[..., nnx.Module]] = {"llama": DecoderLayer}
_KINDS.update(qwen=QwenLayer, olmo=OlmoLayer)
_KINDS.update(gemma=GemmaLayer)
_KINDS.update(deepseek_dense=DeepseekDenseLayer, deepseek=DeepseekLayer)
_KINDS.update(qwen3_5=Qwen35Period, qwen3_next=Qwen3NextPeriod)
_KINDS.update(mixtral=MoeLayer, qwen3_moe=Qwen3MoeLayer)
_KINDS.update(gpt_oss=GptOssLayer)


def register_layer(kind: str, make: Callable[..., nnx.Module]) -> None:
    _KINDS[kind] = make


def unregister_layer(kind: str) -> None:
    _KINDS.pop(kind, None)


def build(stack: Stack, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None) -> nnx.Module:
    """The stack's `count` layers, their parameters stacked on a leading axis."""
    if stack.kind not in _KINDS:
        raise ValueError(f"layer kind {stack.kind!r} is not registered; known: {', '.join(sorted(_KINDS))}")
    make = _KINDS[stack.kind]

    @nnx.split_rngs(splits=stack.count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(layer_rngs):
        return make(cfg, layer_rngs, mesh)

    return make_layers(rngs)


def remat_policy(cfg: ModelConfig):
    """The layer's checkpoint policy: None for remat_policy=none, else one of NAMED_POLICIES, or `custom`
    (MaxText's): each named tensor (maxctx.config.REMAT_NAMES) is recomputed (`remat`), kept in device memory
    (`device`) or moved to pinned host memory during the forward and back for the backward (`offload`). Offloading
    `decoder_layer_input` takes the one [B, S, D] every layer must keep under full remat off the device:
    L x B x S/C x D x b bytes per device."""
    if cfg.remat_policy == "none":
        return None
    if cfg.remat_policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    return names_policy(*remat_names(cfg))


def run(stack: Stack, layers: nnx.Module, x, positions_BS, segment_ids_BS, cfg: ModelConfig, mesh=None,
        first: int = 0):
    """(x[B, S, D] through the stack's layers, the sums of their auxiliary terms: {} for a kind without);
    `first`: the layers of the stacks before it (host_input_layers counts over the whole decoder)."""
    graphdef, stacked = nnx.split(layers)
    carry = (x, _aux_zeros(stack, graphdef, stacked, x, positions_BS, segment_ids_BS))
    rest = stack.count % len(stack.windows)
    if not rest:
        return _run(stack, graphdef, stacked, carry, positions_BS, segment_ids_BS, cfg, mesh, first)
    # The periods, then the last `rest` layers as a stack of their own windows (one period of `rest` layers).
    whole = stack.count - rest
    if whole:
        carry = _run(dataclasses.replace(stack, count=whole), graphdef, jax.tree.map(lambda a: a[:whole], stacked),
                     carry, positions_BS, segment_ids_BS, cfg, mesh, first)
    return _run(Stack(stack.kind, rest, stack.windows[:rest]), graphdef, jax.tree.map(lambda a: a[whole:], stacked),
                carry, positions_BS, segment_ids_BS, cfg, mesh, first + whole)


def _aux_zeros(stack: Stack, graphdef, stacked, x, positions_BS, segment_ids_BS) -> dict:
    """Zeros of the auxiliary sums one layer of the stack returns ({} for a kind without `aux_terms`)."""
    if not hasattr(_KINDS[stack.kind], "aux_terms"):
        return {}
    one = jax.tree.map(lambda a: a[0], stacked)
    shapes = jax.eval_shape(lambda s: nnx.merge(graphdef, s)(x, positions_BS, segment_ids_BS)[1], one)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def aux_terms(cfg: ModelConfig, sums: dict) -> dict:
    """The loss's auxiliary terms, {name: (weight, value)}, from the layers' summed `aux` (each kind that has
    `aux_terms` turns its own sums into terms)."""
    terms: dict = {}
    for kind in dict.fromkeys(stack.kind for stack in cfg.layer_stacks):
        make = _KINDS.get(kind)
        if sums and hasattr(make, "aux_terms"):
            terms.update(make.aux_terms(sums, cfg))
    return terms


def _run(stack: Stack, graphdef, stacked, carry, positions_BS, segment_ids_BS, cfg: ModelConfig, mesh, first: int):
    """`run` over a stack whose count is a multiple of its pattern's period, its layers' state `stacked`; `carry`
    is (x, the auxiliary sums so far)."""
    windows, count = stack.windows, stack.count
    period = len(windows)
    with_aux = hasattr(_KINDS[stack.kind], "aux_terms")

    def make_layer_fn(window: int, cfg: ModelConfig, tag: bool = True):
        def layer_fn(x_BSD, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            if tag:  # untagged inside a strided run: its policy would keep every layer's input (module doc)
                x_BSD = name_layer_input(x_BSD, mesh)
            out = layer(x_BSD, positions_BS, segment_ids_BS, window)
            x_BSD, aux = out if with_aux else (out, {})
            return constrain_activations(x_BSD, mesh), aux

        if cfg.remat_policy != "none":
            layer_fn = jax.checkpoint(layer_fn, policy=remat_policy(cfg), prevent_cse=not cfg.scan_layers)
        return functools.partial(_accumulate, layer_fn)

    # Layers [0, host) run under the policy as given; with decoder_layer_input=offload and host_input_layers
    # = k < L, layers [k, L) keep their input on the device instead (two scans). With layer_input_stride = N > 1
    # each run of N periods is rematerialised as one: the policy keeps (or offloads) only the input of the run,
    # and the backward recomputes the run's layers once more to get the others (kept on the device while their
    # own backward runs): L / N saved inputs instead of L, one more forward of every layer.
    host = count if cfg.host_input_layers < 0 else min(count, max(0, cfg.host_input_layers - first))
    kept = dict(cfg.remat_custom, decoder_layer_input="device")
    cfg_kept = dataclasses.replace(cfg, remat_custom=tuple(kept.items()))
    layer_fns = [make_layer_fn(w, cfg) for w in windows]
    kept_fns = [make_layer_fn(w, cfg_kept) for w in windows] if host < count else layer_fns
    if not cfg.scan_layers:
        for i in range(count):
            fns = layer_fns if i < host else kept_fns
            carry = fns[i % period](carry, jax.tree.map(lambda a, i=i: a[i], stacked))
        return carry
    groups = jax.tree.map(lambda a: a.reshape(count // period, period, *a.shape[1:]), stacked)
    if cfg.layer_input_stride > 1:
        strided_fns = [make_layer_fn(w, cfg_kept, tag=False) for w in windows]
        unroll = any(name != "decoder_layer_input" for name in remat_names(cfg)[1])
        return _strided_scan(strided_fns, carry, groups, cfg.layer_input_stride, remat_policy(cfg), mesh, unroll)
    split = host // period
    if split > 0:
        carry = _scan(layer_fns, carry, jax.tree.map(lambda a: a[:split], groups))
    if split < count // period:
        carry = _scan(kept_fns, carry, jax.tree.map(lambda a: a[split:], groups))
    return carry


def _accumulate(layer_fn, carry, layer_state):
    """One layer on carry = (x, auxiliary sums): its output, and its aux added to the sums."""
    x_BSD, sums = carry
    x_BSD, aux = layer_fn(x_BSD, layer_state)
    return x_BSD, jax.tree.map(jnp.add, sums, aux)


def _scan(fns, carry, groups):
    """carry = (x, aux sums) through the stacked periods `groups` (leading axis: periods), each period's layers
    `fns` in order."""
    return jax.lax.scan(lambda c, group_state: (_period(fns, c, group_state), None), carry, groups)[0]


def _period(fns, carry, group_state):
    for j, fn in enumerate(fns):
        carry = fn(carry, jax.tree.map(lambda a, j=j: a[j], group_state))
    return carry


def _strided_scan(fns, carry, groups, stride: int, policy, mesh, unroll: bool):
    """`_scan` with each run of `stride` periods rematerialised as one under `policy`: only a run's input is kept
    (or offloaded) as decoder_layer_input. With `unroll` (the policy offloads tensors inside the layers) a run's
    periods are unrolled, not scanned, so what goes to the host is stacked over the runs only: libtpu 0.0.42 brings
    an offloaded [runs, stride, ...] buffer back with a two-dimensional slice, which it does not implement ("Async
    slice only supports slicing in 1 dimension"). Otherwise they stay a scan: unrolled, the 2^25-token llama3-8b
    step on v5p-128 needed 104.61 GiB per chip instead of 84.40 (docs/long_context.md)."""
    def stride_fn(carry, stride_state):
        carry = (name_layer_input(carry[0], mesh), carry[1])
        if not unroll:
            return _scan(fns, carry, stride_state), None
        for i in range(stride):
            carry = _period(fns, carry, jax.tree.map(lambda a, i=i: a[i], stride_state))
        return carry, None

    strides = jax.tree.map(lambda a: a.reshape(a.shape[0] // stride, stride, *a.shape[1:]), groups)
    return jax.lax.scan(jax.checkpoint(stride_fn, policy=policy, prevent_cse=False), carry, strides)[0]


# libtpu (0.0.42) aborts in llo_loop.cc ("index_space_.start <= index_space_.limit (0 vs. -1)") when it compiles
# a transfer to or from pinned host memory of one device's array of 2^31 elements or more (docs/long_context.md).
HOST_TRANSFER_ELEMENTS = 2**31


def name_layer_input(x_BSD, mesh):
    """`checkpoint_name(x, "decoder_layer_input")`, named in pieces along D when one device's part of x holds
    HOST_TRANSFER_ELEMENTS or more (llama3-8b at 2^19 tokens per device: [1, 524288, 4096]), so an offloaded
    input goes to the host and back as arrays libtpu can move. Values are unchanged (a split and a concatenation
    along the unsharded D); below that size x is named whole, as always."""
    shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in (*BATCH_AXES, *CONTEXT_AXES))
    pieces, per_device = 1, x_BSD.size // shards
    while per_device // pieces >= HOST_TRANSFER_ELEMENTS and x_BSD.shape[-1] % (2 * pieces) == 0:
        pieces *= 2
    if pieces == 1:
        return checkpoint_name(x_BSD, "decoder_layer_input")
    parts = jnp.split(x_BSD, pieces, axis=-1)
    return jnp.concatenate([checkpoint_name(p, "decoder_layer_input") for p in parts], axis=-1)
