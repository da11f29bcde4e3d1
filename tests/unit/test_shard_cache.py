"""The shard cache (data/shard_cache.py) over a real HTTP server on loopback: staged shards are checked, shared by
processes and evicted under the byte cap in the order the plan needs them; prefetch follows the plan, fetches the
shard read next first, and asks no more than the node's cache holds; a local disk error is named, never retried."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import pytest
from helpers.data import IMAGE_TOKENS, make_cfg, make_dm
from helpers.servers import FaultPlan, http_server

from nanovlm.data.index import load_index
from nanovlm.data.remote import RemoteError, RetryPolicy
from nanovlm.data.shard_cache import Prefetcher, ShardCache, ShardInfo, prefetch_depth

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)


def test_prefetch_asks_no_more_than_the_node_cache_holds_for_every_worker(
    served, tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    """Each worker prefetches ``data.prefetch_shards`` ahead only where the node's cache holds that many for every
    worker of every rank beside a fetch in flight: past that one worker's prefetch evicts another's before it is
    read (twice the bytes per epoch, measured by the stream benchmark). The reduced depth is a logged warning."""
    index = load_index(served / "a")
    shards = {f"s3://b/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
    size = max(i.size for i in shards.values())

    def depth(per_worker: int, workers: int = 2) -> int:
        return prefetch_depth(ShardCache(tmp_path, per_worker * workers * size, shards), 2, workers)

    with caplog.at_level(logging.WARNING, logger="nanovlm.data.shard_cache"):
        assert depth(3) == depth(100) == 2 and not caplog.text
        assert depth(2) == 1 and depth(1) == 0 and "raise data.cache_max_bytes" in caplog.text
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of 2 workers on the node: 4 workers share it
    with http_server(served) as (url, _, _):
        cfg = make_cfg([f"{url}/a"], cache_dir=str(tmp_path / "c"), num_workers=2, cache_max_bytes=8 * size)
        dm = make_dm(cfg, tiny_tokenizer)
        dm.setup("fit")
        assert dm.prefetch_shards == 1 and dm._stream_spec().prefetch_shards == 1


def test_staged_shards_are_checked_shared_and_evicted(served, tmp_path):
    index = load_index(served / "a")
    with http_server(served) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        assert all(i.crc32 for i in shards.values())  # written by prepare
        size = max(i.size for i in shards.values())
        cache = ShardCache(tmp_path / "c", int(2.5 * size), shards, FAST)
        threads = [threading.Thread(target=cache.local, args=(urls[0],)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(1 for line in log if line.startswith("GET") and urls[0].rsplit("/", 1)[1] in line) == 1
        cache.local(urls[1])
        cache.want([urls[0], urls[3]])  # the plan reads shard 0 again next: shard 1 goes first
        cache.local(urls[2])
        staged = {p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")}
        assert len(staged) == 2 and any(urls[0].rsplit("/", 1)[1] in n for n in staged)
        # a staged copy damaged on disk (same size) is caught by its CRC in a process that has not checked it yet
        path = cache.local(urls[0])
        blob = bytearray(path.read_bytes())
        blob[700] ^= 0xFF
        path.write_bytes(bytes(blob))
        fresh = ShardCache(tmp_path / "c", int(2.5 * size), shards, FAST)
        assert fresh.local(urls[0]).read_bytes() != bytes(blob) and fresh.counters.refetched == 1
        # an object replaced by other bytes (here: its size in the index is wrong) is never trusted
        bad = ShardCache(tmp_path / "d", 10 * size, {urls[1]: ShardInfo(shards[urls[1]].size + 1)}, FAST)
        with pytest.raises(RemoteError, match=r"still failing .*the index says"):
            bad.local(urls[1])
        assert not list((tmp_path / "d").glob("*.tar")) and not list((tmp_path / "d").glob(".*part"))


def test_eviction_takes_read_copies_before_ones_a_worker_reads_next(served, tmp_path):
    """Two caches on one directory are two workers of a node, each knowing only its own plan. A copy no one has
    read yet (a prefetch) and one another worker reads next (``want``) are evicted after every copy that was read,
    however long ago they were staged: one worker's fetch never evicts what another prefetched for its reader."""
    index = load_index(served / "a")
    with http_server(served) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        size = max(i.size for i in shards.values())
        w1, w2 = (ShardCache(tmp_path / "c", 2 * size, shards, FAST) for _ in range(2))

        def staged() -> set[str]:
            return {u for u in urls if w1._path(u).exists()}

        w2.local(urls[0])  # w2's prefetch: staged first, not read yet
        w1.open(urls[1]).close()  # read by w1
        w1.local(urls[2])  # the read copy goes, not the older unread one
        assert staged() == {urls[0], urls[2]}
        w1.open(urls[2]).close()
        w2.open(urls[0]).close()  # now both are read, shard 0 last
        w2.want([urls[2]])  # w1 read it; w2 reads it next
        w1.local(urls[3])
        assert staged() == {urls[2], urls[3]}
        w2.open(urls[2]).close()  # read now: it goes before shard 3, not read yet
        w1.local(urls[1])
        assert staged() == {urls[1], urls[3]}


def test_a_shard_the_reader_holds_takes_no_place_in_the_prefetch_depth(served, tmp_path):
    """The packer's look-ahead spans two shards where one ends and the next begins, so a reader often holds the
    shard it finishes while it reads the next: the one held open needs no fetch and no room in the cache, and the
    depth counts from the first shard it does not hold."""
    import time

    from nanovlm.data.reader import ShardReader

    index = load_index(served / "a")
    with http_server(served) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        reader = ShardReader(cache=cache)
        path, off, n, key = next(iter(index.sample_refs()))
        reader.read_members(urls[0], off, n, key)
        assert reader.holds(urls[0]) and not reader.holds(urls[1])
        prefetch = Prefetcher(cache, concurrency=2, ahead=1, held=reader.holds)
        prefetch.upcoming(urls[:4])  # held, read next, one ahead, beyond the depth
        deadline = time.monotonic() + 30
        while not all(cache._path(u).exists() for u in urls[1:3]) and time.monotonic() < deadline:
            time.sleep(0.02)
        prefetch.close()
        reader.close()
    assert all(cache._path(u).exists() for u in urls[1:3]) and not cache._path(urls[3]).exists()
    assert cache.counters.fetched == 3  # shard 0 by the reader, 1 and 2 by prefetch


def test_prefetch_near_an_epoch_end_asks_for_the_next_epochs_first_shards(make_dataset, tiny_tokenizer, tmp_path):
    """A worker's next epoch starts in other shards (its chunk of a new order, after the samples it carries), so
    within the last packs of an epoch prefetch asks for the shards of the next epoch's first packs, and the new
    epoch's first reads find them staged rather than waiting for them."""
    from nanovlm.data.stream import LOOKAHEAD, PackStream

    class Asked:
        def __init__(self) -> None:
            self.lists: list[list[str]] = []

        def upcoming(self, urls) -> None:
            self.lists.append(list(urls))

    make_dataset(tmp_path / "ds", 96, samples_per_shard=4, image_token_count=IMAGE_TOKENS)
    dm = make_dm(make_cfg([tmp_path / "ds"], num_workers=2), tiny_tokenizer)
    dm.setup("fit")
    stream, asked = PackStream(dm._stream_spec(), dm.position, dm.current_split()), Asked()
    packs, n = stream._packs(0, 0, asked), dm.current_split().packs_per_slot
    read_in_epoch_0 = {r.path for _ in range(n) for r in next(packs).refs}  # slot 0's packs of epoch 0
    asked_in_epoch_0 = {u for urls in asked.lists for u in urls}
    assert n // 2 < LOOKAHEAD - 1  # the first packs of epoch 1 below lie within epoch 0's last look-ahead
    first = [next(packs) for _ in range(n // 2)]
    assert first[0].epoch == 1 and first[-1].epoch == 1
    new_shards = {r.path for p in first for r in p.refs} - read_in_epoch_0
    assert new_shards and new_shards <= asked_in_epoch_0


def _deleted_but_open(directory: Path) -> int:
    """Bytes of the files under ``directory`` that are deleted but still held open by this process."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)) and target.endswith(" (deleted)"):
                held += os.fstat(int(fd)).st_size
    return held


def test_readers_hold_few_evicted_copies_and_fetch_a_shard_read_again(make_dataset, tmp_path):
    """A copy the cache evicts keeps its disk space while a reader holds it open: a reader holds at most
    MAX_OPEN_STAGED copies, so the disk holds at most cache_max_bytes and that many shards more, and an epoch
    that reads a shard again fetches it again rather than reading a deleted file (counted in bytes per epoch)."""
    from nanovlm.data.reader import MAX_OPEN_STAGED, ShardReader

    index = make_dataset(tmp_path / "srv" / "ds", 48, samples_per_shard=4, image_token_count=IMAGE_TOKENS)
    assert len(index.shards) == 12
    with http_server(tmp_path / "srv") as (url, _, _):
        shards = {f"{url}/ds/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        size = max(i.size for i in shards.values())
        cache = ShardCache(tmp_path / "c", 2 * size, shards, FAST)
        reader, local = ShardReader(cache=cache), ShardReader()
        for _ in range(2):  # two epochs
            for path, off, n, key in index.sample_refs():
                got = reader.read_members(f"{url}/ds/{Path(path).name}", off, n, key)
                assert got == local.read_members(str(path), off, n, key)
                staged = sum(p.stat().st_size for p in (tmp_path / "c").glob("*.tar"))
                assert staged <= 2 * size and _deleted_but_open(tmp_path / "c") <= MAX_OPEN_STAGED * size
        assert cache.counters.fetched == 2 * len(index.shards)
        reader.close()


def test_wait_counts_the_fetches_readers_wait_for_and_not_the_prefetched(served, tmp_path):
    """``wait_ms``: a reader opening a shard that is not staged waits for its fetch (here 0.3 s of latency per
    request), and one whose prefetch is still in flight waits for that fetch instead of making its own; a shard
    staged beforehand opens at once."""
    index = load_index(served / "a")
    with http_server(served, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        cache.open(urls[0]).close()
        assert cache.counters.wait_ms >= 300 and cache.counters.snapshot()["wait_ms"] == cache.counters.wait_ms
        cache.local(urls[1])  # staged beforehand, as a finished prefetch leaves it
        waited = cache.counters.wait_ms
        cache.open(urls[1]).close()
        assert cache.counters.wait_ms - waited < 100
        prefetch = Prefetcher(cache, ahead=0)
        prefetch.upcoming([urls[2]])  # in flight while the reader asks for it
        cache.open(urls[2]).close()
        prefetch.close()
        assert cache.counters.wait_ms - waited >= 200 and cache.counters.fetched == 3


def test_the_shard_read_next_is_fetched_before_the_ones_after_it(served, tmp_path):
    """Prefetch starts the shards after the one read next only once that one is staged: sharing the link with
    them would delay the shard the reader waits for (every request here waits 0.3 s before its answer)."""
    import time

    index = load_index(served / "a")
    with http_server(served, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)[:3]
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        prefetch = Prefetcher(cache, concurrency=2, ahead=2)
        prefetch.upcoming(urls)
        time.sleep(0.15)  # the first shard's request is waiting for its answer

        def asked(u: str) -> bool:
            return any(u.rsplit("/", 1)[1] in line for line in log)

        assert asked(urls[0]) and not asked(urls[1]) and not asked(urls[2])
        for u in urls:  # then the others, each fetched once
            cache.open(u).close()
        prefetch.close()
    assert cache.counters.fetched == 3 and all(asked(u) for u in urls)


def test_closing_the_prefetcher_with_a_fetch_queued_returns_at_once(served, tmp_path):
    """The pool cancels a queued fetch, and so runs its callbacks, while it holds its own lock: the callback that
    would start the shards after it must not submit (a worker at the end of its epoch would hang on itself)."""
    index = load_index(served / "a")
    with http_server(served, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        prefetch = Prefetcher(cache, concurrency=1, ahead=1)
        prefetch.upcoming(urls[:2])  # the first shard in flight
        prefetch.upcoming(urls[2:4])  # the next plan's first shard queued behind it
        closing = threading.Thread(target=prefetch.close, daemon=True)
        closing.start()
        closing.join(5)
        assert not closing.is_alive()
        prefetch.upcoming(urls[1:3])  # after close: nothing, and no error


def _reader_process(cache: ShardCache, urls: list[str], seed: int, out) -> None:
    import random as rnd
    import zlib

    try:
        for url in rnd.Random(seed).sample(urls * 3, 3 * len(urls)):
            with cache.open(url) as f:
                assert f"{zlib.crc32(f.read()):08x}" == cache.shards[url].crc32
        out.put(("ok", cache.counters.fetched))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(e)))


def test_processes_sharing_a_small_cache_never_read_a_missing_or_partial_shard(served, tmp_path):
    """Three processes read every shard three times, in their own orders, through one cache that holds 2.5
    shards: each copy they open is whole and checked (eviction never pulls one from under a reader), and the cache
    ends within its cap."""
    import multiprocessing as mp

    index = load_index(served / "a")
    with http_server(served) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        cap = int(2.5 * max(i.size for i in shards.values()))
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_reader_process, args=(ShardCache(tmp_path / "c", cap, shards, FAST), list(shards), s, out))
            for s in range(3)
        ]  # fmt: skip
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    assert all(r[0] == "ok" for r in results), results
    staged = [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".tar")]
    assert sum(p.stat().st_size for p in staged) <= cap
    assert not [p.name for p in (tmp_path / "c").iterdir() if p.name.endswith((".part", ".dl"))]


def test_a_local_disk_error_is_named_and_not_retried(served, tmp_path):
    """Writing the staged copy fails (here: its temporary name is taken by a directory): one attempt, and the
    error names the cache directory, not the store."""
    import os

    index = load_index(served / "a")
    with http_server(served) as (url, _, log):
        u = f"{url}/a/{index.shards[0].name}"
        cache = ShardCache(tmp_path / "c", 10**9, {u: ShardInfo(index.shards[0].size_bytes)}, FAST)
        (tmp_path / "c").mkdir()
        blocker = tmp_path / "c" / f".{cache._path(u).name}.{os.getpid()}.{threading.get_ident()}.part"
        blocker.mkdir()
        with pytest.raises(RemoteError, match=f"cannot stage .* in {tmp_path / 'c'}"):
            cache.open(u)
        assert sum(1 for line in log if line.startswith("GET")) <= 1  # not retried


def _fetch_under_file_size_limit(cache: ShardCache, url: str, limit: int, out) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as a full disk does
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        cache.open(url)
        out.put("opened")
    except RemoteError as e:
        out.put(str(e))


def test_a_disk_that_fills_mid_fetch_is_named_and_not_retried(served, tmp_path):
    """The local disk refuses a write halfway through a fetch (a file size limit stands in for a full disk): one
    request, and the error names the cache directory, not the store."""
    import multiprocessing as mp

    index = load_index(served / "a")
    size = index.shards[0].size_bytes
    with http_server(served) as (url, _, log):
        u = f"{url}/a/{index.shards[0].name}"
        # the index claims a small size, so the reservation fits under the limit and the copy is what hits it
        cache = ShardCache(tmp_path / "c", 10**9, {u: ShardInfo(size // 4)}, FAST)
        out = mp.get_context("fork").Queue()
        proc = mp.get_context("fork").Process(target=_fetch_under_file_size_limit, args=(cache, u, size // 2, out))
        proc.start()
        message = out.get(timeout=60)
        proc.join(30)
    assert message.startswith("cannot stage") and str(tmp_path / "c") in message, message
    assert sum(1 for line in log if line.startswith("GET")) == 1  # not retried
