"""The decoder in Flax NNX, and the model families it is built from.

    shape.py           ModelShape: sizes, parameter counts, matmul FLOPs, bytes per dtype (no JAX)
    family.py          ModelFamily: what maxctx asks of a family (shape, tensors, stacks, checks, HF layout; no JAX)
    families.py        the families by decoder_block (no JAX)
    layers.py          ModelConfig (a ModelShape: the model's view of the run config), RMSNorm, attention, SwiGLU
    rope.py            RoPE and its frequency rules (rope_type: default, linear, llama3, yarn)
    stacks.py          the stack runner: builds a stack of layers and runs it (scan, remat, host offload, strides)
    decoder.py         embedding, the family's stacks, the tiled loss
    tiling.py          map_chunks / sum_chunks: per-token work over chunks of each device's tokens
    llama/             the Llama / Mistral family: its family value, layer kind and HF layout
    gemma/             the Gemma 2 / Gemma 3 family: its family value, layer kind and HF layout
    deepseek/          the DeepSeek-V2 / V3 family (Kimi K2 too): MLA, dense then MoE stacks, its HF layout
"""
