"""Planning a run before it runs: which strategy, whether it fits, how long a step takes.

    topology.py       TPU slices by name (v5p-128, ...) for ahead-of-time compiles; their HBM and links
    planner.py        context_parallel_strategy=auto: candidates ranked by memory and step time (no JAX)
    roofline.py       the step-time estimate `maxctx.compile` prints
    out_of_memory.py  XLA's out-of-memory errors read, the fit verdict, and what to change

Nothing is imported here: the planner runs while the config loads, before JAX starts.
"""
