"""Mixture-of-experts families (decoder_block=mixtral, qwen3_moe): the pre-norm block whose MLP is a dropless routed
MoE layer: a softmax top-k router and SwiGLU experts run as grouped matmuls over the tokens sorted by expert.

    family.py      MIXTRAL, QWEN3_MOE: the shape (total and active parameters), named tensors, checks (no JAX)
    layers.py      the MoE layer and the `mixtral` and `qwen3_moe` layer kinds, with their load-balancing loss
    capacity.py    capacity_factor: which (token, slot) pairs each expert takes, the rest dropped (0: dropless)
    hf_layout.py   Hugging Face MixtralForCausalLM / Qwen3MoeForCausalLM <-> maxctx (per-expert tensors)
"""
