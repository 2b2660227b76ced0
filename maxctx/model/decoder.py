"""The Llama-family decoder: embedding, L stacked decoder layers (scanned or unrolled, rematerialised by policy),
final RMSNorm, and a tied or untied output projection.

Legend: B batch, S sequence, D model width, V vocab, L layers.
Layer parameters are always stacked on a leading `layers` axis, so checkpoints do not depend on `scan_layers`.
Activations between layers are laid out x[B_(data,fsdp), S_(context,context_a2a), D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.mesh import BATCH_AXES, CONTEXT_AXES
from maxctx.model.layers import DecoderLayer, ModelConfig, RMSNorm, param

REMAT_POLICIES = {
    "none": None,
    # Save the outputs of matmuls without batch dims (projections); recompute the cheap elementwise rest.
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save nothing inside a layer: only its input is kept, the layer is recomputed in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
}


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

    def _constrain(self, x_BSD):
        if self.mesh is None:
            return x_BSD
        return jax.lax.with_sharding_constraint(x_BSD, NamedSharding(self.mesh, P(BATCH_AXES, CONTEXT_AXES, None)))

    def __call__(self, inputs_BS, positions_BS, segment_ids_BS):
        """Returns fp32 logits [B, S, V]."""
        cfg = self.cfg
        x = self._constrain(jnp.take(self.embed[...], inputs_BS, axis=0).astype(cfg.dtype))
        graphdef, stacked = nnx.split(self.layers)

        def layer_fn(x_BSD, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return self._constrain(layer(x_BSD, positions_BS, segment_ids_BS))

        policy = REMAT_POLICIES[cfg.remat_policy]
        if cfg.remat_policy != "none":
            layer_fn = jax.checkpoint(layer_fn, policy=policy, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            x, _ = jax.lax.scan(lambda carry, s: (layer_fn(carry, s), None), x, stacked)
        else:
            for i in range(cfg.num_layers):
                x = layer_fn(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        x = self.final_norm(x)
        if cfg.tied_embedding:
            return jnp.einsum("BSD,VD->BSV", x, self.embed[...].astype(cfg.dtype), preferred_element_type=jnp.float32)
        return jnp.einsum("BSD,DV->BSV", x, self.unembed[...].astype(cfg.dtype), preferred_element_type=jnp.float32)


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
