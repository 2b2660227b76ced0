"""Input files named by the config: globs expanded, missing files reported as config errors. No JAX, so the
checks run before it starts (maxctx.validate) and again where the data pipeline opens the files. gs:// globs and
paths are looked up in Cloud Storage (maxctx.storage); the readers open local copies of them."""

from __future__ import annotations

import glob
import os

from maxctx import storage
from maxctx.config import Config, ConfigError
from maxctx.datasets import DATASETS

# keys that may name gs:// paths
REMOTE_KEYS = ("base_output_directory", "load_parameters_path", "load_full_state_path", "grain_train_files",
               "grain_eval_files", "tokenizer_path", "tfds_data_dir")


def expand_files(pattern: str, key: str) -> list[str]:
    """Files matching a glob (or a comma-separated list of globs), sorted; ConfigError naming `key` if none."""
    if not pattern:
        fix = ", or set eval_interval=0" if key == "grain_eval_files" else ""
        raise ConfigError(f"{key} is empty; give a file glob, e.g. {key}=/data/shard-*.array_record{fix}")
    files: set[str] = set()
    for part in pattern.split(","):
        if storage.is_remote(part.strip()):
            matches = storage.glob(part.strip(), key)
        else:
            matches = glob.glob(os.path.expanduser(part.strip()))
        if not matches:
            raise ConfigError(f"{key}='{pattern}': '{part.strip()}' matches no files; check the path")
        files.update(m for m in matches if storage.is_remote(m) or os.path.isfile(m))
    if not files:
        raise ConfigError(f"{key}='{pattern}' matches only directories; give a glob of files")
    return sorted(files)


# what tokenizer_path names, per tokenizer_type
_TOKENIZER_FILES = {"sentencepiece": "a sentencepiece .model file (scripts/train_tokenizer.py trains one)",
                    "tiktoken": "a tiktoken BPE file (Llama 3's tokenizer.model)",
                    "huggingface": "a tokenizer.json file or the directory holding it"}


def check_tokenizer_path(path: str, tokenizer_type: str = "sentencepiece") -> None:
    if storage.is_remote(path):
        storage.check_input(path, "tokenizer_path")
        return
    if tokenizer_type == "huggingface" and os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ConfigError(f"tokenizer_path='{path}' is a directory without a tokenizer.json; give "
                              f"{_TOKENIZER_FILES[tokenizer_type]}")
    elif not os.path.isfile(path):
        problem = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"tokenizer_path='{path}' {problem}; with tokenizer_type={tokenizer_type} give "
                          f"{_TOKENIZER_FILES[tokenizer_type]}")


def local_copies(files: list[str]) -> list[str]:
    """The files themselves, with each gs:// one replaced by its local copy (maxctx.storage: the readers need
    local files)."""
    return [storage.local_copy(f) for f in files]


def tfds_local_dir(data_dir: str, dataset_name: str) -> str:
    """tfds_data_dir, or for a gs:// one the local folder holding a copy of just `dataset_name`'s files (TFDS's
    layout <data_dir>/<name>[/<config>]/<version>, so the copy is a valid data_dir)."""
    if not storage.is_remote(data_dir):
        return data_dir
    name = dataset_name.split(":")[0].strip("/")
    storage.local_copy(f"{data_dir.rstrip('/')}/{name}")
    return storage.local_path(data_dir)


def check_remote_paths(config: Config) -> None:
    """Where a run starts, before JAX: every gs:// path of the config probed once (maxctx.storage), so a missing,
    forbidden or unreachable bucket, absent credentials or a missing input is one line, not a client traceback
    minutes later. Only the keys this run reads: eval files only with evals, folders only for their dataset."""
    if storage.is_remote(config.base_output_directory):
        storage.check_output(config.base_output_directory, "base_output_directory")
    for key in ("load_parameters_path", "load_full_state_path"):
        if storage.is_remote(getattr(config, key)):
            storage.check_input(getattr(config, key), key)
    dataset = DATASETS[config.dataset_type]
    if dataset.files:
        train, evaluate = dataset.split_keys
        for key in (train, evaluate) if config.eval_interval > 0 else (train,):
            if storage.is_remote(getattr(config, key)):
                expand_files(getattr(config, key), key)
    if storage.is_remote(config.tokenizer_path):
        check_tokenizer_path(config.tokenizer_path, config.tokenizer_type)
    folder, _ = dataset.folder
    if folder and storage.is_remote(getattr(config, folder)):
        storage.check_input(getattr(config, folder), folder)
