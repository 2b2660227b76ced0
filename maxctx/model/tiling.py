"""Token tiling: run a per-token computation over chunks of every device's tokens, one chunk at a time.

Legend: B batch, S sequence, C the context-parallel degree, N chunks, T = S / (C N) tokens per chunk and shard.

With the sequence sharded over the context axes, device c holds tokens [c S/C, (c + 1) S/C). Splitting S as
(C, N, T) and scanning over N gives every device chunk n of its own tokens at step n: each step is a smaller
copy of the whole computation, sharded exactly like it, and no device idles. The body is rematerialised
(`jax.checkpoint`, nothing saved), so neither direction ever holds more than one chunk's intermediates: the
forward keeps only each chunk's output (`map_chunks`) or a running sum (`sum_chunks`), the backward recomputes
a chunk, takes its gradient and moves on. Weights the body closes over get their gradients summed across chunks
in their own dtype (pass them in fp32 and cast inside `fn`, as the layers do).

The price is one more forward of the tiled computation in the backward pass: the loss's output projection (about
1 / 15 of llama3-8b's forward FLOPs), and for the MLP inside a rematerialised layer a third forward instead of two
(maxctx.plan.roofline counts both).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxctx.parallelism import BATCH_AXES, CONTEXT_AXES, mesh_context_degree


def _split(x, n: int, cp: int, mesh: Mesh | None):
    """x[B, S, ...] -> [N, B, C, T, ...], the C axis laid out like S was."""
    b, s = x.shape[:2]
    parts = jnp.moveaxis(x.reshape(b, cp, n, s // (cp * n), *x.shape[2:]), 2, 0)
    if mesh is None:
        return parts
    spec = P(None, BATCH_AXES, CONTEXT_AXES, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(parts, NamedSharding(mesh, spec))


def _flat(chunk):
    """[B, C, T, ...] -> [B, C T, ...]: one chunk as a (shorter) sequence, still sharded over context."""
    return chunk.reshape(chunk.shape[0], chunk.shape[1] * chunk.shape[2], *chunk.shape[3:])


def _check(s: int, n: int, cp: int) -> None:
    if s % (cp * n):
        raise ValueError(f"sequence length {s} is not divisible by {cp} context shards x {n} chunks")


def map_chunks(fn: Callable, n: int, mesh: Mesh | None, *xs_BS):
    """fn(*chunks of xs) -> a pytree of y[B, S', ...], token by token, applied to N chunks in turn; returns the
    pytree of y[B, S, ...]. Every x is [B, S, ...]."""
    if n <= 1:
        return fn(*xs_BS)
    cp = mesh_context_degree(mesh.shape) if mesh is not None else 1
    _check(xs_BS[0].shape[1], n, cp)
    body = jax.checkpoint(lambda cs: fn(*map(_flat, cs)), policy=jax.checkpoint_policies.nothing_saveable)

    def step(carry, chunks):
        return carry, jax.tree.map(lambda y: y.reshape(chunks[0].shape[:3] + y.shape[2:]), body(chunks))

    _, ys = jax.lax.scan(step, None, tuple(_split(x, n, cp, mesh) for x in xs_BS))  # [N, B, C, T, ...]

    def unsplit(y):
        y = jnp.moveaxis(y, 0, 2)
        return y.reshape(y.shape[0], -1, *y.shape[4:])

    return jax.tree.map(unsplit, ys)


def sum_chunks(fn: Callable, n: int, mesh: Mesh | None, *xs_BS):
    """fn(*chunks of xs) -> a pytree of scalars, summed over N chunks; every x is [B, S, ...]."""
    if n <= 1:
        return fn(*xs_BS)
    cp = mesh_context_degree(mesh.shape) if mesh is not None else 1
    _check(xs_BS[0].shape[1], n, cp)
    body = jax.checkpoint(lambda cs: fn(*map(_flat, cs)), policy=jax.checkpoint_policies.nothing_saveable)
    parts = tuple(_split(x, n, cp, mesh) for x in xs_BS)
    shapes = jax.eval_shape(body, tuple(jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in parts))
    zeros = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), shapes)

    def step(acc, chunks):
        return jax.tree.map(jnp.add, acc, body(chunks)), None

    total, _ = jax.lax.scan(step, zeros, parts)
    return total
