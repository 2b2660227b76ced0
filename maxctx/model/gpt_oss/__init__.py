"""The GPT-OSS family (decoder_block=gpt_oss): MoE layers with a biased router (top-k, then softmax over the k),
clamped-SwiGLU experts with biases, and attention with biases and sinks in sliding-window and full layers in turn.

    family.py      GPT_OSS: shape (total and active parameters), checks, options, stacks (no JAX)
    layers.py      the `gpt_oss` layer kind: the attention with sinks, the experts
    hf_layout.py   Hugging Face GptOssForCausalLM <-> maxctx, the released bf16 layout (fused experts)
"""
