"""Attention: kernels, context-parallel strategies and the one dispatch the model calls.

    dispatch.py        attend(q, k, v, positions, segment_ids, AttentionSpec, mesh): picks kernel and strategy
    base.py            Strategy: what a CP strategy is, with its defaults (no JAX)
    cost.py            AttentionShape and Collective: the terms of the strategies' cost formulas (no JAX)
    strategies.py      the registry: the one list of strategies, names and aliases (`register`)
    all_gather.py, a2a.py, p2p.py, usp.py
                       one strategy each: name, aliases, config rules, A2A degree, communication volume, saved and
                       transient memory, planner candidates, and its shard_map'd attend
    ring.py            ring attention (p2p, usp): K/V blocks around the ring, the custom backward
    seq_to_heads.py    the all-to-all (a2a, usp): sequence shards to head shards and back
    halo.py            local (sliding-window) layers by halo exchange
    kernels.py         LocalKernel: dot_product, flash, splash or cudnn behind one interface
    dot_product.py, flash.py, splash.py, cudnn.py
                       the kernels; splash_masks.py and splash_backward.py: splash's masks over original token
                       order, and its backward for ring hops
    index_runs.py      index sets as runs of integers: which splash kernels of a layout have equal masks
    sharded.py         shard_map across JAX versions, layouts, the ring shift
    load_balance.py    the zig-zag token order
"""
