"""The Qwen3.5 family (decoder_block=qwen3_5): three Gated DeltaNet (linear attention) layers for every gated
full-attention layer.

    gdn.py         the delta rule in chunks (WY / UT form) and its recurrent reference; the short convolution
    cp.py          the linear layers under context parallelism: a prefix scan of state maps, the convolution's halo
"""
