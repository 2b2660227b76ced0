"""The Qwen3.5 family (decoder_block=qwen3_5): three Gated DeltaNet (linear attention) layers for every gated
full-attention layer.

    gdn.py         the delta rule in chunks (WY / UT form) and its recurrent reference; the short convolution
    cp.py          the linear layers under context parallelism: a prefix scan of state maps, the convolution's halo
    layers.py      the `qwen3_5` layer kind: one period of linear layers and a gated full-attention layer
    family.py      QWEN3_5: shape, planner view, config checks, stacks (no JAX)
    hf_layout.py   Hugging Face Qwen3_5ForCausalLM <-> maxctx (no JAX)
"""
