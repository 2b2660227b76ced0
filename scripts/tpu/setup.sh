#!/usr/bin/env bash
# Installs maxctx on every worker of a TPU VM slice: ships the code, makes a virtualenv, pip installs
# maxctx with jax[tpu], and checks that each worker sees its TPU chips.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<HELP
Usage: scripts/tpu/setup.sh [--git-url URL [--git-ref REF]] [--jax SPEC] [--python VERSION] [flags]

Puts maxctx in ~/$REMOTE_DIR on every worker and installs it (pip install -e . "jax[tpu]") into the
virtualenv ~/$REMOTE_VENV (made once, by uv). Safe to re-run after you change code: it ships the code
again and reinstalls.

By default it ships this checkout as it is on disk: tracked files plus untracked ones git does not ignore,
so local edits travel without a commit. They replace everything in ~/$REMOTE_DIR except .venv and outputs,
so files deleted here do not linger there.

  --git-url URL     clone URL on each worker instead of shipping this checkout
  --git-ref REF     with --git-url: branch, tag or commit to check out [default: the remote's HEAD]
  --jax SPEC        the JAX requirement to install [default: jax[tpu]]; pin it, e.g. "jax[tpu]==X.Y.Z",
                    when you need a particular libtpu
  --python VERSION  Python version of the workers' virtualenv [default: 3.12; maxctx needs >= 3.11]
  --no-check        skip the last step, which runs JAX on every worker and prints its device counts

$COMMON_FLAGS_HELP
HELP
}

GIT_URL=""
GIT_REF=""
JAX_SPEC="jax[tpu]"
PYTHON_VERSION=3.12
CHECK=1
while (($#)); do
  common_flag "$@"
  if ((CONSUMED)); then shift "$CONSUMED"; continue; fi
  case $1 in
    --git-url) GIT_URL=${2:?--git-url needs a value}; shift 2 ;;
    --git-ref) GIT_REF=${2:?--git-ref needs a value}; shift 2 ;;
    --jax) JAX_SPEC=${2:?--jax needs a value}; shift 2 ;;
    --python) PYTHON_VERSION=${2:?--python needs a value}; shift 2 ;;
    --no-check) CHECK=0; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ -z $GIT_REF || -n $GIT_URL ]] || die "--git-ref needs --git-url"
resolve_location

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TARBALL_NAME=maxctx-src.tar.gz

# Packs the checkout as git sees it (tracked + untracked-but-not-ignored files that exist on disk).
pack_checkout() {
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do
      [[ ! -e $ROOT/$f ]] || printf '%s\0' "$f"
    done |
    tar -C "$ROOT" --null -T - -czf "$1"
}

# 1. Code on every worker.
if [[ -n $GIT_URL ]]; then
  checkout="git -C $REMOTE_DIR fetch --quiet origin $(shell_quote "${GIT_REF:-HEAD}") && git -C $REMOTE_DIR checkout --quiet --force FETCH_HEAD"
  on_all_workers "set -e; [ -d $REMOTE_DIR/.git ] || git clone --quiet $(shell_quote "$GIT_URL") $REMOTE_DIR; $checkout"
else
  git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 || die "$ROOT is not a git checkout; use --git-url"
  tarball="${TMPDIR:-/tmp}/$TARBALL_NAME"
  if ((DRY_RUN)); then
    echo "# pack $ROOT (files git tracks or would track) into $tarball"
  else
    trap 'rm -f "$tarball"' EXIT
    pack_checkout "$tarball"
  fi
  tpus tpu-vm scp "$tarball" "$NAME:$TARBALL_NAME" --worker=all
  on_all_workers "set -e; mkdir -p $REMOTE_DIR; \
find $REMOTE_DIR -mindepth 1 -maxdepth 1 ! -name .venv ! -name outputs -exec rm -rf {} +; \
tar -xzf $TARBALL_NAME -C $REMOTE_DIR; rm $TARBALL_NAME"
fi

# 2. A virtualenv with maxctx (with gcsfs, for gs:// outputs) and jax[tpu], resolved together so the JAX version maxctx allows picks the
# matching libtpu. maxctx needs Python >= 3.11 and TPU VM images ship older ones, so uv provides it.
venv_python=$REMOTE_VENV/bin/python
get_uv="python3 -m pip install --user --quiet uv || python3 -m pip install --user --quiet --break-system-packages uv"
on_all_workers "set -e; [ -x $venv_python ] || { $get_uv; python3 -m uv venv --quiet --seed --python $(shell_quote "$PYTHON_VERSION") $REMOTE_VENV; }; \
cd $REMOTE_DIR && .venv/bin/python -m pip install --quiet -e '.[gcs]' $(shell_quote "$JAX_SPEC")"

# 3. Every worker must start JAX together on a multi-host slice, which --worker=all does.
if ((CHECK)); then
  on_all_workers "timeout 600 $venv_python -c 'import jax; print(\"process\", jax.process_index(), \"of\", jax.process_count(), \":\", jax.local_device_count(), \"local /\", jax.device_count(), \"devices\", jax.devices()[0].device_kind)'"
fi
((DRY_RUN)) || echo "maxctx is installed on every worker of $NAME; next: scripts/tpu/run.sh --name $NAME --zone $ZONE configs/base.yml ..." >&2
