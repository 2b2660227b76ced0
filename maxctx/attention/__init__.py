"""Attention: the kernels, the context-parallel strategies over them, and the one dispatch the model calls.

    kernels/           what one device computes: dot_product, blockwise flash, splash (and tokamax's), cuDNN,
                       behind one LocalKernel
    cp/                context parallelism: the Strategy unit, one module per strategy, their registry and cost
                       formulas, the ring, the all-to-all, halos, the token order (no JAX where the config loads)
    dispatch.py        attend(q, k, v, positions, segment_ids, AttentionSpec, mesh): picks kernel and strategy

kernels/ imports nothing from cp/; cp/ builds on kernels/; dispatch.py on both.
"""
