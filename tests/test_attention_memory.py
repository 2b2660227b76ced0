"""Memory from the compiled program (memory_analysis), flash kernel, 8 CPU devices.

- The real train step (tiny model, one sequence, p2p over C = 8): temp bytes per device grow at most x2.2 per
  doubling of S, 8K -> 16K -> 32K tokens.
- Attention in a scanned, rematerialised two-layer stack (the model's structure, compiled in seconds): the same
  growth bound for p2p, a2a and usp at C = 4, and at fixed S = 16K the temp bytes fall from C = 2 to C = 4.
The benchmark (benchmarks/context_parallel.py) shows the dot_product kernel's quadratic growth beside these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxctx.attention.dispatch import AttentionSpec, attend
from tests.support.meshes import FAST_COMPILE, make_mesh

LENGTHS = (8192, 16384, 32768)


def attention_stack_temp_bytes(strategy: str, ring: int, a2a: int, seq: int, kernel: str = "flash") -> int:
    """Temp bytes per device of grad(sum(two scanned, rematerialised attention layers)) for one sequence."""
    mesh = make_mesh(ring, a2a)
    spec = AttentionSpec(kernel=kernel, strategy=strategy, block_q=512, block_kv=512)
    h, k, d = 8, 2, 32

    def loss(w_LDE, x_BSD, pos, seg):
        def layer(x, w):
            q = jnp.einsum("BSD,DE->BSE", x, w).reshape(*x.shape[:2], h, d)
            out = attend(q, q[:, :, :k], q[:, :, k:2 * k], pos, seg, spec, mesh)
            return x + out.reshape(x.shape), None

        y, _ = jax.lax.scan(jax.checkpoint(layer), x_BSD, w_LDE)
        return (y ** 2).sum()

    seq_sharding = NamedSharding(mesh, P(("data", "fsdp"), ("context", "context_a2a")))
    args = (jax.ShapeDtypeStruct((2, h * d, h * d), jnp.float32),
            jax.ShapeDtypeStruct((1, seq, h * d), jnp.float32, sharding=seq_sharding),
            jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=seq_sharding),
            jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=seq_sharding))
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile(FAST_COMPILE)
    return compiled.memory_analysis().temp_size_in_bytes


def train_step_temp_bytes(strategy: str, cp: int, seq: int) -> int:
    from maxctx.loader import load_config
    from maxctx.mesh import create_mesh
    from maxctx.train_step import jit_train_step, make_setup

    config = load_config(["configs/base.yml", f"ici_context_parallelism={cp}", "ici_fsdp_parallelism=1",
                          f"per_device_batch_size={1 / cp}", f"context_parallel_strategy={strategy}",
                          f"max_target_length={seq}", "attention=flash", "dtype=float32",
                          "base_num_query_heads=8", "base_num_decoder_layers=1"])
    setup = make_setup(config, create_mesh(config, jax.devices()[:cp]))
    lowered = jit_train_step(setup).lower(setup.abstract_state, setup.abstract_batch())
    return lowered.compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes


def assert_linear(temps: list[int], what: str):
    ratios = [b / a for a, b in zip(temps, temps[1:])]
    assert all(r <= 2.2 for r in ratios), f"{what}: temp bytes {temps} grow x{np.round(ratios, 2)} per doubling"


def test_train_step_p2p_temp_memory_grows_linearly():
    temps = [train_step_temp_bytes("p2p", 8, seq) for seq in LENGTHS]
    assert_linear(temps, "train step, p2p C=8")


@pytest.mark.parametrize("strategy,ring,a2a,half", [("p2p", 4, 1, (2, 1)), ("a2a", 1, 4, (1, 2)),
                                                    ("usp", 2, 2, (1, 2))])
def test_attention_temp_memory_linear_in_s_and_falls_with_c(strategy, ring, a2a, half):
    temps = [attention_stack_temp_bytes(strategy, ring, a2a, seq) for seq in LENGTHS]
    assert_linear(temps, f"{strategy} {ring}x{a2a}")
    at_half_c = attention_stack_temp_bytes(strategy, *half, LENGTHS[1])
    assert temps[1] < at_half_c, f"{strategy}: temp bytes {temps[1]} at C = 4 vs {at_half_c} at C = 2"


