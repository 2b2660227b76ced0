# shellcheck shell=bash disable=SC2034  # the variables set here are read by the scripts that source it
# Shared by scripts/tpu/*.sh (sourced, not run): the flags every script takes, their defaults from the
# environment, the --dry-run switch, and the one function that prints or runs a gcloud command.

# Where things live on every TPU worker, relative to the login user's home (ssh commands start there).
REMOTE_DIR=maxctx
REMOTE_VENV=maxctx/.venv
REMOTE_LOG=maxctx-logs/train.log
REMOTE_PID=maxctx-logs/train.pid

# TPU names allow lowercase letters, digits and dashes.
default_name=$(printf 'maxctx-%s' "${USER:-tpu}" | tr 'A-Z_.' 'a-z--')
NAME=${MAXCTX_TPU_NAME:-$default_name}
ZONE=${MAXCTX_TPU_ZONE:-${CLOUDSDK_COMPUTE_ZONE:-}}
PROJECT=${MAXCTX_TPU_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}
QUEUED=${MAXCTX_TPU_QUEUED:-0}
DRY_RUN=0

COMMON_FLAGS_HELP="Flags every scripts/tpu script takes:
  --name NAME       TPU VM (and queued resource) name   [\$MAXCTX_TPU_NAME, default maxctx-\$USER: $NAME]
  --zone ZONE       zone                                [\$MAXCTX_TPU_ZONE, \$CLOUDSDK_COMPUTE_ZONE, gcloud's compute/zone]
  --project ID      project                             [\$MAXCTX_TPU_PROJECT, \$CLOUDSDK_CORE_PROJECT, gcloud's core/project]
  --queued          the TPU was made as a queued resource (create.sh --queued)  [\$MAXCTX_TPU_QUEUED=1]
  --dry-run         print the gcloud commands instead of running them
  -h, --help        this help"

die() {
  echo "error: $*" >&2
  exit 2
}

# Handles one flag shared by every script. Sets CONSUMED to the words it used (0: not a shared flag).
common_flag() {
  CONSUMED=2
  case $1 in
    --name) NAME=${2:?--name needs a value} ;;
    --zone) ZONE=${2:?--zone needs a value} ;;
    --project) PROJECT=${2:?--project needs a value} ;;
    --queued) QUEUED=1; CONSUMED=1 ;;
    --dry-run) DRY_RUN=1; CONSUMED=1 ;;
    -h | --help) usage; exit 0 ;;
    *) CONSUMED=0 ;;
  esac
}

# Quotes one word for a POSIX shell, leaving plain words (flags, key=value, paths) readable.
shell_quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints a command as one copy-pasteable line.
print_cmd() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(shell_quote "$word")"
  done
  printf '%s\n' "$out"
}

# Runs a command, or prints it under --dry-run; every gcloud call goes through here.
run() {
  if ((DRY_RUN)); then
    print_cmd "$@"
  else
    echo "+ $(print_cmd "$@")" >&2
    "$@"
  fi
}

# Fills in the zone from gcloud's own config when no flag or variable named one, so every printed command
# says where it acts. Call after flag parsing.
resolve_location() {
  if [[ -z $ZONE ]] && command -v gcloud >/dev/null 2>&1; then
    ZONE=$(gcloud config get-value compute/zone 2>/dev/null || true)
  fi
  [[ -n $ZONE ]] || die "no zone: pass --zone (or set MAXCTX_TPU_ZONE); see docs/tpu.md for zones with v5e, v5p and v6e"
}

# gcloud compute tpus <args> with the zone and, if set, the project.
tpus() {
  local where=("--zone=$ZONE")
  [[ -z $PROJECT ]] || where+=("--project=$PROJECT")
  run gcloud compute tpus "$@" "${where[@]}"
}

# Runs one shell command on one worker (0, 1, ...) or on all of them in parallel.
on_worker() {
  tpus tpu-vm ssh "$NAME" --worker="$1" --command="$2"
}

# Runs one shell command on every worker of the TPU VM, in parallel.
on_all_workers() {
  tpus tpu-vm ssh "$NAME" --worker=all --command="$1"
}

# Prints the last $2 lines of the train log on worker $1 (a number or "all"), each line tagged with its
# worker's hostname, then follows it unless FOLLOW=0.
follow_log() {
  local tail_flags="-n $2"
  ((${FOLLOW:-1} == 0)) || tail_flags+=" -F"
  # shellcheck disable=SC2016  # $0 and $(hostname) are for the worker's shell
  on_worker "$1" "tail $tail_flags $REMOTE_LOG | awk -v p=\"[\$(hostname)] \" '{print p \$0; fflush()}'"
}
