"""Real servers on loopback for the remote-dataset tests: an S3 API (moto's server mode), a GCS API
(gcp-storage-emulator) and an HTTP file server with byte ranges that can fail a share of its requests the ways networks and object stores fail (503 throttling,
a reset connection, a body cut short, a slow answer). Nothing here mocks a client: fsspec talks HTTP to them."""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FAULTS = ("503", "reset", "truncate", "delay")


class FaultPlan:
    """Fail ``rate`` of the requests (seeded), each with one of ``kinds``; counts what it did."""

    def __init__(self, rate: float = 0.0, kinds: tuple[str, ...] = FAULTS, seed: int = 0, delay_s: float = 0.02):
        self.rate, self.kinds, self.delay_s = rate, kinds, delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.done: Counter = Counter()

    def draw(self) -> str | None:
        with self._lock:
            self.done["requests"] += 1
            if self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.done[kind] += 1
            return kind


def _handler(root: Path, faults: FaultPlan, log: list[str]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _target(self) -> Path | None:
            rel = self.path.split("?", 1)[0].lstrip("/")
            path = (root / rel).resolve()
            return path if path.is_file() and root.resolve() in path.parents else None

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            log.append(f"{self.command} {self.path} {self.headers.get('Range', '')}")
            fault = faults.draw()
            if fault == "delay":
                time.sleep(faults.delay_s)
            if fault == "503":
                self.send_response(503, "Slow Down")
                self.send_header("Content-Length", "0")
                self.send_header("Retry-After", "0")
                self.end_headers()
                return
            if fault == "reset":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)
                return
            path = self._target()
            if path is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = path.read_bytes()
            start, end, status = 0, len(data), 200
            m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if m:
                start = int(m.group(1))
                end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            chunk = data[start:end]
            if fault == "truncate" and len(chunk) > 1:
                self.wfile.write(chunk[: len(chunk) // 2])
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.wfile.flush()
                    self.connection.shutdown(2)
                return
            self.wfile.write(chunk)

    return Handler


@contextlib.contextmanager
def http_server(root: Path, faults: FaultPlan | None = None):
    """Serve ``root`` on 127.0.0.1 (a free port); yields (base URL, the fault plan, the request log)."""
    faults = faults or FaultPlan()
    log: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, faults, log))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults, log
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def s3_server(monkeypatch, bucket: str = "data"):
    """moto's S3 API server on 127.0.0.1, found by clients through AWS_ENDPOINT_URL as any S3-compatible store
    is; test credentials in the standard variables. Yields (s3fs filesystem, bucket)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    import urllib.request

    # moto keeps its buckets in the process: start from none
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=10)
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test-key-id",
        "AWS_SECRET_ACCESS_KEY": "test-secret-do-not-log",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import fsspec

    fsspec.config.conf.pop("s3", None)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    try:
        yield fs, bucket
    finally:
        server.stop()
        fsspec.filesystem("s3").clear_instance_cache()


@contextlib.contextmanager
def gcs_server(monkeypatch, bucket: str = "data"):
    """A Google Cloud Storage JSON API emulator (gcp-storage-emulator) on 127.0.0.1, found by clients through
    STORAGE_EMULATOR_HOST as Google's own clients find one; no credentials. Yields (gcsfs filesystem, bucket)."""
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    server.start()  # returns once its HTTP server is bound; the port it got is only on that object
    port = server._api._httpd.server_address[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    import fsspec

    fs = fsspec.filesystem("gs", skip_instance_cache=True)
    try:
        yield fs, bucket
    finally:
        server.stop()
        fsspec.filesystem("gs").clear_instance_cache()


def upload(fs, local: Path, remote: str) -> None:
    """Copy a dataset directory (shards and index/) to ``remote`` (bucket/prefix), file by file."""
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe(f"{remote}/{path.relative_to(local).as_posix()}", path.read_bytes())
