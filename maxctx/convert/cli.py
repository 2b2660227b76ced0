"""The converter's command line:

    python -m maxctx.convert from_hf --hf_path DIR --output_path DIR [--skip_mtp_layers] [model_name=... key=value ...]
    python -m maxctx.convert to_hf --checkpoint_path DIR --output_path DIR [--dtype bf16|fp32] [key=value ...]

Relative paths are taken from the working directory. Exit status: 0 converted, 2 a bad input (one line naming the
file or key and the fix).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from maxctx import storage
from maxctx.errors import ConfigError

EXIT_BAD_INPUT = 2


def _path(value: str) -> str:
    """A path flag, made absolute as the command line is read (Orbax refuses relative paths); gs:// as it is."""
    return value if not value or storage.is_remote(value) else os.path.abspath(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maxctx.convert",
                                     description="Hugging Face checkpoints to maxctx checkpoints and back.",
                                     epilog="Exit status: 0 converted, 2 bad input.")
    commands = parser.add_subparsers(dest="command", required=True)
    importer = commands.add_parser("from_hf", help="Hugging Face directory -> maxctx checkpoint")
    importer.add_argument("--hf_path", required=True, type=_path,
                          help="config.json and *.safetensors (with their index)")
    importer.add_argument("--output_path", required=True, type=_path,
                          help="new directory: the checkpoint (load_parameters_path=DIR) and DIR/model.yml")
    importer.add_argument("--skip_mtp_layers", action="store_true",
                          help="convert a checkpoint's main model without its multi-token prediction layers, "
                               "which maxctx does not train (DeepSeek-V3's num_nextn_predict_layers, Qwen3.5's and "
                               "Qwen3-Next's mtp_num_hidden_layers)")
    exporter = commands.add_parser("to_hf", help="maxctx checkpoint -> Hugging Face directory")
    exporter.add_argument("--checkpoint_path", required=True, type=_path,
                          help="a step directory (<run>/checkpoints/<step>) or a checkpoints directory (latest step)")
    exporter.add_argument("--output_path", required=True, type=_path,
                          help="the HF directory; weights an earlier export left there are replaced")
    exporter.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    exporter.add_argument("--architecture", choices=("llama", "mistral"), default="",
                          help="default: the imported model's, else llama")
    exporter.add_argument("--hf_base", default="", type=_path,
                          help="the HF directory the model started from: its config.json entries (token ids, "
                               "context length, architecture) are kept and its tokenizer files copied")
    exporter.add_argument("--max_shard_gb", default="5", help="safetensors shard size (GB, 10^9)")
    return parser


def _check_output(output_path: str) -> None:
    """The output directory can be made: neither it nor a folder above it is a file."""
    existing = output_path
    while existing and not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    if os.path.exists(existing) and not os.path.isdir(existing):
        raise ConfigError(f"--output_path {output_path}: {existing} is a file, not a directory; give a directory "
                          f"path")


def _shard_bytes(max_shard_gb: str) -> int:
    try:
        size = float(max_shard_gb)
    except ValueError:
        size = math.nan
    if not (math.isfinite(size) and size > 0):
        raise ConfigError(f"--max_shard_gb {max_shard_gb} must be a positive number of GB (10^9 bytes); the "
                          f"default is 5, as Hugging Face shards")
    return max(1, int(size * 1e9))


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"convert error: unknown argument '{bad[0]}'; options are --flags, model keys are key=value",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    # The converter uses no accelerator; on a TPU VM it must not take the chips from a training run.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from maxctx.checkpoint.manager import CheckpointError

    try:
        _check_output(args.output_path)
        if args.command == "from_hf":
            from maxctx.convert.from_hf import import_hf

            import_hf(args.hf_path, args.output_path, overrides, skip_mtp_layers=args.skip_mtp_layers)
        else:
            from maxctx.convert.to_hf import export_hf

            export_hf(args.checkpoint_path, args.output_path, args.dtype, overrides, args.architecture,
                      _shard_bytes(args.max_shard_gb), args.hf_base)
    except (ConfigError, CheckpointError) as e:
        print(f"convert error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
