#!/usr/bin/env bash
# Creates a TPU VM slice (v5e, v5p or v6e), directly or as a queued resource that waits for capacity.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/create.sh [--type TYPE] [--queued] [--spot | --reserved] [flags]

Creates the TPU VM slice NAME. Every host of the slice becomes a worker; scripts/tpu/setup.sh installs maxctx
on all of them.

  --type TYPE              accelerator type [\$MAXCTX_TPU_TYPE, default v5litepod-8]:
                             v5e: v5litepod-{1,4,8,16,32,64,128,256} (v5e-N is accepted as v5litepod-N)
                             v5p: v5p-{8,16,32,...}  (N counts TensorCores: 2 per chip)
                             v6e: v6e-{1,4,8,16,32,64,128,256}
  --runtime-version V      TPU software version [default by generation: v5e v2-alpha-tpuv5-lite,
                           v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e]
  --spot                   Spot capacity (cheaper, may be preempted; runs resume from their last checkpoint)
  --reserved               use the project's reservation
  --queued                 request a queued resource and wait until it is ACTIVE (needed for large slices)
  --no-wait                with --queued: return once the request is accepted

$COMMON_FLAGS_HELP

Example:
  scripts/tpu/create.sh --name my-v6e --zone us-east5-b --type v6e-16 --queued --spot
HELP
}

TYPE=${MAXCTX_TPU_TYPE:-v5litepod-8}
RUNTIME_VERSION=""
CAPACITY=()
WAIT=1
while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  case $1 in
    --type) TYPE=${2:?--type needs a value}; shift 2 ;;
    --runtime-version) RUNTIME_VERSION=${2:?--runtime-version needs a value}; shift 2 ;;
    --spot) CAPACITY+=(--spot); shift ;;
    --reserved) CAPACITY+=(--reserved); shift ;;
    --no-wait) WAIT=0; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# gcloud names v5e slices v5litepod-N; v5e-N is how the chip (and maxctx.compile) names them.
[[ $TYPE != v5e-* ]] || TYPE=v5litepod-${TYPE#v5e-}
case $TYPE in
  v5litepod-[0-9]*) default_runtime=v2-alpha-tpuv5-lite ;;
  v5p-[0-9]*) default_runtime=v2-alpha-tpuv5 ;;
  v6e-[0-9]*) default_runtime=v2-alpha-tpuv6e ;;
  *) die "--type=$TYPE is not a v5e (v5litepod-N), v5p (v5p-N) or v6e (v6e-N) accelerator type" ;;
esac
RUNTIME_VERSION=${RUNTIME_VERSION:-$default_runtime}
((${#CAPACITY[@]} <= 1)) || die "--spot and --reserved exclude each other"
resolve_location

if ((QUEUED)); then
  tpus queued-resources create "$NAME" --node-id="$NAME" --accelerator-type="$TYPE" \
    --runtime-version="$RUNTIME_VERSION" ${CAPACITY[@]+"${CAPACITY[@]}"}
  ((WAIT)) || exit 0
  if ((DRY_RUN)); then
    echo "# then, until the state is ACTIVE:"
    tpus queued-resources describe "$NAME" --format='value(state.state)'
    exit 0
  fi
  echo "waiting for queued resource $NAME to become ACTIVE (Ctrl-C stops waiting, not the request)" >&2
  while :; do
    state=$(tpus queued-resources describe "$NAME" --format='value(state.state)' 2>/dev/null) || state=UNKNOWN
    case $state in
      ACTIVE) break ;;
      FAILED | SUSPENDED) die "queued resource $NAME is $state; see: gcloud compute tpus queued-resources describe $NAME --zone=$ZONE" ;;
    esac
    echo "  $(date -u +%H:%M:%S) $state" >&2
    sleep "${MAXCTX_TPU_POLL_SECONDS:-30}"
  done
else
  tpus tpu-vm create "$NAME" --accelerator-type="$TYPE" --version="$RUNTIME_VERSION" \
    ${CAPACITY[@]+"${CAPACITY[@]}"}
fi
((DRY_RUN)) || echo "TPU $NAME ($TYPE) is ready; next: scripts/tpu/setup.sh --name $NAME --zone $ZONE" >&2
