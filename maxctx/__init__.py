"""maxctx: config-driven LLM pretraining in JAX, built for long context.

Module map, lowest layer first (a module imports only from its own layer and those above it in this list;
tests/test_layering.py checks it, and the README's "Layout" section says the same):

    config.py          the typed, frozen schema (Literal choices), YAML + key=value parsing, ConfigError
    parallelism.py     JAX-free mesh arithmetic: axis sizes and fills, the CP degree and its ring x A2A split
    topology.py, optimizer.py, metrics/
                       TPU slices for AOT compiles; AdamW; FLOPs, peak table, writers, the step logger
    attention/         kernels, one module per CP strategy (registry: attention/strategies.py), dispatch
    validate.py        every cross-field check, and load_config (parse + check), before JAX starts
    mesh.py, runtime.py
                       the jax Mesh and logical-axis rules; devices and jax.distributed
    model/, data/      the decoder; the input pipelines
    train_step.py      the pure jitted step, abstract state and shardings
    checkpoint.py, roofline.py, out_of_memory.py
                       Orbax; the step-time estimate; XLA out-of-memory reading, fit verdict and advice
    compile.py, train.py
                       the entry points: `python -m maxctx.compile`, `python train.py`
"""
