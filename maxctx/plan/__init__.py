"""Planning a run before it runs: which strategy, whether it fits, how long a step takes.

    topology.py       TPU slices by name (v5p-128, ...) for ahead-of-time compiles, GPU clusters (h100-64, ...) for
                      the planner; their HBM, links and host memory
    hardware.py       the device as the time model sees it (peak, HBM, torus or NVLink nodes, host link) and the
                      time one collective takes on it
    planner.py        context_parallel_strategy=auto: candidates ranked by memory and step time (no JAX)
    remat.py          remat_policy=auto: each named tensor's placement (remat / device / offload)
    memory.py         the memory estimates per device: HBM besides attention, the host the offloaded tensors hold
                      and its budget
    step_time.py      the one step-time model (planner, maxctx.compile), calibrated on MaxText's measured rows
    roofline.py       the bytes a step moves through HBM, ICI and DCN (the model's memory and collective terms)
    program.py        what a compiled step runs, read from its HLO: attention forwards, host and collective bytes,
                      executed FLOPs
    vmem.py           splash's VMEM per pass
    documents.py      documents per row (planner_document_lengths): their attention pairs and the ranks' shares
    out_of_memory.py  XLA's out-of-memory errors read, the fit verdict, and what to change

Nothing is imported here: the planner runs while the config loads, before JAX starts.
"""
