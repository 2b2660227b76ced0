"""Sliding-window (local) layers under context parallelism: a device fetches only the keys its queries can see.

Legend (per device): B batch, S the whole sequence, C devices on the context axes, n = S / C tokens per device,
L chunk length (S / 2C under zig-zag load balance, S / C without), m = n / L chunks per device, W the window,
K kv heads, D head dim, b bytes per element; ids (positions, segment ids) are int32.

Chunk c holds the original tokens [cL, cL + L); with a window W its queries see keys in [cL - W + 1, cL + L), so
besides itself it needs the W tokens before it: for d = 1 .. ceil(W / L) the last min(L, W - (d - 1) L) rows of
chunk c - d (one row more than the window needs, which keeps the key length W + L, a multiple of the kernel's
blocks). Those rows come from the device holding chunk c - d by `ppermute`, or from the device's own chunks, or
are absent (the start of the sequence: segment id -1, hidden). `plan` groups the transfers on the host into rounds
in which every device sends and receives at most one piece: under zig-zag with W <= L that is two rounds (the
left and the right neighbour), without load balance one. Each chunk then attends over its own W + L keys, the
m chunks batched into one kernel call, so a local layer moves

    forward   rounds x rows x (B K (D + Dv) b + 2 B 4)      K/V and ids of the pieces (Dv: v's head dim)
    backward  rounds x rows x B K (D + Dv) b               dK/dV of the pieces back to their owners

whatever C (`comm_volume`), where all_gather moves 2 B S K D b and a ring (R - 1) blocks of S / R tokens.
Every strategy but a2a (whose all-to-all already gives each device whole sequences, where the kernel skips the
blocks outside the band) runs its local layers this way whenever it moves less than gathering would.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

from maxctx.attention.cp.cost import Collective

if TYPE_CHECKING:
    import numpy as np


@dataclasses.dataclass(frozen=True)
class Round:
    """One ppermute: `rows` rows of chunk c - `distance` go from src to dst for each (src, dst) of `perm`;
    `send_slot[device]` is the chunk slot (0 .. m - 1) a sender takes them from."""

    rows: int
    distance: int
    perm: tuple[tuple[int, int], ...]
    send_slot: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class HaloPlan:
    """The transfers of one local layer. `pieces[d - 1]` rows come from distance d; `source[device][slot][d - 1]`
    picks where device's chunk `slot` finds them: index i < len(rounds of d) is the i-th round of that distance,
    then the device's own chunks 0 .. m - 1, then the last index: none (the sequence's start)."""

    devices: int
    chunk: int
    slots: int
    pieces: tuple[int, ...]
    rounds: tuple[Round, ...]
    source: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def halo(self) -> int:
        return sum(self.pieces)

    @property
    def moved_rows(self) -> int:
        """Rows of K/V one device receives (and, in the backward, sends back as dK/dV)."""
        return sum(r.rows for r in self.rounds)

    def rounds_of(self, distance: int) -> list[int]:
        return [i for i, r in enumerate(self.rounds) if r.distance == distance]


def chunk_length(seq: int, devices: int, load_balance) -> int:
    return seq // (2 * devices) if load_balance is True and devices > 1 else seq // devices


def plan(order: np.ndarray, devices: int, window: int, chunk: int) -> HaloPlan:
    """The halo transfers for tokens stored in `order` (original index per stored position; device r holds
    stored positions [r n, (r + 1) n)) cut into chunks of `chunk` consecutive original tokens."""
    import numpy as np  # not at import: the strategies' formulas are read before JAX and NumPy load

    order = np.asarray(order)
    n = len(order) // devices
    m = n // chunk
    starts = order.reshape(devices, m, chunk)
    ids = starts[:, :, 0] // chunk
    if not (starts == ids[:, :, None] * chunk + np.arange(chunk)).all():
        raise ValueError(f"the stored order is not made of aligned chunks of {chunk} tokens")
    held = {int(ids[r, j]): (r, j) for r in range(devices) for j in range(m)}
    pieces = tuple(min(chunk, window - d * chunk) for d in range(math.ceil(window / chunk)))
    rounds: list[dict] = []
    where: dict[tuple[int, int, int], tuple] = {}
    for d, rows in enumerate(pieces, start=1):
        for r in range(devices):
            for j in range(m):
                c = int(ids[r, j]) - d
                if c < 0:
                    where[r, j, d] = ("none",)
                    continue
                src, slot = held[c]
                if src == r:
                    where[r, j, d] = ("own", slot)
                    continue
                found = next((t for t in rounds if t["distance"] == d and src not in t["senders"]
                              and r not in t["receivers"]), None)
                if found is None:
                    found = {"distance": d, "rows": rows, "perm": [], "senders": {}, "receivers": set()}
                    rounds.append(found)
                found["perm"].append((src, r))
                found["senders"][src] = slot
                found["receivers"].add(r)
                where[r, j, d] = ("round", rounds.index(found))
    frozen = tuple(Round(t["rows"], t["distance"], tuple(t["perm"]),
                         tuple(t["senders"].get(r, 0) for r in range(devices))) for t in rounds)
    of_d = {d: [i for i, t in enumerate(frozen) if t.distance == d] for d in range(1, len(pieces) + 1)}

    def option(kind: tuple, d: int) -> int:  # index into [rounds of distance d] + [own chunks] + [none]
        return (of_d[d].index(kind[1]) if kind[0] == "round" else
                len(of_d[d]) + kind[1] if kind[0] == "own" else len(of_d[d]) + m)

    source = tuple(tuple(tuple(option(where[r, j, d], d) for d in of_d) for j in range(m)) for r in range(devices))
    return HaloPlan(devices, chunk, m, pieces, frozen, source)


@functools.lru_cache(maxsize=64)  # the planner prices each shape at every remat placement
def layout_plan(seq: int, devices: int, load_balance: bool, window: int) -> HaloPlan | None:
    """The plan for `devices` devices holding the sequence in maxctx's stored order, or None when the window
    covers the sequence or a halo would move as much as gathering every key (then the strategy's global path,
    with the window in its kernel's mask, is used)."""
    import numpy as np

    from maxctx.attention.cp.load_balance import zigzag_permutation

    if window <= 0 or window >= seq or devices <= 1 or load_balance == "documents":
        return None  # documents: the stored order changes with every batch (the strategy's path masks from ids)
    order = zigzag_permutation(seq, devices) if load_balance else np.arange(seq)
    p = plan(order, devices, window, chunk_length(seq, devices, load_balance))
    return p if p.moved_rows < seq - seq // devices else None


def shape_plan(s) -> HaloPlan | None:
    """`layout_plan` for an AttentionShape (the strategies' formulas)."""
    return layout_plan(s.seq, s.cp, s.load_balance, s.window)


def comm_volume(p: HaloPlan, batch: float, kv_heads: int, kv_width: int, itemsize: int):
    """(forward, backward) collective-permute bytes of a local layer on one device (see the module docstring);
    kv_width = D + Dv."""
    rows = p.moved_rows
    kv = batch * rows * kv_heads * kv_width * itemsize
    return ([Collective("collective-permute", kv + 2 * batch * rows * 4, p.devices)],
            [Collective("collective-permute", kv, p.devices)])


def local_attention(p: HaloPlan, local, axis, q, k, v, pos, seg, sinks_H=None):
    """Attention of a local layer inside shard_map over `axis`: q[B, n, H, Dk], k[B, n, K, Dk], v[B, n, K, Dv],
    pos/seg[B, n]; `local` a LocalKernel with the window, for chunk queries against their W + L keys. Returns
    out[B, n, H, Dv]."""
    import jax
    import jax.numpy as jnp

    from maxctx.attention.cp.sharded import join_kv, split_kv
    from maxctx.attention.kernels.sinks import attend as sink_attend

    me = jax.lax.axis_index(axis)
    b, n = q.shape[:2]
    m, L = p.slots, p.chunk
    dk, dv = k.shape[-1], v.shape[-1]
    kv = join_kv(k, v)  # [2, B, n, K, D] or [B, n, K, Dk + Dv]: one permute for K/V, one for the ids, per round
    kv = kv if dk == dv else kv[None]
    parts = kv.shape[0]
    ids = jnp.stack([pos, seg])
    received = []
    for rnd in p.rounds:
        start = jnp.asarray(rnd.send_slot, jnp.int32)[me] * L + (L - rnd.rows)
        received.append(tuple(jax.lax.ppermute(jax.lax.dynamic_slice_in_dim(x, start, rnd.rows, axis=2), axis,
                                                list(rnd.perm)) for x in (kv, ids)))
    kv_c = kv.reshape(parts, b, m, L, *kv.shape[3:])
    ids_c = ids.reshape(2, b, m, L)
    table = jnp.asarray(p.source, jnp.int32)[me]  # [m, pieces]
    halo_kv, halo_ids = [], []
    for d, rows in enumerate(p.pieces, start=1):
        from_rounds = [received[i] for i in p.rounds_of(d)]
        kv_options = ([x for x, _ in from_rounds] + [kv_c[:, :, j, L - rows:] for j in range(m)]
                      + [jnp.zeros_like(kv_c[:, :, 0, :rows])])
        none_ids = jnp.stack([jnp.zeros((b, rows), ids.dtype), jnp.full((b, rows), -1, ids.dtype)])
        id_options = [x for _, x in from_rounds] + [ids_c[:, :, j, L - rows:] for j in range(m)] + [none_ids]
        halo_kv.append(jnp.take(jnp.stack(kv_options), table[:, d - 1], axis=0))  # [m, parts, B, rows, K, .]
        halo_ids.append(jnp.take(jnp.stack(id_options), table[:, d - 1], axis=0))
    # Each chunk's keys in original order: the farthest piece first, the chunk itself last.
    own_kv = jnp.moveaxis(kv_c, 2, 0)
    own_ids = jnp.moveaxis(ids_c, 2, 0)
    keys = jnp.concatenate(halo_kv[::-1] + [own_kv], axis=3)  # [m, parts, B, W + L, K, .]
    keys_k, keys_v = (keys[:, 0], keys[:, 1]) if parts == 2 else split_kv(keys[:, 0], dk, dv)
    key_ids = jnp.concatenate(halo_ids[::-1] + [own_ids], axis=3)  # [m, 2, B, W + L]

    def fold(x):  # [m, B, ...] -> [m B, ...]
        return x.reshape(m * b, *x.shape[2:])

    q_c = q.reshape(b, m, L, *q.shape[2:]).swapaxes(0, 1)
    ids_q = ids_c.swapaxes(1, 2).swapaxes(0, 1)  # [m, 2, B, L]
    out = sink_attend(local, 0, fold(q_c), fold(keys_k), fold(keys_v), fold(ids_q[:, 0]), fold(ids_q[:, 1]),
                      fold(key_ids[:, 0]), fold(key_ids[:, 1]), sinks_H)
    return out.reshape(m, b, L, *out.shape[2:]).swapaxes(0, 1).reshape(*q.shape[:3], v.shape[-1])


def attend(q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, mesh, spec, sinks_H=None):
    """A local layer over the context axes by halo exchange (any strategy's token layout but a2a's), or None when
    `layout_plan` says the strategy's own path moves no more. `spec`: as a strategy's attend takes it
    (maxctx.attention.cp.base)."""
    from maxctx.attention.cp.sharded import CONTEXT, context_shard_map
    from maxctx.attention.kernels.local import make_band
    from maxctx.parallelism import mesh_context_degree

    cp = mesh_context_degree(mesh.shape)
    seq = q_BSHD.shape[1]
    p = layout_plan(seq, cp, spec.load_balance, spec.window)
    if p is None:
        return None
    local = make_band(spec.kernel, spec.block_q, spec.block_kv, mesh=mesh, chunk=p.chunk, halo=p.halo,
                      window=spec.window, group=q_BSHD.shape[2] // k_BSKD.shape[2], splash_blocks=spec.splash_blocks,
                      softcap=spec.logit_softcap, residuals=sinks_H is not None)

    def body(q, k, v, pos, seg, sinks):
        return local_attention(p, local, CONTEXT, q, k, v, pos, seg, sinks)

    return context_shard_map(body, mesh, q_BSHD, k_BSKD, v_BSKD, positions_BS, segment_ids_BS, sinks_H)
