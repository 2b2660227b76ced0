"""The Llama-family decoder in Flax NNX.

    shape.py           ModelShape: sizes, parameter counts, matmul FLOPs, bytes per dtype (no JAX)
    layers.py          ModelConfig (a ModelShape: the model's view of the run config), RMSNorm, attention, SwiGLU
    rope.py            RoPE and its frequency rules (rope_type: default, linear, llama3, yarn)
    decoder.py         embedding, scanned and rematerialised layers, the tiled loss
    tiling.py          map_chunks / sum_chunks: per-token work over chunks of each device's tokens
"""
