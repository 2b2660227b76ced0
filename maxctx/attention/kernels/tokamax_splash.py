"""tokamax's splash attention (MaxText's default TPU kernel) behind maxctx's splash masks: `use_tokamax_splash=true`.

Legend: B batch, S query rows, T keys, H query heads, K kv heads, G = H // K, D head dim.

tokamax (`pip install maxctx[tokamax]`) ships its own copy of splash, which differs from JAX's
(maxctx.attention.kernels.splash) in what it is given and what it keeps:
- one 2-D mask per call ([S, T]) and MQA kernels over the G query heads of a kv head, vmapped over K and B as
  splash.py does; the masks are maxctx's own (splash_masks.ordered_causal_mask: causal on original indices, a
  sliding window, partial blocks computed in the kernel from `q_sequence` and a mask function, which tokamax reads
  the same way);
- its block tables list only the visited blocks (active rows and columns), not a [query blocks, key blocks] grid;
- one backward kernel: dQ, dK and dV fused (flash_block_q_dq / flash_block_kv_dq and splash_fused_backward have no
  effect); the dK/dV blocks are flash_block_*_dkv (Blocks.sizes);
- exponentials in base 2: its kernels keep the log-sum-exp times log2(e), and hand it back in natural base.
Ring hops (p2p, usp) run tokamax's forward with residuals and its fused backward kernel given the ring's merged
out and lse (hop_backward: lse back to base 2), as splash_backward does with JAX's kernels; the kernel is a
private function of tokamax, so a tokamax release that changes it fails here rather than silently.
Each call is one kernel: tokamax's tables list only the visited blocks, and maxctx's row chunks for calls whose
block grid passes splash.MAX_TABLE_ENTRIES (a limit measured for JAX's grid tables, splash.make_kernel) are not
applied to them; where its tables outgrow on-chip SMEM, the TPU compile says so. Queries are pre-scaled by
D**-0.5, as in splash.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.kernels import splash
from maxctx.attention.kernels.index_runs import runs
from maxctx.attention.kernels.splash import block_size
from maxctx.attention.kernels.splash_masks import ordered_causal_mask, sees_a_key

NAME = "tokamax_splash"  # the kernel name dispatch resolves splash to under use_tokamax_splash=true
_log = logging.getLogger(__name__)


def installed() -> bool:
    return importlib.util.find_spec("tokamax") is not None


def _lib():
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as kernel_lib

    return kernel_lib


def resolve(kernel: str, use_tokamax: bool) -> str:
    """The kernel a resolved `kernel` name runs under use_tokamax_splash: tokamax's splash in place of maxctx's
    when tokamax is installed; without it, maxctx's splash (the same kernel family) and one logged line. Other
    kernels are unchanged: use_tokamax_splash picks which splash runs, as in MaxText."""
    if kernel != "splash" or not use_tokamax:
        return kernel
    if installed():
        return NAME
    _fallback_notice()
    return kernel


@functools.cache
def _fallback_notice() -> None:  # once per process: attention is traced once per layer and again under remat
    _log.warning("use_tokamax_splash=true but tokamax is not installed: running maxctx's splash (JAX's Pallas "
                 "kernel); pip install maxctx[tokamax] for tokamax's")


def splash_config(rows: int, keys: int, bq: int, bkv: int, blocks: splash.Blocks, interpret: bool,
                  softcap: float = 0.0):
    """tokamax's SplashConfig for a call of `rows` queries and `keys` keys: the forward's and dK/dV's blocks as
    splash.Blocks.sizes cuts them for JAX's kernel, under the fused backward (tokamax's only one); `softcap` the
    logit soft-cap (0: none), which the fused backward's tanh derivative follows."""
    sizes = dataclasses.replace(blocks, fused_backward=True).sizes(rows, keys, bq, bkv, backward=True)
    return _lib().SplashConfig(
        block_q=sizes.block_q, block_kv=sizes.block_kv, block_kv_compute=sizes.block_kv_compute,
        block_q_dkv=sizes.block_q_dkv, block_kv_dkv=sizes.block_kv_dkv,
        block_kv_dkv_compute=sizes.block_kv_dkv_compute, use_fused_bwd_kernel=True, interpret=interpret,
        attn_logits_soft_cap=softcap or None)


def make_kernel(q_orig: np.ndarray, kv_orig: np.ndarray, group: int, block_q: int, block_kv: int,
                save_residuals: bool, interpret: bool = False, max_table_entries: int | None = None,
                window: int = 0, blocks: splash.Blocks | None = None, softcap: float = 0.0):
    """tokamax's kernel for one device's query rows and key block, in splash.make_kernel's form:
    ((0, rows, kernel or None),), None when no query sees a key. Its forward and dK/dV tables are built either way
    (ring hops run hop_backward). `group` and `max_table_entries` are unused: tokamax's masks are 2-D (one MQA
    kernel serves the G query heads) and each call is one kernel (the module docstring says why)."""
    del group, max_table_entries
    if not sees_a_key(runs(q_orig), runs(kv_orig), window):
        return ((0, len(q_orig), None),)
    bq, bkv = block_size(len(q_orig), block_q), block_size(len(kv_orig), block_kv)
    mask = ordered_causal_mask(np.asarray(q_orig), np.asarray(kv_orig), window)
    settings = splash_config(len(q_orig), len(kv_orig), bq, bkv, blocks or splash.Blocks(), interpret, softcap)
    # Concrete tables even when built under a trace, as splash._make_one does.
    with jax.ensure_compile_time_eval():
        kernel = _lib().make_splash_mqa_single_device(mask, config=settings, save_residuals=save_residuals)
    return ((0, len(q_orig), kernel),)


def _visited_blocks(info, grid: int) -> int:
    """Blocks a kernel's tables visit (`grid`: all of them, when tokamax keeps no table for an all-visible mask)."""
    return grid if info.block_mask is None else int(np.count_nonzero(np.asarray(info.block_mask) > 0))


def visited_macs(kernel, rows: int, keys: int, head_dim: int) -> int:
    """Query-key products x head dim per query head of `kernel`'s forward (the scope maxctx.plan.program reads)."""
    settings = kernel.kwargs["config"]
    grid = rows // settings.block_q * (keys // settings.block_kv)
    return _visited_blocks(kernel.fwd_mask_info, grid) * settings.block_q * settings.block_kv * head_dim


def _heads(x_BSHD, kv_heads: int):
    """[B, S, H, D] -> [B, K, G, S, D]: each kv head's G query heads, an MQA call's layout."""
    b, s, h, d = x_BSHD.shape
    return x_BSHD.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def call(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, save_residuals: bool):
    """Runs make_kernel's kernel: (out[B, S, H, D], lse[B, H, S] fp32 natural base, or None)."""
    kernel_lib = _lib()
    kernel = kernels[0][2]
    b, s, h, d = q_BSHD.shape
    if kernel is None:  # no query sees a key: the empty result the ring's merge expects
        return jnp.zeros_like(q_BSHD), jnp.full((b, h, s), -jnp.inf, jnp.float32) if save_residuals else None
    kv_heads = k_BTKD.shape[2]
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    segments = kernel_lib.SegmentIds(q=q_seg_BS.astype(jnp.int32), kv=kv_seg_BT.astype(jnp.int32))

    def one(q_GSD, k_TD, v_TD, seg):
        return kernel(q_GSD, k_TD, v_TD, segment_ids=seg)

    with splash.pallas_scope(visited_macs(kernel, s, k_BTKD.shape[1], d) * b * h):
        result = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(_heads(q_BSHD * d ** -0.5, kv_heads), k_BKTD,
                                                                   v_BKTD, segments)
    out, lse = (result[0], result[1]["logsumexp"]) if save_residuals else (result, None)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
    if lse is None:
        return out, None
    lse = lse.reshape(b, h, s).astype(jnp.float32)
    # Rows with no visible key in a visited block: tokamax leaves lse near its mask value and out finite but
    # meaningless; make them the empty result the ring's merge expects.
    seen = lse > -1e30
    return jnp.where(seen.transpose(0, 2, 1)[..., None], out, 0), jnp.where(seen, lse, -jnp.inf)


def hop_backward(kernels, q_BSHD, k_BTKD, v_BTKD, q_seg_BS, kv_seg_BT, out_BSHD, lse_BHS, dout_BSHD):
    """A ring hop's (dq, dk, dv), fp32, through tokamax's fused backward kernel from the ring's *merged* out and
    lse (natural base; the kernel wants base 2): P = exp(s - lse) is the hop's share of each row's softmax, so the
    hops' gradients add up to the whole attention's (splash_backward.hop_backward's argument)."""
    kernel_lib = _lib()
    kernel = kernels[0][2]
    if kernel is None:  # the hop sees no key
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q_BSHD, k_BTKD, v_BTKD))
    b, s, h, d = q_BSHD.shape
    kv_heads, settings, kw = k_BTKD.shape[2], kernel.kwargs["config"], kernel.kwargs
    base = kernel_lib.LOG2E if settings.use_base2_exp else 1.0
    # A row no hop lets see a key has lse -inf; +inf instead makes its P 0 rather than 0 * inf.
    lse_BKGS = (jnp.where(jnp.isfinite(lse_BHS), lse_BHS, jnp.inf) * base).reshape(b, kv_heads, h // kv_heads, s)
    di_BKGS = jnp.einsum("bshd,bshd->bhs", out_BSHD.astype(jnp.float32),
                         dout_BSHD.astype(jnp.float32)).reshape(b, kv_heads, h // kv_heads, s)
    segments = kernel_lib.SegmentIds(q=q_seg_BS.astype(jnp.int32), kv=kv_seg_BT.astype(jnp.int32))

    def one(q, k, v, seg, lse, do, di):
        return kernel_lib._splash_attention_bwd_dkv(
            q, k, v, seg, lse, do, di, bq=settings.block_q_dkv, bkv=settings.block_kv_dkv,
            bkv_compute=settings.block_kv_dkv_compute, is_mqa=True, mask_info=kernel.dkv_mask_info,
            mask_value=kw["mask_value"], mask_function=kw["mask_function"], config=settings,
            dkv_mask_sparsity=kw["dkv_mask_sparsity"])

    with splash.pallas_scope(visited_macs(kernel, s, k_BTKD.shape[1], d) * b * h):
        dq, dk, dv = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, 0, 0, 0)))(
            _heads(q_BSHD * d ** -0.5, kv_heads), k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3),
            segments, lse_BKGS, _heads(dout_BSHD.astype(q_BSHD.dtype), kv_heads), di_BKGS)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d).astype(jnp.float32) * d ** -0.5
    return dq, dk.astype(jnp.float32).transpose(0, 2, 1, 3), dv.astype(jnp.float32).transpose(0, 2, 1, 3)
