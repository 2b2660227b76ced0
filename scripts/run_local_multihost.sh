#!/usr/bin/env bash
# Runs one maxctx training job as N local processes on this machine's CPU, the way a multi-host job runs:
# jax.distributed over 127.0.0.1, each process with its own simulated CPU devices.
set -euo pipefail

usage() {
  cat <<'HELP'
Usage: scripts/run_local_multihost.sh [--devices-per-process M] [--grace SECONDS] [--dry-run] N CONFIG [key=value ...]

Starts N processes of  python3 train.py CONFIG key=value ... cpu_devices=M  with
JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=0..N-1, so they train
as one job over N x M CPU devices (mesh axes may span processes). N=1 runs one plain process (no coordinator),
e.g. to resume a multi-process run's checkpoint on one process. Each output line is prefixed with [process i]. The script waits for all of them and exits 0 only if all succeed; when one fails, it stops the
others and exits with the failed process's status.

  --devices-per-process M   simulated CPU devices per process [default: 4]; a cpu_devices=K override
                            among the key=value words takes its place
  --grace SECONDS           when one process fails or on Ctrl-C, how long the others get after SIGTERM
                            (maxctx saves a checkpoint of its current step on SIGTERM) before SIGKILL
                            [default: 30]
  --dry-run                 print the N commands instead of running them
  -h, --help                this help

Environment: MAXCTX_PYTHON, the interpreter [default: python3].

Example (2 processes x 4 devices, the context axis spanning both):
  scripts/run_local_multihost.sh 2 configs/base.yml ici_fsdp_parallelism=2 ici_context_parallelism=4 \
      run_name=multihost-demo
HELP
}

die() {
  echo "error: $*" >&2
  exit 2
}

DEVICES=4
GRACE=30
DRY_RUN=0
while (($#)); do
  case $1 in
    --devices-per-process) DEVICES=${2:?--devices-per-process needs a value}; shift 2 ;;
    --grace) GRACE=${2:?--grace needs a value}; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown flag '$1' (see --help)" ;;
    *) break ;;
  esac
done
(($# >= 2)) || die "need N and a config, e.g. scripts/run_local_multihost.sh 2 configs/base.yml (see --help)"
NPROC=$1
shift
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "N=$NPROC must be a positive whole number of processes"
[[ $DEVICES =~ ^[1-9][0-9]*$ ]] || die "--devices-per-process=$DEVICES must be a positive whole number"
[[ $GRACE =~ ^[0-9]+$ ]] || die "--grace=$GRACE must be a whole number of seconds"
TRAIN_ARGS=("$@")
has_devices=0
for word in "${TRAIN_ARGS[@]}"; do
  [[ $word != cpu_devices=* ]] || { has_devices=1; DEVICES=${word#cpu_devices=}; }
done
((has_devices)) || TRAIN_ARGS+=("cpu_devices=$DEVICES")

PYTHON=${MAXCTX_PYTHON:-python3}
TRAIN_PY=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/train.py
# The environment of process i: none for one process, which runs without jax.distributed.
process_env() {
  ((NPROC == 1)) || echo "JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES=$NPROC JAX_PROCESS_ID=$1"
}
COORDINATOR="none (one process)"
unset JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID  # one process: never a job of the caller's
if ((NPROC > 1)); then
  # A port the OS calls free now; the coordinator (process 0) binds it a moment later.
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT
  COORDINATOR=$JAX_COORDINATOR_ADDRESS
fi

if ((DRY_RUN)); then
  for ((i = 0; i < NPROC; i++)); do
    printf '%s' "$(process_env "$i")"
    ((NPROC == 1)) || printf ' '
    printf '%q' "$PYTHON"
    printf ' %q' "$TRAIN_PY" "${TRAIN_ARGS[@]}"
    printf '\n'
  done
  exit 0
fi

PIDS=()
FINISHED=()
# Signals every process not yet reaped (an id seen exiting may since belong to another process).
signal_running() {
  local i
  for i in "${!PIDS[@]}"; do
    [[ -n ${FINISHED[i]:-} ]] || kill "$@" "${PIDS[i]}" 2>/dev/null || true
  done
}
stop_all() {
  signal_running -TERM
  # A process stuck in a collective may ignore SIGTERM; give it --grace seconds, then SIGKILL.
  local i alive tries
  for ((tries = 0; tries < GRACE * 5; tries++)); do
    alive=0
    for i in "${!PIDS[@]}"; do
      [[ -n ${FINISHED[i]:-} ]] || ! kill -0 "${PIDS[i]}" 2>/dev/null || alive=1
    done
    ((alive)) || return 0
    sleep 0.2
  done
  signal_running -KILL
}
trap 'echo "interrupted: stopping all processes" >&2; stop_all; exit 130' INT TERM

for ((i = 0; i < NPROC; i++)); do
  # Process substitution keeps $! the training process's own id, so it can be waited on and killed.
  # shellcheck disable=SC2046 # process_env prints whole VAR=value words, none with spaces
  env $(process_env "$i") "$PYTHON" "$TRAIN_PY" "${TRAIN_ARGS[@]}" \
    > >(awk -v p="[process $i] " '{ print p $0; fflush() }') 2>&1 &
  PIDS+=($!)
done
echo "started $NPROC processes x $DEVICES devices, coordinator $COORDINATOR: pids ${PIDS[*]}" >&2

# Poll rather than `wait -n`, which macOS's bash 3.2 lacks.
remaining=$NPROC
while ((remaining)); do
  for i in "${!PIDS[@]}"; do
    [[ -z ${FINISHED[i]:-} ]] || continue
    ! kill -0 "${PIDS[i]}" 2>/dev/null || continue
    status=0
    wait "${PIDS[i]}" || status=$?
    FINISHED[i]=1
    remaining=$((remaining - 1))
    if ((status != 0)); then
      echo "process $i (pid ${PIDS[i]}) exited with status $status; stopping the other processes" >&2
      stop_all
      wait || true
      exit "$status"
    fi
  done
  ((remaining == 0)) || sleep 0.2
done
wait || true
echo "all $NPROC processes finished" >&2
