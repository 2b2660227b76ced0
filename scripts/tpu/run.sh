#!/usr/bin/env bash
# Starts the same train command on every worker of a TPU VM slice, detached from ssh, then follows
# worker 0's log. JAX's multi-controller runtime finds its peers on a TPU slice by itself.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/run.sh [--env KEY=VALUE]... [--no-follow] [flags] [--] CONFIG [key=value ...]

Runs  python train.py CONFIG key=value ...  in ~/$REMOTE_DIR on every worker at once (run setup.sh first).
Each worker's output goes to ~/$REMOTE_LOG; the run survives a dropped ssh connection, and Ctrl-C
here stops following the log, not the run. Stop it with scripts/tpu/stop.sh. A worker refuses to start a
second run while its previous one is alive.

  --env KEY=VALUE   environment variable for the train process on every worker (repeatable),
                    e.g. --env LIBTPU_INIT_ARGS=--xla_tpu_enable_async_collective_fusion=true
  --no-follow       return after starting instead of following worker 0's log
  --evaluate        run  python -m maxctx.evaluate CONFIG key=value ...  instead (a checkpoint's evals:
                    load_parameters_path=..., docs/continued_pretraining.md)

Everything else (or everything after --) is the train command's arguments.

$COMMON_FLAGS_HELP

Example:
  scripts/tpu/run.sh --name my-v6e --zone us-east5-b configs/base.yml model_name=llama3-8b \\
      max_target_length=131072 ici_fsdp_parallelism=4 ici_context_parallelism=4 \\
      context_parallel_strategy=p2p base_output_directory=gs://my-bucket/maxctx run_name=llama3-8b-128k
HELP
}

ENVS=()
FOLLOW=1
ENTRY="train.py"
TRAIN_ARGS=()
while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  case $1 in
    --env)
      [[ ${2:-} == [A-Za-z_]*=* ]] || die "--env needs KEY=VALUE, got '${2:-}'"
      ENVS+=("$2"); shift 2 ;;
    --no-follow) FOLLOW=0; shift ;;
    --evaluate) ENTRY="-m maxctx.evaluate"; shift ;;
    --) shift; TRAIN_ARGS+=("$@"); break ;;
    --*) die "unknown flag '$1' (see --help); train settings are key=value words" ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done
((${#TRAIN_ARGS[@]})) || die "no train command: give a config and key=value overrides, e.g. configs/base.yml steps=100"
resolve_location

train="env"
for word in ${ENVS[@]+"${ENVS[@]}"}; do train+=" $(shell_quote "$word")"; done
train+=" nohup .venv/bin/python $ENTRY"
for word in "${TRAIN_ARGS[@]}"; do train+=" $(shell_quote "$word")"; done

on_all_workers "set -e; mkdir -p ${REMOTE_LOG%/*}; \
if [ -f $REMOTE_PID ] && kill -0 \"\$(cat $REMOTE_PID)\" 2>/dev/null; then \
echo \"\$(hostname): maxctx run \$(cat $REMOTE_PID) is still going; scripts/tpu/stop.sh stops it\" >&2; exit 1; fi; \
echo \"=== \$(date -u '+%F %T') UTC:\" ${train#env } >> $REMOTE_LOG; \
(cd $REMOTE_DIR && exec $train) >> $REMOTE_LOG 2>&1 < /dev/null & echo \$! > $REMOTE_PID"

if ((FOLLOW)); then
  ((DRY_RUN)) || echo "following worker 0's log; Ctrl-C stops following, not the run" >&2
  follow_log 0 50
fi
