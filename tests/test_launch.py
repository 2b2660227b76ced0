"""`python -m maxctx.launch gke`: the JobSet manifests it writes validate offline against JobSet's CRD schema
(vendored in tests/fixtures/jobset) and each slice's Job against Kubernetes' own batch/v1 schema
(kubernetes-validate, strict); the XPK command carries the workload; multi-slice pods get the MEGASCALE_*
settings JAX's cluster detection reads; a config that does not fit the TPU type exits 2 with one line."""

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from maxctx.launch import gke
from maxctx.launch.cli import cli
from maxctx.plan import topology

SCHEMA = json.loads((Path(__file__).parent / "fixtures" / "jobset" / "jobset.x-k8s.io_v1alpha2.schema.json")
                    .read_text())
K8S = "1.33.0"
CONFIG = ["configs/base.yml", "model_name=llama3-8b", "max_target_length=131072", "ici_fsdp_parallelism=8",
          "ici_context_parallelism=-1", "context_parallel_strategy=p2p", "base_output_directory=gs://bucket/runs"]


def validate(manifest: dict) -> None:
    jsonschema.validate(manifest, SCHEMA)
    for replicated in manifest["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "slice"},
               "spec": replicated["template"]["spec"]}
        kubernetes_validate.validate(job, K8S, strict=True)


@pytest.mark.parametrize("tpu_type,slices,hosts,chips,shape", [
    ("v5p-128", 2, 16, 4, "4x4x4"), ("v6e-256", 4, 64, 4, "16x16"), ("v5litepod-8", 1, 1, 8, "2x4"),
    ("tpu7x-128", 2, 16, 4, "4x4x4")])
def test_manifests_validate_and_carry_the_slice_settings(tpu_type, slices, hosts, chips, shape, tmp_path, capsys):
    out = tmp_path / "jobset.yaml"
    cli(["gke", "--tpu_type", tpu_type, "--num_slices", str(slices), "--image", "us-docker.pkg.dev/p/r/maxctx:tpu",
         "--workload", "long-ctx", "--cluster", "c1", "--output", str(out), "--", *CONFIG,
         f"dcn_data_parallelism={slices}"])
    printed = capsys.readouterr().out
    manifest = yaml.safe_load(out.read_text())
    validate(manifest)
    job = manifest["spec"]["replicatedJobs"][0]
    assert job["replicas"] == slices and job["template"]["spec"]["parallelism"] == hosts
    pod = job["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["google.com/tpu"] == chips
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == shape
    assert container["command"][:3] == ["python3", "train.py", "configs/base.yml"]
    env = {e["name"]: e for e in container["env"]}
    if slices > 1:
        assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "long-ctx-slice-0-0.long-ctx"
        assert "job-index" in env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert "replicatedjob-replicas" in env["MEGASCALE_NUM_SLICES"]["valueFrom"]["fieldRef"]["fieldPath"]
    else:
        assert not any(name.startswith("MEGASCALE") for name in env)
    xpk = printed.splitlines()[1]
    assert xpk.startswith("xpk workload create --workload=long-ctx --cluster=c1 ") and \
        f"--tpu-type={tpu_type} --num-slices={slices}" in xpk and f"dcn_data_parallelism={slices}" in xpk


def test_the_validation_can_fail():
    manifest = gke.jobset("w", topology.parse("v5p-128"), 2, "img", ["configs/base.yml"])
    manifest["spec"]["replicatedJobs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(manifest)
    manifest = gke.jobset("w", topology.parse("v5p-128"), 2, "img", ["configs/base.yml"])
    manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(manifest)


@pytest.mark.parametrize("args,message", [
    (["--tpu_type", "v5p-128", "--", *CONFIG[:3], "ici_fsdp_parallelism=128"], "ici_fsdp_parallelism=128"),
    (["--tpu_type", "v9-8", "--", *CONFIG], "compile_topology='v9-8' is not a TPU topology"),
    (["--tpu_type", "v5p-128", "--workload", "Bad_Name", "--", *CONFIG], "--workload=Bad_Name must be a DNS label"),
    (["--tpu_type", "v5p-128"], "no train.py arguments"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    argv = ["gke", "--image", "img", *(["--workload", "w"] if "--workload" not in args else []), *args]
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("launch error: "), err
    assert message in err, err


def test_sbatch_script_runs_train_py_in_every_task_through_srun(tmp_path):
    """scripts/slurm/train.sh with a stand-in srun on PATH that records its arguments: the venv, the image and
    the plain forms; no arguments: usage and exit 2."""
    import os
    import subprocess

    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\necho "srun $*"\n')
    fake.chmod(0o755)
    script = str(Path(__file__).parents[1] / "scripts" / "slurm" / "train.sh")
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path)}

    def srun(**extra: str) -> str:
        proc = subprocess.run(["bash", script, "configs/base.yml", "steps=3"], env={**env, **extra},
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert srun() == "srun --kill-on-bad-exit=1 python3 train.py configs/base.yml steps=3"
    assert srun(MAXCTX_VENV="/shared/venv") == \
        "srun --kill-on-bad-exit=1 /shared/venv/bin/python train.py configs/base.yml steps=3"
    assert srun(MAXCTX_IMAGE="reg/maxctx:gpu") == ("srun --kill-on-bad-exit=1 --container-image=reg/maxctx:gpu "
                                                   "--container-workdir=/app python train.py configs/base.yml steps=3")
    usage = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and usage.stderr.startswith("Usage: sbatch")
