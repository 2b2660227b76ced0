"""Cloud Storage (`gs://`) paths named by the config: one probe of the bucket before JAX starts, globs, and local
copies for the readers that need local files. No JAX.

The probe. gcsfs (etils.epath's gs:// backend, which writes config.yml, metrics and TensorBoard events) retries a
failed request six times over about half a minute and then ends in an aiohttp or HttpError traceback, and Orbax's
TensorStore writes fail in a background thread. So before anything else, every gs:// path in the config is looked
at once through Cloud Storage's JSON API (one object listing of its bucket and prefix) with the credentials the
clients will use, and what can go wrong becomes one line naming the key, the path and the fix: no credentials,
401/403 (forbidden), 404 (no such bucket), the server unreachable, and for inputs an object that does not exist.
Clients honour STORAGE_EMULATOR_HOST (a local emulator; no credentials then), and so does the probe.

Local copies. Every data reader needs random access to local files: ArrayRecord's C++ reader cannot open gs://,
TFDS's data source reads the ArrayRecord files of its data_dir through it, and the text reader seeks by byte
offset. So gs:// inputs are copied, as `gcloud storage cp` would, to a folder under the system's temporary
directory (`<tmp>/maxctx-gcs/<bucket>/<object>`), once per host; a copy whose size and update time match the object
is reused, so a resumed run does not download again. Object names are chosen by whoever writes the bucket, so each
is joined under its copy's folder by `join_under`, which refuses (one line naming the object) a name that would
land outside it, before anything is fetched.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from maxctx.config import ConfigError

_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_PROBE_TIMEOUT_S = 20


def is_remote(path: str) -> bool:
    return path.startswith("gs://")


def split(url: str) -> tuple[str, str]:
    """gs://bucket/some/prefix -> ('bucket', 'some/prefix')."""
    bucket, _, name = url[len("gs://"):].partition("/")
    return bucket, name.strip("/")


def endpoint() -> str:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host and host != "default":
        return host if host.startswith(("http://", "https://")) else f"http://{host}"
    return "https://storage.googleapis.com"


def _token(key: str, url: str) -> str | None:
    """A bearer token from Application Default Credentials, or None against an emulator (which takes none)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    import google.auth
    import google.auth.exceptions
    import google.auth.transport.requests

    try:
        credentials, _ = google.auth.default(scopes=[_SCOPE])
        credentials.refresh(google.auth.transport.requests.Request())
    except google.auth.exceptions.GoogleAuthError as e:
        detail = str(e).split(". ")[0].rstrip(".")
        raise ConfigError(f"{key}={url}: no Google Cloud credentials ({detail}); run `gcloud auth application-default "
                          f"login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run on a "
                          f"VM/GKE pod whose service account has access") from None
    return credentials.token


def _list(key: str, url: str, prefix: str, max_results: int = 1) -> list[dict]:
    """Objects under `prefix` of the bucket of `url` (at most `max_results`); ConfigError for anything but a
    listing."""
    bucket, _ = split(url)
    if not bucket:
        raise ConfigError(f"{key}={url} names no bucket; write gs://BUCKET/folder")
    query = urllib.parse.urlencode({"prefix": prefix, "maxResults": max_results})
    request = urllib.request.Request(f"{endpoint()}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?{query}")
    token = _token(key, url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT_S) as response:
            return json.loads(response.read() or b"{}").get("items", [])
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            who = "the credentials in use are not accepted" if e.code == 401 else "access is forbidden"
            raise ConfigError(f"{key}={url}: Cloud Storage answered {e.code} ({who}) for bucket '{bucket}'; give "
                              f"the account roles/storage.objectAdmin on it (`gcloud storage buckets "
                              f"add-iam-policy-binding gs://{bucket} --member=... --role=roles/storage.objectAdmin`) "
                              f"or use a bucket it may write") from None
        if e.code == 404:
            raise ConfigError(f"{key}={url}: bucket '{bucket}' does not exist; create it (`gcloud storage buckets "
                              f"create gs://{bucket} --location=REGION`) or fix the name") from None
        raise ConfigError(f"{key}={url}: Cloud Storage answered HTTP {e.code} ({e.reason}) for bucket '{bucket}'; "
                          f"retry, or check the bucket in the Cloud console") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"{key}={url}: cannot reach Cloud Storage at {endpoint()} ({reason}); check the network "
                          f"(a VM without external IP needs Private Google Access), or unset STORAGE_EMULATOR_HOST "
                          f"if it points at a stopped emulator") from None


def check_output(url: str, key: str) -> None:
    """The bucket of an output path exists and these credentials may use it (its objects need not exist yet)."""
    _list(key, url, split(url)[1])


def check_input(url: str, key: str) -> None:
    """An input object or folder exists."""
    name = split(url)[1]
    if not _list(key, url, name):
        raise ConfigError(f"{key}={url}: no such object or folder in bucket '{split(url)[0]}'; check the path "
                          f"(`gcloud storage ls {url.rstrip('/')}`)")


def glob(pattern: str, key: str) -> list[str]:
    """gs:// objects matching a glob (no folders), as gs:// URLs."""
    import fsspec

    check_output(pattern.split("*")[0].split("?")[0].split("[")[0], key)
    matches = fsspec.filesystem("gs").glob(pattern, detail=True)
    return [f"gs://{name}" for name, info in matches.items() if info.get("type") == "file"]


def join_under(root: str, name: str, what: str, fix: str) -> str:
    """`root`/`name` normalised, for a `name` that comes from outside (an object name from a bucket listing, a file
    named inside a downloaded file): ConfigError naming `what` (where the name came from) and `fix` when the name is
    absolute, has an empty segment, names `root` itself or leads out of it through '..', so nothing is written
    outside `root` under a name someone else chose. `a/../b` stays inside and is `root`/b."""
    top = os.path.normpath(root)
    path = os.path.normpath(os.path.join(top, name))
    if name.startswith("/"):
        problem = "is absolute"
    elif "" in name.split("/"):
        problem = "is empty or has an empty segment ('//')"
    elif path == top:
        problem = "names the folder itself"
    elif not path.startswith(top.rstrip("/") + "/"):
        problem = "leads out of it through '..'"
    else:
        return path
    raise ConfigError(f"{what}: the name '{name}' is not a file inside {top} (it {problem}); {fix}")


def local_path(url: str) -> str:
    """Where the local copy of `url` goes: <tmp>/maxctx-gcs/<bucket>/<object>."""
    bucket, name = split(url)
    fix = "give a gs://BUCKET/path with a real bucket name and no '..' past the bucket, '//' or trailing '..'"
    local = join_under(os.path.join(tempfile.gettempdir(), "maxctx-gcs"), bucket, url, fix)
    return join_under(local, name, url, fix) if name else local


def _fetch(fs, url: str, info: dict, local: str) -> str:
    mtime = _updated(info)
    if not (os.path.isfile(local) and os.path.getsize(local) == info["size"] and os.path.getmtime(local) == mtime):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        partial = f"{local}.partial.{os.getpid()}"
        fs.get_file(url, partial)
        os.utime(partial, (mtime, mtime))
        os.replace(partial, local)
    return local


def _updated(info: dict) -> float:
    from datetime import datetime

    stamp = info.get("updated") or info.get("mtime")
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else 0.0


def local_copy(url: str) -> str:
    """A local copy of a gs:// object, or of every object under a gs:// folder (returns the local file or folder);
    local paths come back unchanged. Every object's local path is checked (maxctx.storage.join_under) before the
    first one is fetched, so a folder holding an object named `../x` writes nothing."""
    if not is_remote(url):
        return url
    import fsspec

    local = local_path(url)
    fs = fsspec.filesystem("gs")
    info = fs.info(url)
    if info.get("type") == "file":
        return _fetch(fs, url, info, local)
    bucket, folder = split(url)
    prefix = f"{bucket}/{folder}/" if folder else f"{bucket}/"
    fix = "rename or delete the object (`gcloud storage mv` or `rm`), or point the key at a folder without it"
    copies = [(f"gs://{name}", entry, join_under(local, name.removeprefix(prefix), f"gs://{name}", fix))
              for name, entry in fs.find(url, detail=True).items()
              if not name.endswith("/")]  # a folder marker (the Cloud console's "Create folder"), not a file
    for remote, entry, path in copies:
        _fetch(fs, remote, entry, path)
    return local
