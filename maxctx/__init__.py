"""maxctx: config-driven LLM pretraining in JAX, built for long context.

Module map, lowest layer first (a module imports only from its own layer and those above it in this list;
tests/test_layering.py checks it, and the README's "Layout" section says the same):

    errors.py, data/registry.py, compat.py, config.py
                       ConfigError; the dataset types' table; MaxText's keys and values; the typed, frozen schema
    parallelism.py, files.py
                       JAX-free mesh arithmetic (axis names, sizes and fills, the CP degree and its ring x A2A
                       split); input files checked before JAX
    optimizer.py, metrics/
                       AdamW; FLOPs, peak table, writers, the step logger
    attention/         kernels, one module per CP strategy (registry: attention/strategies.py), dispatch
    plan/, validate.py, loader.py
                       TPU topologies, the planner (auto), the step-time estimate, out-of-memory advice; every
                       cross-field check; loading (YAML, presets, key=value, aliases, auto -> config and plan),
                       all before JAX starts
    mesh.py, runtime.py
                       the jax Mesh and logical-axis rules; devices and jax.distributed
    model/, data/      the decoder; the input pipelines
    train_step.py      the pure jitted step, abstract state and shardings
    checkpoint/, evaluate.py
                       Orbax (verified resume, fallback), integrity, failed saves, resume compatibility,
                       preemption, divergence, the run directory and its lock; the eval loop
    compile.py, train.py
                       the entry points: `python -m maxctx.compile`, `python train.py`
"""
