"""Cloud Storage end to end against a local storage server (fake-gcs-server on 127.0.0.1, tests/support/gcs.py):
gcsfs (config.yml, metrics, TensorBoard), TensorStore and Orbax (checkpoints) all talk to it over HTTP.

- A run with base_output_directory=gs://... writes its outputs to the bucket; one killed with SIGKILL mid-run,
  whose newest checkpoint object is then overwritten in the bucket, sets that step aside and resumes from the
  previous one with the straight run's losses.
- gs:// datasets (JSONL text, ArrayRecord, TFDS) and tokenizers give the same documents as their local copies.
- An unreachable server, a forbidden bucket, a missing bucket, a missing object and absent credentials each exit 2
  with one line naming the path and the fix, before JAX starts.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.support import fixtures as F
from tests.support.gcs import Forbidding, GcsEmulator
from tests.support.processes import BASE_YML, ROOT, cpu_env, free_port, losses, run, train_command

BUCKET = "maxctx-test"
STEPS = 8
COMMON = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=2",
          "learning_rate_schedule_steps=20", "checkpoint_period=2", "peak_tflops_per_device=1", f"steps={STEPS}",
          f"base_output_directory=gs://{BUCKET}/runs"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs") / "objects").start()
    emulator.create_bucket(BUCKET)
    yield emulator
    emulator.stop()


@pytest.fixture(scope="module")
def env(gcs, tmp_path_factory):
    return cpu_env(compile_cache=tmp_path_factory.mktemp("jax_cache"), **gcs.env(),
                   TMPDIR=str(tmp_path_factory.mktemp("tmp")))


def point_at(emulator: GcsEmulator, monkeypatch, tmpdir):
    """This process pointed at `emulator` (gcsfs and the probe read the environment when they connect), with local
    copies of gs:// inputs under `tmpdir`; returns gcsfs."""
    import tempfile

    import fsspec

    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    tmpdir.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    fsspec.filesystem("gs").invalidate_cache()
    return fsspec.filesystem("gs")


@pytest.fixture
def client(gcs, monkeypatch, tmp_path):
    return point_at(gcs, monkeypatch, tmp_path / "tmp")


def in_bucket(gcs, path: str):
    """The stored object (the emulator keeps each object as a file under its root)."""
    return gcs.root / BUCKET / path


def train(env, run_name: str, *overrides: str) -> subprocess.CompletedProcess:
    proc = run(train_command(*COMMON, f"run_name={run_name}", *overrides), env=env, timeout=300)
    # The emulator lacks Cloud Storage's moveTo call: gcsfs logs the refusal with its traceback and falls back to
    # copy and delete (a checkpoint set aside is renamed). No other traceback.
    fallback = proc.stderr.count("ERROR:gcsfs:_request non-retriable exception: Metadata in the request couldn't")
    assert proc.returncode == 0 and proc.stderr.count("Traceback") == fallback, \
        proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def straight(gcs, env):
    train(env, "straight")
    return losses(in_bucket(gcs, "runs/straight"))


def test_a_run_writes_its_outputs_to_the_bucket(gcs, straight):
    run_dir = in_bucket(gcs, "runs/straight")
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert (run_dir / "config.yml").is_file() and f"gs://{BUCKET}/runs" in (run_dir / "config.yml").read_text()
    assert [p.name for p in (run_dir / "tensorboard").iterdir() if p.name.startswith("events.out.tfevents")]
    assert sorted(os.listdir(run_dir / "checkpoints"), key=int) == ["2", "4", "6", "8"]
    assert (run_dir / "checkpoints" / "8" / "state" / "maxctx_integrity.json").is_file()


def test_killed_run_with_a_damaged_checkpoint_object_resumes_from_the_bucket_exactly(gcs, env, straight, client):
    # Synchronous saves, so when step 5 is logged, steps 2 and 4 are complete in the bucket.
    command = train_command(*COMMON, "run_name=killed", "async_checkpointing=false")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    for line in proc.stdout:
        if line.startswith("step 5/"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    step4 = f"{BUCKET}/runs/killed/checkpoints/4/state"
    arrays = [p for p in client.find(step4) if "/d/" in p]
    largest = max(arrays, key=client.size)
    data = bytearray(client.cat_file(largest))
    data[len(data) // 2:len(data) // 2 + 64] = bytes(range(64))
    client.pipe_file(largest, bytes(data))  # a real upload replacing the object

    resumed = train(env, "killed")
    assert "checkpoint step 4 is unusable: state/ocdbt.process_0/d/" in resumed.stdout, resumed.stdout[-3000:]
    assert "fails its checksum" in resumed.stdout and "set aside as 4.corrupt" in resumed.stdout
    assert "resuming from checkpoint step 2" in resumed.stdout, resumed.stdout[-3000:]
    after = losses(in_bucket(gcs, "runs/killed"))
    assert [after[s] for s in range(3, STEPS + 1)] == [straight[s] for s in range(3, STEPS + 1)]
    assert client.exists(f"{BUCKET}/runs/killed/checkpoints/4.corrupt/state")


def test_gs_datasets_and_tokenizer_read_the_same_documents_as_local_files(client, tmp_path):
    from maxctx.data.sources import make_source
    from maxctx.data.tokenizer import load_tokenizer
    from maxctx.loader import load_config

    docs = F.make_documents(40, seed=5)
    local = tmp_path / "local"
    local.mkdir()
    tok = F.tiny_tokenizer(str(local / "sp.model"), docs)
    F.write_jsonl(str(local / "train.jsonl"), docs[:30])
    F.write_arrayrecord(str(local / "train-0.array_record"), [d.encode() for d in docs[:20]])
    F.write_arrayrecord(str(local / "train-1.array_record"), [d.encode() for d in docs[20:30]])
    F.build_tfds(str(local / "tfds"), {"train": docs[:30]})
    client.put(str(local), f"{BUCKET}/data", recursive=True)

    def documents(where: str, *overrides: str) -> list:
        config = load_config([str(BASE_YML), "eval_interval=0", f"tokenizer_path={where}/sp.model", *overrides])
        source = make_source(config, "train")
        assert load_tokenizer(config).encode(docs[0]).tolist() == load_tokenizer(
            load_config([str(BASE_YML), f"tokenizer_path={tok}"])).encode(docs[0]).tolist()
        return [source[i] for i in range(len(source))]

    for setting in (["dataset_type=text", "grain_train_files={}/train.jsonl"],
                    ["dataset_type=arrayrecord", "grain_train_files={}/train-*.array_record"],
                    ["dataset_type=tfds", f"dataset_name={F.TFDS_NAME}", "tfds_data_dir={}/tfds"]):
        remote = documents(f"gs://{BUCKET}/data", *(s.format(f"gs://{BUCKET}/data") for s in setting))
        assert len(remote) == 30, setting
        assert [str(d[0]) for d in remote] == [str(d[0]) for d in documents(str(local), *(
            s.format(local) for s in setting))], setting
    assert os.path.isfile(tmp_path / "tmp" / "maxctx-gcs" / BUCKET / "data" / "train-1.array_record")


def error_line(capsys, *overrides: str) -> str:
    from maxctx.train import main

    started = time.monotonic()
    assert main([str(BASE_YML), *overrides]) == 2
    assert time.monotonic() - started < 60  # no client retrying for minutes (a bound, not a timing)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error: "), err
    return err


def test_missing_bucket_and_missing_objects_exit_2_with_one_line(client, capsys):
    line = error_line(capsys, "base_output_directory=gs://no-such-bucket/runs")
    assert "bucket 'no-such-bucket' does not exist" in line and "gcloud storage buckets create" in line, line
    line = error_line(capsys, f"load_parameters_path=gs://{BUCKET}/no/checkpoint")
    assert f"load_parameters_path=gs://{BUCKET}/no/checkpoint: no such object" in line, line
    line = error_line(capsys, "dataset_type=arrayrecord", f"grain_train_files=gs://{BUCKET}/no-data/*.array_record",
                      "eval_interval=0")
    assert "matches no files" in line, line
    line = error_line(capsys, f"tokenizer_path=gs://{BUCKET}/no/sp.model")
    assert f"tokenizer_path=gs://{BUCKET}/no/sp.model: no such object" in line, line


def test_unreachable_and_forbidden_storage_exit_2_with_one_line(client, monkeypatch, capsys):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    line = error_line(capsys, f"base_output_directory=gs://{BUCKET}/runs")
    assert f"base_output_directory=gs://{BUCKET}/runs: cannot reach Cloud Storage" in line, line
    assert "Private Google Access" in line, line
    forbidding = Forbidding()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", forbidding.url)
        line = error_line(capsys, f"base_output_directory=gs://{BUCKET}/runs")
    finally:
        forbidding.stop()
    assert "answered 403 (access is forbidden)" in line and "roles/storage.objectAdmin" in line, line


def test_absent_credentials_exit_2_with_one_line(client, monkeypatch, capsys, tmp_path):
    for key in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(key, raising=False)
    closed = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("GCE_METADATA_HOST", closed)  # not on a Google Cloud VM: no metadata server
    monkeypatch.setenv("GCE_METADATA_IP", closed)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no `gcloud auth application-default login`
    line = error_line(capsys, f"base_output_directory=gs://{BUCKET}/runs")
    assert "no Google Cloud credentials" in line and "gcloud auth application-default login" in line, line


def test_local_copy_is_reused_while_the_object_is_unchanged(client, tmp_path):
    from maxctx import storage

    client.pipe_file(f"{BUCKET}/copy/a.bin", b"one")
    first = storage.local_copy(f"gs://{BUCKET}/copy/a.bin")
    stamp = os.stat(first).st_ino
    assert storage.local_copy(f"gs://{BUCKET}/copy/a.bin") == first and os.stat(first).st_ino == stamp
    client.pipe_file(f"{BUCKET}/copy/a.bin", b"two!")
    client.invalidate_cache()
    assert storage.local_copy(f"gs://{BUCKET}/copy/a.bin") == first and open(first, "rb").read() == b"two!"
    assert os.stat(first).st_ino != stamp  # fetched again: the object changed


@pytest.fixture
def odd_names(monkeypatch, tmp_path_factory, tmp_path):
    """A bucket that keeps any object name (the memory backend: the filesystem one would itself store `a/../../x`
    outside its root), this process pointed at it, local copies three folders below tmp_path."""
    emulator = GcsEmulator(tmp_path_factory.mktemp("memory_gcs") / "objects", backend="memory").start()
    try:
        emulator.create_bucket(BUCKET)
        yield point_at(emulator, monkeypatch, tmp_path / "a" / "b" / "tmp")
    finally:
        emulator.stop()


def test_an_object_name_leading_out_of_the_local_copy_is_refused_before_anything_is_written(odd_names, tmp_path):
    from maxctx.config import ConfigError
    from maxctx.data.tokenizer import load_tokenizer
    from maxctx.loader import load_config

    escaping = f"{BUCKET}/tokdir/../../../../../escaped_from_gcs.txt"  # from <tmp>/maxctx-gcs/BUCKET/tokdir: a/
    odd_names.pipe_file(f"{BUCKET}/tokdir/tokenizer.json", b"{}")
    odd_names.pipe_file(escaping, b"escaped")
    config = load_config([str(BASE_YML), "tokenizer_type=huggingface", f"tokenizer_path=gs://{BUCKET}/tokdir"])
    with pytest.raises(ConfigError) as refused:
        load_tokenizer(config)
    line = str(refused.value)
    assert len(line.splitlines()) == 1 and line.startswith(f"gs://{escaping}: "), line
    assert "is not a file inside" in line and "leads out of it through '..'" in line, line
    assert "rename or delete the object" in line, line
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nothing outside the copy's folder, nor in it


def test_join_under_keeps_outside_names_below_their_folder(monkeypatch, tmp_path):
    import tempfile

    from maxctx.config import ConfigError
    from maxctx.storage import join_under, local_copy

    root = str(tmp_path / "copy")
    assert join_under(root, "a/../b", "gs://b/o", "fix") == os.path.join(root, "b")
    assert join_under(root + "/", "a/./c.json", "gs://b/o", "fix") == os.path.join(root, "a", "c.json")
    for name, problem in (("/etc/passwd", "is absolute"), ("a/../../x", "leads out of it through '..'"),
                          ("a/b/../../../copy2/x", "leads out of it"), ("..", "leads out of it"),
                          ("a//b", "has an empty segment"), ("", "is empty"), ("a/..", "names the folder itself")):
        with pytest.raises(ConfigError) as refused:
            join_under(root, name, "gs://bkt/obj", "rename it")
        line = str(refused.value)
        assert len(line.splitlines()) == 1 and line.startswith(f"gs://bkt/obj: the name '{name}' is not a file "
                                                               f"inside {root} (it "), line
        assert problem in line and line.endswith("); rename it"), line
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^gs://\.\./escaped: the name '\.\.' is not a file inside .* \(it lead"):
        local_copy("gs://../escaped")  # a bucket named '..': refused before any request
    assert list(tmp_path.iterdir()) == []
