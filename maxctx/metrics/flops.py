"""Model FLOPs per training step, in MaxText's convention, and the throughput / MFU numbers derived from them.

Dimensions: B sequences per optimiser step, S sequence length, D model, H query heads, K kv heads, Dh head dim,
F mlp, V vocab, L layers.

    P_matmul  = L * (D*Dh*(2H + 2K) + 3*D*F) + D*V          # weights a token meets in matmuls (maxctx.model.shape)
    matmul    = 6 * P_matmul * B * S                        # 2 FLOPs per MAC, x3 for forward + backward
    attention = 12 * L * H * Dh * A                         # QK^T and PV: 4*H*Dh per (query, key) pair, x3
    A         = B * S^2 / 2                                 # causal pairs (MaxText's halving)
              = sum over rows and documents of n(n+1)/2     # with segment ids: the true area of packed documents
    A_local   = B * (S W - W^2 / 2)                         # a sliding-window layer (W < S): the band
              = sum of W(W+1)/2 + (n - W) W per document    # with segment ids (n(n+1)/2 when n <= W)
    attention = 12 * H * Dh * (sum of A over the layers)     # each layer with its own window
    total     = matmul + attention

Counted: the Q/K/V/O projections, the SwiGLU MLP, the unembedding (also when it reuses the embedding table);
not counted: the embedding lookup (a gather), norms, RoPE, softmax, the loss and the optimiser, which are small
next to the matmuls. Rematerialisation is not counted either: MFU counts the FLOPs the model needs, not the
recompute a remat policy adds, so changing `remat_policy` changes the step time and not the FLOP count (XLA's
`cost_analysis()` does count recompute; compare against it with `remat_policy=none`). Likewise a kernel that
computes the masked upper triangle (the dense `dot_product` reference) does up to 2x the attention FLOPs counted
here; only the causal half is model work.
"""

from __future__ import annotations

import numpy as np

from maxctx.config import Config, layer_windows
from maxctx.model import families


def attention_pairs(global_batch: int, seq_len: int, *, segment_ids: np.ndarray | None = None,
                    causal: bool = True, window: int = 0) -> float:
    """(query, key) pairs attended per layer and head, summed over the batch: A above.

    Without segment ids: B*S^2/2 causal (MaxText's convention, diagonal not added), B*S^2 otherwise. With segment
    ids [B, S] (0 marks padding, which is not counted), each document of n tokens in a row adds n(n+1)/2 causal
    pairs (n^2 otherwise); counts per id, so any token order (e.g. the load-balanced zig-zag) gives the same area.
    A sliding window W > 0 (causal only) counts the band: S W - W^2 / 2 per row, or per document of n > W tokens
    W(W+1)/2 + (n - W) W.
    """
    if segment_ids is None:
        if causal and 0 < window < seq_len:
            return float(global_batch) * (seq_len * window - window * window / 2)
        full = float(global_batch) * seq_len * seq_len
        return full / 2 if causal else full
    ids = np.asarray(segment_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise ValueError(f"segment_ids must be [batch, seq], got shape {ids.shape}")
    # Tokens per (row, document): one bincount over ids made unique across rows; linear in B*S.
    rows = np.arange(ids.shape[0], dtype=np.int64)[:, None] * (int(ids.max(initial=0)) + 1)
    counts = np.bincount((ids + rows)[ids != 0]).astype(np.float64)
    if causal and window > 0:
        inside = np.minimum(counts, window)
        return float(np.sum(inside * (inside + 1) / 2 + (counts - inside) * window))
    return float(np.sum(counts * (counts + 1) / 2 if causal else counts * counts))


def document_pairs(positions, segment_ids, config: Config, xp=np):
    """(query, key) pairs the batch's documents need, summed over the layers: each non-padding query at position p
    of its document sees p + 1 keys (min(p + 1, W) in a layer of window W). The same A as `attention_pairs` with
    segment ids, from the positions, so the train step computes it on the device (`xp` jax.numpy) in any token
    order; with the step's batch it is the `needed` work of `needed_flops`."""
    windows = layer_windows(config)
    seen = (xp.asarray(positions) + 1).astype(xp.float32)
    real = xp.asarray(segment_ids) != 0
    total = sum(xp.sum(xp.where(real, xp.minimum(seen, w) if w else seen, 0.0)) for w in windows)
    return total * (families.shape(config).num_layers / len(windows))


def needed_flops(config: Config, tokens: float, pairs: float) -> float:
    """Model FLOPs of a step of `tokens` tokens whose documents need `pairs` attention pairs over all layers
    (`document_pairs`): the matmuls as in `training_flops_per_step`, attention by the documents' own area. The
    MFU from it (the progress line's `needed`) says how busy the chips are with the work the data asks for; the
    MFU from `training_flops_per_step` (causal S^2/2 per row, MaxText's convention) is the comparable one."""
    shape = families.shape(config)
    return shape.matmul_flops(tokens) + shape.attention_flops(pairs)


def training_flops_per_step(config: Config, global_batch: int, seq_len: int, *,
                            segment_ids: np.ndarray | None = None) -> float:
    """Model FLOPs of one optimiser step of the whole job (forward + backward), the `total` in the module doc.

    global_batch: sequences per optimiser step over all devices (times gradient_accumulation_steps when
    accumulating). segment_ids: optionally the step's [B, S] segment ids, to count packed documents by their true
    attention area instead of B*S^2/2. Remat recompute is not counted (MFU counts model FLOPs).
    """
    shape = families.shape(config)
    windows = layer_windows(config)  # one group of layers; the pattern repeats L / len(windows) times
    pairs = sum(attention_pairs(global_batch, seq_len, segment_ids=segment_ids, window=w) for w in windows)
    pairs *= shape.num_layers / len(windows)
    return shape.matmul_flops(global_batch * seq_len) + shape.attention_flops(pairs)


def training_flops_per_device(config: Config, global_batch: int, seq_len: int, num_devices: int, *,
                              segment_ids: np.ndarray | None = None) -> float:
    """`training_flops_per_step` split evenly over all devices of the job (MaxText's TFLOPs per device).

    Every parallelism (data, fsdp, context, tensor) divides the same work, so a CP rank is not counted twice.
    """
    return training_flops_per_step(config, global_batch, seq_len, segment_ids=segment_ids) / num_devices


def throughput(step_time_s: float, *, tokens_per_step: int, flops_per_step: float, num_devices: int,
               peak_flops_per_device: float) -> dict[str, float]:
    """Throughput numbers for one step (or a mean step) taking `step_time_s` seconds.

    tokens_per_step counts positions processed, B*S (MaxText's tokens/s; padding included), not loss weights.
    Returns step_time_s, tokens_per_s (global), per_device_tokens_per_sec, per_device_tflops_per_sec and
    mfu = (flops_per_step / num_devices / step_time) / peak_flops_per_device.
    """
    flops_per_s_device = flops_per_step / num_devices / step_time_s
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_step / step_time_s,
        "per_device_tokens_per_sec": tokens_per_step / num_devices / step_time_s,
        "per_device_tflops_per_sec": flops_per_s_device / 1e12,
        "mfu": flops_per_s_device / peak_flops_per_device,
    }
