"""`python -m maxctx.launch gke --tpu_type v5p-128 --num_slices 2 --image IMAGE --workload NAME --cluster CLUSTER
[--output jobset.yaml] -- configs/base.yml key=value ...`: checks the config for that many slices of that TPU
type (every check `python train.py` runs before JAX, the device count included), then prints the XPK command and
writes the JobSet manifest (docs/gke.md). Bad input: exit 2 with one line."""

from __future__ import annotations

import argparse
import re
import shlex
import sys

import yaml

from maxctx.config import ConfigError
from maxctx.launch import gke
from maxctx.plan import topology


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m maxctx.launch", description=__doc__)
    sub = parser.add_subparsers(dest="target", required=True)
    g = sub.add_parser("gke", help="an XPK command and a JobSet manifest for GKE TPU node pools")
    g.add_argument("--tpu_type", required=True, help="e.g. v5p-128, v6e-256, tpu7x-128")
    g.add_argument("--num_slices", type=int, default=1)
    g.add_argument("--image", required=True, help="the maxctx TPU image (docker/Dockerfile.tpu) in a registry")
    g.add_argument("--workload", required=True, help="the JobSet / XPK workload name (a DNS label)")
    g.add_argument("--cluster", default="CLUSTER", help="the GKE cluster (XPK)")
    g.add_argument("--project", default="")
    g.add_argument("--zone", default="")
    g.add_argument("--max_restarts", type=int, default=0, help="JobSet restarts of the whole job on a failure")
    g.add_argument("--output", default="", help="where to write the JobSet manifest (default: print it)")
    g.add_argument("config", nargs=argparse.REMAINDER, help="-- then the train.py arguments")
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> tuple[list[str], topology.Topology]:
    from maxctx.loader import load_config

    config_args = args.config[1:] if args.config[:1] == ["--"] else args.config
    if not config_args:
        raise ConfigError("no train.py arguments; add them after --, e.g. -- configs/base.yml model_name=llama3-8b")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", args.workload):
        raise ConfigError(f"--workload={args.workload} must be a DNS label of at most 40 characters (lower-case "
                          f"letters, digits and '-', starting with a letter): it names the JobSet and its pods")
    if args.num_slices < 1:
        raise ConfigError(f"--num_slices={args.num_slices} must be >= 1")
    where = topology.parse(args.tpu_type)
    if any(a.startswith(("compile_topology=", "cpu_devices=")) for a in config_args):
        raise ConfigError("the train.py arguments set compile_topology or cpu_devices; drop them (the launcher "
                          "checks the config for --tpu_type and --num_slices)")
    # The config as the pods will load it, checked for this slice count of this TPU type (no devices needed).
    load_config([*config_args, f"compile_topology={args.tpu_type}", f"compile_topology_num_slices={args.num_slices}"])
    return config_args, where


def cli(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        config_args, where = check(args)
    except ConfigError as e:
        print(f"launch error: {e}", file=sys.stderr)
        sys.exit(2)
    manifest = yaml.safe_dump(gke.jobset(args.workload, where, args.num_slices, args.image, config_args,
                                         args.max_restarts), sort_keys=False)
    print("# XPK:")
    print(shlex.join(gke.xpk_command(args.workload, args.cluster, args.tpu_type, args.num_slices, args.image,
                                     config_args, args.project, args.zone, args.max_restarts)))
    if args.output:
        with open(args.output, "w") as f:
            f.write(manifest)
        print(f"# JobSet manifest written to {args.output}; without XPK: kubectl apply -f {args.output}")
    else:
        print("# JobSet manifest (kubectl apply -f -):")
        print(manifest)
