"""Datasets in object storage: a dataset directory may be a URL (``s3://``, ``gs://``, ``https://``, ``hf://``).

Everything remote goes through fsspec (``s3fs``, ``gcsfs``, ``huggingface_hub`` are optional extras, imported
when a URL of theirs is used). Endpoints and credentials come from each store's own environment and config files
(for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, profiles), never from our YAML;
every URL in a message goes through ``redact`` first, so user:password@ and query strings (presigned tokens)
never reach a log, an error or a checkpoint.

Reading is by **whole shards staged in a local cache** (``ShardCache``): the epoch plan reads each slot's shards
front to back (the order keeps a shard's samples together, docs/data.md), so a shard is fetched once with one
request instead of one request per sample, and the plan says which shards come next, so they are fetched
before they are needed (``Prefetcher``). A staged shard is trusted only after its size and CRC-32 match the
index; it is written under a temporary name and renamed, under a per-shard file lock, so the processes of a
node share one copy and a crash leaves nothing half-written that is later trusted. The cache stays under
``data.cache_max_bytes``: shards the plan no longer needs go first, then the least recently used.

Transient failures (connection resets, timeouts, 5xx, throttling) are retried with exponential backoff and
jitter (``with_retries``), counted; past the bound, or for an object that is gone, the error names the URL.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "hf", "az", "abfs")
CHUNK = 1 << 22  # bytes per read while staging a shard
_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}


class RemoteError(OSError):
    """A remote object could not be read (after retries), or is gone; the message names it (redacted)."""


def is_remote(path: str | os.PathLike) -> bool:
    """Whether a dataset directory or shard path is a URL of a remote store."""
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", str(path))
    return bool(m) and m.group(1).lower() in REMOTE_SCHEMES


def redact(url: str) -> str:
    """The URL without credentials: no user:password@, no query string or fragment (presigned tokens)."""
    url = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", str(url))
    return re.split(r"[?#]", url, maxsplit=1)[0]


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def filesystem(url: str):
    """(fsspec filesystem, path within it) for ``url``; a missing optional package is named with its install."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with the base install
        raise RemoteError("remote datasets need fsspec: pip install -e '.[remote]'") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        scheme = str(url).split("://", 1)[0].lower()
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
    """What remote reading did (per process): requests retried, shards fetched, bytes fetched, cache hits."""

    retries: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    hits: int = 0
    refetched: int = 0  # staged copies that failed their check and were fetched again
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: getattr(self, k) for k in ("retries", "fetched", "fetched_bytes", "hits", "refetched")}


def _gone(e: BaseException) -> bool:
    """An error that retrying cannot fix: the object (or bucket) does not exist, or access is denied."""
    if isinstance(e, (FileNotFoundError, PermissionError)):
        return True
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("NoSuchKey", "NoSuchBucket", "404", "AccessDenied", "403", "Forbidden"))


def with_retries(fn: Callable[[], T], what: str, policy: RetryPolicy, counters: RemoteCounters | None = None) -> T:
    """``fn()``, retried on transient errors; ``what`` (already redacted) names the object in the final error."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every backend raises its own types; _gone() decides
            if _gone(e):
                raise RemoteError(f"{what} is gone or not readable ({type(e).__name__}: {redact(str(e))})") from None
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


# ----------------------------------------------------------------------------------------------------------
# the shard cache


def crc32_file(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def cache_name(url: str) -> str:
    """A flat, unique file name for a shard URL inside the cache directory (the URL itself is not kept)."""
    digest = hashlib.sha1(redact(url).encode()).hexdigest()[:20]
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", redact(url).rsplit("/", 1)[-1])[-60:]
    return f"{digest}-{tail}"


@dataclass(frozen=True)
class ShardInfo:
    """What the index says a shard is: its size and CRC-32 (empty for indexes written without one)."""

    size: int
    crc32: str = ""


class ShardCache:
    """Remote shards staged whole under ``directory``, at most ``max_bytes`` of them (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        shards: dict[str, ShardInfo],
        policy: RetryPolicy | None = None,
        counters: RemoteCounters | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.max_bytes = int(max_bytes)
        self.shards = shards
        self.policy = policy or RetryPolicy()
        self.counters = counters or RemoteCounters()
        self._used: OrderedDict[str, None] = OrderedDict()  # this process's uses, least recent first
        self._wanted: set[str] = set()  # file names the plan needs soon: evicted last
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict:  # travels to DataLoader workers without its lock and counters
        return {k: v for k, v in self.__dict__.items() if k not in ("_mutex", "counters", "_used", "_wanted")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.counters, self._used, self._wanted, self._mutex = RemoteCounters(), OrderedDict(), set(), threading.Lock()

    def _path(self, url: str) -> Path:
        return self.dir / cache_name(url)

    def want(self, urls: Iterable[str]) -> None:
        """The shards the plan reads next (kept over others when the cache must shrink)."""
        with self._mutex:
            self._wanted = {cache_name(u) for u in urls}

    def local(self, url: str) -> Path:
        """The staged copy of ``url``, fetched (and checked) first when it is not in the cache."""
        info = self.shards.get(url)
        if info is None:
            raise RemoteError(f"{redact(url)} is not a shard of the loaded indexes")
        path = self._path(url)
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._valid(path, info, quick=True):
            self._touch(path)
            self.counters.add(hits=1)
            return path
        with self._locked(path):  # one process of the node fetches; the others wait, then find it staged
            if not self._valid(path, info, quick=False):
                self._fetch(url, path, info)
        self._touch(path)
        return path

    # -- internals ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, path: Path):
        with open(path.with_name(path.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _valid(self, path: Path, info: ShardInfo, quick: bool) -> bool:
        """Staged and whole: the size always; the CRC once per process (``quick`` trusts a copy already checked)."""
        try:
            if path.stat().st_size != info.size:
                return False
        except FileNotFoundError:
            return False
        if quick and path.name in self._used:
            return True
        if info.crc32 and crc32_file(path) != info.crc32:
            log.warning("staged shard %s failed its CRC check: fetching it again", path.name)
            self.counters.add(refetched=1)
            path.unlink(missing_ok=True)
            return False
        return True

    def _fetch(self, url: str, path: Path, info: ShardInfo) -> None:
        self._make_room(info.size)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        fs, remote = filesystem(url)

        def download() -> None:
            with fs.open(remote, "rb", block_size=CHUNK) as src, open(tmp, "wb") as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
            got = tmp.stat().st_size
            if got != info.size:
                raise ConnectionError(f"got {got} bytes, the index says {info.size}")
            if info.crc32 and crc32_file(tmp) != info.crc32:
                raise ConnectionError("the fetched bytes fail the index's CRC-32")

        try:
            with_retries(download, redact(url), self.policy, self.counters)
            os.replace(tmp, path)  # atomic: a reader sees the whole shard or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, RemoteError):
                raise
            raise RemoteError(
                f"cannot stage {redact(url)} in {self.dir}: {e} (a full disk? see data.cache_dir)"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        self.counters.add(fetched=1, fetched_bytes=info.size)

    def _touch(self, path: Path) -> None:
        with self._mutex:
            self._used.pop(path.name, None)
            self._used[path.name] = None

    def _make_room(self, incoming: int) -> None:
        """Evict staged shards until ``incoming`` more bytes fit under max_bytes: first those the plan does not
        want soon, least recently used first (by this process's uses, then by file age)."""
        entries = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.dir):
                if e.is_file() and not e.name.endswith((".lock", ".part")):
                    st = e.stat()
                    entries.append((e.name, st.st_size, st.st_mtime))
        total = sum(size for _, size, _ in entries)
        if total + incoming <= self.max_bytes:
            return
        with self._mutex:
            recency = {name: i for i, name in enumerate(self._used)}
            wanted = set(self._wanted)
        entries.sort(key=lambda e: (e[0] in wanted, recency.get(e[0], -1), e[2]))
        for name, size, _ in entries:
            if total + incoming <= self.max_bytes:
                break
            (self.dir / name).unlink(missing_ok=True)  # an open reader keeps its copy until it closes it
            with self._mutex:
                self._used.pop(name, None)
            total -= size


class Prefetcher:
    """Fetches the shards a worker's plan reads next, in the background: at most ``concurrency`` requests in
    flight and ``ahead`` shards beyond the one being read."""

    def __init__(self, cache: ShardCache, concurrency: int = 2, ahead: int = 2) -> None:
        self.cache, self.ahead = cache, ahead
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="shard-prefetch")
        self._pending: dict[str, Future] = {}

    def upcoming(self, urls: Iterable[str]) -> None:
        """``urls``: the shards of the coming reads, in plan order (duplicates and local paths ignored)."""
        order = list(dict.fromkeys(u for u in urls if is_remote(u)))[: self.ahead + 1]
        self.cache.want(order)
        for done in [u for u, f in self._pending.items() if f.done()]:
            self._pending.pop(done)
        for url in order:
            if url not in self._pending:
                self._pending[url] = self._pool.submit(self._quiet_fetch, url)

    def _quiet_fetch(self, url: str) -> Any:
        try:
            return self.cache.local(url)
        except Exception as e:  # noqa: BLE001 - the reader's own fetch raises it, where it is needed
            log.debug("prefetch of %s failed: %s", redact(url), e)
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
