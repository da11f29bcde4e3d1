"""Whole S3 objects received by one plain HTTP GET of a presigned URL (urllib3) instead of s3fs's own transfer.

Why: s3fs receives through aiobotocore and aiohttp, which costs a DataLoader worker more than twice the CPU per MB
of a plain GET (docs/remote.md#the-transfer), and every core-second a worker spends receiving is taken from
decoding images. s3fs still decides what makes the request right when it presigns the URL (endpoint, region,
credentials and their refresh, addressing style), with SigV4: botocore presigns with SigV2 by default wherever a
region still lists it, which newer buckets and many S3-compatible stores refuse. Only plain answers are handled
here: 200 is streamed to disk; 5xx, 429 and a transfer that breaks are a ConnectionError for the caller's
retries; a missing key or denied access goes to s3fs's own transfer, which raises what it means; any other
answer (a redirect to another region, a refused signature or clock) also goes to s3fs's transfer, and the
process keeps using it for that host. A filesystem whose requests need more than the URL (requester pays, SSE-C
keys, proxies set in its config) keeps s3fs's transfer throughout (``presignable``).

A presigned URL carries a signature (and, with temporary credentials, a session token) in its query string:
errors raised here name only an HTTP status or an exception type, and urllib3's debug log loses query strings.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)
EXPIRES_S = 900  # a URL is presigned right before its GET: it only has to outlive one transfer
CHUNK = 1 << 20
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
CONNECTIONS = 8  # per host, kept open by a process's pool: as many GETs as it runs at once (the index's columns)
_POOLS: dict[tuple, Any] = {}  # (proxy, verify) -> urllib3 pool manager of this process
GONE_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "AccessDenied"})  # S3 error codes about the object, not the URL
_LOADERS: dict[str, Any] = {}  # session options -> botocore's data loader, S3's client data in it (kept over forks)
_SESSIONS: dict[str, Any] = {}  # session options -> this process's session URLs are signed with (never over forks)
_SPARES: dict[str, tuple[int, Any]] = {}  # session options -> (maker's pid, a session it never used): for a child
_REFUSED: set[str] = set()  # hosts (scheme://host:port) that refused a presigned GET: s3fs's transfer from then on
os.register_at_fork(after_in_child=_POOLS.clear)  # connections never cross a fork
os.register_at_fork(after_in_child=_SESSIONS.clear)  # nor credentials a session resolved


def presignable(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose GETs a presigned URL alone can carry."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return (
        "s3" in protocols
        and hasattr(fs, "url")
        and not getattr(fs, "req_kw", None)  # requester pays: a header the signature covers
        and not getattr(fs, "s3_additional_kwargs", None)  # SSE-C keys
        and not (getattr(fs, "config_kwargs", None) or {}).get("proxies")
    )


def get_presigned(fs: Any, path: str, dest: Path) -> None:
    """Stream the object at ``path`` (bucket/key) of s3fs filesystem ``fs`` into ``dest`` (overwritten).

    Raises ConnectionError for an answer or a transfer worth retrying; what s3fs's transfer raises for any other
    answer; the OSError of a local write as ``open`` raises it."""
    import urllib3

    url = presign(fs, path)
    host = "{0.scheme}://{0.netloc}".format(urlsplit(url))
    if host in _REFUSED:
        fs.get_file(path, str(dest))
        return
    verify = (getattr(fs, "client_kwargs", None) or {}).get("verify", os.environ.get("AWS_CA_BUNDLE"))
    try:
        resp = _pool(url, verify).request(
            "GET", url, preload_content=False, retries=False, redirect=False, enforce_content_length=True
        )
    except urllib3.exceptions.HTTPError as e:
        raise ConnectionError(f"{type(e).__name__} requesting the object") from None
    try:
        if resp.status in RETRY_STATUSES:
            raise ConnectionError(f"HTTP {resp.status} {resp.reason}")
        if resp.status != 200:
            code = re.search(rb"<Code>([^<]{1,64})</Code>", resp.read(1 << 16))
            if resp.status != 404 and (code is None or code.group(1).decode() not in GONE_CODES):
                _REFUSED.add(host)  # the URL itself is refused, or points to the wrong place
                log.warning(
                    "the store answered HTTP %d to a presigned GET: s3fs's own transfer from now on", resp.status
                )
            resp.drain_conn()
            fs.get_file(path, str(dest))  # raises what the answer means (a gone object), or reads it
            return
        with open(dest, "wb") as f:
            for chunk in resp.stream(CHUNK, decode_content=False):  # the stored bytes, whatever their encoding
                f.write(chunk)
    except urllib3.exceptions.HTTPError as e:  # reset, timeout, fewer bytes than Content-Length
        resp.close()
        raise ConnectionError(f"{type(e).__name__} reading the object") from None
    except BaseException:
        resp.close()  # a connection whose answer was not read to its end is not reused
        raise
    resp.release_conn()


def presign(fs: Any, path: str) -> str:
    """A URL that GETs the object at ``path`` (bucket/key) of s3fs filesystem ``fs`` for ``EXPIRES_S``, signed
    with SigV4 unless ``fs`` is unsigned or the user chose a signature version."""
    return _signer(fs).url(path, expires=EXPIRES_S)


def warm(fs: Any) -> None:
    """Load what an S3 client is made from (botocore's service model, endpoint rules, partitions: about 75 ms of
    CPU) into a loader this process keeps for signing, and make a spare session on it (botocore registers its
    handlers: about 20 ms more). Called before the DataLoader workers fork, it spares each worker both before its
    first fetch. The spare is never used here, so it holds no credentials, client or lock when a worker takes it
    over (``_session``); botocore initializers registered after ``warm`` do not reach it. Only a speed-up: a
    failure is logged and passed over."""
    if not presignable(fs) or _as_is(fs) or fs.storage_options.get("session") is not None:
        return  # s3fs's transfer, unsigned, signed the user's way, or with the user's own session
    try:
        _loader(fs.kwargs)
        key = _key(fs.kwargs)
        if _SPARES.get(key, (None,))[0] != os.getpid():  # none of its own yet (an inherited one is its parent's)
            _SPARES[key] = (os.getpid(), _new_session(fs.kwargs))
    except Exception as e:  # noqa: BLE001 - each worker then loads its own, as without warm
        log.debug("S3 client data or spare session not preloaded: %s", e)


def _key(kwargs: dict) -> str:
    """The key of s3fs's session options in ``_LOADERS``, ``_SPARES`` and ``_SESSIONS``."""
    return repr(sorted(kwargs.items()))


def _loader(kwargs: dict) -> Any:
    """botocore's data loader for sessions made with ``kwargs``, S3's client data in it (files read once per
    node's process tree: forked workers inherit it)."""
    key = _key(kwargs)
    if key not in _LOADERS:
        from aiobotocore.session import AioSession

        loader = AioSession(**kwargs).get_component("data_loader")
        for name in ("service-2", "endpoint-rule-set-1"):
            loader.load_service_model("s3", name)
        for name in ("endpoints", "partitions", "_retry", "sdk-default-configuration"):
            loader.load_data(name)
        _LOADERS[key] = loader
    return _LOADERS[key]


def _new_session(kwargs: dict) -> Any:
    """An aiobotocore session made as s3fs makes its own, reading client data from the loader ``warm`` filled
    for these options, if any."""
    from aiobotocore.session import AioSession

    session = AioSession(**kwargs)
    loader = _LOADERS.get(_key(kwargs))
    if loader is not None:
        session.register_component("data_loader", loader)
    return session


def _session(fs: Any) -> Any:
    """This process's aiobotocore session for ``fs``'s session options (made as s3fs makes its own): in a process
    forked after ``warm``, the spare it left, else a new one reading client data from the loader ``warm`` filled,
    if any. Either way the session resolves credentials here, never in a parent."""
    key = _key(fs.kwargs)
    session = _SESSIONS.get(key)
    if session is None:
        maker, spare = _SPARES.get(key, (os.getpid(), None))
        if maker != os.getpid() and _SPARES.pop(key, None) is not None:  # this copy of it is ours alone
            session = spare
        else:
            session = _new_session(fs.kwargs)
        session = _SESSIONS.setdefault(key, session)  # one per process, whichever thread got here first
    return session


def _as_is(fs: Any) -> bool:
    """Whether ``fs`` presigns for itself: unsigned, or with the signature version the user chose."""
    return bool(getattr(fs, "anon", False)) or "signature_version" in (fs.config_kwargs or {})


def _signer(fs: Any) -> Any:
    """The filesystem that presigns for ``fs``: ``fs`` made with SigV4 (fsspec keeps one per process and options).
    Its client is made on its first use, from this process's session unless the user gave one, so a worker that
    only fetches shards sets up one client, from the data ``warm`` loaded before the fork."""
    if _as_is(fs):
        return fs
    options = {**fs.storage_options, "config_kwargs": {**fs.config_kwargs, "signature_version": "s3v4"}}
    if options.get("session") is None:
        options["session"] = _session(fs)
    return type(fs)(**options)


def _pool(url: str, verify: bool | str | None) -> Any:
    """This process's pool manager for ``url``: through the proxy the environment names for it (as botocore
    does), verifying TLS against ``verify`` (a CA bundle path; False: not at all; None: certifi's bundle, which
    botocore also uses, else the system's)."""
    import urllib.request  # here: an index that is only read locally does not pay for it

    import urllib3

    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and urllib.request.proxy_bypass(parts.hostname or ""):
        proxy = None
    pool = _POOLS.get((proxy, verify))
    if pool is None:
        tls: dict[str, Any] = {"cert_reqs": "CERT_NONE"} if verify is False else {"ca_certs": verify or _ca_bundle()}
        timeout = urllib3.Timeout(connect=60, read=60)  # botocore's defaults: a stalled transfer fails, never hangs
        options = {"maxsize": CONNECTIONS, "timeout": timeout, **tls}
        pool = (
            urllib3.ProxyManager(proxy, proxy_headers=_proxy_headers(proxy), **options)
            if proxy
            else urllib3.PoolManager(**options)
        )
        _POOLS[(proxy, verify)] = pool
    return pool


def _proxy_headers(proxy: str) -> dict[str, str] | None:
    """Basic auth for a proxy URL with user:password@ (urllib3 does not take it from the URL)."""
    import urllib3

    parts = urlsplit(proxy)
    if parts.username is None:
        return None
    return urllib3.make_headers(proxy_basic_auth=f"{unquote(parts.username)}:{unquote(parts.password or '')}")


def _ca_bundle() -> str | None:
    """certifi's CA bundle where it is installed (None: the system's)."""
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()


class _NoQueryStrings(logging.Filter):
    """urllib3 logs each request's path at DEBUG: a presigned URL's query string (its signature) is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(a.split("?", 1)[0] if isinstance(a, str) else a for a in record.args)
        return True


logging.getLogger("urllib3.connectionpool").addFilter(_NoQueryStrings())
