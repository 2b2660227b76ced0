"""The model's shape and the numbers that follow from it alone: parameter counts, matmul FLOPs, bytes per dtype.

Their one home: the FLOPs (maxctx.metrics.flops), the planner, the roofline and the decoder's ModelConfig (a
ModelShape) all read them here. Without JAX, so every layer from maxctx.metrics up may import it
(tests/test_layering.py places this module in layer 1).

Legend: D model, H query heads, K kv heads, Dh head dim, F mlp, V vocab, L layers.

    P_layer   = D*Dh*(2H + 2K) + 3*D*F        # wq [D,H,Dh], wk/wv [D,K,Dh], wo [H,Dh,D]; w_gate, w_up [D,F], w_down
    P_matmul  = L * P_layer + D*V             # weights a token meets in matmuls (the unembedding, tied or not)
    P         = L * (P_layer + 2D) + D*V * (1 if tied else 2) + D   # every parameter: norms, embedding, final norm
    matmul    = 6 * P_matmul per token        # 2 FLOPs per MAC, x3 for forward + backward
    attention = 12 * H * Dh per (query, key) pair and layer   # QK^T and PV: 4*H*Dh per pair, x3
"""

from __future__ import annotations

import dataclasses

from maxctx.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a schema dtype (maxctx.config.DType)."""
    return DTYPE_BYTES[dtype]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The decoder's sizes and dtypes (defaults: maxctx.config.Config's); maxctx.model.layers.ModelConfig adds the
    rest of what the layers read."""

    emb_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    num_layers: int
    vocab_size: int
    tied_embedding: bool = Config.logits_via_embedding
    dtype: str = Config.dtype
    weight_dtype: str = Config.weight_dtype

    @classmethod
    def from_config(cls, config: Config) -> ModelShape:
        return cls(emb_dim=config.base_emb_dim, num_heads=config.base_num_query_heads,
                   num_kv_heads=config.base_num_kv_heads, head_dim=config.head_dim, mlp_dim=config.base_mlp_dim,
                   num_layers=config.base_num_decoder_layers, vocab_size=config.vocab_size,
                   tied_embedding=config.logits_via_embedding, dtype=config.dtype, weight_dtype=config.weight_dtype)

    @property
    def mlp_params(self) -> int:
        """One layer's SwiGLU weights: 3 D F."""
        return 3 * self.emb_dim * self.mlp_dim

    @property
    def layer_matmul_params(self) -> int:
        """One layer's matmul weights, P_layer: the Q/K/V/O projections and the MLP."""
        return self.emb_dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads) + self.mlp_params

    @property
    def output_params(self) -> int:
        """The output projection's weights, D V (the embedding table itself when tied)."""
        return self.emb_dim * self.vocab_size

    @property
    def matmul_params(self) -> int:
        """Weights each token multiplies in the forward pass, P_matmul (the embedding lookup is a gather)."""
        return self.num_layers * self.layer_matmul_params + self.output_params

    @property
    def num_params(self) -> int:
        """Every parameter of the decoder, P: what counting its parameter tree gives (tests/test_model.py)."""
        layer = self.layer_matmul_params + 2 * self.emb_dim  # and its two RMSNorm scales
        return self.num_layers * layer + self.output_params * (1 if self.tied_embedding else 2) + self.emb_dim

    def matmul_flops(self, tokens: float) -> float:
        """Forward + backward FLOPs of the weight matmuls over `tokens` tokens: 6 P_matmul each."""
        return 6.0 * self.matmul_params * tokens

    def attention_flops(self, pairs: float) -> float:
        """Forward + backward FLOPs of QK^T and PV over `pairs` (query, key) pairs summed over layers."""
        return 12.0 * self.num_heads * self.head_dim * pairs

    # A hybrid family's linear-attention layers (maxctx.model.qwen35.family) override these three; a softmax
    # family has none.
    @property
    def attention_layers(self) -> int:
        """Layers whose tokens mix by attention, each with the CP strategy's collectives."""
        return self.num_layers

    def linear_flops(self, tokens: float, cp: int = 1) -> float:
        """Forward + backward FLOPs of the linear layers' token mixing over `tokens` tokens per device, C = cp."""
        return 0.0

    def linear_exchange(self, batch: float, cp: int, zigzag: bool) -> tuple[float, int]:
        """(bytes one rank receives, collective-permutes waited for in turn) of one linear layer's forward under CP
        with `batch` rows per device."""
        return 0.0, 0

    @property
    def itemsize(self) -> int:
        """Bytes of one activation element (`dtype`)."""
        return dtype_bytes(self.dtype)

    @property
    def weight_itemsize(self) -> int:
        """Bytes of one stored parameter (`weight_dtype`)."""
        return dtype_bytes(self.weight_dtype)
