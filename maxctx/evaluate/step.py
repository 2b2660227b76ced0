"""The jitted eval step and the position buckets of loss by position.

Buckets double: a token at 0-based position p inside its document (the batch's `positions`, which restart at 0
for every packed document) is the document's (p + 1)-th token and falls in the bucket [2^k, 2^(k+1)) holding
p + 1; the last bucket is closed at the sequence length S, so S = 2^n gives n buckets 1-2, 2-4, ..., S/2-S.
Positions travel with the tokens, so the buckets are the same in any token order (zig-zag included) and on
any mesh: each bucket's sums are reduced over every token of the global batch, once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.train_step import TrainSetup, compiler_options


def num_buckets(seq_len: int) -> int:
    """Doubling buckets covering positions 1..seq_len (the last one closed at seq_len)."""
    return max(1, math.ceil(math.log2(seq_len)))


def bucket_labels(seq_len: int) -> list[str]:
    """'1-2', '2-4', ..., the last ending at seq_len: the keys of `loss_by_position`."""
    n = num_buckets(seq_len)
    return [f"{2 ** k}-{2 ** (k + 1) if k < n - 1 else seq_len}" for k in range(n)]


def bucket_of(positions_BS: jax.Array, seq_len: int) -> jax.Array:
    """The bucket index [B, S] of each token: floor(log2(position + 1)), the last bucket taking the rest.
    Integer arithmetic (the highest set bit), so a power of two never rounds into the bucket below."""
    n = num_buckets(seq_len)
    bit_length = 32 - jax.lax.clz(positions_BS.astype(jnp.int32) + 1)
    return jnp.minimum(bit_length - 1, n - 1)


def eval_sums(ce_BS: jax.Array, correct_BS: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """What an eval batch adds up, from per-token cross-entropy and right greedy predictions: loss_sum,
    weight_sum, rows (holding a weight), bucket_loss and bucket_weight [num_buckets(S)], and row_correct [B]
    (1 where every weighted token's greedy prediction is its target: how a passkey answer is scored)."""
    weights_BS = batch["weights"].astype(jnp.float32)
    seq_len = batch["inputs"].shape[1]
    in_bucket_BSK = jax.nn.one_hot(bucket_of(batch["positions"], seq_len), num_buckets(seq_len),
                                   dtype=jnp.float32) * weights_BS[..., None]
    scored_B = jnp.any(weights_BS > 0, axis=1)
    all_right_B = jnp.all(correct_BS | (weights_BS == 0), axis=1) & scored_B
    return {"loss_sum": jnp.sum(ce_BS * weights_BS), "weight_sum": jnp.sum(weights_BS),
            "rows": jnp.sum(scored_B.astype(jnp.float32)), "bucket_loss": jnp.einsum("BS,BSK->K", ce_BS, in_bucket_BSK),
            "bucket_weight": jnp.sum(in_bucket_BSK, axis=(0, 1)), "row_correct": all_right_B.astype(jnp.float32)}


def eval_step_fn(setup: TrainSetup):
    """`(params, batch) -> eval_sums` of the model (unjitted)."""

    def step(params, batch):
        model = nnx.merge(setup.graphdef, params)
        ce_BS, correct_BS = model.token_scores(batch["inputs"], batch["positions"], batch["segment_ids"],
                                               batch["targets"])
        return eval_sums(ce_BS, correct_BS, batch)

    return step


def jit_eval_step(setup: TrainSetup):
    """The eval step, jitted for any batch shape (one compile per shape: the eval split's, each passkey length);
    every output replicated, the caller adds sums across batches and divides once."""
    replicated = NamedSharding(setup.mesh, P())
    return jax.jit(eval_step_fn(setup), in_shardings=(setup.state_shardings["params"], setup.batch_shardings),
                   out_shardings=replicated, compiler_options=compiler_options(setup.config, setup.mesh))
