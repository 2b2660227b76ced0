"""A maxctx run on GKE TPU node pools: the `xpk workload create` command, and the JobSet manifest XPK would
create, for users who apply manifests themselves.

Per slice, GKE's TPU webhook gives every pod TPU_WORKER_ID and TPU_WORKER_HOSTNAMES (the Job must be Indexed, one
pod per TPU VM host, with `google.com/tpu` resources). Across slices (`--num_slices` > 1) libtpu and JAX's cluster
detection read MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and MEGASCALE_COORDINATOR_ADDRESS (the first pod of
slice 0, reachable through the JobSet's headless service), set here from the JobSet's own labels and annotations
as XPK does; the DCN keys of the config (`dcn_*_parallelism`) then shard over the slices.
"""

from __future__ import annotations

import shlex
from typing import Any

from maxctx.plan.topology import Topology

# GKE's node label values per TPU generation (cloud.google.com/gke-tpu-accelerator)
ACCELERATORS = {"v4": "tpu-v4-podslice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
                "v6e": "tpu-v6e-slice", "tpu7x": "tpu7x"}
COORDINATOR_PORT = 8080  # the MEGASCALE coordinator's port (XPK's)
JAX_COORDINATOR_PORT = 8482  # jax.distributed's on TPU pods (jax._src.clusters.cloud_tpu_cluster.coordinator_port)


def hosts(topology: Topology) -> tuple[int, int]:
    """(TPU VM hosts per slice, chips per host): 4 chips per host, except single-host v5e/v6e slices of 8."""
    chips = topology.num_chips
    if chips <= 4 or (topology.chip.dims == 2 and chips == 8):
        return 1, chips
    return chips // 4, 4


def train_args(config_args: list[str]) -> list[str]:
    """The container's command: the image's train.py with the user's config and keys."""
    return ["python3", "train.py", *config_args]


def xpk_command(workload: str, cluster: str, tpu_type: str, num_slices: int, image: str, config_args: list[str],
                project: str = "", zone: str = "", max_restarts: int = 0) -> list[str]:
    command = ["xpk", "workload", "create", f"--workload={workload}", f"--cluster={cluster}",
               f"--tpu-type={tpu_type}", f"--num-slices={num_slices}", f"--docker-image={image}",
               f"--max-restarts={max_restarts}", f"--command={shlex.join(train_args(config_args))}"]
    return command + [f"--project={project}"] * bool(project) + [f"--zone={zone}"] * bool(zone)


def jobset(workload: str, topology: Topology, num_slices: int, image: str, config_args: list[str],
           max_restarts: int = 0) -> dict[str, Any]:
    """A jobset.x-k8s.io/v1alpha2 JobSet: one replicated Job per slice, one pod per TPU VM host."""
    per_slice, chips = hosts(topology)
    env = [{"name": "MEGASCALE_NUM_SLICES", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']"}}},
           {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}},
           {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{workload}-slice-0-0.{workload}"},
           {"name": "MEGASCALE_PORT", "value": str(COORDINATOR_PORT)},
           {"name": "JAX_PLATFORMS", "value": "tpu"}]
    container = {"name": "maxctx", "image": image, "imagePullPolicy": "Always", "command": train_args(config_args),
                 "env": env if num_slices > 1 else env[-1:],
                 "ports": [{"containerPort": 8471}, {"containerPort": COORDINATOR_PORT},
                           {"containerPort": JAX_COORDINATOR_PORT}],
                 "securityContext": {"privileged": True},
                 "resources": {"limits": {"google.com/tpu": chips}}}
    pod = {"metadata": {"labels": {"app": workload}},
           "spec": {"restartPolicy": "Never", "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                    "terminationGracePeriodSeconds": 60,
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": ACCELERATORS[topology.chip.libtpu_prefix],
                                     "cloud.google.com/gke-tpu-topology": "x".join(map(str, topology.shape))},
                    "containers": [container]}}
    job = {"parallelism": per_slice, "completions": per_slice, "completionMode": "Indexed", "backoffLimit": 0,
           "template": pod}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": workload,
                         "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology":
                                         "cloud.google.com/gke-nodepool"}},
            "spec": {"failurePolicy": {"maxRestarts": max_restarts},
                     "network": {"enableDNSHostnames": True, "subdomain": workload},
                     "replicatedJobs": [{"name": "slice", "replicas": num_slices, "template": {"spec": job}}]}}
