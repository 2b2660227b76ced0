"""Attention kernels: what one device computes for the queries and keys it holds.

    local.py           LocalKernel and make_local / make_band: dot_product, flash, splash, tokamax_splash or cudnn
                       behind one interface, built for a strategy's token layout
    dot_product.py     the reference: O(S T) memory, masks from positions and segment ids
    flash.py           the blockwise flash-attention algorithm in plain JAX (every platform)
    splash.py          TPU Pallas splash attention over the stored token order; splash_masks.py: its masks over
                       original token order; splash_backward.py: its backward for ring hops
    tokamax_splash.py  tokamax's copy of splash on the same masks (use_tokamax_splash)
    cudnn.py           GPU: cuDNN's causal and packed mask types where the call's tokens allow
    document_blocks.py splash's tables narrowed to the batch's documents (context_parallel_load_balance=documents)
    index_runs.py      index sets as runs of integers: which splash kernels of a layout have equal masks
    sinks.py           attention sinks (GPT-OSS): a per-head logit merged once into a row's (out, lse)
    scopes.py          the named scopes the kernels write and maxctx.plan.program reads (no JAX)

Nothing here imports maxctx.attention.cp: a strategy picks a kernel, never the reverse.
"""
