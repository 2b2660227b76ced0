"""Makes tests/fixtures/hf/: tiny random Hugging Face models (made and run by `transformers`) and their fp32 logits
on fixed tokens, then checks that maxctx's export of each loads back in `transformers` with the same logits.

    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--check-only | --token-losses-only] [--only NAME...]

Needs torch and transformers (pip install torch transformers); neither is a dependency of maxctx or its tests,
which read only the files written here:

    <name>/config.json, <name>/model.safetensors   the model as save_pretrained writes it (fp32)
    <name>/tokens.npy  int32 [1, S]                 fixed tokens
    <name>/logits.npy  float32 [1, S, V]            transformers' fp32 logits at positions 0..S-1
    <name>/token_losses.npy  float32 [S - 1]        transformers' cross-entropy of token t+1 given tokens 0..t
                                                    (per-position loss; --token-losses-only adds it to existing
                                                    fixtures without remaking their weights)

Models (a Llama 3 tokenizer-free shape, kept small: 2 layers, width 32, 4 query and 2 KV heads of 16):
    llama      Llama 2 style: rope_theta 1e4, untied output
    llama3_1   Llama 3.1 RoPE scaling (rope_type llama3, factor 8, original context 64); S = 128 tokens, so half
               the positions are past the original context and every frequency band (kept, blended, scaled) is used
    mistral    MistralForCausalLM, no sliding window, rope_theta 1e6, tied embedding (the tied path); also
               logits_sliding_window_32.npy: the same weights with config.json's sliding_window=32 (Mistral v0.1's
               kind of window, every layer local)
    qwen2      Qwen2ForCausalLM: q, k, v biases (random, as every bias here), rope_theta 1e6
    qwen3      Qwen3ForCausalLM: per-head QK-norm, tied embedding
    olmo2      Olmo2ForCausalLM: post-norms, QK-norm over the whole projection
    olmo3      Olmo3ForCausalLM: layer 0 local (sliding_window 32 < S), layer 1 global with YaRN (factor 4,
               original context 32), the local layer's RoPE plain (transformers 5's per-layer-type form)
    gemma2     Gemma2ForCausalLM: local (window 32) and global layers in turn, query_pre_attn_scalar 24 (not the
               head dim), attention soft-cap 5 and final soft-cap 15 (both change the logits), tied embedding
    gemma3     Gemma3ForCausalLM (transformers 5's config form): 3 layers local, global, local (a pattern that ends
               part-way), window 32, QK-norm, local RoPE theta 1e4 against global 1e6 with linear scaling 8,
               query_pre_attn_scalar 24
    mixtral    MixtralForCausalLM: every layer 4 experts, 2 per token (renormalised); also aux_loss.npy:
               transformers' load-balancing loss (output_router_logits) on the tokens
    qwen3_moe  Qwen3MoeForCausalLM: QK-norm, 4 experts 48 wide, 2 per token, norm_topk_prob false (the router
               form without renormalisation); also aux_loss.npy
    qwen3_moe_sparse  qwen3_moe's shape in 4 layers with decoder_sparse_step 2 and mlp_only_layers [3]: layers dense,
               MoE, dense, dense (the dense ones Qwen 3's SwiGLU of intermediate_size); also aux_loss.npy
    qwen3_5    Qwen3_5ForCausalLM: layers linear, linear, linear, full (Gated DeltaNet: 2 key heads of 16, 4 value
               heads of 8, kernel 4; the full layer's output gate, per-head QK-norm, RoPE on a quarter of each head);
               key heads of 16, not 8: an L2-normalised q or k of 8 silu outputs all near 0 is common enough at
               random weights to amplify rounding past the 1e-5 comparison
    qwen3_next Qwen3NextForCausalLM: qwen3_5's layers and head shapes, width 64, with Qwen3-Next's fused linear
               projections; every MLP 4 experts 24 wide, 2 per token (renormalised), and a shared expert 48 wide (two
               experts' width) behind its sigmoid gate; also aux_loss.npy
    deepseek2  DeepseekV2ForCausalLM: layer 0 dense, layers 1-2 MoE (4 experts 24 wide, 2 per token, one shared
               expert, routed_scaling_factor 1.5); MLA without query LoRA: latent 16, q/k heads 12 + 8 RoPE dims,
               value heads 10 (narrower than q/k's 20); YaRN factor 4 over 32 positions with mscale 1.0 and
               mscale_all_dim 0.8 (both the rotary's attention factor and the softmax scale move)
    gpt_oss    GptOssForCausalLM: layer 0 local (sliding_window 32 < S), layer 1 global, YaRN (factor 4 over 32
               positions, truncate false); q/k/v/o biases and sinks (about 1, random); 4 experts 48 wide, 2 per
               token, router bias, the fused gate_up_proj at 4x the scale so the experts' clamp at 7 acts;
               router_aux_loss_coef 0.02; also aux_loss.npy
    deepseek3  DeepseekV3ForCausalLM: deepseek2's shape with query LoRA 12, 8 experts in 4 groups (top 2 per token
               from the best 2 groups, a group scored by its best two), sigmoid router with a random correction
               bias, norm_topk_prob, routed_scaling_factor 2.5, two shared experts
MoE routers get weights 3x the others' scale, so no token's top-k choice hangs on a rounding difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, VOCAB = 128, 64
SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=SEQ,
             bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3_1": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True,
                                                            sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=5e5, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        tie_word_embeddings=False, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                            "original_max_position_embeddings": 32},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        rope_theta=10000.0, tie_word_embeddings=True, sliding_window=32, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        tie_word_embeddings=True, sliding_window=32, query_pre_attn_scalar=24, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        rope_theta=1e6, tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-6, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-6, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                              "partial_rotary_factor": 0.25})),
    "deepseek2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False, rms_norm_eps=1e-6, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        routed_scaling_factor=1.5, topk_method="greedy",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0})),
    "deepseek3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False, rms_norm_eps=1e-6,
        q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        n_shared_experts=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0})),
    # last, so the seeds (a model's index here) of the others stay as they were made
    "qwen3_moe_sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2,
        mlp_only_layers=[3])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})),
}
MOE = ("mixtral", "qwen3_moe", "qwen3_moe_sparse", "qwen3_next", "gpt_oss")


def logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def make(name: str, out: str) -> None:
    import torch
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra}, attn_implementation="eager")
    torch.manual_seed(list(MODELS).index(name))
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # weights of unit-scale activations, so the logits span a range worth comparing
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 1:  # Qwen3.5's (1 + w) norms around 1 as well, so activations keep their scale
                zero_centred = name in ("qwen3_5", "qwen3_next") and "norm" in pname
                centre = 0 if zero_centred and "linear_attn" not in pname else 1
                p.copy_(centre + 0.2 * torch.randn_like(p))
            else:
                routed = name in MOE or name.startswith("deepseek")
                router = 3.0 if routed and pname.endswith(("gate.weight", "router.weight")) else 1.0
                router *= 4.0 if pname.endswith("gate_up_proj") else 1.0  # GPT-OSS: past its clamp at 7 at times
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in pname else router * p.shape[1] ** -0.5))
        for bname, buffer in model.named_buffers():  # DeepSeek-V3's router bias: enough to change some choices
            if bname.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    directory = os.path.join(out, name)
    model.save_pretrained(directory, safe_serialization=True)
    tokens = np.random.default_rng(100 + list(MODELS).index(name)).integers(0, VOCAB, (1, SEQ)).astype(np.int32)
    np.save(os.path.join(directory, "tokens.npy"), tokens)
    np.save(os.path.join(directory, "logits.npy"), logits(model, tokens))
    print(f"{directory}: {sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))} bytes")


def token_losses(name: str, out: str) -> None:
    """The per-position loss of the stored model on its tokens: loss_type ForCausalLM's cross-entropy, unreduced."""
    import torch
    import transformers

    directory = os.path.join(out, name)
    config = json.load(open(os.path.join(directory, "config.json")))
    model = getattr(transformers, config["architectures"][0]).from_pretrained(directory, attn_implementation="eager")
    tokens = torch.from_numpy(np.load(os.path.join(directory, "tokens.npy"))).long()
    with torch.no_grad():
        logits = model.float().eval()(tokens).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="none")
    np.save(os.path.join(directory, "token_losses.npy"), losses.numpy().astype(np.float32))
    print(f"{directory}/token_losses.npy: mean {float(losses.mean()):.4f} over {losses.numel()} positions")


def aux_loss(name: str, out: str) -> None:
    """transformers' load-balancing loss (load_balancing_loss_func, unweighted) of the stored model on its tokens."""
    import torch
    import transformers

    directory = os.path.join(out, name)
    config = json.load(open(os.path.join(directory, "config.json")))
    model = getattr(transformers, config["architectures"][0]).from_pretrained(directory, attn_implementation="eager")
    tokens = torch.from_numpy(np.load(os.path.join(directory, "tokens.npy"))).long()
    with torch.no_grad():
        value = model.float().eval()(tokens, output_router_logits=True).aux_loss
    np.save(os.path.join(directory, "aux_loss.npy"), np.float32(value))
    print(f"{directory}/aux_loss.npy: {float(value):.6f}")


def window_logits(out: str, window: int = 32) -> None:
    import transformers

    directory = os.path.join(out, "mistral")
    model = transformers.MistralForCausalLM.from_pretrained(directory, sliding_window=window,
                                                            attn_implementation="eager").float().eval()
    assert model.config.sliding_window == window
    np.save(os.path.join(directory, f"logits_sliding_window_{window}.npy"),
            logits(model, np.load(os.path.join(directory, "tokens.npy"))))


def check_export(name: str, out: str, python: str = sys.executable) -> float:
    """from_hf then to_hf (fp32) with maxctx; the export, loaded by transformers, must give the stored logits.
    Returns the largest difference relative to the logit range."""
    import transformers

    directory = os.path.join(out, name)
    with tempfile.TemporaryDirectory() as tmp:
        for command in (["from_hf", "--hf_path", directory, "--output_path", f"{tmp}/ckpt"],
                        ["to_hf", "--checkpoint_path", f"{tmp}/ckpt", "--output_path", f"{tmp}/hf", "--dtype",
                         "fp32"]):
            subprocess.run([python, "-m", "maxctx.convert", *command], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        architecture = json.load(open(f"{tmp}/hf/config.json"))["architectures"][0]
        model = getattr(transformers, architecture).from_pretrained(f"{tmp}/hf", attn_implementation="eager")
        expected = np.load(os.path.join(directory, "logits.npy"))
        got = logits(model.float().eval(), np.load(os.path.join(directory, "tokens.npy")))
    error = float(np.abs(got - expected).max() / (expected.max() - expected.min()))
    print(f"{name}: export loads as {type(model).__name__}; logits differ by {error:.2e} of their range")
    assert error < 1e-6, error
    return error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "hf"))
    parser.add_argument("--check-only", action="store_true", help="only check the exports of existing fixtures")
    parser.add_argument("--token-losses-only", action="store_true",
                        help="only write token_losses.npy for the existing fixtures")
    parser.add_argument("--only", nargs="+", choices=list(MODELS), help="only these fixtures")
    parser.add_argument("--maxctx-python", default=sys.executable,
                        help="the Python that runs maxctx's converter (a venv with JAX) when this one has torch only")
    args = parser.parse_args()
    for name in args.only or MODELS:
        if args.token_losses_only:
            token_losses(name, args.out)
            continue
        if not args.check_only:
            make(name, args.out)
            token_losses(name, args.out)
            if name == "mistral":
                window_logits(args.out)
            if name in MOE:
                aux_loss(name, args.out)
        check_export(name, args.out, args.maxctx_python)


if __name__ == "__main__":
    main()
