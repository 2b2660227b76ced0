"""maxctx: config-driven LLM pretraining in JAX, built for long context.

Module map, lowest layer first (a module imports only from its own layer and those above it in this list;
tests/test_layering.py checks it, and the README's "Layout" section says the same):

    errors.py, compat.py, config.py
                       ConfigError; MaxText's keys and values; the typed, frozen schema, YAML + key=value parsing
    parallelism.py, files.py
                       JAX-free mesh arithmetic (axis sizes and fills, the CP degree and its ring x A2A split);
                       input files checked before JAX
    topology.py, optimizer.py, metrics/, run_dir.py, divergence.py, checkpoint_integrity.py, checkpoint_failure.py
                       TPU slices for AOT compiles; AdamW; FLOPs, peak table, writers, the step logger; the run
                       directory and its lock; known-good states; checkpoint checksums; failed saves (disk full)
    attention/         kernels, one module per CP strategy (registry: attention/strategies.py), dispatch
    validate.py        every cross-field check, and load_config (parse + check), before JAX starts
    mesh.py, runtime.py
                       the jax Mesh and logical-axis rules; devices and jax.distributed
    model/, data/      the decoder; the input pipelines
    train_step.py      the pure jitted step, abstract state and shardings
    checkpoint.py, checkpoint_compat.py, roofline.py, out_of_memory.py
                       Orbax (verified resume, fallback); checkpoint vs config; the step-time estimate; XLA
                       out-of-memory reading, fit verdict and advice
    compile.py, train.py
                       the entry points: `python -m maxctx.compile`, `python train.py`
"""
