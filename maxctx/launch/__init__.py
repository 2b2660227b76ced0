"""What a cluster runs for a maxctx config: GKE (an XPK command and a JobSet manifest, maxctx.launch.gke);
SLURM launches through scripts/slurm/train.sbatch (docs/slurm.md)."""
