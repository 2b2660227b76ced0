#!/usr/bin/env bash
# Stops the maxctx run that scripts/tpu/run.sh started, on every worker, by the process id it recorded.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/stop.sh [--grace SECONDS] [flags]

Sends SIGTERM to the train process on every worker: maxctx finishes its current step, saves a checkpoint
of it and exits. Whatever is still running after --grace seconds gets SIGKILL. Started again with the same
run_name, the run resumes from its latest checkpoint.

  --grace SECONDS   how long the final checkpoint may take [default: 300]

$COMMON_FLAGS_HELP
HELP
}

GRACE=300
while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  case $1 in
    --grace) GRACE=${2:?--grace needs a value}; shift 2 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $GRACE =~ ^[0-9]+$ ]] || die "--grace=$GRACE must be a whole number of seconds"
resolve_location

# shellcheck disable=SC2016  # $pid and $(...) are for the worker's shell
on_all_workers "pid=\$(cat $REMOTE_PID 2>/dev/null) || { echo \"\$(hostname): no run\"; exit 0; }; \
if kill \"\$pid\" 2>/dev/null; then \
i=0; while kill -0 \"\$pid\" 2>/dev/null && [ \$i -lt $((GRACE * 5)) ]; do sleep 0.2; i=\$((i+1)); done; \
kill -0 \"\$pid\" 2>/dev/null && kill -9 \"\$pid\"; echo \"\$(hostname): stopped \$pid\"; \
else echo \"\$(hostname): run \$pid had already ended\"; fi; rm -f $REMOTE_PID"
