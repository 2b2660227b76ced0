"""Attention: kernels, context-parallel strategies and the one dispatch the model calls.

    dispatch.py        attend(q, k, v, positions, segment_ids, AttentionSpec, mesh): picks kernel and strategy
    strategy.py        what a strategy module provides (AttentionShape, Collective): no JAX
    strategies.py      the registry: the one list of strategies, names and aliases
    all_gather.py, a2a.py, p2p.py, usp.py
                       one strategy each: name, aliases, config rules, A2A degree, collective and memory formulas,
                       and its shard_map'd attend
    kernels.py         LocalKernel: dot_product, flash, splash or cudnn behind one interface
    dot_product.py, flash.py, splash.py, cudnn.py
                       the kernels
    collectives.py     shard_map across JAX versions, layouts, the ring shift
    load_balance.py    the zig-zag token order
"""
