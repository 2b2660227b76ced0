#!/usr/bin/env bash
# Shows and follows the train log of one worker, or of all of them with each line tagged by host.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/logs.sh [--worker N|all] [--lines N] [--no-follow] [flags]

Prints the end of ~/$REMOTE_LOG on a worker and follows it (Ctrl-C stops following, not the run).
Worker 0 runs JAX process 0, which writes the step log; other workers show their own errors.

  --worker N|all    which worker [default: 0]
  --lines N         lines of history to print first [default: 100]
  --no-follow       print and return

$COMMON_FLAGS_HELP
HELP
}

WORKER=0
LINES=100
FOLLOW=1
while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  case $1 in
    --worker) WORKER=${2:?--worker needs a value}; shift 2 ;;
    --lines) LINES=${2:?--lines needs a value}; shift 2 ;;
    --no-follow) FOLLOW=0; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker=$WORKER must be a worker number or all"
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines=$LINES must be a number"
resolve_location
follow_log "$WORKER" "$LINES"
