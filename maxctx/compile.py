"""Compile the train step without training: `python -m maxctx.compile configs/base.yml key=value ...`.

Lowers and compiles the real step for the abstract state (no parameters are allocated) and reports per-device
memory and FLOPs, as text and as JSON on stdout's last line. The step compiles for the local devices, or, with
`compile_topology=v5p-128` (names in maxctx.plan.topology), for that TPU slice (x compile_topology_num_slices) on any
machine with libtpu installed and no TPU. For a topology the report adds:

- memory per device (memory_analysis: arguments + outputs + temporaries - aliased) against the device's HBM: fits
  or not, and by how much (plan.out_of_memory.fit; against Google's round capacity in plan.topology; XLA's own
  limit differs a little, docs/tpu.md). XLA sometimes refuses to compile a program that does not fit, reported
  with XLA's own figures (when XLA stops at its temporaries the real need is larger still); sometimes it compiles
  one that needs more than HBM, which the memory analysis catches.
  Exit status 0: compiled and fits; 3: does not fit; 2: bad config.
- FLOPs per step: analytic model FLOPs (maxctx.metrics, MaxText's convention) and XLA's cost analysis (which counts a
  scanned layer once and counts remat recompute, so it is far below the analytic figure with scan_layers=true).
- what the compiled program runs per step (maxctx.plan.program, read from its HLO): how many times each layer
  runs the attention forward (1: kept for the backward; 2: recomputed), bytes to and from pinned host memory,
  collective bytes per kind, and the FLOPs it executes (matmuls plus the Pallas kernels' visited blocks) against
  the model FLOPs (also for local devices).
- a step-time ESTIMATE and MFU, not a measurement: maxctx.plan.step_time (the one model, calibrated on MaxText's
  measured v5p rows; docs/step_time_model.md), fed the program's attention forwards and host bytes.

With `--plan`, nothing compiles: the ranked table of maxctx.plan.planner (what `context_parallel_strategy=auto`
chooses from; with `remat_policy=auto` also each candidate's remat placement, host memory and what it recomputes)
is printed; `--verify[=N]` then compiles its N (3) best fitting candidates that compile for the topology (each in
a process of its own: one libtpu aborts on is a line, and the next takes its place) and prints each one's
compiled memory, attention forwards per layer and host bytes next to the planner's estimates, and the step-time
model fed the program's counts (JSON on stdout's last line either way).
"""

from __future__ import annotations

import json
import math
import sys
import time

from maxctx.attention.cp import strategies
from maxctx.config import Config, ConfigError
from maxctx.loader import load, usage
from maxctx.parallelism import A2A_AXIS, MeshPlan
from maxctx.plan import documents, planner, program, step_time, topology
from maxctx.plan.out_of_memory import fit, onchip_advice, xla_out_of_memory
from maxctx.validate import check_devices

GIB = 1024 ** 3
NOT_FITTING = 3


def compile_report(config: Config, plan: planner.Plan | None = None) -> dict:
    """Compiles the step for this config (local devices, or `compile_topology`) and returns its statistics, with
    `plan` (auto's table, from maxctx.loader.load) when given."""
    import jax

    from maxctx.attention.dispatch import resolve_kernel
    from maxctx.mesh import create_mesh
    from maxctx.metrics import compile_record, training_flops_per_device
    from maxctx.model.decoder import count_params
    from maxctx.plan import topology as topo
    from maxctx.train_step import compile_train_step, make_setup, save_compiled

    target = topo.parse(config.compile_topology) if config.compile_topology else None
    devices = topo.topology_devices(target, config.compile_topology_num_slices) if target else jax.devices()
    mesh_plan = strategies.mesh_plan(config, len(devices))
    mesh = create_mesh(config, devices, mesh_plan)
    setup = make_setup(config, mesh)
    num_devices = mesh.devices.size
    flops = training_flops_per_device(config, setup.global_batch, config.max_target_length, num_devices)
    report = {"model_name": config.model_name, "num_params": count_params(setup.abstract_state["params"]),
              "mesh": dict(mesh.shape), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
              "num_devices": num_devices, "global_batch": setup.global_batch, "seq_len": config.max_target_length,
              "context_parallel_strategy": config.context_parallel_strategy,
              "context_parallel_a2a": int(mesh.shape[A2A_AXIS]),
              "attention": resolve_kernel(config.attention, platform=devices[0].platform, dtype=config.dtype,
                                           softcap=config.attn_logits_soft_cap)}
    start = time.perf_counter()
    try:
        compiled = compile_train_step(setup)
        if config.compiled_trainstep_file:
            save_compiled(compiled, config.compiled_trainstep_file)
            report["compiled_trainstep_file"] = config.compiled_trainstep_file
        report.update(compile_record(compiled, analytic_flops_per_device=flops))
        report.update(program.read(compiled, config.base_num_decoder_layers))
    except jax.errors.JaxRuntimeError as e:
        if target is None or "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report.update(analytic_flops_per_device=flops, argument_bytes_from_shardings=_argument_bytes(setup),
                      **xla_out_of_memory(str(e)))
    report["compile_time_s"] = round(time.perf_counter() - start, 2)
    if plan is not None:
        report["context_parallel_plan"] = plan.rows()
    if target is not None:
        report.update(topology=target.name, libtpu_topology=target.libtpu_name,
                      num_slices=config.compile_topology_num_slices, devices_per_chip=target.chip.devices_per_chip,
                      **fit(report, target.chip), **_estimate(config, mesh_plan, setup.global_batch, report))
    return report


def _estimate(config: Config, plan: MeshPlan, global_batch: int, report: dict) -> dict:
    """maxctx.plan.step_time's estimate, with the compiled program's attention forwards and host bytes."""
    hw = step_time.hardware(config, plan.num_devices)
    host = report.get("host_to_device_bytes", 0) + report.get("device_to_host_bytes", 0)
    est = step_time.estimate(config, plan, global_batch, hw, forwards_per_layer=report.get(
        "attention_forwards_per_layer"), host_bytes=host if "host_to_device_bytes" in report else None)
    out = step_time.report(est, hw, global_batch * config.max_target_length)
    out["estimate_attention_counted"] = documents.attention_counted(config, plan.cp)
    if report.get("attention") == "splash":
        from maxctx.plan import topology as topo

        chip = topo.parse(config.compile_topology).chip
        out["estimate_splash_block"] = step_time.splash_block(config, step_time.scoped_vmem_bytes(chip))
    return out


def _argument_bytes(setup) -> int:
    """Bytes of one device's shards of the state and the batch (what memory_analysis calls arguments)."""
    import jax

    leaves = jax.tree.leaves((setup.abstract_state, setup.abstract_batch()))
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def format_report(report: dict) -> list[str]:
    params = report["num_params"]
    lines = [f"{report['model_name']}: {params / 1e9:.2f}B parameters" if params >= 1e8 else
             f"{report['model_name']}: {params / 1e6:.2f}M parameters"]
    lines[0] += (f", mesh {report['mesh']}, batch {report['global_batch']} x {report['seq_len']}, "
                 f"{report['context_parallel_strategy']} with {report['attention']} attention, "
                 f"{report['num_devices']} x {report['device_kind']}")
    device = "device"
    if "topology" in report:
        slices = f" x {report['num_slices']} slices" if report["num_slices"] > 1 else ""
        lines[0] += f" ({report['topology']} = {report['libtpu_topology']} chips{slices})"
        device = "chip" if report["devices_per_chip"] == 1 else f"device (1/{report['devices_per_chip']} chip)"
    if "total_size_in_bytes" in report:
        lines.append(f"per {device}: {report['total_size_in_bytes'] / GIB:.2f} GiB (arguments "
                     f"{report['argument_size_in_bytes'] / GIB:.2f}, temp {report['temp_size_in_bytes'] / GIB:.2f})")
    if "xla_error" in report:
        lines.append(f"XLA: {report['xla_error']}")
    if "fits" in report:
        hbm, room = report["hbm_bytes_per_device"] / GIB, report.get("headroom_bytes")
        verdict = "FITS" if report["fits"] else "DOES NOT FIT"
        by = "" if room is None else f", {abs(room) / GIB:.2f} GiB {'free' if room >= 0 else 'over'}"
        if report.get("xla_memory_space"):
            lines.append(f"DOES NOT COMPILE: on-chip {report['xla_memory_space'].upper()} overflowed, not HBM "
                         f"({hbm:.2f} GiB per {device}, untested): "
                         f"{onchip_advice(report['xla_memory_space'], report['attention'], report)}")
        else:
            lines.append(f"{verdict} in {hbm:.2f} GiB HBM per {device}{by}")
    lines.append(f"FLOPs per device per step: {report['analytic_flops_per_device'] / 1e12:.4g} TFLOP (model, "
                 f"analytic); XLA cost analysis {report.get('xla_flops_per_device', math.nan) / 1e12:.4g} TFLOP "
                 f"(a scanned layer counted once, recompute included)")
    lines += program_lines(report)
    if "estimate_step_time_s" in report:
        terms = ", ".join(f"{k} {_seconds(report[f'estimate_{k}_s'])}" for k in
                          ("matmul", "attention", "recompute", "memory", "collectives", "host"))
        lines.append(f"step-time ESTIMATE (maxctx.plan.step_time, calibrated on MaxText's measured v5p rows): step "
                     f"{_seconds(report['estimate_step_time_s'])} ({terms}; collectives and host: the exposed "
                     f"part), MFU {report['estimate_mfu']:.1%}, {report['estimate_tokens_per_s']:,.0f} tokens/s"
                     + (f"; the model's splash block: {report['estimate_splash_block']}"
                        if "estimate_splash_block" in report else "")
                     + (f"; attention counted: {report['estimate_attention_counted']}"
                        if "estimate_attention_counted" in report else ""))
    lines.append(f"compiled in {report['compile_time_s']:.1f} s")
    return lines


def program_lines(report: dict) -> list[str]:
    """What the compiled program runs per step (maxctx.plan.program), when it compiled."""
    if "attention_forward_calls" not in report:
        return []
    per_layer = report["attention_forwards_per_layer"]
    forwards = "none found" if per_layer is None else (
        f"{per_layer:g} per layer ({'recomputed in the backward' if per_layer > 1 else 'kept for the backward'})")
    comm = ", ".join(f"{k} {v / GIB:.3g} GiB" for k, v in sorted(report["collective_bytes"].items())) or "none"
    executed, model = report["executed_flops"], report["analytic_flops_per_device"]
    return [f"compiled program per step: attention forward {forwards}; host transfers: to device "
            f"{report['host_to_device_bytes'] / GIB:.3g} GiB, to host {report['device_to_host_bytes'] / GIB:.3g} GiB",
            f"collectives per step: {comm}",
            f"executed FLOPs per device: {executed / 1e12:.4g} TFLOP (matmuls {report['executed_dot_flops'] / 1e12:.4g}"
            f" + Pallas kernels {report['executed_pallas_flops'] / 1e12:.4g}), {executed / model:.3g} x model FLOPs"
            + (f"; {report['uncounted_loops']} loops of unknown trip count counted once"
               if report["uncounted_loops"] else "")]


USAGE = ("Compiles the train step without training and reports memory per device, FLOPs and (for a TPU\n"
         "compile_topology) whether it fits and a step-time estimate. Exit status: 0 fits, 2 bad config, 3 does not "
         "fit.\n--plan: print the context-parallel planner's ranked table instead (context_parallel_strategy=auto);"
         "\n--verify[=N]: also compile its N (3) best candidates: compiled memory, attention forwards per layer and "
         "host bytes next to the estimate.")
FLAGS = ("--plan", "--verify")  # --verify=N: compile the N best (3 by default)


def make_plan(config: Config) -> planner.Plan:
    """The planner's table, its candidates checked by the same device rules as a loaded config."""
    n = topology.num_devices(config)
    return planner.plan(config, None if n is None else lambda c: check_devices(c, n))


def verify_plan(plan: planner.Plan, config: Config, top: int = 3, argv: list[str] | None = None,
                run=None) -> list[dict]:
    """Compiles the `top` best fitting candidates (strategy and remat placement) that compile; for each, the
    planner's estimates beside what the compiled program says: memory per device, attention forwards per layer,
    host bytes, and the step-time model fed the program's counts. With `argv` (a TPU topology's compile, where
    libtpu may abort) each candidate compiles in a process of its own, `run(args)` -> (exit status, stdout,
    stderr): an abort or a failure is a row and a line, and the next candidate is compiled in its place."""
    import signal

    rows = []
    for cand in [c for c in plan.ranked if c.fits]:
        if len([r for r in rows if "aborted" not in r]) == top:
            break
        if argv is None:
            report = compile_report(planner.candidate_config(config, cand.strategy, cand.a2a, dict(cand.placement)))
        else:
            keys = candidate_keys(config, plan, cand)
            given = {key.split("=")[0] for key in keys}
            status, out, err = (run or _run_child_report)([*(a for a in argv if a.split("=")[0] not in given), *keys])
            report = _last_json(out)
            if report is None:
                why = (f"aborted while compiling ({signal.Signals(-status).name})" if status < 0 else
                       f"failed (exit status {status}: {(err.strip().splitlines() or ['no message'])[-1]})")
                print(f"verify {cand.label} ({cand.placed}): {why}; taking the next", flush=True)
                rows.append({"label": cand.label, "placement": dict(cand.placement), "aborted": why})
                continue
        rows.append(_verified(cand, report))
    return rows


def _verified(cand: planner.Candidate, report: dict) -> dict:
    """One candidate's estimates beside its compiled report: the row, and its line printed."""
    compiled = report.get("total_size_in_bytes", report.get("xla_required_bytes"))
    held = report.get("device_to_host_bytes")
    row = {"label": cand.label, "placement": dict(cand.placement), "estimate_bytes": cand.memory_bytes,
           "compiled_bytes": compiled, "fits": report.get("fits"), "estimate_step_s": cand.step_s,
           "compiled_estimate_step_s": report.get("estimate_step_time_s"),
           "estimate_forwards_per_layer": cand.forwards_per_layer,
           "attention_forwards_per_layer": report.get("attention_forwards_per_layer"),
           "estimate_host_bytes": cand.host_bytes, "device_to_host_bytes": held,
           "compile_time_s": report["compile_time_s"]}
    got = "?" if compiled is None else f"{compiled / GIB:.2f} GiB"
    step = report.get("estimate_step_time_s")
    forwards = report.get("attention_forwards_per_layer")
    print(f"verify {cand.label} ({cand.placed}): HBM estimate {cand.memory_bytes / GIB:.2f} GiB, compiled {got}"
          + ("" if report.get("fits") is None else f" ({'fits' if report['fits'] else 'does not fit'})")
          + f"; attention forwards per layer estimate {cand.forwards_per_layer:g}, compiled "
          + ("?" if forwards is None else f"{forwards:g}")
          + f"; host bytes estimate {cand.host_bytes / GIB:.2f} GiB, compiled "
          + ("?" if held is None else f"{held / GIB:.2f} GiB")
          + f"; step estimate {_seconds(cand.step_s)}, with the program's counts "
          + ("?" if step is None else _seconds(step))
          + f"; compiled in {report['compile_time_s']:.0f} s", flush=True)
    return row


def _last_json(out: str) -> dict | None:
    """The report a `python -m maxctx.compile` child printed on stdout's last line, or None."""
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) and "compile_time_s" in report else None


def _run_child_report(args: list[str]) -> tuple[int, str, str]:
    return _run_child_code("from maxctx.compile import cli; cli()", args)


def check_layout_cli(argv: list[str]) -> int:
    """Exit status 2 and one line for an ICI mesh that cannot be laid over compile_topology's physical axes
    (maxctx.mesh.create_mesh over the topology's devices, which needs no TPU), else 0."""
    from maxctx.mesh import create_mesh
    from maxctx.plan import topology as topo

    try:
        config, _ = load(argv)
        create_mesh(config, topo.topology_devices(topo.parse(config.compile_topology),
                                                  config.compile_topology_num_slices))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


def _run_child_code(code: str, args: list[str]) -> tuple[int, str, str]:
    import subprocess

    done = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def candidate_keys(config: Config, plan: planner.Plan, cand: planner.Candidate) -> list[str]:
    """The command-line keys that run `cand` of `plan` (what auto chose for it) without auto."""
    chosen = strategies.get(cand.strategy).candidate_config(config, cand.a2a)
    keys = [f"context_parallel_strategy={cand.strategy}",
            f"context_parallel_a2a_degree={chosen.context_parallel_a2a_degree}"]
    if "remat_policy=auto" in plan.keys:
        keys += ["remat_policy=custom", *(f"{name}={where}" for name, where in cand.placement)]
    return keys


def _run_child(args: list[str]) -> int:
    import subprocess

    return subprocess.run([sys.executable, "-m", "maxctx.compile", *args], check=False).returncode


def compile_first_that_works(argv: list[str], config: Config, plan: planner.Plan, run=_run_child) -> int:
    """auto's candidates that fit by the estimate, best first, each compiled in its own process (a libtpu abort
    kills only that one) until one compiles and fits: its exit status, or NOT_FITTING when none does. `run(args)`
    runs `python -m maxctx.compile args` and returns its exit status (negative: killed by that signal)."""
    import signal

    fitting = [c for c in plan.ranked if c.fits]
    for i, cand in enumerate(fitting):
        keys = candidate_keys(config, plan, cand)
        given = {key.split("=")[0] for key in keys}
        status = run([*(a for a in argv if a.split("=")[0] not in given), *keys])
        if status in (0, 2):
            return status
        why = (f"aborted while compiling ({signal.Signals(-status).name})" if status < 0 else
               "compiled but does not fit" if status == NOT_FITTING else f"failed (exit status {status})")
        following = f"; taking the next, {fitting[i + 1].label}" if i + 1 < len(fitting) else ""
        print(f"auto: candidate {cand.label} ({cand.placed}) {why}{following}", file=sys.stderr, flush=True)
    print(f"auto: none of the {len(fitting)} candidates that fit by the estimate compiled and fit; "
          f"`--plan --verify` compiles each and shows why", file=sys.stderr)
    return NOT_FITTING


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage("python -m maxctx.compile", USAGE))
        return 0
    flags = [a.split("=")[0] for a in argv if a.split("=")[0] in FLAGS]
    top = [a.split("=", 1)[1] for a in argv if a.startswith("--verify=")]
    argv = [a for a in argv if a.split("=")[0] not in FLAGS]
    if top and not top[-1].isdigit():
        print(f"config error: --verify={top[-1]}: give the number of candidates to compile, e.g. --verify=1",
              file=sys.stderr)
        return 2
    try:
        config, auto_plan = load(argv)
        if flags:
            plan = auto_plan if auto_plan is not None else make_plan(config)
            print("\n".join(planner.format_plan(plan)), flush=True)
            verified = []
            if "--verify" in flags and config.compile_topology:  # each candidate in a process of its own
                verified = verify_plan(plan, config, int(top[-1]) if top else 3, argv)
            elif "--verify" in flags:
                from maxctx import runtime

                runtime.initialize(config)
                verified = verify_plan(plan, config, int(top[-1]) if top else 3)
            print(json.dumps({"plan": plan.rows(), "verify": verified}))
            return 0
        if auto_plan is not None and config.compile_topology:
            # auto's first choice verified by compiling it, in a process of its own, before it is reported
            print("\n".join(planner.format_plan(auto_plan)), flush=True)
            # The candidates share the mesh's physical layout: one error, not one per child. Checked in a child
            # too: libtpu in this process would keep the candidates' processes from starting it.
            status, _, err = _run_child_code("import sys; from maxctx.compile import check_layout_cli; "
                                             "sys.exit(check_layout_cli(sys.argv[1:]))", argv)
            if status == 2:
                print(err.strip().splitlines()[-1], file=sys.stderr)
                return 2
            return compile_first_that_works(argv, config, auto_plan)
        from maxctx import runtime

        runtime.initialize(config)
        report = compile_report(config, auto_plan)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_report(report)))
    print(json.dumps(report))
    return NOT_FITTING if report.get("fits") is False else 0


def cli() -> None:
    """The `maxctx-compile` console script."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
