"""maxctx.plan.out_of_memory on a kernel's on-chip overflow: the verdict names the kernel, what it needs against
which limit, and the key to change; tpu_scoped_vmem_limit_kib and tpu_sparse_core_gathers reach the TPU compile.

tests/fixtures/libtpu/*.txt are libtpu 0.0.42.1's messages (jax 0.10.2) for splash's forward at 2048-token blocks,
head_dim 256, printed whole: over the 16 MiB scoped limit (tpu_scoped_vmem_limit_kib=0), and over v5p's 63.94 MiB
of VMEM (the default limit), the latter recorded when splash still loaded its partial blocks (an s32 window of
2048 x 2048, double-buffered); they are now computed in the kernel (maxctx.attention.kernels.splash_masks) and that
compile fits.
"""

from __future__ import annotations

import pathlib

import pytest

from maxctx.plan.out_of_memory import onchip_advice, xla_out_of_memory
from tests.support.tpu_compile import finish, needs_libtpu, start_compile

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "libtpu"
MIB = 2 ** 20
# One layer, 16 query and 4 kv heads of 256 (the record model's attention), 32K tokens, splash at 2048-token blocks.
HEAD_DIM_256 = ("compile_topology=v5p-8", "attention=splash", "base_num_decoder_layers=1", "base_emb_dim=1024",
                "base_num_query_heads=16", "base_num_kv_heads=4", "head_dim=256", "base_mlp_dim=2048",
                "vocab_size=1024", "max_target_length=32768", "per_device_batch_size=1", "flash_block_q=2048",
                "flash_block_kv=2048")


def test_over_the_scoped_limit_names_the_kernel_and_the_key():
    text = (FIXTURES / "vmem_scoped_limit.txt").read_text()
    out = xla_out_of_memory(text)
    assert out["xla_error"] == "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:"
    assert out["xla_error_text"] == text.strip()  # the whole message, not its first line
    assert out["xla_overflow_op"] == "splash_mqa_fwd_segmented_residuals"
    assert (out["xla_overflow_need_bytes"], out["xla_overflow_limit_bytes"]) == (18 * MIB, 16 * MIB)
    advice = onchip_advice(out["xla_memory_space"], "splash", out)
    assert advice.startswith("splash_mqa_fwd_segmented_residuals needs 18.00 MiB of VMEM, over libtpu's scoped "
                             "limit of 16.00 MiB: set tpu_scoped_vmem_limit_kib=18432 or more")
    assert "flash_block_q, flash_block_kv" in advice  # the forward's keys: it is the forward kernel


def test_over_the_chip_names_the_kernel_and_its_largest_buffer():
    out = xla_out_of_memory((FIXTURES / "vmem_capacity.txt").read_text())
    assert out["xla_overflow_op"] == "splash_mqa_fwd_segmented_residuals" and out["xla_overflow_limit"] == "capacity"
    assert out["xla_overflow_need_bytes"] == pytest.approx(70.59 * MIB, abs=0.01 * MIB)
    assert out["xla_overflow_largest"].startswith("32.00M: input window allocation for operator input 8. The window "
                                                  "shape is s32[1,2048,2048]")
    advice = onchip_advice("vmem", "splash", out)
    assert "more than the chip's 63.94 MiB: lower flash_block_q, flash_block_kv" in advice
    assert "tpu_scoped_vmem_limit_kib" not in advice  # no limit to raise: the memory itself is full


def test_a_backward_kernel_gets_its_own_keys():
    overflow = {"xla_overflow_op": "splash_mha_dkv_no_residuals", "xla_overflow_need_bytes": 80 * MIB,
                "xla_overflow_limit_bytes": 64 * MIB, "xla_overflow_limit": "capacity"}
    assert "lower flash_block_q_dkv, flash_block_kv_dkv" in onchip_advice("vmem", "splash", overflow)
    assert onchip_advice("vmem", "splash").startswith("a kernel needs more on-chip VMEM than it has")


def test_a_vmem_overflow_is_named_in_a_real_compile():
    # libtpu's own limit (0): the scoped limit stops the forward kernel, which the verdict names. Under the default
    # (-1, v5p: 65472 KiB) the same kernels fit: their partial blocks are computed in the kernel, not loaded (with
    # them loaded, the recorded capacity overflow above: 70.59 MiB of the chip's 63.94); that compile is
    # tests/test_attention_tpu_compile.py's (attention alone, the same kernels at the same blocks).
    needs_libtpu()
    code, text, report = finish(start_compile(*HEAD_DIM_256, "tpu_scoped_vmem_limit_kib=0"), timeout=600)
    assert code == 3 and report is not None, text
    assert report["xla_overflow_op"].startswith("splash_") and report["xla_overflow_limit"] == "scoped", report
    assert "Ran out of memory in memory space vmem" in report["xla_error_text"]
    assert "DOES NOT COMPILE: on-chip VMEM overflowed, not HBM" in text and report["xla_overflow_op"] in text
    assert "set tpu_scoped_vmem_limit_kib=" in text


GATHER = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from maxctx.loader import load_config
from maxctx.plan import topology
from maxctx.train_step import compiler_options
mesh = Mesh(topology.topology_devices(topology.parse("tpu7x-8"), 1)[:1], ("x",))
whole = NamedSharding(mesh, P())
take = jax.jit(lambda table, ids: jnp.take(table, ids, axis=0), in_shardings=(whole, whole), out_shardings=whole)
lowered = take.lower(jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((131072,), jnp.int32))
for key in ("tpu_sparse_core_gathers=false", "tpu_sparse_core_gathers=true"):
    options = compiler_options(load_config(["configs/base.yml", key]), mesh)
    print(key, lowered.compile(options).as_text().count('execution_thread="sparsecore"'))
"""


def test_gathers_stay_on_the_tensor_cores_unless_the_key_lets_them_go():
    # llama3-8b's embedding lookup of 131,072 tokens compiled for TPU7x: libtpu runs it on the SparseCores by
    # default, which tpu_sparse_core_gathers (false by default, in the step's compile options) turns off
    import subprocess
    import sys

    from tests.support.processes import ROOT, tpu_env

    needs_libtpu()
    done = subprocess.run([sys.executable, "-c", GATHER], cwd=ROOT, env=tpu_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(line.split() for line in done.stdout.strip().splitlines())
    assert counts["tpu_sparse_core_gathers=false"] == "0" and int(counts["tpu_sparse_core_gathers=true"]) > 0, counts
