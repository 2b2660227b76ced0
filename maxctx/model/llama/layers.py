"""The Llama / Mistral layer kind (`llama` in maxctx.model.stacks): a pre-norm block of the shared grouped-query
attention and SwiGLU MLP (maxctx.model.layers).

Legend: B batch, S sequence, D model width.
"""

from __future__ import annotations

from flax import nnx

from maxctx.model.layers import MLP, Attention, ModelConfig, RMSNorm


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); `window` > 0 makes the attention local. A family
    with the same block and its own attention (maxctx.model.qwen) subclasses it with another `attention`."""

    attention = Attention

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mesh=None):
        self.attn_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.attn = self.attention(cfg, rngs, mesh)
        self.mlp_norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, cfg.weight_dtype, rngs)
        self.mlp = MLP(cfg, rngs, mesh)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, window: int = 0):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, segment_ids_BS, window)
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))
