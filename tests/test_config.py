"""Config loading, coercion and validation: every bad config exits 2 with one readable line, before JAX starts."""

import dataclasses
import os

import pytest
import yaml

from maxctx.config import Config, ConfigError, choices
from maxctx.loader import available_models, load_config, parse_overrides
from maxctx.parallelism import context_degree
from maxctx.train import main
from tests.support.processes import run, train_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")


def test_defaults_and_overrides_are_typed():
    config = load_config([BASE, "steps=7", "learning_rate=1e-3", "scan_layers=false", "run_name=123",
                          "per_device_batch_size=2"])
    assert config.steps == 7 and isinstance(config.steps, int)
    assert config.learning_rate == 1e-3 and isinstance(config.learning_rate, float)
    assert config.scan_layers is False
    assert config.run_name == "123"
    assert config.per_device_batch_size == 2.0


def test_model_preset_fills_shape_and_cli_wins():
    config = load_config([BASE, "model_name=llama3-8b", "base_num_decoder_layers=2"])
    assert (config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads) == (4096, 32, 8)
    assert config.vocab_size == 128256 and config.rope_max_timescale == 500000.0
    assert config.base_num_decoder_layers == 2


def test_base_yml_documents_every_key():
    lines = [line for line in open(BASE) if line.strip() and not line.lstrip().startswith("#")]
    keys = {line.split(":")[0].strip() for line in lines}
    assert keys == set(Config.__dataclass_fields__)
    assert all("#" in line for line in lines), "every key in base.yml needs a one-line comment"


def test_base_yml_values_are_the_schema_defaults():
    # One source of defaults: base.yml states them for users, the schema holds them for code (AttentionSpec and
    # ModelConfig take theirs from the schema); they must not drift apart.
    with open(BASE) as f:
        written = yaml.safe_load(f)
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    differ = {k: (v, defaults[k]) for k, v in written.items() if (v if v is not None else "") != defaults[k]}
    assert not differ, f"base.yml value vs schema default: {differ}"


def test_fixed_choice_keys_are_literals():
    assert choices("attention") == ("auto", "flash", "dot_product", "blockwise", "splash", "cudnn")
    assert "custom" in choices("remat_policy") and choices("decoder_layer_input") == ("remat", "device", "offload")
    assert choices("steps") == ()


def test_presets_exist():
    assert {"tiny", "llama2-7b", "llama3-8b", "llama3.1-70b", "mistral-7b"} <= set(available_models())


def test_config_is_frozen():
    config = load_config([BASE])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 3  # type: ignore[misc]


def test_aliases_and_derived_values():
    config = load_config([BASE, "context_parallel_strategy=ring", "ici_context_parallelism=2", "cpu_devices=2"])
    assert config.context_parallel_strategy == "p2p" and context_degree(config, 2) == 2
    assert load_config([BASE, "context_parallel_strategy=ulysses"]).context_parallel_strategy == "a2a"
    assert load_config([BASE, "steps=30"]).schedule_steps == 30
    assert load_config([BASE, "steps=30", "learning_rate_schedule_steps=50"]).schedule_steps == 50


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a=1", "b=true", "c=0.5", "d=hello", "e="]) == {"a": 1, "b": True, "c": 0.5,
                                                                           "d": "hello", "e": ""}


BAD_CONFIGS = [
    (["stpes=10"], "did you mean 'steps'"),
    (["learning_rte=0.1"], "did you mean 'learning_rate'"),
    (["steps=ten"], "steps='ten'"),
    (["scan_layers=maybe"], "scan_layers='maybe'"),
    (["learning_rate=fast"], "learning_rate='fast'"),
    (["steps=-5"], "steps=-5 must be >= 0"),
    (["steps=1.5"], "steps=1.5"),
    (["model_name=llama9-1t"], "model_name='llama9-1t' has no preset"),
    (["cpu_devices=8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=4"], "there are 8 devices"),
    (["cpu_devices=8", "ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"], "at most one ici_* size may be -1"),
    (["cpu_devices=8", "ici_fsdp_parallelism=-1", "ici_data_parallelism=3"], "does not divide 8"),
    (["cpu_devices=8", "per_device_batch_size=0.1"], "not a whole number of sequences"),
    (["cpu_devices=8", "per_device_batch_size=0.25"], "not divisible by data x fsdp = 8"),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], "base_num_query_heads=6 is not divisible"),
    (["cpu_devices=2", "ici_context_parallelism=2", "max_target_length=6"],
     "max_target_length=6 is not divisible by 4"),
    (["cpu_devices=8", "ici_tensor_parallelism=8"], "tensor parallelism 8"),
    (["attention=magic"], "attention='magic' (from command line) is not one of"),
    (["attention=flahs"], "did you mean 'flash'?"),
    (["context_parallel_strategy=spiral"], "context_parallel_strategy='spiral'"),
    (["context_parallel_strategy=usb"], "did you mean 'usp'?"),
    (["remat_policy=sometimes"], "remat_policy='sometimes'"),
    (["dtype=bfloat61"], "did you mean 'bfloat16'?"),
    (["max_target_length=0"], "max_target_length=0 must be > 0"),
    (["warmup_steps_fraction=1.5"], "warmup_steps_fraction=1.5"),
    (["load_parameters_path=/a", "load_full_state_path=/b"], "set only one"),
    (["run_name=a/b"], "run_name='a/b'"),
    (["dataset_type=text"], "needs grain_train_files"),
    (["dataset_type=text", "grain_train_files=s3://b/*.txt"], "point grain_train_files at the mount"),
    (["steps"], "is not key=value"),
    (["cpu_devices=8", "ici_context_parallelism=8", "context_parallel_strategy=a2a", "base_num_query_heads=6",
      "base_num_kv_heads=2"], "not divisible by the A2A degree 8"),
]


@pytest.mark.parametrize("overrides,expected", BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_bad_config_exits_2_with_one_line(overrides, expected, capsys):
    assert main([BASE, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("config error: ") and expected in err, err


def test_gs_output_without_gcsfs_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gcsfs", "tensorflow") else real(name, *a))
    assert main([BASE, "base_output_directory=gs://bucket/runs"]) == 2
    err = capsys.readouterr().err
    assert "base_output_directory=gs://bucket/runs: gs:// paths need gcsfs" in err and "'.[gcs]'" in err, err


def test_missing_yaml_file(capsys):
    assert main(["configs/does_not_exist.yml"]) == 2
    assert "does_not_exist.yml' does not exist" in capsys.readouterr().err


def test_bad_config_in_a_real_process_has_no_traceback():
    result = run(train_command("ici_fsdp_paralelism=2"), timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "did you mean 'ici_fsdp_parallelism'" in result.stderr.strip().splitlines()[-1]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_retired_keys_in_an_old_config_yml(tmp_path):
    # A run's config.yml written before these keys went still loads when it holds the value that is now fixed
    # behaviour; another value asked for what no longer exists and is refused, naming the key.
    old = {**yaml.safe_load(open("configs/base.yml")), "context_parallel_auto": True, "ring_backward_overlap": False,
           "ring_splash_backward": True}
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(old))
    assert load_config([str(path)]) == load_config(["configs/base.yml"])
    path.write_text(yaml.safe_dump({**old, "ring_backward_overlap": True}))
    with pytest.raises(ConfigError, match="ring_backward_overlap=True is no longer a key"):
        load_config([str(path)])
    with pytest.raises(ConfigError, match="unknown config key 'ring_splash_backward'"):
        load_config(["configs/base.yml", "ring_splash_backward=true"])


def test_relative_paths_are_absolute_from_the_working_directory(tmp_path, monkeypatch):
    """Orbax refused a relative checkpoint path with a traceback; every local path key is now resolved once, at
    load, against the working directory (globs and comma lists part by part), and config.yml names them absolute.
    gs:// URLs and empty keys are kept."""
    from maxctx.loader import PATH_KEYS, parse_config, save_config

    monkeypatch.chdir(tmp_path)
    for name in ("a1.rec", "a2.rec", "b.rec", "tok.model"):
        (tmp_path / name).write_text("")
    config = load_config([BASE, "dataset_type=arrayrecord", "grain_train_files=a*.rec, ./b.rec", "tokenizer_path="
                          "tok.model", "load_parameters_path=run/checkpoints", "base_output_directory=out",
                          "metrics_file=m/metrics.txt", "compiled_trainstep_file=../step.pkl"])
    assert config.grain_train_files == f"{tmp_path}/a*.rec,{tmp_path}/b.rec"
    assert (config.tokenizer_path, config.load_parameters_path, config.base_output_directory) == (
        f"{tmp_path}/tok.model", f"{tmp_path}/run/checkpoints", f"{tmp_path}/out")
    assert (config.metrics_file, config.compiled_trainstep_file) == (f"{tmp_path}/m/metrics.txt",
                                                                     f"{tmp_path.parent}/step.pkl")
    assert config.grain_eval_files == config.load_full_state_path == ""
    save_config(config, str(tmp_path / "run"))
    written = yaml.safe_load((tmp_path / "run" / "config.yml").read_text())
    assert all(written[key] == getattr(config, key) for key in PATH_KEYS)
    kept = parse_config([BASE, "load_full_state_path=gs://bucket/run", "grain_eval_files=gs://b/x*,y"])
    assert kept.load_full_state_path == "gs://bucket/run" and kept.grain_eval_files == f"gs://b/x*,{tmp_path}/y"
    assert parse_config([BASE, "tokenizer_path=~/tok.model"]).tokenizer_path == os.path.expanduser("~/tok.model")


def test_every_path_key_is_resolved():
    from maxctx.config import FIELD_TYPES
    from maxctx.loader import PATH_KEYS

    named = {k for k, kind in FIELD_TYPES.items() if kind is str and
             k.endswith(("_path", "_file", "_files", "_dir", "_directory"))}
    assert named <= set(PATH_KEYS), named - set(PATH_KEYS)


def _hinted_keys() -> set[tuple[str, str]]:
    """(key, where) of every literal `<verb> key=value` fix in maxctx's strings, e.g. "; set dtype=bfloat16"."""
    import ast
    import pathlib
    import re

    hint = re.compile(r"(?:resume with|rerun with|set|add|use|give|choose|e\.g\.|keep|with|or)\s+([a-z_]\w*)=(?!=)")
    found = set()
    for path in pathlib.Path(REPO, "maxctx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= {(m.group(1), path.name) for m in hint.finditer(node.value)}
    return found


def _resume_hints() -> set[tuple[str, str]]:
    """(key, record key) of the `resume with key=` fix of each refusal of maxctx.checkpoint.compatibility, one
    per value a checkpoint records (a key spelled in code, like the global batch's, is only seen here)."""
    import re

    from maxctx.checkpoint.compatibility import NOTICE_KEYS, check_resume_record, resume_record

    config = load_config([BASE])
    now, found = resume_record(config, 8), set()
    for key, value in now.items():
        if key in NOTICE_KEYS:
            continue
        other = not value if isinstance(value, bool) else value + 1 if isinstance(value, int | float) else "x"
        with pytest.raises(ConfigError) as error:
            check_resume_record({**now, key: other}, config, 8, "/run/checkpoints/10")
        found |= {(m.group(1), key) for m in re.finditer(r"resume with ([a-z_]\w*)=", str(error.value))}
    return found


def test_fix_hints_name_config_keys():
    """A fix that names `key=value` names a key the command line takes (the schema's, or a MaxText key maxctx
    reads): "resume with global_batch=4" named none."""
    from maxctx.loader import parse_config

    def accepted(key: str) -> bool:
        try:
            parse_config([BASE, f"{key}=0"])
        except ConfigError as e:
            return f"unknown config key '{key}'" not in str(e)
        return True

    hints = _hinted_keys() | _resume_hints()
    assert len(hints) > 30
    assert not {(key, where) for key, where in hints if not accepted(key)}
