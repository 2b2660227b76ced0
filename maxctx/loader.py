"""Loading a run's config: YAML files, the model preset, MaxText's keys, the command line, aliases and `auto`.

Load order (later wins): `configs/base.yml`, then the model preset `configs/models/<model_name>.yml`, then the YAML
file named on the command line (if it is not base.yml itself), then command-line overrides; so a run's own
`config.yml` reruns it exactly. A key given twice on the command line: the last wins (as in MaxText), with a
notice on stderr. MaxText's key names and values are read through maxctx.compat. Values are coerced to the
schema's types (maxctx.config) or refused with the key, the value and the fix; unknown keys get the closest key.

`load(argv)` then resolves the strategy (an alias such as ring or ulysses to its name; `auto` to the strategy and
A2A degree maxctx.plan.planner chooses, the planner running once; `remat_policy=auto` to `custom` with each tensor
placed by it, maxctx.plan.remat) and runs every check of maxctx.validate, all before JAX is imported. It returns the
config and, for `auto`, the planner's table.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Literal, NamedTuple, get_origin

import yaml

from maxctx import compat
from maxctx.attention.cp import strategies
from maxctx.config import FIELD_TYPES, MODEL_KEYS, Config, choices
from maxctx.errors import ConfigError, article, did_you_mean
from maxctx.files import REMOTE_KEYS
from maxctx.plan import planner, topology
from maxctx.validate import check_devices, validate

# The repo's configs/ (a source checkout, `pip install -e`), or the copy a wheel carries in the package.
_PACKAGED_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
REPO_CONFIG_DIR = (_PACKAGED_CONFIG_DIR if os.path.isdir(_PACKAGED_CONFIG_DIR) else
                   os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
# Keys older versions wrote into a run's config.yml that the schema no longer has, with the value that is now fixed
# behaviour (None: any value): read and dropped. Another value is refused, since it asked for what no longer exists.
RETIRED_KEYS: dict[str, Any] = {"context_parallel_auto": None, "ring_backward_overlap": False,
                                "ring_splash_backward": True}


# The keys naming local files or folders: made absolute against the working directory when the config loads, so
# Orbax (which refuses relative checkpoint paths) and every later use, and the run's config.yml, see one path.
PATH_KEYS = (*REMOTE_KEYS, "metrics_file", "compiled_trainstep_file", "local_checkpoint_directory")
_GLOB_LISTS = ("grain_train_files", "grain_eval_files")  # comma-separated globs (maxctx.files.expand_files)


class Loaded(NamedTuple):
    """What `load` returns: `config, plan = load(argv)`."""

    config: Config
    plan: planner.Plan | None  # the planner's ranked table when context_parallel_strategy=auto chose; else None


def load(argv: list[str]) -> Loaded:
    """Builds and checks a Config from `[config.yml] key=value ...` (the command line of train.py,
    maxctx.compile and maxctx.evaluate)."""
    config, plan = parse_config(argv), None
    # the planner's choice (strategy, remat placement or both), checked by the same rules as any other
    if config.context_parallel_strategy == "auto" or config.remat_policy == "auto":
        n = topology.num_devices(config)
        config, plan = planner.resolve_auto(config, None if n is None else lambda c: check_devices(c, n))
    config = dataclasses.replace(config,
                                 context_parallel_strategy=strategies.resolve(config.context_parallel_strategy))
    validate(config)
    return Loaded(config, plan)


def load_config(argv: list[str]) -> Config:
    """`load(argv).config`, for callers that do not print the planner's table."""
    return load(argv).config


def _without_retired(raw: dict[str, Any]) -> dict[str, Any]:
    for key, fixed in RETIRED_KEYS.items():
        if key in raw and fixed is not None and raw[key] != fixed:
            raise ConfigError(f"{key}={raw[key]} is no longer a key: maxctx always runs as {key}={fixed} "
                              f"(docs/long_context.md, 'Ring backward keys'); remove it from the YAML file")
    return {k: v for k, v in raw.items() if k not in RETIRED_KEYS}


def _closest(key: str) -> str:
    return "; " + did_you_mean(key, FIELD_TYPES, cutoff=0.75, otherwise="see configs/base.yml for the valid keys")


def _choose(key: str, value: Any, source: str) -> Any:
    options = choices(key)
    if isinstance(value, str) and value in options:
        return value
    if True in options and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
        return value if isinstance(value, bool) else str(value).lower() == "true"  # a key taking true/false too
    names = [str(o).lower() if isinstance(o, bool) else o for o in options]
    raise ConfigError(f"{key}='{value}' (from {source}) is not one of {', '.join(names)}; "
                      f"{did_you_mean(str(value), names)}")


def _coerce(key: str, value: Any, source: str) -> Any:
    """Coerces a YAML-parsed value to the field's type, or raises a ConfigError naming the key."""
    if key not in FIELD_TYPES:
        raise ConfigError(f"unknown config key '{key}' (from {source}){_closest(key)}")
    kind = FIELD_TYPES[key]
    if get_origin(kind) is Literal:
        return _choose(key, value, source)
    bad = ConfigError(f"{key}={value!r} (from {source}) is not a valid {kind.__name__}; "
                      f"give {article(kind.__name__)}, e.g. {key}={Config.__dataclass_fields__[key].default!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise bad
    if kind is float:
        if isinstance(value, bool):
            raise bad
        try:
            result = float(value)  # YAML 1.1 reads '1e-3' as a string; float() takes it.
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(result):
            raise bad
        return result
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file, e.g. configs/base.yml")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {_yaml_error_where(path, e)}; fix the YAML there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of key: value, not {type(data).__name__}")
    return data


def _yaml_error_where(path: str, error: yaml.YAMLError) -> str:
    """"'f.yml', line 3, column 1: did not find expected ',' or ']' (while parsing a flow sequence started at line
    2, column 6)" from PyYAML's marks (0-based)."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"'{path}' is not valid YAML: {str(error).splitlines()[0]}"
    what = getattr(error, "problem", None) or "invalid YAML"
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and start is not None:
        what += f" ({context} started at line {start.line + 1}, column {start.column + 1})"
    return f"'{path}', line {mark.line + 1}, column {mark.column + 1}: {what}"


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Parses `key=value` arguments; values are read as YAML (so `true`, `8`, `0.5` get their types). A key given
    twice keeps its last value, with a notice on stderr."""
    overrides: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value; write e.g. steps=100")
        key, raw = arg.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if key in overrides and overrides[key] != value:
            print(f"notice: {key} is given twice on the command line; using the last, {key}={raw}", file=sys.stderr)
        overrides[key] = value
    return overrides


def model_preset_path(model_name: str) -> str:
    return os.path.join(REPO_CONFIG_DIR, "models", f"{model_name}.yml")


def available_models() -> list[str]:
    folder = os.path.join(REPO_CONFIG_DIR, "models")
    return sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".yml"))


def parse_config(argv: list[str]) -> Config:
    """Builds a Config from `[config.yml] key=value ...` (the train.py command line), without resolving the
    strategy or the cross-field checks (`load` does both)."""
    args = list(argv)
    base = os.path.join(REPO_CONFIG_DIR, "base.yml")
    user = find_yaml(args.pop(0)) if args and "=" not in args[0] else None
    if user is not None and os.path.samefile(user, base):
        user = None
    layers = [(base, _read_yaml(base))]
    if user is not None:
        layers.append((user, compat.translate(_without_retired(_read_yaml(user)), user)))
    layers.append(("command line", compat.translate(parse_overrides(args), "command line")))
    merged = {k: v for _, raw in layers for k, v in raw.items()}  # later layers win
    source = {k: name for name, raw in layers for k in raw}
    user_keys = {k for _, raw in layers[1:] for k in raw}
    merged, scale = compat.resolve(merged, user_keys)
    values = {k: _coerce(k, v, source.get(k, "MaxText's meaning")) for k, v in merged.items()}
    values.update({k: absolute_path(k, values[k]) for k in PATH_KEYS if k in values})
    preset = _preset(values.get("model_name", Config.model_name))
    preset.update({k: values[k] for k in user_keys & set(preset)})  # the user's file and command line win
    return Config(**compat.scale_model({**values, **preset}, scale))


def absolute_path(key: str, value: str) -> str:
    """A local path (each part of a comma list of globs) resolved against the working directory, `~` expanded;
    URLs (gs://) and empty values as given."""
    parts = value.split(",") if key in _GLOB_LISTS else [value]
    return ",".join(os.path.abspath(os.path.expanduser(part.strip())) if part.strip() and "://" not in part
                    else part.strip() for part in parts)


def usage(command: str, what: str) -> str:
    """The --help text of the entry points."""
    return (f"usage: {command} [CONFIG.yml] key=value ...\n{what}\n"
            f"Settings, later wins: {os.path.join(REPO_CONFIG_DIR, 'base.yml')}, the model preset of model_name "
            f"({os.path.join(REPO_CONFIG_DIR, 'models')}), CONFIG.yml, then the key=value overrides. Every key is "
            f"documented in base.yml; MaxText's key names are accepted (docs/from_maxtext.md).")


def find_yaml(path: str) -> str:
    """`path`, or for `configs/...` paths that are not there (an installed wheel, run from elsewhere) the bundled
    copy."""
    if os.path.isfile(path):
        return path
    parts = os.path.normpath(path).split(os.sep)
    bundled = os.path.join(REPO_CONFIG_DIR, *parts[parts.index("configs") + 1:]) if "configs" in parts else ""
    if bundled and os.path.isfile(bundled):
        return bundled
    raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file, e.g. configs/base.yml "
                      f"(the bundled ones are in {REPO_CONFIG_DIR})")


def _preset(model_name: str) -> dict[str, Any]:
    path = model_preset_path(model_name)
    if not os.path.isfile(path):
        compat.check_model_name(model_name, available_models())
        raise ConfigError(f"model_name='{model_name}' has no preset {path}; choose one of "
                          f"{', '.join(available_models())}")
    preset = _read_yaml(path)
    for key in preset:
        if key not in MODEL_KEYS:
            raise ConfigError(f"model preset {path} sets '{key}', which is not a model-shape key; presets may set "
                              f"only {', '.join(MODEL_KEYS)}")
    return {k: _coerce(k, v, path) for k, v in preset.items()}


def save_config(config: Config, run_dir: str) -> None:
    """Writes the resolved config to <run_dir>/config.yml (local paths or gs:// through etils.epath)."""
    from etils import epath

    path = epath.Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
