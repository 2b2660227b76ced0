"""What each splash pass holds in on-chip VMEM, as a formula of its blocks, from the kernels' block specs.

Splash (jax.experimental.pallas.ops.tpu.splash_attention) runs one MQA kernel per pass over the G query heads of
a kv head: forward, dQ and dK/dV. Each grid step holds a window of every operand (the block spec's shape), and
Pallas keeps two of each (double buffering, "2 buffering levels" in libtpu's report), so a pass needs

    2 x sum(window bytes) + temporaries

The windows per pass, for query block bq, key block bkv, head_dim D, bf16 (2-byte) inputs; a lane row is 128 x 4
bytes and a sublane tile 8 x 4 bytes per query:

    forward: q, out: bq D 2 each; k, v: bkv D 2 each; accumulator: bq D 4; q segment ids, running max, running
             sum, logsumexp: bq 128 4 each; kv segment ids: 8 bkv 4
    dK/dV:   q, dout: bq D 2 each; k, v, dk, dv: bkv D 2 each; dk and dv accumulators: bkv D 4 each; q segment ids,
             logsumexp, di: 8 bq 4 each; kv segment ids: bkv 128 4
    dQ:      q, dout, dq: bq D 2 each; k, v: bkv D 2 each; dq accumulator: bq D 4; q segment ids: bq 128 4;
             logsumexp, di: bq 4 each (one row); kv segment ids: 8 bkv 4

plus the partial mask: a loaded block is s32 bq bkv (4 bytes per entry: splash takes booleans and the compiled
operand is 32-bit), a computed one (maxctx.attention.kernels.splash_masks) only the query values, bq 128 4 (forward,
dQ) or 8 bq 4 (dK/dV). Temporaries (score and probability tiles of bq x block_kv_compute fp32, and the register
allocator's spill slots) are the compiler's; libtpu's report names them. benchmarks/splash_vmem.md checks the
windows against libtpu's own allocation list, where a compile overflows the chip.
"""

from __future__ import annotations

LANES, SUBLANES, F32 = 128, 8, 4


def windows(kernel_pass: str, bq: int, bkv: int, head_dim: int, stored_mask: bool, itemsize: int = 2) -> dict:
    """Bytes of one buffer of each window `kernel_pass` ("fwd", "dkv" or "dq") holds, by operand name."""
    d = head_dim
    if kernel_pass == "fwd":
        out = {"q": bq * d * itemsize, "k": bkv * d * itemsize, "v": bkv * d * itemsize, "out": bq * d * itemsize,
               "accumulator": bq * d * F32, "q_segment_ids": bq * LANES * F32, "max": bq * LANES * F32,
               "sum": bq * LANES * F32, "logsumexp": bq * LANES * F32, "kv_segment_ids": SUBLANES * bkv * F32}
        query_values = bq * LANES * F32
    elif kernel_pass == "dkv":
        out = {"q": bq * d * itemsize, "dout": bq * d * itemsize, "k": bkv * d * itemsize, "v": bkv * d * itemsize,
               "dk": bkv * d * itemsize, "dv": bkv * d * itemsize, "dk_accumulator": bkv * d * F32,
               "dv_accumulator": bkv * d * F32, "q_segment_ids": SUBLANES * bq * F32,
               "logsumexp": SUBLANES * bq * F32, "di": SUBLANES * bq * F32, "kv_segment_ids": bkv * LANES * F32}
        query_values = SUBLANES * bq * F32
    elif kernel_pass == "dq":
        out = {"q": bq * d * itemsize, "dout": bq * d * itemsize, "dq": bq * d * itemsize, "k": bkv * d * itemsize,
               "v": bkv * d * itemsize, "dq_accumulator": bq * d * F32, "q_segment_ids": bq * LANES * F32,
               "logsumexp": bq * F32, "di": bq * F32, "kv_segment_ids": SUBLANES * bkv * F32}
        query_values = bq * LANES * F32
    else:
        raise ValueError(f"kernel_pass must be fwd, dkv or dq, not {kernel_pass!r}")
    out["mask"] = bq * bkv * F32 if stored_mask else query_values
    return out


def window_bytes(kernel_pass: str, bq: int, bkv: int, head_dim: int, stored_mask: bool, itemsize: int = 2) -> int:
    """What a pass's windows take in VMEM, double-buffered: 2 x sum(windows)."""
    return 2 * sum(windows(kernel_pass, bq, bkv, head_dim, stored_mask, itemsize).values())
