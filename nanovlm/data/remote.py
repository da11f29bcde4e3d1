"""Datasets in object storage: a dataset directory may be a URL (``s3://``, ``gs://``, ``https://``, ``hf://``).

Everything remote goes through fsspec (``s3fs``, ``gcsfs``, ``huggingface_hub`` are optional extras, imported
when a URL of theirs is used), except the bytes of a whole S3 object: s3fs presigns its URL, and one plain GET
receives it for less CPU (data/presigned.py). Endpoints and credentials come from each store's own environment
and config files (for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, profiles), never
from our YAML; every URL in a message goes through ``redact`` first, so user:password@ and query strings
(presigned tokens) never reach a log, an error or a checkpoint.

Here: URLs, the filesystem of each, retries, one object copied to a local file. Its users: the index of a URL is
fetched by data/index.py, shards are staged by data/shard_cache.py, a prepared dataset is uploaded by
data/prepare.py.

Transient failures (connection resets, timeouts, 5xx, throttling) are retried with exponential backoff and
jitter (``with_retries``), counted; past the bound, or for an object that is gone, the error names the URL.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from nanovlm.data.presigned import get_presigned, presignable

log = logging.getLogger(__name__)
T = TypeVar("T")

REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "hf", "az", "abfs")
LOCAL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)  # a write error of the local cache
_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}


class RemoteError(OSError):
    """A remote object could not be read (after retries), or is gone; the message names it (redacted)."""


class RemoteGoneError(RemoteError):
    """The object does not exist (or may not be read): retrying cannot help."""


def is_remote(path: str | os.PathLike) -> bool:
    """Whether a dataset directory or shard path is a URL of a remote store."""
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", str(path))
    return bool(m) and m.group(1).lower() in REMOTE_SCHEMES


def redact(text: str) -> str:
    """``text`` (a URL, or a message holding URLs) without credentials: every URL loses its user:password@ and
    its query string and fragment (presigned tokens)."""
    text = re.sub(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]*@", r"\1", str(text))
    return re.sub(r"(://[^\s?#'\"]*)[?#][^\s'\")]*", r"\1", text)


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def filesystem(url: str):
    """(fsspec filesystem, path within it) for ``url``; a missing optional package is named with its install."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with the base install
        raise RemoteError("remote datasets need fsspec: pip install -e '.[remote]'") from None
    scheme = str(url).split("://", 1)[0].lower()
    # s3fs would split an object over 50 MB into parallel ranged parts, each held whole in memory (10 x 50 MB per
    # fetch): a shard is streamed in one request instead
    options = {"max_concurrency": 1} if scheme in ("s3", "s3a") else {}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        extra = _EXTRAS.get(scheme, "the fsspec backend of this scheme")
        raise RemoteError(
            f"{redact(url)}: reading {scheme}:// needs {extra} (pip install -e '.[remote]'): {e}"
        ) from None


# ----------------------------------------------------------------------------------------------------------
# retries


@dataclass
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter: delay ~ U(0, min(max_delay, base * 2^attempt))."""

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0


@dataclass
class RemoteCounters:
    """What remote reading did (per process): requests retried, shards fetched, bytes fetched, cache hits, and
    ``wait_ms``: how long readers waited to open shards, fetching them or waiting on their prefetch (an open of a
    staged copy costs microseconds), which says whether prefetch hides the store's latency."""

    retries: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    hits: int = 0
    refetched: int = 0  # staged copies that failed their check and were fetched again
    wait_ms: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def _gone(e: BaseException) -> bool:
    """An error that retrying cannot fix: the object (or bucket) does not exist, or access is denied."""
    if isinstance(e, (FileNotFoundError, PermissionError)):
        return True
    if getattr(e, "status", None) in (401, 403, 404):  # aiohttp's ClientResponseError (http, https)
        return True
    response = getattr(e, "response", None)
    if getattr(response, "status_code", None) in (401, 403, 404):  # an httpx or requests response (hf://)
        return True
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None  # botocore's ClientError
    return code in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "403", "404")


def with_retries(fn: Callable[[], T], what: str, policy: RetryPolicy, counters: RemoteCounters | None = None) -> T:
    """``fn()``, retried on transient errors; ``what`` (already redacted) names the object in the final error."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except LocalCacheError:
            raise
        except Exception as e:  # noqa: BLE001 - every backend raises its own types; _gone() decides
            if _gone(e):
                raise RemoteGoneError(
                    f"{what} is gone or not readable ({type(e).__name__}: {redact(str(e))})"
                ) from None
            if attempt == policy.attempts - 1:
                raise RemoteError(
                    f"{what}: still failing after {policy.attempts} attempts ({type(e).__name__}: {redact(str(e))}); "
                    "the last checkpoint resumes the run"
                ) from None
            if counters is not None:
                counters.add(retries=1)
            delay = random.uniform(0, min(policy.max_delay, policy.base_delay * 2**attempt))
            log.warning("%s: %s, retry %d/%d in %.2fs", what, type(e).__name__, attempt + 1, policy.attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def read_bytes(url: str, policy: RetryPolicy | None = None, counters: RemoteCounters | None = None) -> bytes:
    """One whole (small) remote object, e.g. an index file."""
    fs, path = filesystem(url)
    return with_retries(lambda: fs.cat_file(path), redact(url), policy or RetryPolicy(), counters)


def copy_object(fs: Any, remote: str, dest: Path) -> int:
    """Stream one remote object into ``dest`` (overwritten) with one request: over s3:// a GET of a presigned URL
    (data/presigned.py), else ``get_file`` (over http(s):// no size probe first; hf:// lists the directory once
    per process); returns the bytes copied. A local write error is a LocalCacheError: retrying the store cannot
    fix it."""
    try:
        open(dest, "wb").close()  # noqa: SIM115 - can we write there at all (not a directory, not read-only)
    except OSError as e:
        raise LocalCacheError(e) from None
    try:
        if presignable(fs):
            get_presigned(fs, remote, dest)
        else:
            fs.get_file(remote, str(dest))
    except OSError as e:
        if e.errno in LOCAL_ERRNOS:  # the disk filled up mid-copy, or went read-only
            raise LocalCacheError(e) from None
        raise  # the store's (a network error, a 5xx, a gone object): the caller decides whether to retry
    try:
        return dest.stat().st_size
    except OSError as e:
        raise LocalCacheError(e) from None


def download(url: str, dest: Path, policy: RetryPolicy, counters: RemoteCounters | None = None) -> int:
    """Stream ``url`` into ``dest`` (overwritten), with retries; returns its size."""
    fs, path = filesystem(url)
    return with_retries(lambda: copy_object(fs, path, dest), redact(url), policy, counters)


def default_cache_dir() -> Path:
    """``$NANOVLM_CACHE``, else ~/.cache/nanovlm: where remote indexes and staged shards go by default."""
    return Path(os.environ.get("NANOVLM_CACHE") or Path.home() / ".cache" / "nanovlm")


def cache_name(url: str) -> str:
    """A flat, unique file name for a shard URL inside the cache directory (the URL itself is not kept)."""
    digest = hashlib.sha1(redact(url).encode()).hexdigest()[:20]
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", redact(url).rsplit("/", 1)[-1])[-60:]
    return f"{digest}-{tail}"


class LocalCacheError(Exception):
    """Writing a staged copy failed on the local disk (full, read-only, permissions): never retried."""
