"""Checkpointing: exact resume (synthetic with CP, and a text source), kill -9 mid async save, SIGTERM, resharding
onto another mesh, params-only and full-state loads, and clear errors for bad load paths and model shapes.

End-to-end runs use `python3 train.py` in subprocesses on 4 simulated CPU devices (fsdp=2 x context=2), tiny
shapes, and one persistent compilation cache, so every run after the first reuses the compiled step."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.processes import BASE_YML, HOOKED_TRAIN, ROOT, cpu_env, losses, run, steps_on_disk, train_command

COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=4",
          "ici_context_parallelism=2", "learning_rate_schedule_steps=20", "checkpoint_period=5",
          "peak_tflops_per_device=1", "enable_tensorboard=false"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return cpu_env(compile_cache=tmp_path_factory.mktemp("jax_cache"))


def command(out: Path, run_name: str, *overrides: str, script: Path | None = None) -> list[str]:
    return train_command(*COMMON, f"base_output_directory={out}", f"run_name={run_name}", *overrides, script=script)


def train(env, out: Path, run_name: str, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = run(command(out, run_name, *overrides), env=env, timeout=300)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_continues(reference: dict[int, float], resumed: dict[int, float], first: int) -> None:
    """Bit-for-bit equal losses from step `first` to the end."""
    steps = sorted(s for s in resumed if s >= first)
    assert steps and steps[-1] == max(reference), (steps, sorted(reference))
    assert [resumed[s] for s in steps] == [reference[s] for s in steps]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """20 steps straight, saving every 5 and keeping 3."""
    out = tmp_path_factory.mktemp("ref")
    train(env, out, "straight", "steps=20")
    return out


def test_straight_run_keeps_last_checkpoints(reference):
    assert steps_on_disk(reference / "straight") == ["10", "15", "20"]
    meta = json.loads((reference / "straight/checkpoints/20/meta/metadata").read_text())
    assert meta["step"] == 20 and meta["seed"] == 0 and len(meta["rng_key"]) == 2
    data = json.loads((reference / "straight/checkpoints/20/data/process_0-of-1.json").read_text())
    assert data["position"] == "global" and data["rows"] == 20 * data["block"]  # the rows of 20 global batches


def test_exact_resume_with_context_parallelism(env, reference, tmp_path):
    train(env, tmp_path, "split", "steps=10")
    first_half = losses(tmp_path / "split")
    proc = train(env, tmp_path, "split", "steps=20")
    assert "resuming from checkpoint step 10" in proc.stdout
    ref = losses(reference / "straight")
    assert [first_half[s] for s in range(1, 11)] == [ref[s] for s in range(1, 11)]
    assert_continues(ref, losses(tmp_path / "split"), first=11)


def test_orbax_storage_keys_write_their_format_and_resume_exactly(env, reference, tmp_path):
    """MaxText's checkpoint_storage_use_zarr3 / _use_ocdbt reach Orbax: zarr v3 arrays, no OCDBT database, and a
    resume from them continues the straight run bit for bit."""
    keys = ("checkpoint_storage_use_zarr3=true", "checkpoint_storage_use_ocdbt=false")
    train(env, tmp_path, "zarr3", "steps=10", *keys)
    state = tmp_path / "zarr3/checkpoints/10/state"
    names = {p.name for p in state.rglob("*")}
    assert "zarr.json" in names and ".zarray" not in names and not any("ocdbt" in n for n in names), sorted(names)
    assert "manifest.ocdbt" in {p.name for p in (reference / "straight/checkpoints/20/state").rglob("*")}
    proc = train(env, tmp_path, "zarr3", "steps=20", *keys)
    assert "resuming from checkpoint step 10" in proc.stdout
    assert_continues(losses(reference / "straight"), losses(tmp_path / "zarr3"), first=11)


def test_kill_during_async_save_resumes_from_last_complete(env, reference, tmp_path):
    proc = subprocess.Popen(command(tmp_path, "killed", "steps=20", script=HOOKED_TRAIN),
                            env={**env, "SLOW_STEP": "15"}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("SAVING 15"):
                break
        assert seen and seen[-1].startswith("SAVING 15"), "".join(seen[-30:])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    on_disk = steps_on_disk(tmp_path / "killed")
    assert "10" in on_disk and "15" not in on_disk and any(s.startswith("15.") for s in on_disk), on_disk
    resumed = train(env, tmp_path, "killed", "steps=20")
    assert "resuming from checkpoint step 10" in resumed.stdout
    assert not any(s.startswith("15.") for s in steps_on_disk(tmp_path / "killed"))  # the cut-off save is removed
    assert_continues(losses(reference / "straight"), losses(tmp_path / "killed"), first=11)


def test_sigterm_finishes_step_saves_and_exits_0(env, reference, tmp_path):
    args = command(tmp_path, "preempted", "steps=20", "checkpoint_period=100", script=HOOKED_TRAIN)
    proc = run(args, env={**env, "SIGTERM_STEP": "7"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "preemption notice (SIGTERM): saved step 7" in proc.stdout
    assert steps_on_disk(tmp_path / "preempted") == ["7"]
    assert max(losses(tmp_path / "preempted")) == 7
    resumed = train(env, tmp_path, "preempted", "steps=20", "checkpoint_period=100")
    assert "resuming from checkpoint step 7" in resumed.stdout
    assert steps_on_disk(tmp_path / "preempted") == ["20", "7"]
    assert_continues(losses(reference / "straight"), losses(tmp_path / "preempted"), first=8)


def test_missing_load_path_exits_2_with_one_line(env, tmp_path):
    missing = tmp_path / "nowhere"
    proc = train(env, tmp_path, "bad", "steps=2", f"load_parameters_path={missing}", expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and f"load_parameters_path='{missing}' does not exist" in errors[0], proc.stderr
    assert not (tmp_path / "bad").exists()


# In-process tests (8 devices from conftest).

def _setup(out: Path, run: str, *overrides: str):
    from maxctx.loader import load_config
    from maxctx.mesh import create_mesh
    from maxctx.train_step import make_setup

    config = load_config([str(BASE_YML), f"base_output_directory={out}", f"run_name={run}",
                          "dtype=float32", "per_device_batch_size=1", "max_target_length=64",
                          "learning_rate_schedule_steps=20", "enable_tensorboard=false", *overrides])
    return make_setup(config, create_mesh(config))


def test_other_model_shape_is_refused_before_writing(reference, tmp_path):
    from maxctx.checkpoint.manager import Checkpointer
    from maxctx.config import ConfigError

    source = reference / "straight/checkpoints"
    for key in ("load_parameters_path", "load_full_state_path"):
        setup = _setup(tmp_path, "wide", "base_emb_dim=64", f"{key}={source}")
        with pytest.raises(ConfigError, match=r"'params/embed' has shape \(256, 128\) in the checkpoint but "
                                              r"\(256, 64\) in this config"):
            Checkpointer(setup.config, setup)
    # Resuming a run under a changed model shape is refused, naming the key (maxctx.checkpoint.compatibility).
    setup = _setup(reference, "straight", "base_num_decoder_layers=3")
    with pytest.raises(ConfigError, match=r"saved with base_num_decoder_layers=2 but this run has 3"):
        Checkpointer(setup.config, setup)
    # The master weights' dtype: bfloat16 was accepted and the float32 state cast (losses off by 3.7e-3).
    setup = _setup(reference, "straight", "weight_dtype=bfloat16")
    with pytest.raises(ConfigError, match=r"saved with weight_dtype='float32' but this run has 'bfloat16'; "
                                          r"resume with weight_dtype=float32"):
        Checkpointer(setup.config, setup)
    assert not (tmp_path / "wide").exists()


def test_load_parameters_and_full_state(reference, tmp_path, monkeypatch):
    import jax
    import orbax.checkpoint as ocp

    from maxctx.checkpoint.manager import Checkpointer

    def restore(setup):
        checkpointer = Checkpointer(setup.config, setup)
        state = checkpointer.restore_or_init(data=None)
        checkpointer.close()
        return state

    saved = ocp.StandardCheckpointer().restore(reference / "straight/checkpoints/20/state")
    monkeypatch.chdir(reference)  # a relative load path (Orbax refused one with a traceback): resolved at load
    setup = _setup(tmp_path, "params", "load_parameters_path=straight/checkpoints/15", "ici_fsdp_parallelism=8")
    state = restore(setup)
    assert int(state["step"]) == 0 and int(state["opt_state"][1][0].count) == 0
    assert not np.array_equal(np.asarray(state["params"]["embed"]), saved["params"]["embed"])  # step 15, not 20

    setup = _setup(tmp_path, "full", f"load_full_state_path={reference / 'straight/checkpoints'}")
    state = restore(setup)
    assert int(state["step"]) == 20
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state["params"], saved["params"])
    assert int(state["opt_state"][1][0].count) == 20
    assert state["params"]["embed"].sharding == setup.state_shardings["params"]["embed"]


def test_resume_onto_another_mesh_and_device_count(env, reference, tmp_path):
    """Step 10 saved on 4 devices as fsdp=2 x context=2 resumes on 8 devices as fsdp=2 x context=4 (same global
    batch): the losses continue as in the uninterrupted run within fp32 tolerance."""
    shutil.copytree(reference / "straight/checkpoints/10", tmp_path / "moved/checkpoints/10")
    mesh_b = ["cpu_devices=8", "per_device_batch_size=0.5", "ici_fsdp_parallelism=2", "ici_context_parallelism=4"]
    proc = train(env, tmp_path, "moved", "steps=20", *mesh_b)
    assert "resuming from checkpoint step 10" in proc.stdout and "'context': 4" in proc.stdout
    ref, moved = losses(reference / "straight"), losses(tmp_path / "moved")
    steps = range(11, 21)
    np.testing.assert_allclose([moved[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


def test_exact_resume_text_source(env, tmp_path):
    from tests.support.fixtures import make_documents, tiny_tokenizer, write_txt

    documents = make_documents(300)
    docs = write_txt(str(tmp_path / "docs.txt"), documents)
    tokenizer = tiny_tokenizer(str(tmp_path / "tok.model"), documents, vocab_size=200)
    source = ["dataset_type=text", f"grain_train_files={docs}", f"tokenizer_path={tokenizer}"]
    train(env, tmp_path, "straight", "steps=20", *source)
    train(env, tmp_path, "split", "steps=10", *source)
    proc = train(env, tmp_path, "split", "steps=20", *source)
    assert "resuming from checkpoint step 10" in proc.stdout
    state = json.loads((tmp_path / "split/checkpoints/20/data/process_0-of-1.json").read_text())
    assert "grain" in state
    assert_continues(losses(tmp_path / "straight"), losses(tmp_path / "split"), first=1)  # both halves


def test_resume_compares_what_makes_the_data_and_the_numbers(tmp_path):
    """The tokenizer's content (not only its path), the shuffle and the weights' dtype are refused when they
    change; the compute dtype gets a notice. A record from before these fields resumes as before."""
    from maxctx.checkpoint.compatibility import check_resume_record, resume_notices, resume_record
    from maxctx.config import ConfigError
    from maxctx.loader import load_config

    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"old vocabulary")
    config = load_config([str(BASE_YML), f"tokenizer_path={tokenizer}", "dtype=float32"])
    saved = resume_record(config, 8)
    check_resume_record(saved, config, 8, "/run/checkpoints/10")
    assert resume_notices(saved, config, 10) == []
    tokenizer.write_bytes(b"new vocabulary")  # the same path, other content
    with pytest.raises(ConfigError, match=f"saved with tokenizer_path='{tokenizer}' holding other content"):
        check_resume_record(saved, config, 8, "/run/checkpoints/10")
    tokenizer.write_bytes(b"old vocabulary")
    for change, expected in (("enable_data_shuffling=false", "resume with enable_data_shuffling=True"),
                             ("weight_dtype=bfloat16", "resume with weight_dtype=float32")):
        with pytest.raises(ConfigError, match=expected):
            check_resume_record(saved, load_config([str(BASE_YML), f"tokenizer_path={tokenizer}", change]), 8, "x")
    (notice,) = resume_notices(saved, load_config([str(BASE_YML), "dtype=bfloat16"]), 10)
    assert notice.startswith("resuming at step 10 with dtype=bfloat16, not float32 as saved") and \
        notice.endswith("resume with dtype=float32"), notice
    (notice,) = resume_notices(saved, load_config([str(BASE_YML), "dtype=float32", "load_balance_loss_weight=0.001"]),
                               10)
    assert notice.endswith("resume with load_balance_loss_weight=0.01"), notice
    check_resume_record(saved, load_config([str(BASE_YML), f"tokenizer_path={tokenizer}", "dtype=float32",
                                            "load_balance_loss_weight=0.001", "router_z_loss_weight=0.001"]), 8, "x")
    old = {k: v for k, v in saved.items() if k not in ("tokenizer_sha256", "enable_data_shuffling", "weight_dtype",
                                                         "dtype")}
    check_resume_record(old, load_config([str(BASE_YML), f"tokenizer_path={tokenizer}", "weight_dtype=bfloat16",
                                          "enable_data_shuffling=false"]), 8, "x")
    assert resume_notices(old, load_config([str(BASE_YML), "dtype=bfloat16"]), 10) == []


def test_rng_key_is_a_function_of_seed_and_step():
    import jax

    from maxctx.checkpoint.manager import rng_key

    assert np.array_equal(jax.random.key_data(rng_key(0, 7)), jax.random.key_data(rng_key(0, 7)))
    assert not np.array_equal(jax.random.key_data(rng_key(0, 7)), jax.random.key_data(rng_key(0, 8)))
