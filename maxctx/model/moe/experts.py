"""What the experts' layout costs: the expert strategies as formulas (no JAX), the way maxctx.attention.cp.cost
states a CP strategy's. `gathered` (expert_parallelism=1, maxctx.model.moe.layers.gathered): every expert-block
parameter sharded over the devices experts borrow (fsdp and the context axes, maxctx.parallelism.EXPERT_AXES) is
gathered once per layer by an explicit all-gather into one copy per device, and its gradient leaves the layer by
the gather's transpose, one reduce-scatter; the tokens never move. MaxText's Ironwood MoE recipes shard experts the
same way (FSDP-style) rather than run expert parallelism. Expert parallelism of degree E
(maxctx.model.moe.dispatch): each EP rank gathers its X / E experts only (`comm_volume` with `degree`; the router
and what the combine reads whole, ExpertParam.spread), and the tokens move by one of the exchanges
(`dispatch_volume`).

Legend (per MoE layer and device): X experts, D model width, M an expert's width, T tensor parallelism (M split
over it), G the devices a parameter is gathered from, b bytes per number as gathered (the compute dtype for the
matrices and the router, the parameter's own for GPT-OSS's biases).

    forward      all-gather      W = sum over the gathered parameters of their whole size / T (where M is split) x b
    backward     reduce-scatter  W (the gradients, in the same dtype), and the all-gather again when the layer's
                                 forward runs again in the backward (remat: `forward_passes` = 2)
    transient    the copies W while the layer runs (4 / b times more with mlp_sequence_chunks > 1: fp32 copies, so
                 that the chunks' gradients add up in fp32), and their gradient W in the backward
    activation   W kept for the backward when the layer is not rematerialised (one forward)

A collective's bytes are per device as maxctx.attention.cp.cost counts them (the all-gather's result, the
reduce-scatter's operand); a parameter gathered from one device (G = 1) has none. tests/test_expert_comm.py checks
these against the compiled HLO. The load-balancing sums add over the devices in an all-reduce of O(X) numbers,
whatever the sequence length (not counted here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from maxctx.attention.cp.cost import Collective
from maxctx.parallelism import TENSOR_AXIS, resolve_axes


@dataclasses.dataclass(frozen=True)
class ExpertParam:
    """One expert-block parameter the strategy gathers: its whole shape, logical axes and bytes per number as
    gathered."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int
    spread: bool = True  # expert parallelism splits its experts over the EP ranks (else gathered whole)

    def gathered_bytes(self, sizes: Mapping[str, int], degree: int = 1) -> float:
        """Bytes of one device's copy: the whole parameter, less the tensor split (and an expert-parallel
        `degree`'s split of an expert dimension)."""
        split = resolve_axes(self.axes, self.shape, sizes)
        tensor = math.prod(sizes[a] for dim in split for a in dim if a == TENSOR_AXIS)
        return math.prod(self.shape) / tensor / self._ep(degree) * self.itemsize

    def group(self, sizes: Mapping[str, int], degree: int = 1) -> int:
        """Devices the parameter is gathered from."""
        split = resolve_axes(self.axes, self.shape, sizes)
        return math.prod(sizes[a] for dim in split for a in dim if a != TENSOR_AXIS) // self._ep(degree)

    def _ep(self, degree: int) -> int:
        return degree if self.spread else 1


def routed_params(experts: int, emb_dim: int, mlp_dim: int, itemsize: int) -> tuple[ExpertParam, ...]:
    """maxctx.model.moe.layers.MoeBlock's: the router [D, X] and w_gate, w_up [X, D, M], w_down [X, M, D]."""
    x, d, m = experts, emb_dim, mlp_dim
    return (ExpertParam((d, x), ("embed", "expert"), itemsize, spread=False),
            ExpertParam((x, d, m), ("expert", "embed", "mlp"), itemsize),
            ExpertParam((x, d, m), ("expert", "embed", "mlp"), itemsize),
            ExpertParam((x, m, d), ("expert", "mlp", "embed"), itemsize))


def comm_volume(params: tuple[ExpertParam, ...], sizes: Mapping[str, int],
                forward_passes: int = 1, degree: int = 1) -> tuple[list[Collective], list[Collective]]:
    """(forward, backward) collectives of one MoE layer's weights per device (module doc); `sizes`: the mesh axes'
    sizes; `degree`: expert parallelism's (each EP rank gathers its experts only; `dispatch_volume` moves the
    tokens)."""
    gathers = [Collective("all-gather", p.gathered_bytes(sizes, degree), p.group(sizes, degree)) for p in params
               if p.group(sizes, degree) > 1]
    scatters = [Collective("reduce-scatter", c.bytes, c.group) for c in gathers]
    return gathers, scatters + gathers * (forward_passes - 1)


def dispatch_volume(pairs: int, emb_dim: int, itemsize: int, experts: int, degree: int, dispatch: str,
                    chunks: int = 1, forward_passes: int = 1) -> tuple[list[Collective], list[Collective]]:
    """(forward, backward) token exchanges of one MoE layer per device under expert parallelism of `degree` E
    (maxctx.model.moe.dispatch), R = `pairs` (the device's tokens x k, over its `chunks` chunks), D = `emb_dim`:

        padded  forward  all-to-all [E R, D] there and back, and the rows' experts [E R] int32
                backward the two [E R, D] all-to-alls transposed
        ragged  forward  ragged all-to-all of R rows there and back (counted as maxctx.plan.program counts it:
                         the smaller of operand and output, R D b, what a device sends when the routing is
                         balanced), and an all-gather of every device's counts [E, X] int32 per chunk
                backward the two ragged all-to-alls transposed

    With the layer's forward run again in the backward (`forward_passes` = 2: remat, or mlp_sequence_chunks > 1,
    whose chunks maxctx.model.tiling rematerialises) the forward's exchanges come again."""
    rows = pairs * itemsize * emb_dim
    if dispatch == "padded":
        there = [Collective("all-to-all", degree * rows, degree)] * 2
        forward = [*there, Collective("all-to-all", degree * pairs * 4, degree)]
    else:
        there = [Collective("ragged-all-to-all", rows, degree)] * 2
        forward = [*there, Collective("all-gather", chunks * degree * experts * 4, degree)]
    return forward, there + forward * (forward_passes - 1)


def transient_bytes(params: tuple[ExpertParam, ...], sizes: Mapping[str, int], chunked: bool) -> float:
    """The copies while the layer runs (fp32 when chunked) and their gradient in the backward."""
    copies = sum(p.gathered_bytes(sizes) * (4 / p.itemsize if chunked else 1) for p in params)
    return copies + sum(p.gathered_bytes(sizes) for p in params)


def activation_bytes(params: tuple[ExpertParam, ...], sizes: Mapping[str, int], forward_passes: int) -> float:
    """The copies kept for the backward: none when the layer's forward runs again there."""
    return 0.0 if forward_passes > 1 else sum(p.gathered_bytes(sizes) for p in params)


def gpt_oss_params(experts: int, emb_dim: int, mlp_dim: int, itemsize: int,
                   bias_itemsize: int) -> tuple[ExpertParam, ...]:
    """maxctx.model.gpt_oss.layers.GptOssExperts': the router [D, X] and its bias [X], w_gate_up [X, D, M, 2],
    w_down [X, M, D], and the experts' biases b_gate_up [X, M, 2], b_down [X, D] in their own dtype (the router,
    its bias and b_down, which the combine reads, gathered whole under expert parallelism)."""
    x, d, m = experts, emb_dim, mlp_dim
    return (ExpertParam((d, x), ("embed", "expert"), itemsize, spread=False),
            ExpertParam((x, d, m, 2), ("expert", "embed", "mlp", None), itemsize),
            ExpertParam((x, m, d), ("expert", "mlp", "embed"), itemsize),
            ExpertParam((x,), ("expert",), bias_itemsize, spread=False),
            ExpertParam((x, m, 2), ("expert", "mlp", None), bias_itemsize),
            ExpertParam((x, d), ("expert", "embed"), bias_itemsize, spread=False))
