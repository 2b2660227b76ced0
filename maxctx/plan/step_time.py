"""The one step-time model: the seconds one training step takes per device, term by term, for the planner
(`context_parallel_strategy=auto`), `python -m maxctx.compile` and benchmarks/step_time_model.py. An ESTIMATE,
calibrated on MaxText's measured v5p rows (docs/step_time_model.md: the sources, the fit, the error on each row).

    step = matmul + attention + recompute + memory + exposed collectives + exposed host transfers

    matmul       the weight matmuls' model FLOPs (6 P_matmul t; maxctx.metrics' count, the same as MaxText's
                 calculate_tflops_training_per_device) at XLA_MATMUL_EFFICIENCY of the peak, and a strategy's
                 rebuild of K and V from what it moved (rebuild_flops: MLA's latent under latent_all_gather)
    attention    the attention's FLOPs (12 H Dh per visible query-key pair per layer) at the kernel's efficiency:
                 splash per block size (SPLASH_EFFICIENCY), the blockwise JAX kernel BLOCKWISE_EFFICIENCY; then
                 splash's exps (splash_exps per pair and query head) at the chip's transcendental rate
                 (topology.Chip.transcendentals_per_s, libtpu's cost model), in series with its matmuls. Which
                 pairs: causal S / 2 keys per query (MaxText's count, and the MFU's) for one document per row; with
                 planner_document_lengths, the rows' documents' own pairs (each query sees its position + 1 keys)
                 times the busiest context rank's share of them over the mean under the configured
                 context_parallel_load_balance (maxctx.plan.documents: the kernels skip blocks with no shared document;
                 the zig-zag does not balance documents of mixed lengths)
    recompute    what the backward runs again: the forward of each projection whose output is recomputed (every one
                 under remat_policy=full, the `remat` ones under custom; the output projection once more with
                 num_vocab_tiling > 1, the MLP once more with mlp_sequence_chunks > 1 under remat, and every
                 projection once more with decoder_layer_input_stride > 1) at the matmul efficiency, and
                 (attention forwards per layer - 1) attention forwards, each RECOMPUTE_ATTENTION times a forward's
                 share of the attention term. Forwards per layer: the
                 compiled program's count when given (maxctx.plan.program), else the policy's (1 when
                 remat_policy=none, or `context` is kept on the device or the host and the ring carries it:
                 _keeps_attention; else 2, and 3 with decoder_layer_input_stride > 1)
    memory       bytes every step moves through HBM (maxctx.plan.roofline.traffic: weights, optimizer state, the
                 layers' matmul operands and results per pass, logits) at the HBM bandwidth; they stream beside
                 the matmuls that read and write them, so only what exceeds the matmuls' time (recompute
                 included) is counted (a roofline's overlap)
    collectives  the CP strategy's per layer, exposed as exposed_per_layer says (a ring hop overlaps the attention
                 of the block it carries, at the attention's calibrated rate; all-gather, reduce-scatter and
                 all-to-all wait), and the weights' gathers, gradients' reductions and tensor-parallel traffic
                 (roofline.traffic's ICI and DCN bytes), which XLA runs asynchronously beside the layers' compute:
                 exposed by what exceeds that compute; expert parallelism's token exchanges, exposed in full
                 (expert_dispatch_seconds). A hybrid family's linear layers (ModelShape.attention_layers
                 fewer than its layers) have the prefix scan's instead: linear_exchange_s, exposed in full; their
                 delta rule's FLOPs (ModelShape.linear_flops) join the matmul term at its rate
    host         bytes to and from pinned host memory (the compiled program's when given, else the offloaded
                 tensors' shapes x layers, each way) at HOST_BYTES_PER_S per chip each way (shared by its devices),
                 as asynchronous copies: to the host during the forward, back during the backward; exposed by what
                 one way's time exceeds the forward's compute (a third of the step's)

Latency of collectives and ring hops (ICI_LATENCY_S, DCN_LATENCY_S) and DCN bandwidth where Google gives none are
assumptions. Not modelled: input pipeline, host overheads; load imbalance only from planner_document_lengths.
"""

from __future__ import annotations

import dataclasses
import math

from maxctx.attention.cp import strategies
from maxctx.attention.cp.cost import AttentionShape, Collective, replicated_kv_heads
from maxctx.config import REMAT_NAMES, Config, layer_windows
from maxctx.model import families
from maxctx.parallelism import RING_AXIS, TENSOR_AXIS, MeshPlan, expert_parallel_axes, mesh_context_degree
from maxctx.plan import topology
from maxctx.plan.documents import attention_pairs_per_token, causal_keys
from maxctx.plan.hardware import (  # noqa: F401  (the device and the collectives' timing, named here for readers)
    CUDNN_EFFICIENCY,
    DCN_BYTES_PER_S,
    DCN_LATENCY_S,
    GPU_HOST_BYTES_PER_S,
    GPU_MATMUL_EFFICIENCY,
    HOST_BYTES_PER_S,
    ICI_LATENCY_S,
    Hardware,
    _collective_s,
    hardware,
)
from maxctx.plan.roofline import attention_shape, dispatch_exchanges, traffic

GIB = 1024 ** 3
# Calibrated on MaxText's measured v5p-128 rows (benchmarks/step_time_model.py --fit; docs/step_time_model.md).
XLA_MATMUL_EFFICIENCY = 0.875  # fitted on the 65,536-token row
# Splash's MXU side (its FLOPs; its exps are priced apart at the chip's rate: attention_seconds), by block size;
# fitted on the 4,194,304-token row at 1024
SPLASH_EFFICIENCY = {1024: 0.762}
DEFAULT_SCOPED_VMEM_BYTES = 16 * 2 ** 20  # where maxctx.plan.topology states no limit: an assumption
SPLASH_BLOCKS = (512, 1024, 2048)  # what splash_block chooses from; an uncalibrated one is not chosen
BLOCKWISE_EFFICIENCY = 0.3  # assumption: no measured row runs the blockwise kernel
RECOMPUTE_ATTENTION = 2.70  # fitted on the 10,485,760-token row
def exposed_per_layer(strategy: str, s: AttentionShape, hw: Hardware, ici_cp: int, dcn_cp: int,
                      forward_passes: int) -> float:
    """Communication seconds one layer's attention does not hide behind compute (module doc). A local layer whose
    keys come by halo exchange (maxctx.attention.cp.halo) waits for its permutes. The ring backward's sends
    overlap its hops' kernels where the strategy says so (Strategy.overlapped_backward: the software-pipelined
    backward); else each waits in full, as in maxctx's program."""
    attn_fwd = 4 * s.batch * (s.seq / s.cp) * causal_keys(s.seq, s.window) * s.heads * s.head_dim / hw.peak_flops
    unit = strategies.get(strategy)
    fwd, bwd = unit.comm_volume(s)
    ring_bw = min(hw.link_bytes_per_s, hw.dcn_bytes_per_s) if dcn_cp > 1 else hw.link_bytes_per_s
    latency = DCN_LATENCY_S if dcn_cp > 1 else ICI_LATENCY_S
    if unit.halo_plan(s) is not None:
        return sum(c.sent_bytes / ring_bw + latency for c in fwd) * forward_passes + sum(
            c.sent_bytes / ring_bw + latency for c in bwd)
    r = s.ring

    # Each ring step merges its block's result into fp32 accumulators in HBM (read both, write one): out in the
    # forward; dq and the travelling dK/dV in the backward. Not overlapped: the merge waits for the block.
    acc = s.batch * (s.seq / r) * s.head_dim * 4 * s.heads / s.a2a
    kv_acc = 2 * s.batch * (s.seq / r) * s.head_dim * 4 * replicated_kv_heads(s.kv_heads, s.a2a) / s.a2a
    if unit.moves == "latent" and s.latent_width:  # the travelling accumulator is d latent (latent_p2p)
        kv_acc = s.batch * (s.seq / r) * s.latent_width * 4

    def ring_s(ops: list[Collective], compute: float, hops: int, merged: float, overlap: bool) -> float:
        sent = sum(c.sent_bytes for c in ops if c.kind == "collective-permute")
        if not sent:
            return 0.0
        hidden = compute / r if overlap else 0.0
        return hops * (max(0.0, sent / hops / ring_bw - hidden) + latency + 3 * merged / hw.hbm_bytes_per_s)

    def others_s(ops: list[Collective]) -> float:
        return sum(_collective_s(c, hw, ici_cp) for c in ops if c.kind != "collective-permute")

    forward = others_s(fwd) + ring_s(fwd, attn_fwd, r - 1, acc, True)
    backward = others_s(bwd) + ring_s(bwd, 2 * attn_fwd, r, acc + kv_acc, unit.overlapped_backward)
    return forward_passes * forward + backward



def placement(config: Config) -> dict[str, str]:
    """Where the policy puts each of REMAT_NAMES: `remat` (recomputed in the backward), `device` or `offload`."""
    if config.remat_policy == "none":
        return dict.fromkeys(REMAT_NAMES, "device")
    if config.remat_policy == "custom":
        return {name: getattr(config, name) for name in REMAT_NAMES}
    from maxctx.config import NAMED_POLICIES

    saved, offloaded = NAMED_POLICIES[config.remat_policy]
    return {name: "device" if name in saved or name == "decoder_layer_input" else
            "offload" if name in offloaded else "remat" for name in REMAT_NAMES}


def per_token(config: Config, tp: int) -> dict[str, float]:
    """Per token and device: each named projection's forward FLOPs (`flops`) and each named tensor's bytes."""
    # The ring's log-sum-exp (fp32) goes with the attention output: maxctx.attention.cp.ring names both `context`.
    # A strategy may name more than one array `context` (Strategy.output_copies; usp's two), and a policy that keeps
    # it keeps all: for usp, the program compiled for
    # v5p-128 at 10,485,760 tokens moves 120.31 GiB per chip to the host with context and the layer input
    # offloaded, 2 x 40.0 + 0.31 + 40.0 (docs/long_context.md); p2p's ring output is the layer's (80.31 GiB).
    strategy = strategies.for_config(config)
    family = families.for_config(config)
    shape = family.shape(config)
    tensors = family.tensors(shape, tp, strategy.output_copies)
    if strategy.moves == "latent" and family.latent_tensors is not None:  # MLA's latent, K and V never formed
        tensors = family.latent_tensors(shape, tp, tensors)
    # Under expert parallelism the experts' gate and up rows ([E R, M / T], maxctx.model.moe.dispatch) are E times
    # a token's pairs (dropless buffers).
    grown = {"mlpwi": config.expert_parallelism} if getattr(shape, "num_experts", 1) > 1 else {}
    return {"bytes": {name: t.bytes * grown.get(name, 1) for name, t in tensors.items()},
            "flops": {name: t.flops for name, t in tensors.items() if t.flops}}


def offloading_layers(config: Config, name: str) -> int:
    """How many layers send tensor `name` to the host when the policy offloads it: every layer, but for the layer
    input only the first of each run of decoder_layer_input_stride periods of the layer pattern, or the first
    decoder_layer_input_host_layers."""
    layers = families.shape(config).num_layers
    if name != "decoder_layer_input":
        return layers
    if config.decoder_layer_input_stride > 1:
        return kept_layer_inputs(config)
    return layers if config.decoder_layer_input_host_layers < 0 else config.decoder_layer_input_host_layers


def kept_layer_inputs(config: Config) -> int:
    """Layers whose input the remat policy keeps (on the device or the host): every layer, or with
    decoder_layer_input_stride N the first of each run of N periods of the layer pattern."""
    stride, layers = config.decoder_layer_input_stride, families.shape(config).num_layers
    return layers // (stride * len(layer_windows(config))) if stride > 1 else layers


def _keeps_attention(config: Config, mesh: dict[str, int], where: dict[str, str]) -> bool:
    """Whether the backward reuses the attention forward's outputs: always without remat; with `context` kept only
    through the ring (p2p, usp over a ring of 2 or more), whose out and log-sum-exp are named `context`
    (maxctx.attention.cp.ring). Splash's and the blockwise kernel's own VJPs keep residuals no policy names, so their
    forward runs again (the compiled program's count says so: maxctx.plan.program)."""
    if config.remat_policy == "none":
        return True
    strategy = strategies.for_config(config)
    return where["context"] != "remat" and strategy.keeps_output_for_backward(mesh[RING_AXIS])


def scoped_vmem_bytes(chip: topology.Chip) -> int:
    """The VMEM a kernel may use on `chip`: maxctx's scoped limit where topology states one, else
    DEFAULT_SCOPED_VMEM_BYTES."""
    return chip.scoped_vmem_kib * 1024 or DEFAULT_SCOPED_VMEM_BYTES


def splash_block(config: Config, vmem_bytes: float) -> int:
    """The splash block (query and key, every pass) the model picks: of SPLASH_BLOCKS, those whose passes' windows
    (maxctx.plan.vmem, double-buffered, partial blocks computed in the kernel) take at most half of `vmem_bytes`
    (the other half left to the compiler's score tiles and spills: an assumption) and whose efficiency is calibrated
    (SPLASH_EFFICIENCY), the most efficient, the larger on a tie; the smallest that fits when none is calibrated."""
    from maxctx.plan.vmem import window_bytes

    head_dim = families.shape(config).head_dim
    fitting = [b for b in SPLASH_BLOCKS if max(window_bytes(p, b, b, head_dim, False)
                                               for p in ("fwd", "dkv", "dq")) <= vmem_bytes / 2]
    known = [b for b in fitting if b in SPLASH_EFFICIENCY]
    if not known:
        return min(fitting, default=min(SPLASH_BLOCKS))
    return max(known, key=lambda b: (SPLASH_EFFICIENCY[b], b))


def splash_exps(config: Config, hw: Hardware) -> tuple[int, int]:
    """Exps per visible (query head, key) pair that splash's kernels run (forward, backward), where the chip's
    rate is priced (Hardware.transcendentals_per_s): the forward's exp(s - m), and one more in each backward kernel
    that rebuilds the probabilities (dQ and dK/dV; once when fused: splash_fused_backward, tokamax's kernel).
    jax.experimental.pallas.ops.tpu.splash_attention's kernels; the per-row rescale exps are B / block of these."""
    if not hw.transcendentals_per_s or hw.switch or config.attention not in ("splash", "flash", "auto"):
        return 0, 0
    return 1, 1 if config.splash_fused_backward or config.use_tokamax_splash else 2


def attention_seconds(config: Config, attention_flops: float, head_pairs: float, hw: Hardware) -> tuple[float, float]:
    """(forward and backward, forward alone) seconds of the attention kernels: their FLOPs at the kernel's
    efficiency of the MXU peak, then splash's exps (splash_exps, `head_pairs` visible pairs x query heads) at the
    chip's transcendental rate, after them: each exp needs the block's scores from the MXU and the next matmul
    needs its result, so the model charges them in series (docs/step_time_model.md, "Per generation")."""
    mxu = attention_flops / (hw.peak_flops * attention_efficiency(config))
    fwd, bwd = splash_exps(config, hw)
    per_exp = head_pairs / hw.transcendentals_per_s if hw.transcendentals_per_s else 0.0
    return mxu + (fwd + bwd) * per_exp, mxu / 3 + fwd * per_exp


def attention_efficiency(config: Config) -> float:
    """The attention kernel's calibrated share of the peak: splash at its block size (the nearest calibrated one
    below it, else the smallest), the blockwise kernel otherwise."""
    if config.compile_topology and topology.parse(config.compile_topology).chip.switch:
        return CUDNN_EFFICIENCY if config.attention in ("cudnn", "flash", "auto") else BLOCKWISE_EFFICIENCY
    if config.attention not in ("splash", "flash", "auto"):
        return BLOCKWISE_EFFICIENCY
    block = min(config.flash_block_q, config.flash_block_kv)
    known = sorted(SPLASH_EFFICIENCY)
    return SPLASH_EFFICIENCY[max((b for b in known if b <= block), default=known[0])]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step's terms per device, in seconds (module doc)."""

    matmul_s: float
    attention_s: float
    recompute_s: float
    memory_s: float
    collective_s: float  # all collectives' time on the links
    exposed_collective_s: float  # of which the compute does not hide
    host_s: float  # host transfers' time on the host link
    exposed_host_s: float
    model_flops: float
    forwards_per_layer: float
    host_bytes: float

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s + self.recompute_s + self.memory_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_collective_s + self.exposed_host_s


def estimate(config: Config, plan: MeshPlan, global_batch: float, hw: Hardware, *,
             forwards_per_layer: float | None = None, host_bytes: float | None = None) -> StepTime:
    """The step-time model (module doc) for `config` on the mesh `plan` (maxctx.parallelism.MeshPlan: its sizes,
    ICI and DCN together, and the slices its context axis spans). `forwards_per_layer` and `host_bytes` (both
    directions): the compiled program's counts (maxctx.plan.program), else the policy's."""
    mesh = plan.sizes
    n = math.prod(mesh.values())
    shape = families.shape(config)
    tp, seq, layers = mesh[TENSOR_AXIS], config.max_target_length, shape.num_layers
    t = global_batch * seq / n  # tokens per device
    windows = layer_windows(config)
    matmul_flops = shape.matmul_flops(t)
    cp = mesh_context_degree(mesh)
    pairs = [attention_pairs_per_token(config, w, cp, mesh[RING_AXIS]) for w in windows]
    model_flops = matmul_flops + shape.attention_flops(t * layers * sum(c for c, _ in pairs) / len(windows))
    # What the busiest rank's kernels run: the causal count, or the documents' own (planner_document_lengths).
    attention_flops = shape.attention_flops(t * layers * sum(r for _, r in pairs) / len(windows))
    where, stride = placement(config), config.decoder_layer_input_stride
    if forwards_per_layer is None:  # a strided run recomputes its layers' forwards once more, attention included
        forwards_per_layer = 1 if _keeps_attention(config, mesh, where) else 2 + (stride > 1)
    per = per_token(config, tp)
    redone = sum(f for name, f in per["flops"].items() if where[name] == "remat") * layers * t
    redone += sum(per["flops"].values()) * layers * t * (stride > 1)
    redone += 2 * t * shape.output_params / tp * (config.num_vocab_tiling > 1)
    redone += 2 * layers * t * shape.mlp_params / tp * (config.mlp_sequence_chunks > 1 and redone > 0)
    head_pairs = attention_flops * shape.num_heads / shape.attention_flops(1.0)
    attention_s, forward_attention_s = attention_seconds(config, attention_flops, head_pairs, hw)
    attention_rate = attention_flops / attention_s if attention_s else hw.peak_flops  # ring hops hide behind it
    matmul_rate = hw.peak_flops * (hw.matmul_efficiency or XLA_MATMUL_EFFICIENCY)
    redone_s = redone / matmul_rate
    recompute_s = redone_s + (forwards_per_layer - 1) * RECOMPUTE_ATTENTION * forward_attention_s
    rebuilt = rebuild_flops(config, plan, forwards_per_layer)  # K and V from a moved latent (0: none)
    matmul_s = (matmul_flops + shape.linear_flops(t, cp) + rebuilt) / matmul_rate
    moved = traffic(config, mesh, global_batch, 2 if redone else 1)
    memory_s = max(0.0, moved["hbm"] / hw.hbm_bytes_per_s - matmul_s - redone_s)
    compute_s = matmul_s + attention_s + recompute_s + memory_s

    cp_total, cp_exposed = _cp_seconds(config, plan, hw, attention_rate, forwards_per_layer)
    scan_s = linear_exchange_s(config, plan, hw, forwards_per_layer)
    other = moved["ici"] / hw.ici_bytes_per_s + moved["dcn"] / hw.dcn_bytes_per_s
    dispatch_s = expert_dispatch_seconds(config, plan, hw, t * tp, 2 if redone else 1)  # every tensor shard's
    exposed = shape.attention_layers * cp_exposed + scan_s + dispatch_s + max(0.0, other - compute_s)
    if host_bytes is None:
        host_bytes = 2 * t * sum(per["bytes"][name] * offloading_layers(config, name)
                                 for name, w in where.items() if w == "offload")
    host_s = host_bytes / 2 / hw.host_bytes_per_s  # one way: to the host in the forward, back in the backward
    return StepTime(matmul_s, attention_s, recompute_s, memory_s,
                    shape.attention_layers * cp_total + scan_s + dispatch_s + other, exposed, host_s,
                    max(0.0, host_s - compute_s / 3), model_flops, forwards_per_layer, host_bytes)


def expert_dispatch_seconds(config: Config, plan: MeshPlan, hw: Hardware, tokens: float, forward_passes: int) -> float:
    """Expert parallelism's token exchanges per step (maxctx.plan.roofline.dispatch_exchanges) for `tokens` per
    device (its batch and context shard, which each tensor shard holds), each waited for in full (the experts need
    their rows; the return, the combine), a ragged all-to-all priced as an all-to-all. The EP group spans the
    slices its leading axes cross on DCN."""
    axes = expert_parallel_axes(config, plan.sizes)
    inside = config.expert_parallelism // math.prod(plan.dcn.get(a, 1) for a in axes)  # of its devices, per slice
    return sum(_collective_s(dataclasses.replace(c, kind="all-to-all") if c.kind == "ragged-all-to-all" else c, hw,
                             inside)
               for c in dispatch_exchanges(config, families.shape(config), tokens, forward_passes))


def rebuild_flops(config: Config, plan: MeshPlan, forwards: float) -> float:
    """FLOPs per step and device that the strategy spends rebuilding K and V from what it moved, beyond the model's
    projections (Strategy.rebuild_flops: MLA's latent under latent_all_gather), in each forward and the backward of
    every attention layer; priced at the matmul rate."""
    if plan.cp == 1:
        return 0.0
    s = attention_shape(config, plan.sizes, config.per_device_batch_size * plan.cp * plan.sizes[TENSOR_AXIS])
    fwd, bwd = strategies.get(config.context_parallel_strategy).rebuild_flops(s)
    return families.shape(config).attention_layers * (forwards * fwd + bwd)


def linear_exchange_s(config: Config, plan: MeshPlan, hw: Hardware, forwards: float) -> float:
    """Seconds per step of the linear layers' CP exchange (a hybrid family's: maxctx.model.qwen35.cp): each forward
    and the backward wait for every collective-permute of the prefix scan in turn, its bytes at one link's rate
    and a latency each, none hidden behind compute (each step needs the one before). Independent of S."""
    shape = families.shape(config)
    linear = shape.num_layers - shape.attention_layers
    if not linear or plan.cp == 1:
        return 0.0
    batch = config.per_device_batch_size * plan.cp * plan.sizes[TENSOR_AXIS]
    sent, steps = shape.linear_exchange(batch, plan.cp, config.context_parallel_load_balance is True)
    across = plan.dcn_cp > 1
    bw = min(hw.link_bytes_per_s, hw.dcn_bytes_per_s) if across else hw.link_bytes_per_s
    return linear * (forwards + 1) * (sent / bw + steps * (DCN_LATENCY_S if across else ICI_LATENCY_S))


def _cp_seconds(config: Config, plan: MeshPlan, hw: Hardware, attention_rate: float,
                forwards: float) -> tuple[float, float]:
    """(time on the links, exposed time) of one layer's CP collectives (exposed_per_layer, the ring's hops hidden
    behind the attention at its calibrated rate)."""
    mesh, cp, dcn_cp = plan.sizes, plan.cp, plan.dcn_cp
    if cp == 1:
        return 0.0, 0.0
    if hw.switch and cp > hw.switch:  # a GPU ring past one node crosses the NICs
        dcn_cp = max(dcn_cp, cp // hw.switch)
    tp = mesh[TENSOR_AXIS]
    strategy, windows = config.context_parallel_strategy, layer_windows(config)
    effective = dataclasses.replace(hw, peak_flops=attention_rate)
    on_links = exposed = 0.0
    for window in windows:  # averaged over the layer pattern
        s = attention_shape(config, mesh, config.per_device_batch_size * cp * tp, window)
        exposed += exposed_per_layer(strategy, s, effective, cp // dcn_cp, dcn_cp, round(forwards))
        fwd, bwd = strategies.get(strategy).comm_volume(s)
        on_links += (forwards * sum(c.sent_bytes for c in fwd) + sum(c.sent_bytes for c in bwd)) / hw.link_bytes_per_s
    return on_links / len(windows), exposed / len(windows)


def report(est: StepTime, hw: Hardware, tokens_per_step: float) -> dict:
    """The estimate as `maxctx.compile`'s report fields."""
    terms = {"matmul": est.matmul_s, "attention": est.attention_s, "recompute": est.recompute_s,
             "memory": est.memory_s, "collectives": est.exposed_collective_s, "host": est.exposed_host_s}
    return {"peak_flops_per_device": hw.peak_flops, "estimate_step_time_s": est.step_s,
            **{f"estimate_{k}_s": v for k, v in terms.items()},
            "estimate_collective_time_s": est.collective_s, "estimate_host_time_s": est.host_s,
            "estimate_host_bytes": est.host_bytes, "estimate_forwards_per_layer": est.forwards_per_layer,
            "estimate_largest_term": max(terms, key=terms.get),
            "estimate_mfu": est.model_flops / (est.step_s * hw.peak_flops),
            "estimate_tokens_per_s": tokens_per_step / est.step_s}
