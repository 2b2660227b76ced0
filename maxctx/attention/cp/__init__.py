"""Context parallelism: how one attention layer's sequence is split over the mesh's context axes.

    base.py            Strategy: what a CP strategy is, with its defaults (no JAX)
    cost.py            AttentionShape and Collective: the terms of the strategies' cost formulas (no JAX)
    strategies.py      the registry: the one list of strategies, names and aliases (`register`)
    all_gather.py, a2a.py, p2p.py, usp.py
                       one strategy each: name, aliases, config rules, A2A degree, communication volume, saved and
                       transient memory, planner candidates, and its shard_map'd attend
    ring.py            ring attention (p2p, usp): K/V blocks around the ring, the custom backward
    seq_to_heads.py    the all-to-all (a2a, usp): sequence shards to head shards and back
    halo.py            local (sliding-window) layers by halo exchange
    sharded.py         shard_map across JAX versions, layouts, the ring shift
    load_balance.py    the stored token order: the zig-zag and the documents placement

The modules the config loads (base, cost, strategies and the strategies' rules) import no JAX; `attend` imports
its kernels when called.
"""
