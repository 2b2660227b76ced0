"""The DeepSeek-V2 / V3 family (decoder_block=deepseek, MaxText's name; Kimi K2 too): multi-head latent attention in
every layer, dense first layers (first_num_dense_layers), then MoE layers with shared experts and a softmax (V2) or
sigmoid router with its correction bias (V3), group-limited top-k and routed_scaling_factor where the model has
them.

    family.py      DEEPSEEK: the shape (MLA's and the experts' parameters, total and active), named tensors, checks
    layers.py      MLA (query LoRA or not, the KV latent and its norm, the shared RoPE key, YaRN's mscale) and the
                   `deepseek_dense` and `deepseek` layer kinds
    hf_layout.py   Hugging Face DeepseekV2ForCausalLM / DeepseekV3ForCausalLM <-> maxctx (per-expert tensors)
"""
