"""Compile the train step without training: `python -m maxctx.compile configs/base.yml key=value ...`.

Builds the mesh for the local devices, lowers and compiles the real step for the abstract state (no parameters
are allocated), prints per-device memory and FLOPs, and writes them as JSON to stdout's last line.
"""

from __future__ import annotations

import json
import sys
import time

from maxctx.config import Config, ConfigError, load_config


def compile_report(config: Config) -> dict:
    """Compiles the step for this config on the local devices and returns its per-device statistics."""
    import jax

    from maxctx.mesh import create_mesh
    from maxctx.metrics import compile_record, training_flops_per_device
    from maxctx.model.decoder import count_params
    from maxctx.train_step import compile_train_step, make_setup

    mesh = create_mesh(config)
    setup = make_setup(config, mesh)
    start = time.perf_counter()
    compiled = compile_train_step(setup)
    report = {"model_name": config.model_name, "num_params": count_params(setup.abstract_state["params"]),
              "mesh": dict(mesh.shape), "platform": jax.devices()[0].platform, "global_batch": setup.global_batch,
              "seq_len": config.max_target_length, "compile_time_s": round(time.perf_counter() - start, 2),
              **compile_record(compiled, analytic_flops_per_device=training_flops_per_device(
                  config, setup.global_batch, config.max_target_length, mesh.devices.size))}
    return report


def main(argv: list[str]) -> int:
    try:
        config = load_config(argv)
        from maxctx import runtime

        runtime.initialize(config)
        report = compile_report(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    gib = 1024 ** 3
    print(f"{report['model_name']}: {report['num_params'] / 1e9:.3f}B parameters, mesh {report['mesh']}, "
          f"batch {report['global_batch']} x {report['seq_len']}")
    print(f"per device: {report.get('total_size_in_bytes', 0) / gib:.3f} GiB "
          f"(arguments {report.get('argument_size_in_bytes', 0) / gib:.3f}, temp "
          f"{report.get('temp_size_in_bytes', 0) / gib:.3f}); "
          f"{report.get('xla_flops_per_device', 0) / 1e12:.4f} TFLOP per step (XLA)")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
