"""GPU attention through cuDNN flash, by the cheapest of three calls that is exact for the call's tokens.

Legend: B batch, S query length, T key/value length, H query heads, K kv heads, D head dim, M documents per row.

  masked  jax.nn.dot_product_attention(implementation='cudnn') with the position/segment mask as a boolean
          mask[B, 1, S, T]. Any layout, but jax turns the mask into a dense bias that every block reads: no block
          is skipped, so a packed row costs as much as a causal one (benchmarks/gpu.md: 118 ms against 37 ms).
  causal  cuDNN's own causal mask type (is_causal, and local_window_size for a sliding window): every row is one
          document.
  packed  cuDNN's packed layout: per row the offsets and lengths of its documents, M at most, and the
          padding-causal mask type, so each document attends only to itself. This is JAX's private
          jax._src.cudnn.fused_attention_stablehlo.dot_product_attention (jax.nn does not expose the offsets),
          checked by signature; Hopper or later.

causal and packed compute the mask from array indices, which equals the position/segment mask exactly when the
queries and the keys are the same tokens and each row is a series of runs: a run is one document whose
positions rise by 1 from token to token, and segment ids rise from one run to the next (so no document comes
back after another one). `choose_path` tests that on the device and the call goes through `lax.switch`. The
test alone is exact in any token order; `natural` (kernels.make_local: the call's queries and keys are the whole
sequence in its natural order, no context-parallel split, no zig-zag) only says statically whether the fast
paths can ever apply, so that calls where they cannot (CP shards, ring hops, zig-zag) compile the masked call
alone. Rows with padding (segment id 0, positions all 0) are not runs and take the masked call. One call serves
the whole batch: causal when every row is one document, packed when every row has at most M (a single-document
row is a packed row of one), masked otherwise.

The packed call's residual (the lse ring hops need) is read as [document, H, t], documents numbered over the
batch (packed_residual_index): an assumption about cuDNN that benchmarks/gpu_check.py checks against other
layouts. JAX before 0.11 strides the packed key offsets by the query heads, wrong under GQA: where its own
offset fix-up says so (kv_offsets_follow_kv_heads), the packed call gets the kv heads repeated.

cuDNN needs bf16 or fp16 inputs; `auto` picks it on GPU only for those dtypes and uses flash otherwise. Rows with
no visible key give out 0 and lse -inf, as the other kernels do (only masked calls have such rows).
`implementation='xla'` runs the same three calls through jax.nn's XLA implementation and an XLA stand-in for
the packed call (same offsets, lengths and residual layout): CPU tests and benchmarks/gpu_check.py --cpu-check.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxctx.attention.kernels.dot_product import mask_from_positions

MASKED, CAUSAL, PACKED = 0, 1, 2
PATHS = ("masked", "causal", "packed")
# Documents per row the packed call takes (M): its residual is [B * M, H, S] fp32 and its offsets [B, M + 1]; a
# row with more documents takes the masked call.
MAX_DOCUMENTS = 16
_PACKED_ARGUMENTS = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type",
                     "sliding_window_length", "return_residual"}


def document_runs(q_pos, q_seg, kv_pos, kv_seg):
    """(runs, documents[B]): `runs` (a scalar bool) when the queries and keys are the same tokens and every row
    is a series of runs (see the module docstring); `documents` counts each row's runs."""
    same = jnp.all(q_pos == kv_pos) & jnp.all(q_seg == kv_seg)
    stays = q_seg[:, 1:] == q_seg[:, :-1]
    steps = jnp.where(stays, q_pos[:, 1:] - q_pos[:, :-1] == 1, q_seg[:, 1:] > q_seg[:, :-1])
    return same & jnp.all(steps), 1 + jnp.sum(~stays, axis=1)


def choose_path(q_pos, q_seg, kv_pos, kv_seg, max_documents: int = MAX_DOCUMENTS, packed: bool = True):
    """The call (MASKED, CAUSAL or PACKED, an int32 on the device) that is exact for these tokens: causal when
    every row is one document, packed (where `packed`) when every row has at most `max_documents`."""
    runs, documents = document_runs(q_pos, q_seg, kv_pos, kv_seg)
    most = jnp.max(documents)
    path = jnp.where(most == 1, CAUSAL, jnp.where(packed & (most <= max_documents), PACKED, MASKED))
    return jnp.where(runs, path, MASKED).astype(jnp.int32)


def _runs(seg_BS, max_documents: int):
    """(run[B, S], first[B, M + 1]): each token's run of equal segment ids (0, 1, ...) and each run's first
    token (S past a row's last run)."""
    b = seg_BS.shape[0]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg_BS[:, 1:] != seg_BS[:, :-1]], axis=1)
    run_BS = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
    m = jnp.arange(max_documents + 1, dtype=jnp.int32)
    return run_BS, jax.vmap(lambda row: jnp.searchsorted(row, m))(run_BS).astype(jnp.int32)


def packed_layout(seg_BS, max_documents: int):
    """(offsets[B, M + 1], lengths[B, M]) int32 in JAX's packed layout: each run's first token and length, -1 past
    a row's last run. A row with more than M runs is cut (choose_path sends it to the masked call)."""
    run_BS, first = _runs(seg_BS, max_documents)
    m = jnp.arange(max_documents + 1, dtype=jnp.int32)
    documents = run_BS[:, -1:] + 1
    return jnp.where(m < documents, first, -1), jnp.where(m[:-1] < documents, first[:, 1:] - first[:, :-1], -1)


def packed_residual_index(seg_BS, max_documents: int):
    """(sequence[B, S], local[B, S]): where each token's log-sum-exp sits in the packed call's residual
    [B * M, H, S]. cuDNN runs every document as a sequence of its own, numbered over the batch in order (rows'
    unused slots squeezed out, as jax's _fix_seqlen_offsets does), the token at its index in its document."""
    run_BS, first = _runs(seg_BS, max_documents)
    run_BS = jnp.minimum(run_BS, max_documents - 1)
    documents = run_BS[:, -1] + 1
    before = jnp.cumsum(documents) - documents
    local = jnp.arange(seg_BS.shape[1], dtype=jnp.int32) - jnp.take_along_axis(first, run_BS, axis=1)
    return before[:, None] + run_BS, local


def _masked(q, k, v, q_pos, q_seg, kv_pos, kv_seg, *, return_lse, window, implementation):
    mask_BST = mask_from_positions(q_pos, q_seg, kv_pos, kv_seg, window)
    result = jax.nn.dot_product_attention(q, k, v, mask=mask_BST[:, None], implementation=implementation,
                                          return_residual=return_lse)
    out, lse = result if return_lse else (result, None)
    seen_BS = mask_BST.any(-1)
    out = jnp.where(seen_BS[:, :, None, None], out, 0)
    if lse is not None:
        lse_BHS = lse.astype(jnp.float32).transpose(0, 2, 1)  # the residual is laid out [B, S, H]
        lse = jnp.where(seen_BS[:, None, :], lse_BHS, -jnp.inf)
    return out, lse


def _causal(q, k, v, *_, return_lse, window, implementation):
    result = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation,
                                          local_window_size=(window - 1, 0) if window else None,
                                          return_residual=return_lse)
    out, lse = result if return_lse else (result, None)
    return out, None if lse is None else lse.astype(jnp.float32).transpose(0, 2, 1)


def _packed(q, k, v, q_pos, q_seg, *_, return_lse, window, implementation, max_documents):
    offsets, lengths = packed_layout(q_seg, max_documents)
    call = _packed_cudnn if implementation == "cudnn" else _packed_xla
    out, residual = call(q, k, v, offsets, lengths, window=window, return_lse=return_lse)
    if not return_lse:
        return out, None
    sequence, local = packed_residual_index(q_seg, max_documents)
    return out, residual[sequence, :, local].astype(jnp.float32).transpose(0, 2, 1)  # [B, S, H] -> [B, H, S]


def _packed_cudnn(q, k, v, offsets, lengths, *, window, return_lse):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    if k.shape[2] != q.shape[2] and not kv_offsets_follow_kv_heads():
        # This JAX strides the key offsets by the query heads: give it as many kv heads (dk, dv sum back).
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    result = fa.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                                      scale=q.shape[-1] ** -0.5, mask_type=fa.MaskType.PADDING_CAUSAL,
                                      sliding_window_length=window or None, return_residual=return_lse)
    return result if return_lse else (result, None)


def _packed_xla(q, k, v, offsets, lengths, *, window, return_lse):
    """The packed call's stand-in off GPU: documents from the offsets and lengths alone, the residual laid out
    [B * M, H, S] as cuDNN's (see packed_residual_index)."""
    b, s, h, _ = q.shape
    index = jnp.arange(s)
    inside_BMS = (index >= offsets[:, :-1, None]) & (index < (offsets[:, :-1] + lengths)[:, :, None])
    doc_BS = jnp.where(inside_BMS.any(1), jnp.argmax(inside_BMS, axis=1), -1)
    behind = index[:, None] - index[None, :]
    mask = (doc_BS[:, :, None] == doc_BS[:, None, :]) & (doc_BS[:, :, None] >= 0) & (behind >= 0)
    if window:
        mask &= behind < window
    out, lse_BSH = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla",
                                                return_residual=True)
    if not return_lse:
        return out, None
    documents = jnp.sum(lengths >= 0, axis=1)
    doc_BS = jnp.maximum(doc_BS, 0)
    sequence = (jnp.cumsum(documents) - documents)[:, None] + doc_BS
    local = index - jnp.take_along_axis(offsets, doc_BS, axis=1)
    residual = jnp.zeros((b * lengths.shape[1], h, s), jnp.float32)
    return out, residual.at[sequence, :, local].set(lse_BSH.astype(jnp.float32))


@functools.cache
def packed_supported(implementation: str = "cudnn") -> bool:
    """Whether the packed call is there: JAX's private cuDNN entry point with the offsets, lengths and mask type
    it needs, on a Hopper or later GPU (JAX refuses the packed layout before). Off GPU, the XLA stand-in."""
    if implementation != "cudnn":
        return True
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        names = set(inspect.signature(fa.dot_product_attention).parameters)
        return (_PACKED_ARGUMENTS <= names and hasattr(fa.MaskType, "PADDING_CAUSAL")
                and bool(fa.check_compute_capability("9.0")))
    except Exception:  # the private module moved or changed: the masked call
        return False


@functools.cache
def kv_offsets_follow_kv_heads() -> bool:
    """Whether JAX strides the packed key offsets by the kv heads (jax >= 0.11); before, by the query heads, which
    is wrong under GQA. Asked of JAX's own offset fix-up on a two-token example, not of its version."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets

        offsets, lengths = np.array([[0, 1, -1]], np.int32), np.array([[1, 1]], np.int32)
        with jax.ensure_compile_time_eval():  # may be first asked while tracing
            kv_offsets = _fix_seqlen_offsets(lengths, lengths, offsets, offsets, np.zeros((1, 2, 2, 1)),
                                             np.zeros((1, 2, 1, 1)))[3]
        return int(kv_offsets[0, 1]) == 1
    except Exception:
        return False


def compiled_calls(q_shape, kv_len: int, natural: bool, max_documents: int = MAX_DOCUMENTS,
                   implementation: str = "cudnn") -> tuple[int, ...]:
    """The calls a cudnn_attention call compiles (choose_path picks among them on the device): the masked one,
    and where `natural` and the queries and keys are as long, the causal one and, where it is there and its
    offsets fit JAX's int32 element offsets (B S H D < 2^31), the packed one."""
    if not natural or q_shape[1] != kv_len:
        return (MASKED,)
    packed = max_documents > 1 and math.prod(q_shape) < 2 ** 31 and packed_supported(implementation)
    return (MASKED, CAUSAL, PACKED) if packed else (MASKED, CAUSAL)


def cudnn_attention(q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg, return_lse: bool = False,
                    window: int = 0, natural: bool = False, max_documents: int = MAX_DOCUMENTS,
                    implementation: str = "cudnn"):
    """Returns (out[B, S, H, D], lse[B, H, S] fp32 or None). A sliding window (> 0) is part of every call's mask.
    `natural`: the queries and keys are the same sequence in its natural order (the fast calls are compiled and
    chosen on the device); otherwise the masked call alone."""
    options = dict(return_lse=return_lse, window=window, implementation=implementation)
    branches = {MASKED: functools.partial(_masked, **options), CAUSAL: functools.partial(_causal, **options),
                PACKED: functools.partial(_packed, max_documents=max_documents, **options)}
    calls = compiled_calls(q_BSHD.shape, k_BTKD.shape[1], natural, max_documents, implementation)
    args = (q_BSHD, k_BTKD, v_BTKD, q_pos, q_seg, kv_pos, kv_seg)
    if calls == (MASKED,):
        return branches[MASKED](*args)
    path = choose_path(q_pos, q_seg, kv_pos, kv_seg, max_documents, packed=PACKED in calls)
    return jax.lax.switch(path, [branches[c] for c in calls], *args)
