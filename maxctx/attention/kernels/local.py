"""The kernels every strategy can run, behind one local interface.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, D head dim.

A `LocalKernel` is built outside shard_map for one strategy's token layout and used inside it:
  attend(hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg)           -> (out, lse|None), differentiable in out
  block_forward(hop, ...)                                      -> (out fp32, lse fp32), for ring hops
  block_backward(hop, ..., out, lse, dout)                     -> (dq, dk, dv) fp32 given the merged out/lse
Kernels: dot_product (reference, O(S T) memory), blockwise (flash.py: the flash-attention algorithm in plain
JAX, every platform), splash (TPU Pallas), tokamax_splash (tokamax's copy of splash on the same masks:
use_tokamax_splash, tokamax_splash.py), cudnn (GPU: cuDNN's causal or packed mask types where the call's
tokens allow, chosen on the device, else a boolean mask; see cudnn.py). `hop` (a Python int, or the ring loop's
traced index) picks the ring hop's splash kernel; only splash (and tokamax_splash) needs it (its masks are
index-based, see splash.py), the others mask from positions. Splash rings run their backward hops through splash's
own dQ and dK/dV kernels given the ring's merged out and lse (splash_backward); cuDNN rings, and splash's where this JAX
lacks those kernels or with Blocks.ring_backward=False, with the blockwise backward (exact, pure JAX): cuDNN
exposes no backward that takes the merged lse. tokamax rings run tokamax's fused backward kernel the same way.
Attention sinks (GPT-OSS) run on block_forward / block_backward in every kernel (sinks.py).
`softcap` > 0 (attn_logits_soft_cap) caps every kernel's scores, splash's and tokamax's through their own
`attn_logits_soft_cap`, so a ring's hops merge capped scores; cuDNN has no soft-cap and is refused (ConfigError).

V's head dim may be below q and k's (MLA: 192 and 128). The reference and blockwise kernels take it as it is; splash,
tokamax and cuDNN get V (and a hop backward's out and dout) zero-padded to q's head dim, and their out and dV sliced
back: exact (the padded columns of out are sums of zeros, and add nothing to rowsum(dout * out)), for D / Dv of
the P V products (1.5 at MLA's dims).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.kernels import (
    cudnn,
    document_blocks,
    flash,
    splash,
    splash_backward,
    splash_masks,
    tokamax_splash,
)
from maxctx.attention.kernels.dot_product import dot_product_attention, dot_product_block_backward
from maxctx.attention.kernels.index_runs import expand, ranked, runs, shifted
from maxctx.config import ConfigError


@dataclasses.dataclass(frozen=True)
class LocalKernel:
    name: str
    block_q: int = 512
    block_kv: int = 512
    q_axes: Any = None
    window: int = 0  # sliding window W (0: none): query i sees key j iff 0 <= pos[i] - pos[j] < W, same document
    # splash only: the distinct kernels over all hops and, per [hop][query shard], which one runs.
    splash_kernels: tuple = ()
    splash_table: tuple = ()
    # cudnn only: queries and keys are the whole sequence in natural order (cudnn.py's fast calls may apply)
    natural: bool = False
    # splash only: the stored order is the batch's (context_parallel_load_balance=documents; document_blocks):
    # each call derives its q_sequence and tables from its ids, one row at a time; `sort_keys`: the call's keys
    # are gathered from every rank and are put back in document order first.
    documents: bool = False
    sort_keys: bool = False
    softcap: float = 0.0  # logit soft-cap c > 0: scores -> c tanh(s / c) (splash's kernels carry their own)

    def _pick(self, hop, branches, *args):
        """Runs this device's branch of `branches` (one per splash kernel) at `hop`."""
        if len(branches) == 1:
            return branches[0](*args)
        # `hop` may be the ring loop's traced index: the table is a constant indexed on the device.
        which = jnp.asarray(self.splash_table, jnp.int32)[hop, jax.lax.axis_index(self.q_axes)]
        return jax.lax.switch(which, branches, *args)

    def _splash(self, hop, save_residuals, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == tokamax_splash.NAME:  # tokamax's own tables (not narrowed to documents)
            branches = [functools.partial(tokamax_splash.call, kern, save_residuals=save_residuals)
                        for kern in self.splash_kernels]
            return self._pick(hop, branches, q, k, v, q_seg, kv_seg)
        # Each call's tables are narrowed to the documents of its rows (maxctx.attention.kernels.document_blocks).
        if not self.documents:
            branches = [functools.partial(splash.splash_call, kern, save_residuals=save_residuals,
                                          ids=(q_pos, kv_pos, self.window, None)) for kern in self.splash_kernels]
            return self._pick(hop, branches, q, k, v, q_seg, kv_seg)
        call = functools.partial(splash.splash_call, self.splash_kernels[0], save_residuals=save_residuals)
        rows = self._document_rows(call, q_pos, q_seg, kv_pos, kv_seg, q, k, v, q_seg, kv_seg)
        out = jnp.concatenate([o for o, _ in rows])
        return out, (jnp.concatenate([lse for _, lse in rows]) if save_residuals else None)

    def _document_rows(self, fn, q_pos, q_seg, kv_pos, kv_seg, *arrays) -> list:
        """A documents call, one batch row at a time: fn(*the row's `arrays`, ids=...) with the row's positions,
        the window and the row's q_sequence (document_blocks.query_values), for each row."""
        values = document_blocks.query_values(q_pos, q_seg, kv_pos, kv_seg)
        return [fn(*_row(b, *arrays), ids=(*_row(b, q_pos, kv_pos), self.window, values[b:b + 1]))
                for b in range(arrays[0].shape[0])]

    def gathered(self, k, v, kv_pos, kv_seg):
        """A documents call's gathered keys, put back in document order (sort_keys); others as they are."""
        if self.name == "splash" and self.documents and self.sort_keys:
            kv_pos, kv_seg, k, v = document_blocks.sort_keys(kv_pos, kv_seg, k, v)
        return k, v, kv_pos, kv_seg

    def attend(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            return dot_product_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.window, self.softcap)
        if self.name == "blockwise":
            return flash.flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv,
                                         self.window, self.softcap)
        out, lse = self._pallas_attend(hop, q, k, _widened(v, q), q_pos, q_seg, kv_pos, kv_seg)
        return out[..., :v.shape[-1]], lse

    def _pallas_attend(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "cudnn":
            return cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, window=self.window,
                                         natural=self.natural)
        k, v, kv_pos, kv_seg = self.gathered(k, v, kv_pos, kv_seg)
        return self._splash(hop, False, q, k, v, q_pos, q_seg, kv_pos, kv_seg)

    def block_forward(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        if self.name == "dot_product":
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            return dot_product_attention(*f32, q_pos, q_seg, kv_pos, kv_seg, self.window, self.softcap)
        if self.name == "blockwise":
            return flash.flash_forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, self.block_q, self.block_kv,
                                       self.window, self.softcap)
        width, v = v.shape[-1], _widened(v, q)
        if self.name == "cudnn":
            out, lse = cudnn.cudnn_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, return_lse=True,
                                             window=self.window, natural=self.natural)
        else:
            out, lse = self._splash(hop, True, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
        return out[..., :width].astype(jnp.float32), lse

    def block_backward(self, hop, q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout):
        if self.name == "dot_product":
            return dot_product_block_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout, self.window,
                                              self.softcap)
        if self.name != "blockwise" and v.shape[-1] != q.shape[-1]:
            v_out_dout = (_widened(x, q) for x in (v, out, dout))
            dq, dk, dv = self._pallas_backward(hop, q, k, *v_out_dout, q_pos, q_seg, kv_pos, kv_seg, lse)
            return dq, dk, dv[..., :v.shape[-1]]
        return self._pallas_backward(hop, q, k, v, out, dout, q_pos, q_seg, kv_pos, kv_seg, lse)

    def _pallas_backward(self, hop, q, k, v, out, dout, q_pos, q_seg, kv_pos, kv_seg, lse):
        def blockwise(*_):
            return flash.flash_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, out, lse, dout, None,
                                        self.block_q, self.block_kv, self.window, self.softcap)

        if self.name == tokamax_splash.NAME:  # its fused backward kernel given the merged out and lse
            branches = [functools.partial(tokamax_splash.hop_backward, kern) for kern in self.splash_kernels]
            return self._pick(hop, branches, q, k, v, q_seg, kv_seg, out, lse, dout)
        if self.name != "splash" or not any(splash_backward.has_backward(kern) for kern in self.splash_kernels):
            return blockwise()
        # splash's own dQ and dK/dV kernels for a hop that has their tables (in row chunks too), else the blockwise
        # backward (XLA fusions: fp32 score tiles through HBM).
        if self.documents:  # one row at a time (_splash); a ring hop's keys are one rank's, in document order
            kern = self.splash_kernels[0]
            if not splash_backward.has_backward(kern):
                return blockwise()
            rows = self._document_rows(functools.partial(splash_backward.hop_backward, kern), q_pos, q_seg, kv_pos,
                                       kv_seg, q, k, v, q_seg, kv_seg, out, lse, dout)
            return tuple(jnp.concatenate(parts) for parts in zip(*rows))
        branches = [functools.partial(splash_backward.hop_backward, kern, ids=(q_pos, kv_pos, self.window, None))
                    if splash_backward.has_backward(kern) else blockwise for kern in self.splash_kernels]
        return self._pick(hop, branches, q, k, v, q_seg, kv_seg, out, lse, dout)


def _widened(x, q):
    """x[..., Dv] zero-padded to q's head dim (module doc); x itself when they are equal."""
    extra = q.shape[-1] - x.shape[-1]
    if extra < 0:
        raise ConfigError(f"value head dim {x.shape[-1]} above the query's {q.shape[-1]}: only the reference and "
                         f"blockwise kernels take it; use attention=blockwise")
    return x if not extra else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _row(b: int, *arrays):
    return tuple(x[b:b + 1] for x in arrays)


def make_local(name: str, block_q: int, block_kv: int, *, mesh=None, order: np.ndarray | None = None,
               q_shards: int = 1, kv_blocks: int = 1, q_axes=None, group: int = 1, ring: bool = False,
               window: int = 0, splash_blocks: splash.Blocks | None = None, documents: bool = False,
               sort_keys: bool = False, softcap: float = 0.0) -> LocalKernel:
    """Builds the kernel for a layout. Splash only: `order` is the stored order of the whole sequence, split into
    `q_shards` query shards (the linear index over mesh axes `q_axes`); the keys a call sees are either the whole
    sequence (kv_blocks=1) or, at ring hop t, block (r - t) mod kv_blocks for query shard r; `group` = query heads
    per kv head; `ring` builds lse-returning kernels for every hop (with splash's dQ and dK/dV tables, for
    block_backward). Calls whose masks are equal share a kernel, across hops too: under zig-zag or without load
    balance a whole ring has at most 3 distinct masks (the diagonal, key block before, key block after), whatever
    C. A device picks its own with `lax.switch` on a [hop, query shard] table. Off TPU (the mesh's devices, else
    the default backend) splash runs in Pallas interpret mode: slow, for tests. `window` > 0: a sliding window
    (masks then compare by offset, not rank). `splash_blocks`: splash's other block sizes (splash.Blocks; None:
    all derived from block_q / block_kv). cuDNN: a call whose queries and keys are the whole sequence in natural
    order (one query shard, one key block, `order` the identity: no CP split, no zig-zag) may take cuDNN's own
    mask types (maxctx.attention.kernels.cudnn). `documents`: the stored order is the batch's (`order` then only
    gives the length): splash gets one kernel for every call (_documents_kernel) and derives its masks per call from
    the ids; `sort_keys`: the calls' keys are gathered from all ranks (all_gather, a2a) and are sorted first.
    `name` tokamax_splash: the same kernels and tables from tokamax (tokamax_splash.make_kernel). `softcap`: the
    logit soft-cap (0: none), refused for cuDNN."""
    _check_softcap(name, softcap)
    if name not in ("splash", tokamax_splash.NAME):
        natural = (not documents and order is not None and q_shards == 1 and kv_blocks == 1
                   and np.array_equal(order, np.arange(len(order))))
        return LocalKernel(name, block_q, block_kv, window=window, natural=natural, softcap=softcap)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if documents and name == tokamax_splash.NAME:
        raise ConfigError("use_tokamax_splash=true with context_parallel_load_balance=documents: tokamax's tables "
                          "cannot follow a per-batch token order; use maxctx's splash (use_tokamax_splash=false) "
                          "or context_parallel_load_balance=true")
    if documents:
        kernel = _documents_kernel(len(order) // q_shards, len(order) // kv_blocks, group, block_q, block_kv,
                                         ring, platform != "tpu", splash.MAX_TABLE_ENTRIES, window,
                                         splash_blocks or splash.Blocks(), softcap)
        table = ((0,) * q_shards,) * (kv_blocks if ring else 1)
        return LocalKernel(name, block_q, block_kv, q_axes, window, (kernel,), table, documents=True,
                           sort_keys=sort_keys, softcap=softcap)
    kernels, table = _splash_kernels(np.asarray(order, np.int64).tobytes(), q_shards, kv_blocks, group, block_q,
                                     block_kv, ring, platform != "tpu", splash.MAX_TABLE_ENTRIES, window,
                                     splash_blocks or splash.Blocks(), name == tokamax_splash.NAME, softcap)
    return LocalKernel(name, block_q, block_kv, q_axes, window, kernels, table, softcap=softcap)


def _check_softcap(name: str, softcap: float) -> None:
    """cuDNN (jax.nn.dot_product_attention) has no logit soft-cap: refused here, at trace time, for what config
    validation (maxctx.validate) cannot see."""
    if softcap and name == "cudnn":
        raise ConfigError(f"attn_logits_soft_cap={softcap} needs attention=auto, blockwise, dot_product or splash; "
                          f"cudnn has no logit soft-cap")


def make_band(name: str, block_q: int, block_kv: int, *, mesh=None, chunk: int, halo: int, window: int,
              group: int = 1, splash_blocks: splash.Blocks | None = None, softcap: float = 0.0,
              residuals: bool = False) -> LocalKernel:
    """The kernel of a local layer's chunk (maxctx.attention.cp.halo): `chunk` queries against the `halo` keys before
    them and themselves, all in original order; splash gets the one static sliding-window mask they share.
    `residuals`: splash's kernel returns lse, for block_forward / block_backward (attention sinks: sinks.py)."""
    _check_softcap(name, softcap)
    if name not in ("splash", tokamax_splash.NAME):
        return LocalKernel(name, block_q, block_kv, window=window, softcap=softcap)
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    build = tokamax_splash.make_kernel if name == tokamax_splash.NAME else splash.make_kernel
    kernel = build(np.arange(halo, halo + chunk), np.arange(halo + chunk), group, block_q, block_kv,
                   save_residuals=residuals, interpret=platform != "tpu", window=window,
                   blocks=splash_blocks or splash.Blocks(), softcap=softcap)
    return LocalKernel(name, block_q, block_kv, None, window, (kernel,), ((0,),), softcap=softcap)


@functools.lru_cache(maxsize=32)
def _splash_kernels(order_bytes: bytes, q_shards: int, kv_blocks: int, group: int, block_q: int, block_kv: int,
                    ring: bool, interpret: bool, max_table_entries: int, window: int,
                    blocks: splash.Blocks, tokamax: bool = False, softcap: float = 0.0) -> tuple[tuple, tuple]:
    """The distinct kernels over all hops and each [hop][query shard]'s index into them. Cached: building the
    mask info walks every block on the host, and the train step, the eval step and rematerialisation trace
    attention again. Kernels are built on the ranks, not the original indices: equal masks then compare equal
    in splash's own mask-info cache, which serves equal row chunks of one kernel (make_kernel) once. A sliding
    window depends on index distances, which ranks do not keep: its masks are compared shifted to start at 0.
    `tokamax`: tokamax's kernels (tokamax_splash.make_kernel) instead of JAX's."""
    order = np.frombuffer(order_bytes, np.int64)
    n, rows = len(order) // kv_blocks, len(order) // q_shards
    q_runs = [runs(order[r * rows:(r + 1) * rows]) for r in range(q_shards)]
    kv_runs = [runs(order[b * n:(b + 1) * n]) for b in range(kv_blocks)]
    build = tokamax_splash.make_kernel if tokamax else splash.make_kernel
    kernels, table, seen = [], [], {}
    for hop in range(kv_blocks if ring else 1):
        row = []
        for r in range(q_shards):
            pair = (q_runs[r], kv_runs[(r * kv_blocks // q_shards - hop) % kv_blocks])
            key = shifted(*pair) if window else ranked(*pair)
            if key not in seen:  # a hop that sees no key gets make_kernel's empty chunk (splash refuses its mask)
                seen[key] = len(kernels)
                kernels.append(build(expand(key[0]), expand(key[1]), group, block_q, block_kv,
                                     save_residuals=ring, interpret=interpret,
                                     max_table_entries=max_table_entries, window=window, blocks=blocks,
                                     softcap=softcap))
            row.append(seen[key])
        table.append(tuple(row))
    return tuple(kernels), tuple(table)


def _documents_kernel(rows: int, keys: int, group: int, block_q: int, block_kv: int, save_residuals: bool,
                      interpret: bool, max_table_entries: int, window: int, blocks: splash.Blocks, softcap: float):
    """splash.make_kernel's result for a call of `rows` queries and `keys` keys whose order changes with the batch
    (context_parallel_load_balance=documents, document_blocks): every block listed, the mask computed in the
    kernel as `key place <= q_sequence` (and within `window`), q_sequence and the tables given per call."""
    built = splash.make_kernel(np.arange(keys, keys + rows), np.arange(keys), group, block_q, block_kv,
                               save_residuals, interpret, max_table_entries, 0,
                               dataclasses.replace(blocks, stored_masks=False), softcap)
    function = splash_masks.KeyRuns(((0, keys),), window)

    def patched(kernel):
        return None if kernel is None else type(kernel)(kernel.fwd_mask_info, kernel.dq_mask_info,
                                                        kernel.dkv_mask_info,
                                                        **{**kernel.kwargs, "mask_function": function})

    if isinstance(built, splash.RowLoop):
        built.kernel = patched(built.kernel)
        return built
    return tuple((start, stop, patched(kernel)) for start, stop, kernel in built)
