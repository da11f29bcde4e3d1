"""A local directory served as a Hugging Face Hub *dataset repository* on 127.0.0.1, so ``hf://`` URLs are tested
offline through the real client (huggingface_hub's ``HfFileSystem``). No registry package runs a Hub server, so
this implements the Hub HTTP API that the client calls, for one repo at revision "main" (or ``SHA``):

* ``GET /api/datasets/{repo}[/revision/{rev}]``: ``resolve_path`` checks once per instance that the repo and the
  revision exist (``HfApi.repo_info``); another repo is 404 ``RepoNotFound``, another revision ``RevisionNotFound``.
* ``GET /api/datasets/{repo}/tree/{rev}[/{dir}]?recursive=&expand=``: ``ls``, ``info`` (it lists the parent),
  ``glob``, ``find``, ``exists`` (``HfApi.list_repo_tree``); one page (no ``Link`` pagination). A missing path or
  a file is 404 ``EntryNotFound``, the error ``ls`` catches (by its X-Error-Code) to list the parent instead.
* ``POST /api/datasets/{repo}/paths-info/{rev}`` (form ``paths``, ``expand``): ``info(refresh=True)`` and ``info``
  of a path whose parent is not listed (``HfApi.get_paths_info``); missing paths are left out, as on the Hub.
* ``GET|HEAD /datasets/{repo}/resolve/{rev}/{path}``: the bytes. ``cat_file``, ``read()`` and ``get_file`` stream
  the whole file; ``open(block_size>0).read(n)`` sends ``Range: bytes=a-b`` (206 + Content-Range; 416 past the
  end, which ends a stream); HEAD (``hf_hub_download``'s metadata call) needs ETag, X-Repo-Commit, Content-Length.
  A missing file is 404 ``EntryNotFound``.

``hub_server`` also points the already imported huggingface_hub at the server (its import-time copies of
HF_ENDPOINT) and the environment (for spawned processes; forked DataLoader workers inherit the patched modules),
turns offline mode, implicit tokens and telemetry off, drops cached HfFileSystem instances and the pooled HTTP
client, and restores all of it on exit. Paths stay inside ``root`` (no ``..``, no symlink out of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

SHA = "0123456789abcdef0123456789abcdef01234567"  # the fake commit "main" points to


def _handler(root: Path, repo_id: str, log: list[str]):
    r = re.escape(repo_id)
    routes = {  # patterns on the raw (still quoted) URL path
        "info": re.compile(rf"/api/datasets/{r}(?:/revision/(?P<rev>[^/]+))?"),
        "tree": re.compile(rf"/api/datasets/{r}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?"),
        "paths_info": re.compile(rf"/api/datasets/{r}/paths-info/(?P<rev>[^/]+)"),
        "resolve": re.compile(rf"/datasets/{r}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
    }

    def local(rel: str) -> Path | None:
        parts = [p for p in rel.split("/") if p]
        if any(p in (".", "..") or "\\" in p for p in parts):
            return None
        path = root.joinpath(*parts).resolve()
        return path if (path == root or root in path.parents) and path.exists() else None

    def entry(path: Path, expand: bool = False) -> dict:
        rel, st = path.relative_to(root).as_posix(), path.stat()
        out = {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()}
        if path.is_file():
            oid = hashlib.sha1(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
            out.update(type="file", oid=oid, size=st.st_size)
        if expand:
            out["lastCommit"] = {"id": SHA, "title": "local", "date": "2024-01-01T00:00:00.000Z"}
        return out

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: httpx pools connections

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._route(body=True)

        do_POST = do_GET

        def do_HEAD(self) -> None:
            self._route(body=False)

        def _send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(data)), **(headers or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, obj, body: bool, status: int = 200, **headers: str) -> None:
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **headers}, body)

        def _error(self, status: int, code: str, body: bool) -> None:  # read by hf_raise_for_status
            msg = f"{code}: {urlsplit(self.path).path}"
            self._json({"error": msg}, body, status, **{"X-Error-Code": code, "X-Error-Message": msg})

        def _route(self, body: bool) -> None:
            url, rng = urlsplit(self.path), self.headers.get("Range")
            log.append(f"{self.command} {url.path}" + (f" [{rng}]" if rng else ""))
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode()) if length else {}
            query = {k: v[-1].lower() for k, v in parse_qs(url.query).items()}
            name, m = next(((n, m) for n, p in routes.items() if (m := p.fullmatch(url.path))), (None, None))
            if m is None:
                return self._error(404, "RepoNotFound", body)
            if m["rev"] and unquote(m["rev"]) not in ("main", SHA):
                return self._error(404, "RevisionNotFound", body)
            expand = "true" in (query.get("expand"), form.get("expand", [""])[-1].lower())
            if name == "info":
                return self._json({"id": repo_id, "sha": SHA, "private": False, "disabled": False}, body)
            if name == "paths_info":
                found = [local(p) for p in form.get("paths", [])]
                return self._json([entry(p, expand) for p in found if p is not None], body)
            path = local(unquote(m["path"] or ""))
            if name == "tree":
                if path is None or not path.is_dir():
                    return self._error(404, "EntryNotFound", body)
                found = sorted(path.rglob("*") if query.get("recursive") == "true" else path.iterdir())
                return self._json([entry(p, expand) for p in found if local(p.relative_to(root).as_posix())], body)
            if path is None or not path.is_file():
                return self._error(404, "EntryNotFound", body)
            size, status = path.stat().st_size, 200
            start, end = 0, size - 1
            headers = {"Accept-Ranges": "bytes", "ETag": f'"{entry(path)["oid"]}"', "X-Repo-Commit": SHA}
            if (m := re.fullmatch(r"bytes=(\d*)-(\d*)", (rng or "").strip())) and (m[1] or m[2]):
                if m[1]:
                    start, end = int(m[1]), min(int(m[2]), size - 1) if m[2] else size - 1
                else:  # bytes=-n: the last n bytes
                    start = max(0, size - int(m[2]))
                if start >= size or start > end:
                    return self._send(416, headers={**headers, "Content-Range": f"bytes */{size}"}, body=body)
                status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
            self._send(status, headers={**headers, "Content-Length": str(end - start + 1)}, body=False)
            with open(path, "rb") as f, contextlib.suppress(ConnectionError):
                f.seek(start)
                left = (end - start + 1) if body else 0
                while left > 0 and (chunk := f.read(min(left, 1 << 20))):
                    self.wfile.write(chunk)
                    left -= len(chunk)

    return Handler


@contextlib.contextmanager
def hub_server(root: Path, repo_id: str = "org/data"):
    """Serve ``root`` as dataset repo ``repo_id``; yields (base URL, log of "METHOD /path [range]" strings)."""
    from huggingface_hub import HfFileSystem, constants
    from huggingface_hub.utils import close_session

    log: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Path(root).resolve(), repo_id, log))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    consts = {
        "ENDPOINT": url,
        "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",  # hf_hub_url's base
        "HF_URL_HOSTS": frozenset(getattr(constants, "HF_URL_HOSTS", ())) | {"127.0.0.1"},
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
        "HF_HUB_DISABLE_TELEMETRY": True,  # else the first request's user agent GETs {ENDPOINT}/api/agent-harnesses
    }
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
    env = {"HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    env.update({"HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": no_proxy, "no_proxy": no_proxy})
    saved = {k: getattr(constants, k, None) for k in consts}, {k: os.environ.get(k) for k in env}

    def apply(values: dict, environ: dict) -> None:
        for k, v in values.items():
            setattr(constants, k, v)
        for k, v in environ.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        HfFileSystem.clear_instance_cache()  # instances (and their dircache) of the previous endpoint
        close_session()  # the pooled client: its keep-alive connections, its proxy settings read at creation

    try:
        apply(consts, env)
        yield url, log
    finally:
        apply(*saved)
        server.shutdown()
        server.server_close()
