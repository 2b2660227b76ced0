"""The Qwen 2 / 2.5 / 3 family (decoder_block=qwen2, qwen3): Llama's pre-norm block whose attention adds biases on
the q, k, v projections (Qwen 2 / 2.5: attention_bias) or an RMSNorm of each head of q and k before RoPE (Qwen 3:
use_qk_norm).

    family.py      QWEN: the family's shape (with its biases and norms), named tensors and config checks (no JAX)
    layers.py      the `qwen` layer kind: the block and its attention
    hf_layout.py   Hugging Face Qwen2ForCausalLM / Qwen3ForCausalLM <-> maxctx
"""
