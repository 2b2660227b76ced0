"""Hugging Face fixtures (tests/fixtures/hf, made by scripts/make_hf_fixtures.py) loaded through train.py's load
path: a checkpoint's setup, its logits on fixed tokens on 1 device or under a CP strategy, its safetensors read
back."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from maxctx.attention.cp.load_balance import reorder_batch, restore_order
from maxctx.checkpoint.manager import Checkpointer
from maxctx.convert import safetensors
from maxctx.loader import load_config
from maxctx.mesh import batch_sharding, create_mesh
from maxctx.train_step import make_setup

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf"


def setup(checkpoint: Path, devices: int, *overrides: str):
    config = load_config([str(checkpoint / "model.yml"), f"load_parameters_path={checkpoint}", "dtype=float32",
                          "enable_checkpointing=false", "per_device_batch_size=1", "max_target_length=128",
                          *overrides])
    made = make_setup(config, create_mesh(config, jax.devices()[:devices]))
    return config, made, Checkpointer(config, made).restore_or_init(None)


def logits(checkpoint: Path, tokens: np.ndarray, cp: int = 1, *overrides: str) -> np.ndarray:
    config, made, state = setup(checkpoint, cp, f"ici_context_parallelism={cp}", *overrides)
    seq = tokens.shape[1]
    batch = {"inputs": tokens, "positions": np.arange(seq, dtype=np.int32)[None],
             "segment_ids": np.ones_like(tokens)}
    balanced = config.context_parallel_load_balance and cp > 1
    if balanced:
        batch = reorder_batch(batch, cp)
    batch = {k: jax.device_put(v, batch_sharding(made.mesh)) for k, v in batch.items()}
    forward = jax.jit(lambda p, b: nnx.merge(made.graphdef, p)(b["inputs"], b["positions"], b["segment_ids"]))
    out = np.asarray(forward(state["params"], batch))
    return restore_order(out, cp) if balanced else out


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / (expected.max() - expected.min()))


def tensors(directory: Path) -> dict[str, np.ndarray]:
    return {name: safetensors.read(info) for name, info in safetensors.model_tensors(str(directory)).items()}


def import_fixtures(out: Path, names) -> dict[str, Path]:
    """Each named fixture imported (maxctx.convert's from_hf, quietly) under `out`."""
    from maxctx.convert.from_hf import import_hf

    for name in names:
        import_hf(str(FIXTURES / name), str(out / name), [], say=lambda *args, **kwargs: None)
    return {name: out / name for name in names}

