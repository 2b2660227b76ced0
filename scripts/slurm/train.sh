#!/usr/bin/env bash
# maxctx on a SLURM GPU cluster (H100/H200 nodes): one task per GPU, JAX's SLURM detection in every task.
#
#   sbatch --nodes=2 scripts/slurm/train.sh configs/base.yml model_name=llama3-8b ici_fsdp_parallelism=8 \
#       dcn_fsdp_parallelism=2 base_output_directory=gs://BUCKET/runs
#
# Every task runs `python train.py ARGS`; JAX reads SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID and
# SLURM_STEP_NODELIST (coordinator: the first node, port 61440 + job id % 4096) and gives each task the GPU of its
# local id. What runs the tasks (docs/slurm.md):
#   MAXCTX_IMAGE=registry/maxctx:gpu   the GPU image (docker/Dockerfile.gpu) through pyxis/enroot
#   MAXCTX_VENV=/shared/venv           a virtualenv with maxctx and jax[cuda12] on a shared filesystem
#   neither                            python3 on PATH, run from this repository
#SBATCH --job-name=maxctx
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

if [ "$#" -eq 0 ]; then
  echo "Usage: sbatch [--nodes=N] scripts/slurm/train.sh configs/base.yml key=value ..." >&2
  exit 2
fi

repo="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
# XLA's GPU flags MaxText's GPU recipes use: overlap collectives with compute.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

if [ -n "${MAXCTX_IMAGE:-}" ]; then
  exec srun --kill-on-bad-exit=1 --container-image="$MAXCTX_IMAGE" --container-workdir=/app \
    python train.py "$@"
fi
python="python3"
if [ -n "${MAXCTX_VENV:-}" ]; then
  python="$MAXCTX_VENV/bin/python"
fi
cd "$repo"
exec srun --kill-on-bad-exit=1 "$python" train.py "$@"
