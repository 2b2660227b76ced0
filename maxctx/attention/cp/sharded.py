"""Running attention bodies sharded over the mesh: shard_map across JAX versions, the partition specs of attention
inputs, and the ring shift.

Layouts (global): q[B_(data,fsdp), S_(context,context_a2a), H_tensor, D], k/v[B, S, K_tensor, D] (K replicated
over tensor when it does not divide it), positions/segment ids[B_(data,fsdp), S_(context,context_a2a)].
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from maxctx.parallelism import BATCH_AXES as BATCH, CONTEXT_AXES as CONTEXT, TENSOR_AXIS

try:  # jax >= 0.6: jax.shard_map with check_vma
    from jax import shard_map as _shard_map

    _NO_CHECK = {"check_vma": False}
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}



def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    # Replication checking is off: custom VJPs and Pallas calls inside carry no replication rules.
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def ring_shift(tree, axis, size: int):
    """Sends every array of `tree` from ring rank i to rank i + 1 (mod size)."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def context_shard_map(body: Callable, mesh: Mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS,
                      sinks_H=None):
    """Runs body(q, k, v, positions, segment_ids, sinks) on each device's shards; returns out like q. `sinks_H`
    (attention sinks, one logit per query head, or None) reaches the body as its device's heads' [H_tensor].

    With fewer kv heads than the tensor axis (kv replicated over it), each device keeps the one kv head its
    local query heads use, so GQA grouping is the same locally as globally.
    """
    tp = mesh.shape[TENSOR_AXIS]
    h, kv_heads = q_BSHD.shape[2], k_BSKD.shape[2]
    kv_sharded = kv_heads % tp == 0
    q_spec = P(BATCH, CONTEXT, TENSOR_AXIS, None)
    kv_spec = P(BATCH, CONTEXT, TENSOR_AXIS if kv_sharded else None, None)
    bs_spec = P(BATCH, CONTEXT)

    def wrapped(q, k, v, pos, seg, *sinks):
        if not kv_sharded:
            head = jax.lax.axis_index(TENSOR_AXIS) * (h // tp) // (h // kv_heads)
            k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=2)
        return body(q, k, v, pos, seg, *sinks or (None,))

    sinks = () if sinks_H is None else (sinks_H,)
    specs = (q_spec, kv_spec, kv_spec, bs_spec, bs_spec) + (P(TENSOR_AXIS),) * len(sinks)
    return shard_map(wrapped, mesh, specs, q_spec)(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, *sinks)


def join_kv(k, v):
    """K and V as one array, so one permute moves both: stacked [2, ...] when their head dims agree (the leading
    axis slices apart without copies), else joined along the head dim [..., Dk + Dv] (MLA's 192 and 128)."""
    import jax.numpy as jnp

    return jnp.stack([k, v]) if k.shape[-1] == v.shape[-1] else jnp.concatenate([k, v], -1)


def split_kv(kv, first: int, second: int):
    """`join_kv`'s two parts, of head dims `first` and `second`."""
    return (kv[0], kv[1]) if first == second else (kv[..., :first], kv[..., first:])

