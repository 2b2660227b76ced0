"""The Gemma 2 / Gemma 3 family (decoder_block=gemma2, gemma3): sandwich-normed blocks ((1 + w) RMSNorm before and
after the attention and the MLP) of grouped-query attention and a GeGLU MLP, local and global layers in turn.

    family.py      GEMMA2, GEMMA3: the family's shape, named tensors, options and config checks (no JAX)
    layers.py      the `gemma` layer kind: its (1 + w) norm, attention (QK-norm, query scale, RoPE per layer type)
    hf_layout.py   Hugging Face Gemma2ForCausalLM / Gemma3ForCausalLM <-> maxctx
"""
