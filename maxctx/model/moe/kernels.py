"""The grouped matmul of the MoE layers' experts, chosen by `moe_kernel` as `attention=` chooses attention kernels.

Legend: R rows (the T k (token, slot) pairs of one chunk, sorted by expert), D in width, N out width, X experts.

    out[R, N] = lhs[R, D] rhs[x(r), D, N], rows grouped by expert: sizes[X] rows each, in expert order

Kernels (each with its backward: dlhs a grouped matmul with rhs transposed, drhs one per expert over its rows):
    ragged_dot   jax.lax.ragged_dot, XLA's lowering: on GPU (jax 0.11.2, H100) dense through an [R, X, D] buffer
    megablox     JAX's Pallas TPU grouped matmul (jax.experimental.pallas.ops.tpu.megablox: gmm, tgmm), MaxText's
                 sparse_matmul kernel; rows padded to whole row tiles, the padding in no expert's group
    auto         megablox on TPU (benchmarks/fit_table.md, the MoE section of docs/long_context.md: what one
                 Qwen3-30B-A3B layer compiles to), ragged_dot elsewhere

megablox runs on TPU, and in Pallas interpret mode on CPU (slow: tests); on GPU it is refused. tokamax 0.0.12's
ragged dot (the same Megablocks scheme) is not offered: it refuses any device but an attached TPU v5 or later
(PallasMosaicTpuRaggedDot.supported_on reads the default device when its operands are traced), so neither a step
compiled for a TPU topology on a CPU host nor an interpret-mode test can run it.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp

from maxctx.config import MoeKernel
from maxctx.errors import ConfigError

KERNELS = typing.get_args(MoeKernel)
PALLAS_TPU = ("megablox",)
# megablox's row, contraction and output tiles (MaxText's defaults: tile_batch_seq, tile_embed_dim, tile_mlp_dim);
# a dimension below its tile is one tile of its own size.
TILE = (512, 1024, 1024)


def resolve(name: str, platform: str | None = None, dtype=None) -> str:
    """`auto` -> megablox on TPU (ragged_dot for float16, which megablox lacks), ragged_dot elsewhere; a Pallas
    TPU kernel on GPU, and megablox for float16, are refused."""
    if name not in KERNELS:
        raise ConfigError(f"moe_kernel='{name}' is not one of {', '.join(KERNELS)}")
    platform = platform or jax.default_backend()
    fp16 = dtype is not None and jnp.dtype(dtype) == jnp.float16
    if name == "auto":
        return "megablox" if platform == "tpu" and not fp16 else "ragged_dot"
    if name == "megablox" and fp16:
        raise ConfigError("moe_kernel=megablox needs dtype=bfloat16 or float32 (JAX's Pallas grouped matmul has no "
                          "float16); set dtype=bfloat16, or moe_kernel=ragged_dot")
    if name in PALLAS_TPU and platform == "gpu":
        raise ConfigError(f"moe_kernel={name} is a Pallas TPU kernel and does not run on gpu; set moe_kernel=auto "
                          f"or ragged_dot")
    return name


def for_mesh(name: str, mesh=None, dtype=None):
    """`grouped_matmul` of moe_kernel=`name` resolved for the mesh's platform (abstract TPU devices say "tpu"), or
    the default backend's without a mesh, and the compute `dtype`."""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return grouped_matmul(resolve(name, platform, dtype), platform)


def grouped_matmul(kernel: str, platform: str | None = None):
    """f(lhs[R, D], rhs[X, D, N], sizes[X] int32) -> out[R, N] in lhs's dtype, for a resolved kernel name run on
    `platform` (interpret mode off TPU)."""
    interpret = (platform or jax.default_backend()) != "tpu"
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot
    if kernel == "megablox":
        return functools.partial(_megablox, interpret=interpret)
    raise ConfigError(f"moe_kernel='{kernel}' is not one of {', '.join(KERNELS[1:])} (resolve it first)")


def _megablox(lhs, rhs, sizes, interpret: bool):
    from jax.experimental.pallas.ops.tpu.megablox import ops

    rows = lhs.shape[0]
    tm, tk, tn = (min(t, n) for t, n in zip(TILE, (rows, rhs.shape[1], rhs.shape[2])))
    pad = -rows % tm  # gmm takes whole row tiles; rows past the last group are in no group, and cut off below
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    out = ops.gmm(lhs, rhs, sizes, lhs.dtype, (tm, tk, tn), None, None, False, interpret)
    return out[:rows]
