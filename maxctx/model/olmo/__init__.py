"""The OLMo 2 / 3 family (decoder_block=olmo2, olmo3): post-norm blocks (x + norm(attn(x)), then
x + norm(mlp(x))) whose attention RMS-normalises q and k over the whole projection before RoPE (use_qk_norm);
OLMo 3 makes 3 of every 4 layers local (sliding_window_size, attention_layer_pattern LLLG), its RoPE scaling
applying to the global layers only.

    family.py      OLMO: the family's shape (with its norms), named tensors and config checks (no JAX)
    layers.py      the `olmo` layer kind: the block and its attention
    hf_layout.py   Hugging Face Olmo2ForCausalLM / Olmo3ForCausalLM <-> maxctx
"""
