"""The one attention entry point the model calls: picks the kernel and the context-parallel strategy.

Layouts: q[B_(data,fsdp), S_(context,context_a2a), H_tensor, D], k/v[B, S, K_tensor, D], positions and segment ids
[B, S]; out like q. With a mesh, the call goes to the registered strategy (maxctx.attention.cp.strategies; every
strategy's attend takes the same arguments: the arrays, the mesh and this spec with its kernel resolved), which
shard_maps over the mesh (C = 1 runs all_gather, whose gathers are then no-ops); without a mesh the kernel runs on
the arrays as they are. A local (sliding-window) layer under a strategy with `local_by_halo` runs as
maxctx.attention.cp.halo's exchange instead, where that moves less. MLA under a strategy that moves its latent
(`moves_latent`) calls `attend_latent` with the latent and the weight that expands it in place of K and V.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.cp import halo, strategies
from maxctx.attention.kernels import sinks, splash, tokamax_splash
from maxctx.attention.kernels.local import make_local
from maxctx.config import AttentionKernel, Config, ConfigError
from maxctx.parallelism import mesh_context_degree


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention keys of the run config (defaults: maxctx.config.Config's)."""

    kernel: AttentionKernel = Config.attention
    strategy: str = Config.context_parallel_strategy
    load_balance: bool = Config.context_parallel_load_balance
    block_q: int = Config.flash_block_q
    block_kv: int = Config.flash_block_kv
    window: int = 0  # this layer's sliding window (0: global); the model sets it per layer from the pattern
    # Gemma 2's attention logit soft-cap (attn_logits_soft_cap): scores -> cap * tanh(scores / cap) before the
    # mask, the online softmax's running max and the rings' merges; 0: off. Every kernel but cuDNN takes it.
    logit_softcap: float = Config.attn_logits_soft_cap
    splash_blocks: splash.Blocks = splash.Blocks()  # splash's other block sizes (flash_block_*_dkv, ...)
    tokamax: bool = Config.use_tokamax_splash  # splash runs as tokamax's kernel (tokamax_splash.resolve)
    # Rings (p2p, usp): the software-pipelined backward (maxctx.attention.cp.ring). No config key: it costs memory
    # and no measurement shows it faster (docs/long_context.md); benchmarks and tests set it here.
    ring_backward_overlap: bool = False

    @classmethod
    def from_config(cls, config: Config) -> AttentionSpec:
        return cls(kernel=config.attention, strategy=config.context_parallel_strategy,
                   load_balance=config.context_parallel_load_balance, block_q=config.flash_block_q,
                   block_kv=config.flash_block_kv, splash_blocks=splash.Blocks.from_config(config),
                   tokamax=config.use_tokamax_splash, logit_softcap=config.attn_logits_soft_cap)


def resolve_kernel(name: str, platform: str | None = None, dtype=None, softcap: float = 0.0) -> str:
    """`auto` and `flash` (MaxText's meaning) -> the platform's fast kernel: splash on TPU, cuDNN on GPU for
    bf16/fp16 without a logit soft-cap (cuDNN has none), the blockwise JAX kernel otherwise."""
    if name not in ("auto", "flash"):
        if name not in typing.get_args(AttentionKernel):
            raise ConfigError(f"attention='{name}' is not one of {', '.join(typing.get_args(AttentionKernel))}")
        return name
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "splash"
    if platform == "gpu" and not softcap and dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "blockwise"


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, spec: AttentionSpec, mesh=None, sinks_H=None):
    """Causal, document-masked attention; returns out[B, S, H, D]. `sinks_H`: attention sinks (GPT-OSS), one
    learned logit per query head in every row's softmax denominator, merged once per row whatever the strategy and
    kernel (maxctx.attention.kernels.sinks); None: none."""
    kernel = _kernel(spec, q_BSHD.dtype, mesh)
    if mesh is None:
        seq = q_BSHD.shape[1]
        local = make_local(kernel, spec.block_q, spec.block_kv, order=np.arange(seq),
                           group=q_BSHD.shape[2] // k_BSKD.shape[2], window=spec.window,
                           splash_blocks=spec.splash_blocks, softcap=spec.logit_softcap, ring=sinks_H is not None)
        return sinks.attend(local, 0, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, positions_BS,
                            segment_ids_BS, sinks_H)
    cp = mesh_context_degree(mesh.shape)
    strategy = strategies.get(spec.strategy if cp > 1 else "all_gather")
    spec = dataclasses.replace(spec, kernel=kernel)
    if spec.window and cp > 1 and strategy.local_by_halo:
        out = halo.attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H)
        if out is not None:  # None: a halo would move as much as the strategy's own path
            return out
    return strategy.attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H)


def _kernel(spec: AttentionSpec, dtype, mesh) -> str:
    platform = mesh.devices.flat[0].platform if mesh is not None else None  # abstract TPU devices say "tpu"
    return tokamax_splash.resolve(resolve_kernel(spec.kernel, platform=platform, dtype=dtype,
                                                 softcap=spec.logit_softcap), spec.tokamax)


def moves_latent(spec: AttentionSpec, mesh) -> bool:
    """Whether an MLA layer hands the configured strategy its latent (`attend_latent`) rather than K and V: a
    strategy that moves the latent (Strategy.moves), over more than one context shard."""
    return (mesh is not None and mesh_context_degree(mesh.shape) > 1
            and strategies.get(spec.strategy).moves == "latent")


def attend_latent(q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS, spec: AttentionSpec, mesh):
    """MLA's attention under a strategy that moves the latent (`moves_latent`): out[B, S, H, V] from q, the latent
    [B, S, R + P] (the normed latent and the rotated shared RoPE key) and wkv_b [R, H, N + V], which the strategy
    rebuilds K and V with (maxctx.attention.cp.latent)."""
    spec = dataclasses.replace(spec, kernel=_kernel(spec, q_BSHQ.dtype, mesh))
    return strategies.get(spec.strategy).attend_latent(q_BSHQ, latent_BSL, wkv_b_RHU, positions_BS, segment_ids_BS,
                                                       mesh, spec)


__all__ = ["AttentionSpec", "attend", "attend_latent", "moves_latent", "resolve_kernel"]
