"""The Llama-family decoder: embedding, L stacked decoder layers (scanned or unrolled, rematerialised by policy),
final RMSNorm, and a tied or untied output projection. Local (sliding-window) and global layers follow the
repeating pattern `cfg.layer_windows`; with a period P > 1 the scan runs over the L / P groups, P layers each.

Legend: B batch, S sequence, D model width, V vocab, L layers.
Layer parameters are always stacked on a leading `layers` axis, so checkpoints do not depend on `scan_layers`.
Activations between layers are laid out x[B_(data,fsdp), S_(context,context_a2a), D].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxctx.model.layers import (
    DecoderLayer,
    ModelConfig,
    RMSNorm,
    constrain_activations,
    names_policy,
    param,
    remat_names,
)
from maxctx.model.tiling import map_chunks, sum_chunks
from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES


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


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        wd = cfg.weight_dtype
        self.embed = param(rngs, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), wd, scale=1.0)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs):
            return DecoderLayer(cfg, layer_rngs, mesh)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, wd, rngs)
        if not cfg.tied_embedding:
            self.unembed = param(rngs, (cfg.emb_dim, cfg.vocab_size), ("embed", "vocab"), wd)
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, inputs_BS, positions_BS, segment_ids_BS):
        """Returns fp32 logits [B, S, V]."""
        return _logits(self.hidden(inputs_BS, positions_BS, segment_ids_BS), *self._output_weight(), self.cfg.dtype)

    def loss_sums(self, inputs_BS, positions_BS, segment_ids_BS, targets_BS, weights_BS):
        """(sum of weighted token cross-entropy, sum of weights). With num_vocab_tiling = N > 1 the output
        projection and the cross-entropy run over N chunks of each device's tokens (maxctx.model.tiling), so at
        most B x S / (C N) x V logits are live at once, in the forward and in the backward."""
        x_BSD = self.hidden(inputs_BS, positions_BS, segment_ids_BS)
        w, tied, dtype = *self._output_weight(), self.cfg.dtype
        weights_BS = weights_BS.astype(jnp.float32)

        def chunk_loss(x, targets, weights):
            return jnp.sum(_cross_entropy(_logits(x, w, tied, dtype), targets)[0] * weights)

        loss = sum_chunks(chunk_loss, self.cfg.num_vocab_tiling, self.mesh, x_BSD, targets_BS, weights_BS)
        return loss, jnp.sum(weights_BS)

    def token_scores(self, inputs_BS, positions_BS, segment_ids_BS, targets_BS):
        """Per token, for evals: (cross-entropy fp32 [B, S], the greedy prediction is the target bool [B, S]);
        tiled over the vocabulary like `loss_sums`."""
        x_BSD = self.hidden(inputs_BS, positions_BS, segment_ids_BS)
        w, tied, dtype = *self._output_weight(), self.cfg.dtype
        chunk = lambda x, targets: _cross_entropy(_logits(x, w, tied, dtype), targets)  # noqa: E731
        return map_chunks(chunk, self.cfg.num_vocab_tiling, self.mesh, x_BSD, targets_BS)

    def _output_weight(self):
        """(weight, tied): the embedding [V, D] when tied, else the output projection [D, V]; in weight_dtype."""
        return (self.embed[...], True) if self.cfg.tied_embedding else (self.unembed[...], False)

    def hidden(self, inputs_BS, positions_BS, segment_ids_BS):
        """The final-normed hidden states x[B, S, D] (before the output projection)."""
        cfg = self.cfg
        embed_VD = self.embed[...]
        if cfg.use_iota_embed:  # MaxText's option: a one-hot matmul instead of a gather (exact: one 1 per row)
            one_hot_BSV = jax.nn.one_hot(inputs_BS, cfg.vocab_size, dtype=embed_VD.dtype)
            x = jnp.einsum("BSV,VD->BSD", one_hot_BSV, embed_VD, precision=jax.lax.Precision.HIGHEST)
        else:
            x = jnp.take(embed_VD, inputs_BS, axis=0)
        x = constrain_activations(x.astype(cfg.dtype), self.mesh)
        graphdef, stacked = nnx.split(self.layers)

        windows = cfg.layer_windows
        period = len(windows)

        def make_layer_fn(window: int, cfg: ModelConfig, tag: bool = True):
            def layer_fn(x_BSD, layer_state):
                layer = nnx.merge(graphdef, layer_state)
                if tag:  # untagged inside a strided run: its policy would keep every layer's input (module doc)
                    x_BSD = name_layer_input(x_BSD, self.mesh)
                return constrain_activations(layer(x_BSD, positions_BS, segment_ids_BS, window), self.mesh)

            if cfg.remat_policy != "none":
                return jax.checkpoint(layer_fn, policy=remat_policy(cfg), prevent_cse=not cfg.scan_layers)
            return layer_fn

        # Layers [0, host) run under the policy as given; with decoder_layer_input=offload and host_input_layers
        # = k < L, layers [k, L) keep their input on the device instead (two scans). With layer_input_stride = N > 1
        # each run of N periods is rematerialised as one: the policy keeps (or offloads) only the input of the run,
        # and the backward recomputes the run's layers once more to get the others (kept on the device while their
        # own backward runs): L / N saved inputs instead of L, one more forward of every layer.
        host = cfg.num_layers if cfg.host_input_layers < 0 else cfg.host_input_layers
        kept = dict(cfg.remat_custom, decoder_layer_input="device")
        cfg_kept = dataclasses.replace(cfg, remat_custom=tuple(kept.items()))
        layer_fns = [make_layer_fn(w, cfg) for w in windows]
        kept_fns = [make_layer_fn(w, cfg_kept) for w in windows] if host < cfg.num_layers else layer_fns
        strided_fns = [make_layer_fn(w, cfg_kept, tag=False) for w in windows]
        if cfg.scan_layers:
            groups = jax.tree.map(lambda a: a.reshape(cfg.num_layers // period, period, *a.shape[1:]), stacked)

            if cfg.layer_input_stride > 1:
                unroll = any(name != "decoder_layer_input" for name in remat_names(cfg)[1])
                return self.final_norm(_strided_scan(strided_fns, x, groups, cfg.layer_input_stride,
                                                     remat_policy(cfg), self.mesh, unroll))
            split = host // period
            if split > 0:
                x = _scan(layer_fns, x, jax.tree.map(lambda a: a[:split], groups))
            if split < cfg.num_layers // period:
                x = _scan(kept_fns, x, jax.tree.map(lambda a: a[split:], groups))
        else:
            for i in range(cfg.num_layers):
                fns = layer_fns if i < host else kept_fns
                x = fns[i % period](x, jax.tree.map(lambda a, i=i: a[i], stacked))
        return self.final_norm(x)


def _scan(fns, x_BSD, groups):
    """x through the stacked periods `groups` (leading axis: periods), each period's layers `fns` in order."""
    return jax.lax.scan(lambda carry, group_state: (_period(fns, carry, group_state), None), x_BSD, groups)[0]


def _period(fns, x_BSD, group_state):
    for j, fn in enumerate(fns):
        x_BSD = fn(x_BSD, jax.tree.map(lambda a, j=j: a[j], group_state))
    return x_BSD


def _strided_scan(fns, x_BSD, groups, stride: int, policy, mesh, unroll: bool):
    """`_scan` with each run of `stride` periods rematerialised as one under `policy`: only a run's input is kept
    (or offloaded) as decoder_layer_input. With `unroll` (the policy offloads tensors inside the layers) a run's
    periods are unrolled, not scanned, so what goes to the host is stacked over the runs only: libtpu 0.0.42 brings
    an offloaded [runs, stride, ...] buffer back with a two-dimensional slice, which it does not implement ("Async
    slice only supports slicing in 1 dimension"). Otherwise they stay a scan: unrolled, the 2^25-token llama3-8b
    step on v5p-128 needed 104.61 GiB per chip instead of 84.40 (docs/long_context.md)."""
    def stride_fn(carry, stride_state):
        carry = name_layer_input(carry, mesh)
        if not unroll:
            return _scan(fns, carry, stride_state), None
        for i in range(stride):
            carry = _period(fns, carry, jax.tree.map(lambda a, i=i: a[i], stride_state))
        return carry, None

    strides = jax.tree.map(lambda a: a.reshape(a.shape[0] // stride, stride, *a.shape[1:]), groups)
    return jax.lax.scan(jax.checkpoint(stride_fn, policy=policy, prevent_cse=False), x_BSD, strides)[0]


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


def _cross_entropy(logits_BSV, targets_BS):
    """(cross-entropy [B, S], argmax == target [B, S]) from fp32 logits."""
    log_z = jax.nn.logsumexp(logits_BSV, axis=-1)
    target_logit = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return log_z - target_logit, jnp.argmax(logits_BSV, axis=-1) == targets_BS


def _logits(x_BSD, w, tied: bool, dtype):
    """fp32 logits [B, S, V]; the weight is cast here, so under tiling its gradient is summed in weight_dtype."""
    if tied:
        return jnp.einsum("BSD,VD->BSV", x_BSD, w.astype(dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("BSD,DV->BSV", x_BSD, w.astype(dtype), preferred_element_type=jnp.float32)


def param_axes(model: nnx.Module) -> dict:
    """Nested dict (like the params) of each parameter's logical axis names, `layers` prepended when stacked."""
    axes: dict = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = tuple(variable.get_metadata()["axes"])
        if len(names) < len(variable.shape):
            names = ("layers",) + names
        node = axes
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = names
    return axes


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
