"""Real servers on loopback for the remote-dataset tests: an S3 API (moto's server mode), a GCS API
(gcp-storage-emulator), and an HTTP file server with byte ranges (or a reverse proxy in front of another server)
that can fail a share of its requests the ways networks and object stores fail (503 throttling, a reset
connection, a body cut short, a slow answer). Nothing here mocks a client: the clients talk HTTP to them."""

from __future__ import annotations

import contextlib
import http.client
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
        self.refuse_presigned = False  # answer 403 to every request signed in its query string, as some stores do
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.done: Counter = Counter()
        self.in_flight = self.most_in_flight = 0  # requests being answered now, and at most at once

    def enter(self) -> None:
        """A request is being answered (until ``leave``)."""
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def leave(self) -> None:
        """A request's answer is done."""
        with self._lock:
            self.in_flight -= 1

    def draw(self) -> str | None:
        with self._lock:
            self.done["requests"] += 1
            if self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.done[kind] += 1
            return kind


HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


def _handler(root: Path | None, faults: FaultPlan, log: list[str], upstream: tuple[str, int] | None = None):
    """Serves the files under ``root``, or (``upstream`` set) passes every request on to that server as a reverse
    proxy; either way a share of the requests fails as ``faults`` draws."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _target(self) -> Path | None:
            rel = self.path.split("?", 1)[0].lstrip("/")
            path = (root / rel).resolve()
            return path if path.is_file() and root.resolve() in path.parents else None

        def _file(self) -> tuple[int, list[tuple[str, str]], bytes]:
            path = self._target()
            if path is None:
                return 404, [], b""
            data = path.read_bytes()
            m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if not m:
                return 200, [("Accept-Ranges", "bytes")], data
            start = int(m.group(1))
            end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
            span = ("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            return 206, [("Accept-Ranges", "bytes"), span], data[start:end]

        def _forward(self) -> tuple[int, list[tuple[str, str]], bytes]:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            conn = http.client.HTTPConnection(*upstream, timeout=30)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            # a HEAD's Content-Length is the object's size, passed on as is; a body's is set from what is sent
            drop = HOP_HEADERS if self.command == "HEAD" else HOP_HEADERS | {"content-length"}
            return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in drop], data

        def _serve(self) -> None:
            log.append(f"{self.command} {self.path} {self.headers.get('Range', '')}")
            faults.enter()
            try:
                self._answer()
            finally:
                faults.leave()

        def _answer(self) -> None:
            fault = faults.draw()
            if faults.refuse_presigned and "Signature=" in self.path:
                fault = "403"
            if fault == "delay":
                time.sleep(faults.delay_s)
            if fault in ("503", "403"):
                self.send_response(int(fault), "Slow Down" if fault == "503" else "Forbidden")
                self.send_header("Content-Length", "0")
                self.send_header("Retry-After", "0")
                self.end_headers()
                return
            if fault == "reset":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)
                return
            status, headers, data = self._forward() if upstream else self._file()
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            if not any(k.lower() == "content-length" for k, _ in headers):
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if fault == "truncate" and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.wfile.flush()
                    self.connection.shutdown(2)
                return
            self.wfile.write(data)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

    return Handler


@contextlib.contextmanager
def http_server(root: Path | None, faults: FaultPlan | None = None, upstream: tuple[str, int] | None = None):
    """Serve ``root`` on 127.0.0.1 (a free port), or proxy to the server at ``upstream``; yields (base URL, the
    fault plan, the request log)."""
    faults = faults or FaultPlan()
    log: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, faults, log, upstream))
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
