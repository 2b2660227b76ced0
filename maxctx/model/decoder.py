"""The decoder: embedding, the family's layer stacks (maxctx.model.stacks runs each: scanned or unrolled,
rematerialised by policy), final RMSNorm, and a tied or untied output projection, its logits soft-capped where
final_logits_soft_cap > 0. A family's DecoderOptions (maxctx.model.family) scale the embeddings by sqrt(D) and
offset the final norm (Gemma).

Legend: B batch, S sequence, D model width, V vocab, L layers.
Activations between layers are laid out x[B_(data,fsdp), S_(context,context_a2a), D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.model import stacks
from maxctx.model.family import DecoderOptions
from maxctx.model.layers import SIGN_UPDATE, ModelConfig, RMSNorm, constrain_activations, param
from maxctx.model.tiling import map_chunks, sum_chunks
from maxctx.parallelism import TENSOR_AXIS


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        wd = cfg.weight_dtype
        self.embed = param(rngs, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), wd, scale=1.0)
        for name, stack in zip(self._stack_names(cfg), cfg.layer_stacks):
            setattr(self, name, stacks.build(stack, cfg, rngs, mesh))
        self.final_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, wd, rngs, offset=_options(cfg).norm_offset)
        if not cfg.tied_embedding:
            self.unembed = param(rngs, (cfg.emb_dim, cfg.vocab_size), ("embed", "vocab"), wd)
        self.cfg, self.mesh = cfg, mesh

    @staticmethod
    def _stack_names(cfg: ModelConfig) -> list[str]:
        """`layers` for the first stack (so a one-stack family's checkpoints keep their paths), `layers_<i>` after."""
        return ["layers" if i == 0 else f"layers_{i}" for i in range(len(cfg.layer_stacks))]

    def __call__(self, inputs_BS, positions_BS, segment_ids_BS):
        """Returns fp32 logits [B, S, V]."""
        return _logits(self.hidden(inputs_BS, positions_BS, segment_ids_BS), *self._output_weight(), self.cfg)

    def loss_sums(self, inputs_BS, positions_BS, segment_ids_BS, targets_BS, weights_BS):
        """(sum of weighted token cross-entropy, sum of weights). With num_vocab_tiling = N > 1 the output
        projection and the cross-entropy run over N chunks of each device's tokens (maxctx.model.tiling), so at
        most B x S / (C N) x V logits are live at once, in the forward and in the backward."""
        return self.loss_terms(inputs_BS, positions_BS, segment_ids_BS, targets_BS, weights_BS)[:2]

    def loss_terms(self, inputs_BS, positions_BS, segment_ids_BS, targets_BS, weights_BS):
        """`loss_sums` and the layers' auxiliary loss terms, {name: (weight, value)} (maxctx.model.stacks.aux_terms:
        {} for a family without; maxctx.train_step adds sum(weight x value) to the loss)."""
        x_BSD, sums = self._hidden(inputs_BS, positions_BS, segment_ids_BS)
        return (*self._cross_entropy_sums(x_BSD, targets_BS, weights_BS), stacks.aux_terms(self.cfg, sums))

    def _cross_entropy_sums(self, x_BSD, targets_BS, weights_BS):
        w, tied, cfg = *self._output_weight(), self.cfg
        weights_BS = weights_BS.astype(jnp.float32)

        def chunk_loss(x, targets, weights):
            return jnp.sum(_cross_entropy(_logits(x, w, tied, cfg), targets)[0] * weights)

        loss = sum_chunks(chunk_loss, self.cfg.num_vocab_tiling, self.mesh, x_BSD, targets_BS, weights_BS)
        return loss, jnp.sum(weights_BS)

    def token_scores(self, inputs_BS, positions_BS, segment_ids_BS, targets_BS):
        """Per token, for evals: (cross-entropy fp32 [B, S], the greedy prediction is the target bool [B, S]);
        tiled over the vocabulary like `loss_sums`."""
        x_BSD = self.hidden(inputs_BS, positions_BS, segment_ids_BS)
        w, tied, cfg = *self._output_weight(), self.cfg
        chunk = lambda x, targets: _cross_entropy(_logits(x, w, tied, cfg), targets)  # noqa: E731
        return map_chunks(chunk, self.cfg.num_vocab_tiling, self.mesh, x_BSD, targets_BS)

    def _output_weight(self):
        """(weight, tied): the embedding [V, D] when tied, else the output projection [D, V]; in weight_dtype."""
        return (self.embed[...], True) if self.cfg.tied_embedding else (self.unembed[...], False)

    def hidden(self, inputs_BS, positions_BS, segment_ids_BS):
        """The final-normed hidden states x[B, S, D] (before the output projection)."""
        return self._hidden(inputs_BS, positions_BS, segment_ids_BS)[0]

    def _hidden(self, inputs_BS, positions_BS, segment_ids_BS):
        """(`hidden`, the layers' auxiliary sums over every stack: maxctx.model.stacks)."""
        cfg = self.cfg
        embed_VD = self.embed[...]
        if cfg.use_iota_embed:  # MaxText's option: a one-hot matmul instead of a gather (exact: one 1 per row)
            one_hot_BSV = jax.nn.one_hot(inputs_BS, cfg.vocab_size, dtype=embed_VD.dtype)
            x = jnp.einsum("BSV,VD->BSD", one_hot_BSV, embed_VD, precision=jax.lax.Precision.HIGHEST)
        else:
            if self.mesh is not None and self.mesh.devices.flat[0].platform == "cpu":
                # On CPU, XLA partitions the lookup of a table sharded over its embed axis with a full
                # rematerialization it warns about on every compile; gathering the (small) table first avoids it.
                # Not on TPU: there it costs the whole table per device (+1.0 GiB for llama3-8b on v5p-8) and
                # XLA partitions the lookup without the warning.
                table = NamedSharding(self.mesh, P(TENSOR_AXIS, None))
                embed_VD = jax.lax.with_sharding_constraint(embed_VD, table)
            x = jnp.take(embed_VD, inputs_BS, axis=0)
        x = x.astype(cfg.dtype)
        if _options(cfg).embed_scale:  # as transformers' Gemma: sqrt(D) rounded to the activation dtype first
            x = x * jnp.asarray(cfg.emb_dim**0.5, cfg.dtype)
        x = constrain_activations(x, self.mesh)
        first, sums = 0, {}
        for name, stack in zip(self._stack_names(cfg), cfg.layer_stacks):
            x, aux = stacks.run(stack, getattr(self, name), x, positions_BS, segment_ids_BS, cfg, self.mesh, first)
            for key, value in aux.items():
                sums[key] = sums[key] + value if key in sums else value
            first += stack.count
        return self.final_norm(x), sums


def _cross_entropy(logits_BSV, targets_BS):
    """(cross-entropy [B, S], argmax == target [B, S]) from fp32 logits."""
    log_z = jax.nn.logsumexp(logits_BSV, axis=-1)
    target_logit = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return log_z - target_logit, jnp.argmax(logits_BSV, axis=-1) == targets_BS


def _options(cfg: ModelConfig) -> DecoderOptions:
    return cfg.options if isinstance(cfg.options, DecoderOptions) else DecoderOptions()


def _logits(x_BSD, w, tied: bool, cfg: ModelConfig):
    """fp32 logits [B, S, V], soft-capped by final_logits_soft_cap; the weight is cast here, so under tiling its
    gradient is summed in weight_dtype."""
    equation = "BSD,VD->BSV" if tied else "BSD,DV->BSV"
    logits = jnp.einsum(equation, x_BSD, w.astype(cfg.dtype), preferred_element_type=jnp.float32)
    cap = cfg.final_logits_soft_cap
    return jnp.tanh(logits / cap) * cap if cap > 0 else logits


def _per_param(model: nnx.Module, value) -> dict:
    """Nested dict (like the params) of value(variable) for each parameter."""
    out: dict = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value(variable)
    return out


def param_axes(model: nnx.Module) -> dict:
    """Nested dict (like the params) of each parameter's logical axis names, `layers` prepended when stacked."""

    def names(variable) -> tuple:
        axes = tuple(variable.get_metadata()["axes"])
        return ("layers",) + axes if len(axes) < len(variable.shape) else axes

    return _per_param(model, names)


def sign_updated(model: nnx.Module) -> dict | None:
    """Nested dict (like the params) of bools: the parameters tagged SIGN_UPDATE (maxctx.model.layers); None
    when there are none."""
    flags = _per_param(model, lambda variable: bool(variable.get_metadata().get(SIGN_UPDATE, False)))
    return flags if any(jax.tree.leaves(flags)) else None


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
