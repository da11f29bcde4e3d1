"""The shard cache: remote shards staged whole on local disk, shared by a node's processes, fetched ahead along
the plan.

Why whole shards: the epoch plan reads each slot's shards one after another (the order keeps a shard's samples
together, docs/data.md), so a shard is fetched once with one request instead of one request per sample, and the
plan says which shards come next, so they are fetched before they are needed (``Prefetcher``). A staged shard is
trusted only after its size and CRC-32 match the index; it is written under a temporary name and renamed, under
a per-shard file lock, so the processes of a node share one copy and a crash leaves nothing half-written that is
later trusted. The cache stays under ``data.cache_max_bytes`` (a fetch reserves its size first): shards the plan
does not read next go first, then the least recently used on the node, and copies no worker has read yet last
(``UNREAD_S``). Talking to the store (URLs, retries, the transfer) is data/remote.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from nanovlm.data.index import crc32_file
from nanovlm.data.presigned import warm
from nanovlm.data.remote import (
    LocalCacheError,
    RemoteCounters,
    RemoteError,
    RetryPolicy,
    cache_name,
    copy_object,
    default_cache_dir,
    filesystem,
    is_remote,
    redact,
    with_retries,
)
from nanovlm.dist import file_lock

log = logging.getLogger(__name__)

# A copy no one has read yet is staged with its mtime this far ahead (a reader's open sets it to now), so eviction,
# which takes the oldest mtimes first, takes it only after every copy that was read: the workers of a node never
# evict one another's prefetched shards while read ones remain. One never read (its worker stopped) loses the mark
# this much later.
UNREAD_S = 600


@dataclass(frozen=True)
class ShardInfo:
    """What the index says a shard is: its size and CRC-32 (empty for indexes written without one)."""

    size: int
    crc32: str = ""


class ShardCache:
    """Remote shards staged whole under ``directory``, at most ``max_bytes`` of them (see the module docstring).

    ``open(url)`` is what readers call: it returns an open file, so a shard another process evicts afterwards stays
    readable through it (an unlinked file lives while it is open), and one evicted between staging and opening is
    simply staged again. Staging and eviction take the shard's file lock, and eviction also a cache-wide one, so
    the processes of a node never fetch one shard twice at once nor delete a copy that is being written or checked.
    The last read of a staged copy is its mtime (set by ``open``), which orders eviction across processes; a copy
    staged and not read yet has its mtime ``UNREAD_S`` ahead, so it goes after every copy that was read.
    """

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
        self._checked: set[str] = set()  # copies this process has CRC-checked since it staged or first used them
        self._wanted: set[str] = set()  # file names the plan needs soon: evicted last
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict:  # travels to DataLoader workers without its lock and counters
        return {k: v for k, v in self.__dict__.items() if k not in ("_mutex", "counters", "_checked", "_wanted")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.counters, self._checked, self._wanted, self._mutex = RemoteCounters(), set(), set(), threading.Lock()

    def _path(self, url: str) -> Path:
        return self.dir / cache_name(url)

    def want(self, urls: Iterable[str]) -> None:
        """The shards the plan reads next, kept over others when the cache must shrink: by this process, and by
        every process of the node, as unread copies (the staged ones' mtimes are set ``UNREAD_S`` ahead). A copy
        another worker read last may be the one this worker reads next (their chunks meet in it)."""
        names = {cache_name(u) for u in urls}
        with self._mutex:
            self._wanted = names
        now = time.time()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.dir / name, (now, now + UNREAD_S))

    def open(self, url: str) -> BinaryIO:
        """The staged copy of ``url``, open for reading (fetched and checked first when it is not staged)."""
        t0 = time.perf_counter()
        for _ in range(3):
            f = self._staged(url, opened=True)
            if f is None:  # evicted by another process between its check and opening: stage again
                continue
            if os.fstat(f.fileno()).st_size == self.shards[url].size:
                os.utime(f.fileno())  # read now: eviction's "last used" (and no longer marked unread)
                self.counters.add(wait_ms=round((time.perf_counter() - t0) * 1000))
                return f
            f.close()
        raise RemoteError(f"{redact(url)}: its staged copy in {self.dir} keeps disappearing (is the cache too small?)")

    def local(self, url: str) -> Path:
        """The path of the staged copy of ``url`` (fetched and checked first when needed); prefer ``open``."""
        return self._staged(url, opened=False)

    def _staged(self, url: str, opened: bool) -> Any:
        """``local``'s path, or with ``opened`` the copy open for reading (None if it vanished before it was
        opened). A copy staged here is opened under its lock, which eviction respects, so another process cannot
        remove it between its fetch and its opening."""
        info = self.shards.get(url)
        if info is None:
            raise RemoteError(f"{redact(url)} is not a shard of the loaded indexes")
        if info.size > self.max_bytes:
            raise RemoteError(
                f"{redact(url)} has {info.size} bytes, more than data.cache_max_bytes={self.max_bytes}: raise it"
            )
        path = self._path(url)
        if self._valid(path, info, quick=True):
            self.counters.add(hits=1)
            if not opened:
                return path
            try:
                return open(path, "rb")  # noqa: SIM115 - the caller owns it
            except FileNotFoundError:
                return None
        self.dir.mkdir(parents=True, exist_ok=True)
        with file_lock(self._lock_path(path)):  # one process fetches; the others then find it staged
            if not self._valid(path, info, quick=False):
                self._fetch(url, path, info)
            out = open(path, "rb") if opened else path  # noqa: SIM115 - the caller owns it
        # A fetch's eviction skips copies other processes hold locked (fetching or checking them), so the cache
        # may now be over its cap: whoever releases a lock trims it, so the last one leaves it within the cap.
        with file_lock(self.dir / ".evict.lock"):
            self._evict(0, keep=path.name)
        return out

    # -- internals ------------------------------------------------------------------------------------------

    def _lock_path(self, path: Path) -> Path:
        return path.with_name(path.name + ".lock")

    def _valid(self, path: Path, info: ShardInfo, quick: bool) -> bool:
        """Staged and whole: the size always, the CRC once per process (``quick`` skips a copy not yet checked
        here, which is then checked under its lock)."""
        try:
            if path.stat().st_size != info.size:
                return False
            if path.name not in self._checked:
                if quick:
                    return False
                if info.crc32 and crc32_file(path) != info.crc32:
                    log.warning("staged shard %s failed its CRC check: fetching it again", path.name)
                    self.counters.add(refetched=1)
                    path.unlink(missing_ok=True)  # under the shard's lock: no one is writing it
                    return False
                self._checked.add(path.name)
        except FileNotFoundError:
            self._checked.discard(path.name)
            return False
        return True

    def _fetch(self, url: str, path: Path, info: ShardInfo) -> None:
        part = f".{path.name}.{os.getpid()}.{threading.get_ident()}"
        reserve, tmp = path.with_name(part + ".part"), path.with_name(part + ".dl")  # see _make_room
        self._make_room(info.size, reserve)
        fs, remote = filesystem(url)

        def fetch_checked() -> None:
            got = copy_object(fs, remote, tmp)
            if got != info.size:  # a cut connection, or the object was replaced: fetch again
                raise ConnectionError(f"got {got} bytes, the index says {info.size}")
            if info.crc32 and crc32_file(tmp) != info.crc32:
                raise ConnectionError("the fetched bytes fail the index's CRC-32")

        try:
            with_retries(fetch_checked, redact(url), self.policy, self.counters)
            with file_lock(self.dir / ".evict.lock"):  # the shard replaces its reservation in one step for eviction
                now = time.time()
                os.utime(tmp, (now, now + UNREAD_S))  # not read yet: evicted after every copy that was (_evict)
                os.replace(tmp, path)  # atomic: a reader sees the whole shard or none
                reserve.unlink(missing_ok=True)
        except RemoteError:
            raise
        except (LocalCacheError, OSError) as e:  # writing or renaming the staged copy
            raise RemoteError(f"cannot stage {redact(url)} in {self.dir}: {e} (is the disk full?)") from None
        finally:
            tmp.unlink(missing_ok=True)
            reserve.unlink(missing_ok=True)
        with self._mutex:
            self._checked.add(path.name)
        self.counters.add(fetched=1, fetched_bytes=info.size)

    def _make_room(self, incoming: int, reserve: Path) -> None:
        """Evict staged shards until ``incoming`` more bytes fit under max_bytes, then reserve them: ``reserve``
        (``.NAME.PID.TID.part``, beside the fetch's ``.dl`` file that grows) is created at the full size, so
        fetches in flight count against the cap.
        Evicted first: shards this process's plan does not want soon, then the least recently used on the node; a
        copy whose lock another process holds (being fetched or checked) is left alone; leftovers of fetches whose
        process died are removed."""
        with file_lock(self.dir / ".evict.lock"):
            self._evict(incoming)
            try:
                with open(reserve, "wb") as f:
                    f.truncate(incoming)
            except OSError as e:
                raise RemoteError(f"cannot stage a shard in {self.dir}: {e} (is the disk full?)") from None

    def _evict(self, incoming: int, keep: str = "") -> None:
        """Delete staged copies (not ``keep``) until ``incoming`` more bytes fit (the caller holds the cache-wide
        lock)."""
        staged, total = [], 0
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.dir):
                if not e.is_file() or e.name.endswith(".lock"):
                    continue
                st = e.stat()
                if e.name.endswith((".part", ".dl")):  # a fetch's reservation, and its bytes so far
                    if not _pid_alive(e.name):
                        Path(e.path).unlink(missing_ok=True)
                    elif e.name.endswith(".part"):
                        total += st.st_size
                    continue
                staged.append((e.name, st.st_size, st.st_mtime))
                total += st.st_size
        if total + incoming <= self.max_bytes:
            return
        with self._mutex:
            wanted = set(self._wanted)
        staged.sort(key=lambda e: (e[0] in wanted, e[2]))  # unread copies' mtimes lie ahead: they sort last
        for name, size, _ in staged:
            if total + incoming <= self.max_bytes:
                break
            if name != keep and _try_remove(self.dir / name, self._lock_path(self.dir / name)):
                with self._mutex:
                    self._checked.discard(name)
                total -= size


def _pid_alive(part_name: str) -> bool:
    """Whether the process that is writing ``.NAME.PID.TID.part`` (or ``.dl``) still runs."""
    try:
        pid = int(part_name.rsplit(".", 3)[-3])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _try_remove(path: Path, lock: Path) -> bool:
    """Delete a staged copy unless another process holds its lock (fetching or checking it)."""
    try:
        with open(lock, "a+b") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                path.unlink(missing_ok=True)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return True


def shard_cache(indexes: Iterable, cache_dir: str | os.PathLike | None, max_bytes: int) -> ShardCache | None:
    """The cache of the remote shards of ``indexes`` (DatasetIndex), or None when all of them are local."""
    shards = {
        idx.shard_location(s): ShardInfo(s.size_bytes, s.crc32) for idx in indexes if idx.source for s in idx.shards
    }
    if not shards:
        return None
    for url in {u.split("://", 1)[0]: u for u in shards}.values():  # one per scheme, whose options fsspec sets
        warm(filesystem(url)[0])  # in the trainer's process, before its workers fork: they inherit the client data
    return ShardCache(Path(cache_dir or default_cache_dir()) / "shards", max_bytes, shards)


def prefetch_depth(cache: ShardCache, wanted: int, workers_on_node: int) -> int:
    """How many shards each DataLoader worker fetches ahead: ``wanted`` (``data.prefetch_shards``), or fewer where
    the node's cache cannot hold that many for every worker beside the fetch each has in flight. Past that, one
    worker's prefetch evicts another's prefetched shard before it is read, and both are fetched twice (measured:
    twice the dataset's bytes per epoch with 2 shards per worker and 2 ahead). The shard a worker reads needs no
    room: its reader holds it open (data/reader.py)."""
    largest = max((info.size for info in cache.shards.values()), default=1)
    per_worker = cache.max_bytes // max(1, largest * max(1, workers_on_node))
    depth = max(0, min(wanted, per_worker - 1))
    if depth < wanted:
        log.warning(
            "data.cache_max_bytes=%d holds %d of the largest shards per DataLoader worker of this node (%d): "
            "prefetching %d ahead instead of data.prefetch_shards=%d; raise data.cache_max_bytes to %d for that",
            cache.max_bytes,
            per_worker,
            workers_on_node,
            depth,
            wanted,
            largest * workers_on_node * (wanted + 1),
        )
    return depth


class Prefetcher:
    """Fetches the shards a worker's plan reads next, in the background: at most ``concurrency`` requests in
    flight and ``ahead`` shards beyond the one read next. The shard read next goes first, alone: the ones after
    it start once it is staged, so they never share the link with the shard the reader is waiting for.

    ``held(url)``: whether the worker's reader has the shard open (``ShardReader.holds``). Such a shard is
    staged and needs no room in the cache, so it neither counts as read next nor takes a place in ``ahead``:
    a reader still finishing one shard while it reads the next (the packer's look-ahead spans both) does not
    hold back the fetch of the one after them."""

    def __init__(
        self, cache: ShardCache, concurrency: int = 2, ahead: int = 2, held: Callable[[str], bool] | None = None
    ) -> None:
        self.cache, self.ahead, self.held = cache, ahead, held or (lambda url: False)
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="shard-prefetch")
        self._pending: dict[str, Future] = {}
        self._last: list[str] = []
        self._lock = threading.Lock()  # _pending, _last, _closed: the reader's thread and the pool's callbacks
        self._closed = False

    def upcoming(self, urls: Iterable[str]) -> None:
        """``urls``: the shards of the coming reads, in plan order (duplicates and local paths ignored); work is
        done only when the list changed since the last call."""
        order = list(dict.fromkeys(u for u in urls if is_remote(u) and not self.held(u)))[: self.ahead + 1]
        if order == self._last:
            return
        self.cache.want(order)
        with self._lock:
            if self._closed:
                return
            self._last = order
            for done in [u for u, f in self._pending.items() if f.done() and u not in order]:
                self._pending.pop(done)
            head = self._submit(order[0]) if order else None
        if head is not None:
            head.add_done_callback(self._submit_rest)  # at once if it is done

    def _submit(self, url: str) -> Future:
        """The fetch of ``url``, started unless it is in flight or done (the caller holds the lock)."""
        if url not in self._pending:
            self._pending[url] = self._pool.submit(self._quiet_fetch, url)
        return self._pending[url]

    def _submit_rest(self, done: Future) -> None:
        """The shards after the one read next, once that one is staged (the latest plan's, not the caller's)."""
        if done.cancelled():  # by close(), which holds the pool's lock while it cancels: submit nothing
            return
        with self._lock:
            head = self._pending.get(self._last[0]) if self._last else None
            if self._closed or head is None or not head.done():  # a newer head: its own callback starts the rest
                return
            for url in self._last[1:]:
                self._submit(url)

    def _quiet_fetch(self, url: str) -> Any:
        try:
            return self.cache.local(url)
        except Exception as e:  # noqa: BLE001 - the reader's own fetch raises it, where it is needed
            log.debug("prefetch of %s failed: %s", redact(url), e)
            return None

    def close(self) -> None:
        with self._lock:  # no callback submits after this
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
