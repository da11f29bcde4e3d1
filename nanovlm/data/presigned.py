"""Whole S3 objects fetched with one plain HTTP GET of a presigned URL (urllib3) instead of s3fs's own transfer.

Why: s3fs receives through aiobotocore and aiohttp, which costs a DataLoader worker about 1.5 ms of CPU per MB and
a few ms per request; a plain GET costs about 0.1 ms per MB (docs/remote.md#the-transfer), and every core-second a
worker spends receiving is taken from decoding images. s3fs still decides everything that makes the request
right when it presigns the URL (endpoint, region, credentials and their refresh, addressing style, requester
pays); only the transfer changes. A filesystem that adds arguments to every request (SSE-C keys) keeps s3fs's
transfer (``presignable``).

A presigned URL carries a signature (and, with temporary credentials, a session token) in its query string: it is
never logged, and the errors raised here name only an HTTP status or an exception type.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

EXPIRES_S = 900  # a URL is presigned right before its GET: it only has to outlive one transfer
CHUNK = 1 << 20
_POOLS: dict[tuple, Any] = {}  # (pid, proxy, verify) -> urllib3 pool manager: connections never cross a fork


def presignable(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose GETs a presigned URL can carry (no per-request extras)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return "s3" in protocols and not getattr(fs, "s3_additional_kwargs", None) and hasattr(fs, "url")


def get_presigned(fs: Any, path: str, dest: Path) -> None:
    """Stream the object at ``path`` (bucket/key) of s3fs filesystem ``fs`` into ``dest`` (overwritten).

    Raises FileNotFoundError (404), PermissionError (401, 403): retrying cannot help; ConnectionError for any
    other status or a transfer that fails (reset, timeout, a body cut short): retry. A local write error is the
    OSError of the write, as ``open`` raises it."""
    import urllib3

    url = fs.url(path, expires=EXPIRES_S, **getattr(fs, "req_kw", {}))
    verify = (getattr(fs, "client_kwargs", None) or {}).get("verify", os.environ.get("AWS_CA_BUNDLE"))
    try:
        resp = _pool(url, verify).request("GET", url, preload_content=False, retries=False, redirect=False)
    except urllib3.exceptions.HTTPError as e:
        raise ConnectionError(f"{type(e).__name__} requesting the object") from None
    try:
        if resp.status == 404:
            raise FileNotFoundError(f"HTTP 404 for {path}")
        if resp.status in (401, 403):
            raise PermissionError(f"HTTP {resp.status} for {path}")
        if resp.status != 200:
            raise ConnectionError(f"HTTP {resp.status} {resp.reason}")
        with open(dest, "wb") as f:
            for chunk in resp.stream(CHUNK):
                f.write(chunk)
    except urllib3.exceptions.HTTPError as e:  # reset, timeout, fewer bytes than Content-Length
        raise ConnectionError(f"{type(e).__name__} reading the object") from None
    finally:
        resp.release_conn()


def _pool(url: str, verify: bool | str | None) -> Any:
    """This process's pool manager for ``url``: through the proxy the environment names for it (as botocore
    does), verifying TLS against ``verify`` (a CA bundle path; False: not at all; None: certifi's bundle, which
    botocore also uses, else the system's)."""
    import urllib3

    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and urllib.request.proxy_bypass(parts.hostname or ""):
        proxy = None
    key = (os.getpid(), proxy, verify)
    pool = _POOLS.get(key)
    if pool is None:
        tls: dict[str, Any] = {"cert_reqs": "CERT_NONE"} if verify is False else {"ca_certs": verify or _ca_bundle()}
        timeout = urllib3.Timeout(connect=60, read=60)  # botocore's defaults: a stalled transfer fails, never hangs
        options = {"maxsize": 8, "timeout": timeout, **tls}
        pool = urllib3.ProxyManager(proxy, **options) if proxy else urllib3.PoolManager(**options)
        _POOLS[key] = pool
    return pool


def _ca_bundle() -> str | None:
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()
