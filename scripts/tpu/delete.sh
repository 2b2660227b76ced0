#!/usr/bin/env bash
# Deletes the TPU VM slice (and its queued resource, with --queued). Checkpoints in a bucket are kept.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/delete.sh [--queued] [flags]

Deletes TPU NAME without asking. With --queued it deletes the queued resource and, with it, its TPU VM
(queued-resources delete --force). Anything on the workers' disks is lost; outputs written to a gs://
base_output_directory are not.

$COMMON_FLAGS_HELP
HELP
}

while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  die "unknown argument '$1' (see --help)"
done
resolve_location

if ((QUEUED)); then
  tpus queued-resources delete "$NAME" --force --quiet
else
  tpus tpu-vm delete "$NAME" --quiet
fi
