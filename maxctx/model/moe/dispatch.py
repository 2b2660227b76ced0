"""Expert parallelism (`expert_parallelism` E > 1): each device keeps X / E whole experts and the (token, slot)
pairs travel to them by all-to-all, instead of every device gathering every expert (`gathered`,
maxctx.model.moe.layers). The E devices are the leading mesh axes of the experts' dimension (fsdp, then the context
axes: maxctx.parallelism.EXPERT_AXES) whose sizes multiply to E (maxctx.parallelism.ep_axes); the experts' other
axes still gather, so each device holds experts [e X / E, (e + 1) X / E) of its EP rank e, and the stored layout
(and so every checkpoint) is the same at any E.

Legend (per device, one chunk): T tokens, k experts per token, R = T k pairs, X experts, L = X / E local experts,
D model width.

    route       the R pairs sorted by expert (global id); destination rank = expert // L
    dispatch    the sorted rows to their ranks: each rank receives up to E R rows (a dropless worst case: every
                pair of every device may choose one rank), with each row's local expert
    experts     the received rows sorted by local expert, one grouped matmul per weight over L groups
    return      the outputs back to the rows' senders by the reverse exchange, unsorted, combined over k

Two exchanges (`expert_dispatch`):
    padded  jax.lax.all_to_all of an [E, R, D] buffer (each destination's rows at the front of its R slots) and the
            rows' local experts [E, R]: every platform, E R D numbers each way whatever the routing
    ragged  jax.lax.ragged_all_to_all of the sorted rows [R, D], offsets from an all-gather of every device's
            per-expert counts [E, X]: only the routed rows move (R D each way when balanced). XLA:CPU has no
            ragged all-to-all (jax 0.10.2: UNIMPLEMENTED), so on CPU `emulated_ragged_all_to_all` runs its
            documented semantics from all-gathers (E times the bytes): the offsets' arithmetic is tested there,
            and the step with the real collective compiles for TPU.
    auto    ragged on TPU and GPU, padded on CPU

No pair is dropped: the receive buffer holds E R rows (E times the gathered strategy's [R, D] buffers; tile the
sequence with mlp_sequence_chunks to bound it). The gradients take the exchanges' transposes (the same collectives
in reverse); the experts' gradients stay on their EP rank, reduce-scattered over the axes that still gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxctx.errors import ConfigError


def resolve(name: str, platform: str) -> str:
    """`auto` -> ragged on TPU and GPU, padded on CPU."""
    if name != "auto" and name not in EXCHANGES:
        raise ConfigError(f"expert_dispatch='{name}' is not one of auto, {', '.join(EXCHANGES)}")
    if name == "auto":
        return "padded" if platform == "cpu" else "ragged"
    return name


def exchange_for(platform: str):
    """The ragged all-to-all a platform runs: XLA's, or the all-gather emulation on CPU."""
    return emulated_ragged_all_to_all if platform == "cpu" else jax.lax.ragged_all_to_all


def dispatched_swiglu(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, glu=None, gate_up_bias=None, *,
                      axes: tuple[str, ...], dispatch: str, platform: str, matmul=jax.lax.ragged_dot):
    """maxctx.model.moe.layers.grouped_swiglu with the experts spread over the EP ranks of mesh `axes` (inside a
    shard_map): w_gate, w_up [L, D, M], w_down [L, M, D] (and the hook's biases [L, M]) this rank's experts;
    `dispatch` padded or ragged; `glu`, `gate_up_bias` grouped_swiglu's hooks (GPT-OSS)."""
    t, k = experts_TK.shape
    local = w_gate.shape[0]
    degree = jax.lax.axis_size(axes)
    flat = experts_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair (token t, slot j) is entry t k + j
    experts = jnp.take(flat, order)
    xs = jnp.take(x_TD, order // k, axis=0)  # [R, D], grouped by expert and so by destination rank
    counts = jnp.bincount(flat, length=local * degree).astype(jnp.int32)
    run = functools.partial(_local_experts, w_gate=w_gate, w_up=w_up, w_down=w_down, matmul=matmul, glu=glu,
                            gate_up_bias=gate_up_bias)
    ys = EXCHANGES[dispatch](xs, experts, counts, axes, degree, run, platform)
    y_TKD = jnp.take(ys, jnp.argsort(order), axis=0).reshape(t, k, -1)
    return jnp.einsum("TKD,TK->TD", y_TKD, weights_TK.astype(ys.dtype), preferred_element_type=jnp.float32)


def _local_experts(rows, ids, *, w_gate, w_up, w_down, matmul, glu, gate_up_bias):
    """This rank's SwiGLU experts over received rows [N, D] whose local expert is ids[N] (L: an empty slot, whose
    output is 0)."""
    local = w_gate.shape[0]
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)
    xs = jnp.take(rows, order, axis=0)
    row_experts = jnp.take(ids, order)
    gate = checkpoint_name(matmul(xs, w_gate, sizes), "mlpwi")
    up = checkpoint_name(matmul(xs, w_up, sizes), "mlpwi")
    if gate_up_bias is not None:  # an empty slot takes no bias, nor gives its (unwritten) rows' gradient to one
        gate, up = (h + jnp.take(b.astype(h.dtype), row_experts, axis=0, mode="fill", fill_value=0)
                    for h, b in zip((gate, up), gate_up_bias))
    ys = matmul(glu(gate, up) if glu is not None else jax.nn.silu(gate) * up, w_down, sizes)
    ys = jnp.where((row_experts < local)[:, None], ys, jnp.zeros((), ys.dtype))
    return jnp.take(ys, jnp.argsort(order), axis=0)


def _padded(xs, experts, counts, axes, degree: int, run, platform: str):
    """The sorted rows xs[R, D] (global experts `experts` [R]) through an [E, R, D] all-to-all and back."""
    del platform  # every platform's
    rows, width = xs.shape
    local = counts.shape[0] // degree
    send = counts.reshape(degree, local).sum(axis=1)
    dest = experts // local
    slot = dest * rows + jnp.arange(rows) - (jnp.cumsum(send) - send)[dest]  # row's place in its rank's R slots
    buffer = jnp.zeros((degree * rows, width), xs.dtype).at[slot].set(xs)
    ids = jnp.full((degree * rows,), local, jnp.int32).at[slot].set(experts % local)
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axes, split_axis=0, concat_axis=0, tiled=True)
    out = run(a2a(buffer), a2a(ids))
    return jnp.take(a2a(out), slot, axis=0)


def _exclusive(v, axis=-1):
    return jnp.cumsum(v, axis=axis) - v


def _ragged(xs, experts, counts, axes, degree: int, run, platform: str):
    """The sorted rows xs[R, D] to their ranks by a ragged all-to-all (the platform's: `exchange_for`) into an
    [E R, D] buffer, and back into [R, D]."""
    del experts  # the counts place the rows
    exchange = exchange_for(platform)
    rows, width = xs.shape
    local = counts.shape[0] // degree
    me = jax.lax.axis_index(axes)
    every = jax.lax.all_gather(counts, axes).reshape(degree, degree, local)  # [sender, rank, local expert]
    pairs = every.sum(axis=-1)  # rows sender -> rank
    send, recv = pairs[me], pairs[:, me]
    lands = _exclusive(pairs, axis=0)[me]  # where this device's rows start in each rank's buffer
    buffer = exchange(xs, jnp.zeros((degree * rows, width), xs.dtype), _exclusive(send), send, lands, recv,
                      axis_name=axes)
    # The buffer holds each sender's rows in turn, each sorted by this rank's experts.
    ends = jnp.cumsum(every[:, me, :].reshape(-1))
    group = jnp.searchsorted(ends, jnp.arange(degree * rows), side="right")
    ids = jnp.where(group < degree * local, group % local, local).astype(jnp.int32)
    out = run(buffer, ids)
    back = _exclusive(pairs, axis=1)[:, me]  # where each sender's rows to this rank start in its own rows
    return exchange(out, jnp.zeros((rows, width), out.dtype), _exclusive(recv), recv, back, send, axis_name=axes)


# The exchanges by `expert_dispatch` name (their bytes: maxctx.model.moe.experts.dispatch_volume).
EXCHANGES = {"padded": _padded, "ragged": _ragged}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all's semantics (one slice per rank) from all-gathers, for XLA:CPU, which has no
    ragged all-to-all: rank i's slice operand_i[input_offsets_i[me] :][: send_sizes_i[me]] lands at
    output[output_offsets_i[me] :]; the rest of `output` stays. `recv_sizes` is implied by the senders' sizes."""
    del recv_sizes
    operands = jax.lax.all_gather(operand, axis_name)  # [E, N, ...]
    starts, sizes, lands = (jax.lax.all_gather(v, axis_name) for v in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    lo, n, src = lands[:, me][:, None], sizes[:, me][:, None], starts[:, me][:, None]
    hit = (rows >= lo) & (rows < lo + n)  # [E, rows]: sender i writes row r
    sender = jnp.argmax(hit, axis=0)
    source = jnp.clip(jnp.take_along_axis(src - lo + rows, sender[None], axis=0)[0], 0, operand.shape[0] - 1)
    values = operands[sender, source]
    mask = jnp.any(hit, axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, values, output)


def local_experts(num_experts: int, degree: int) -> int:
    """L = X / E, refusing an E that does not divide X."""
    if num_experts % degree:
        raise ConfigError(f"expert_parallelism={degree} does not divide num_experts={num_experts}: each EP rank "
                          f"holds whole experts; choose a divisor of {num_experts}")
    return num_experts // degree

