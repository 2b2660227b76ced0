"""Entry points: `python -m maxctx.train`, `python train.py`, `python -m maxctx.compile` and their console scripts
answer --help; an installed package (not the source tree) finds its bundled configs from any directory."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.support.processes import BASE_YML, ROOT, cpu_env, losses, run, train_command


@pytest.mark.parametrize("command", [["-m", "maxctx.train"], ["train.py"], ["-m", "maxctx.compile"],
                                     ["-m", "maxctx.evaluate"]])
def test_help(command):
    result = subprocess.run([sys.executable, *command, "model_name=llama3-8b", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and "base.yml" in result.stdout, result.stdout


def test_module_entry_point_reports_config_errors():
    result = subprocess.run([sys.executable, "-m", "maxctx.train", "configs/base.yml", "stpes=3"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "did you mean 'steps'" in result.stderr, result.stderr


def test_console_scripts_are_declared():
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert "maxctx-train=maxctx.train:cli" in setup and "maxctx-compile=maxctx.compile:cli" in setup
    assert "maxctx-evaluate=maxctx.evaluate.cli:cli" in setup
    from maxctx import compile, train
    from maxctx.evaluate import cli as evaluate

    assert callable(train.cli) and callable(compile.cli) and callable(evaluate.cli)


def test_built_package_carries_its_configs(tmp_path):
    # What `pip install .` puts in site-packages: setup.py's build_py copies configs/ into the package.
    build = tmp_path / "build"
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (build / "maxctx" / "configs" / "base.yml").is_file()
    assert (build / "maxctx" / "configs" / "models" / "llama3-8b.yml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import maxctx; from maxctx.loader import load_config; "
            "c = load_config(['configs/base.yml', 'model_name=llama3-8b']); print(maxctx.__file__, c.base_emb_dim)")
    result = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(build)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(build / "maxctx" / "__init__.py"), "4096"]


def test_compiled_trainstep_file_is_loaded_instead_of_compiling(tmp_path):
    # MaxText's AOT flow: maxctx.compile writes the compiled step, training loads it; same losses as compiling.
    step_file = tmp_path / "step.pickle"
    common = ["cpu_devices=2", "ici_fsdp_parallelism=2", "steps=3", "log_period=1", "enable_checkpointing=false",
              "dtype=float32", f"base_output_directory={tmp_path}"]
    made = run([sys.executable, "-m", "maxctx.compile", str(BASE_YML), *common,
                f"compiled_trainstep_file={step_file}"], env=cpu_env())
    assert made.returncode == 0 and step_file.is_file(), made.stderr[-2000:]
    metrics_file = tmp_path / "maxtext" / "metrics.txt"
    for name, extra in (("compiled", [f"metrics_file={metrics_file}"]),
                        ("loaded", [f"compiled_trainstep_file={step_file}"])):
        done = run(train_command(*common, f"run_name={name}", *extra), env=cpu_env())
        assert done.returncode == 0, done.stderr[-2000:]
    assert losses(tmp_path / "loaded") == losses(tmp_path / "compiled") and len(losses(tmp_path / "loaded")) == 3
    # metrics_file: MaxText's per-step lines, keyed by its tags, step = the 0-based step index
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["learning/loss"] for line in lines] == [losses(tmp_path / "compiled")[s] for s in (1, 2, 3)]
    assert {"perf/step_time_seconds", "learning/grad_norm", "learning/current_learning_rate"} <= set(lines[-1])
    other = run(train_command(*common, "run_name=other", "base_num_decoder_layers=3",
                              f"compiled_trainstep_file={step_file}"), env=cpu_env())
    assert other.returncode == 2 and "was compiled for another model, batch or mesh" in other.stderr, other.stderr
    digest = tmp_path / "step.pickle.sha256"  # written by maxctx.compile beside the file, checked before unpickling
    assert digest.read_text() == f"{hashlib.sha256(step_file.read_bytes()).hexdigest()}  step.pickle\n"
    changed = bytearray(step_file.read_bytes())
    changed[len(changed) // 2] ^= 1
    step_file.write_bytes(bytes(changed))
    line = compiled_step_refusal(step_file, "false")
    assert "was changed since `python -m maxctx.compile` wrote it" in line, line


class Touch:
    """A pickle whose loading creates `marker`, as a hostile compiled_trainstep_file could run any command."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def compiled_step_refusal(path, trusted: str) -> str:
    """The one-line ConfigError of loading compiled_trainstep_file=`path` (a config, no model: the file is refused
    or fails before the run's shapes are compared)."""
    from maxctx.config import ConfigError
    from maxctx.loader import load_config
    from maxctx.train_step import load_compiled

    config = load_config([str(BASE_YML), f"compiled_trainstep_file={path}",
                          f"compiled_trainstep_file_trusted={trusted}"])
    with pytest.raises(ConfigError) as refused:
        load_compiled(config.compiled_trainstep_file, SimpleNamespace(config=config))
    line = str(refused.value)
    assert len(line.splitlines()) == 1 and line.startswith(f"compiled_trainstep_file={path} "), line
    return line


def test_a_compiled_trainstep_file_maxctx_did_not_write_is_not_unpickled(tmp_path):
    marker, hostile = tmp_path / "ran", tmp_path / "step.pickle"
    hostile.write_bytes(pickle.dumps(Touch(marker)))
    line = compiled_step_refusal(hostile, "false")
    assert not marker.exists()
    assert "was not written by `python -m maxctx.compile` (no step.pickle.sha256 beside it)" in line, line
    assert "loading it runs code from it" in line and "python -m maxctx.compile" in line, line
    assert "compiled_trainstep_file_trusted=true if you trust whoever wrote it" in line, line
    (tmp_path / "step.pickle.sha256").write_text(f"{hashlib.sha256(b'other bytes').hexdigest()}  step.pickle\n")
    assert "was changed since" in compiled_step_refusal(hostile, "false") and not marker.exists()
    assert "cannot be loaded here" in compiled_step_refusal(hostile, "true")
    assert marker.exists()  # trusted: unpickled, so the refusals above can fail


def test_reuse_example_batch_trains_on_one_batch(tmp_path):
    # MaxText's performance-test mode: every step sees the first batch. Step 1 is the same as a normal run's; from
    # then on the runs see different data, so their losses part.
    for name, reuse in (("reuse", 1), ("normal", 0)):
        done = run(train_command("cpu_devices=1", "steps=4", "log_period=1", "enable_checkpointing=false",
                                 "dtype=float32", f"reuse_example_batch={reuse}", f"base_output_directory={tmp_path}",
                                 f"run_name={name}"), env=cpu_env())
        assert done.returncode == 0, done.stderr[-2000:]
    reuse, normal = losses(tmp_path / "reuse"), losses(tmp_path / "normal")
    assert len(reuse) == len(normal) == 4 and reuse[1] == normal[1]
    assert all(reuse[s] != normal[s] for s in (2, 3, 4)), (reuse, normal)
