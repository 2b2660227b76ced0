"""The Llama / Mistral family (decoder_block=llama2, mistral): pre-norm RMSNorm blocks of grouped-query attention
with RoPE and a SwiGLU MLP.

    family.py      LLAMA: the family's shape, named tensors, working set and config checks (no JAX)
    hf_layout.py   Hugging Face Llama / Mistral <-> maxctx: config keys and every parameter's name and layout
"""
