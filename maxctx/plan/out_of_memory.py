"""Out of device memory: XLA's refusal parsed, the fit verdict against a chip's HBM, and what to change.

Training uses it to name the error and the levers (exit status 4); `maxctx.compile` to report whether a program
fits a TPU slice before anyone pays for one. No JAX at import: the training entry point imports it before JAX
starts.
"""

from __future__ import annotations

import math
import re

from maxctx.config import Config

_SIZE = r"([\d.]+)\s*([KMGT]i?B?)?"
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _bytes(number: str, unit: str | None) -> int:
    return int(float(number) * _UNITS[(unit or "")[:1]])


def xla_out_of_memory(message: str) -> dict:
    """XLA:TPU's refusal to compile a program larger than HBM: its required and available bytes when it says them
    ('... required for HLO temporaries (21.83G) exceeds available HBM (15.75G)' or 'Used 17.1G of 15.75G hbm').
    xla_error_text keeps the whole message; xla_error its first line."""
    out = {"xla_error": message.strip().splitlines()[0][:500], "xla_error_text": message.strip()}
    space = re.search(r"out of memory in memory space (\w+)", message, re.IGNORECASE)
    if space and space[1].lower() != "hbm":
        # On-chip scalar (SMEM) or vector (VMEM) memory: a kernel's tables or blocks, not the program's HBM.
        out["xla_memory_space"] = space[1].lower()
        out.update(onchip_overflow(message))
        return out
    m = (re.search(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)", message)
         or re.search(rf"Used {_SIZE} of {_SIZE} hbm", message, re.IGNORECASE))
    if m:
        out["xla_required_bytes"] = _bytes(m[1], m[2])
        out["xla_available_bytes"] = _bytes(m[3], m[4])
        out["xla_required_is_temporaries_only"] = "exceeds available" in m[0]
    return out


def onchip_overflow(message: str) -> dict:
    """Which kernel or fusion overflowed on-chip memory, by how much and against what: libtpu's scoped limit
    ('Scoped allocation with size 18.00M and limit 16.00M', error E1001) or the memory itself ('Used 70.59M of
    63.94M vmem'), with the largest allocation's description (e.g. a kernel input's window: its shape and
    buffering)."""
    out: dict = {}
    name = (re.search(r"allocating on stack for %([\w.-]+) =", message)
            or re.search(r"XLA label: %?([\w.-]+) = ", message))
    if name:
        out["xla_overflow_op"] = re.sub(r"\.\d+$", "", name[1])
    scoped = re.search(rf"Scoped allocation with size {_SIZE} and limit {_SIZE}", message)
    used = re.search(rf"Used {_SIZE} of {_SIZE} (\w+)", message)
    if scoped:
        out.update(xla_overflow_need_bytes=_bytes(scoped[1], scoped[2]),
                   xla_overflow_limit_bytes=_bytes(scoped[3], scoped[4]), xla_overflow_limit="scoped")
    elif used:
        out.update(xla_overflow_need_bytes=_bytes(used[1], used[2]),
                   xla_overflow_limit_bytes=_bytes(used[3], used[4]), xla_overflow_limit="capacity")
    largest = re.search(r"\n\s*1\. Size: (\S+)(?:(?!\n\s*2\. ).)*?Tag: ([^\n]*?\.[^\n]*?\.)", message, re.DOTALL)
    if largest:
        out["xla_overflow_largest"] = f"{largest[1]}: {largest[2].strip()}"
    return out


# Splash kernels by pass (jax's names: splash_mha_fwd..., splash_mqa_dkv..., ...) and the keys of their blocks.
_PASS_KEYS = (("dkv", "flash_block_q_dkv, flash_block_kv_dkv (and flash_block_kv_dkv_compute)"),
              ("dq", "flash_block_q_dq, flash_block_kv_dq"),
              ("fwd", "flash_block_q, flash_block_kv (and flash_block_kv_compute)"))


def onchip_advice(space: str, attention: str, overflow: dict | None = None) -> str:
    """What to change when a kernel overflows on-chip memory: SMEM holds splash's block tables (one entry per query
    block x key block of a call), so larger blocks shrink them; VMEM holds the blocks themselves. Over libtpu's
    scoped limit, the limit can rise to the chip's VMEM (tpu_scoped_vmem_limit_kib); over the VMEM itself, the
    overflowing kernel's blocks must shrink. `overflow`: onchip_overflow's fields, naming the kernel."""
    if space == "smem":
        what = "splash's block tables" if attention == "splash" else "a kernel's scalar tables"
        return (f"{what} overflowed on-chip SMEM: raise flash_block_q and flash_block_kv (e.g. 1024 or 2048; they "
                f"set the splash blocks too) so a call has fewer blocks")
    overflow = overflow or {}
    op = overflow.get("xla_overflow_op")
    what = f"{op} needs" if op else "a kernel needs"
    keys = next((k for tag, k in _PASS_KEYS if op and f"_{tag}" in op), "flash_block_q and flash_block_kv")
    if "xla_overflow_need_bytes" not in overflow:
        return f"{what} more on-chip {space.upper()} than it has: lower {keys} (e.g. 256)"
    need, limit = overflow["xla_overflow_need_bytes"] / 2 ** 20, overflow["xla_overflow_limit_bytes"] / 2 ** 20
    largest = f"; its largest buffer: {overflow['xla_overflow_largest']}" if "xla_overflow_largest" in overflow else ""
    if overflow["xla_overflow_limit"] == "scoped":
        return (f"{what} {need:.2f} MiB of {space.upper()}, over libtpu's scoped limit of {limit:.2f} MiB: set "
                f"tpu_scoped_vmem_limit_kib={math.ceil(need * 1024)} or more (up to the chip's VMEM), or lower "
                f"{keys}{largest}")
    return (f"{what} {need:.2f} MiB of {space.upper()}, more than the chip's {limit:.2f} MiB: lower {keys}"
            f"{largest}")


def fit(report: dict, chip) -> dict:
    """fits, and headroom_bytes = device HBM - bytes the program needs (negative: over by that much)."""
    hbm = chip.hbm_bytes_per_device
    if "total_size_in_bytes" in report:
        need = report["total_size_in_bytes"]
    elif "xla_required_bytes" in report:  # XLA's figure, against its own (slightly smaller) limit
        need = report["xla_required_bytes"] + hbm - report["xla_available_bytes"]
        if report.get("xla_required_is_temporaries_only"):  # XLA stopped at the temporaries: add the arguments
            need += report.get("argument_bytes_from_shardings", 0)
    else:
        return {"fits": False, "hbm_bytes_per_device": hbm}
    fits = "xla_error" not in report and need <= hbm
    return {"fits": fits, "hbm_bytes_per_device": hbm, "headroom_bytes": int(hbm - need)}


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's device-memory errors (compile or run time); other RESOURCE_EXHAUSTED statuses (a coordination
    service or storage quota) are not."""
    import jax

    message = str(error)
    return (isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in message
            and re.search(r"out of memory|memory space|exceeds available", message, re.IGNORECASE) is not None)


def out_of_memory_advice(message: str, config: Config, argv: list[str]) -> str:
    """What to change: for a kernel's on-chip memory, its block sizes; for HBM, the memory levers, and the
    command that checks a fit before launching."""
    parsed = xla_out_of_memory(message)
    space = parsed.get("xla_memory_space")
    if space:
        import jax

        from maxctx.attention.dispatch import resolve_kernel

        kernel = resolve_kernel(config.attention, platform=jax.devices()[0].platform, dtype=config.dtype,
                                softcap=config.attn_logits_soft_cap)
        return f"what to change: {onchip_advice(space, kernel, parsed)}"
    plan = " ".join(["python -m maxctx.compile", *argv, "compile_topology=<your slice, e.g. v5p-128>"])
    return (f"what to change: lower per_device_batch_size or max_target_length, set remat_policy=full, or spread the "
            f"state and sequence over more devices (ici_fsdp_parallelism, ici_context_parallelism); check a setting "
            f"without a TPU first: {plan}")
