"""The Qwen3-Next family (decoder_block=qwen3_next): Qwen3.5's periods of Gated DeltaNet layers and a gated
full-attention layer (maxctx.model.qwen35), each layer's MLP a routed MoE with a sigmoid-gated shared expert.

    layers.py      the `qwen3_next` layer kind: the fused-projection linear layer, the shared-expert MoE, a period
    family.py      QWEN3_NEXT: shape (total and active parameters), planner view, config checks, stacks (no JAX)
    hf_layout.py   Hugging Face Qwen3NextForCausalLM <-> maxctx (no JAX)
"""
