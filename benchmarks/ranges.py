"""The ``ranges`` section: whole shards or byte ranges, measured. Reading a remote dataset, a loader either stages
each shard whole (one GET) and reads its samples from disk, as the shard cache does, or asks the store for each
sample's bytes (one ranged GET per sample, from the index's offset and size). Which costs less depends on how many
of a shard's samples are read: training epochs read every sample of a shard one after another (the epoch plan's
order, docs/data.md); a look at a few samples reads a handful.

Each row reads ``k`` samples of one shard (all of them, or a few at random places) from the remote section's store
(``remote.store``: moto's S3 server on loopback, a slow port per latency and a bandwidth cap, in its own process)
both ways: whole through ``remote.copy_object`` (the cache's own transfer: one GET of a presigned URL); ranges as
GETs of the URL the cache would fetch (signed once per read: the signature does not cover the Range header), with
a Range header each, ``connections`` in flight. Timed per read: wall seconds, the measuring process's CPU (the
client) and the store process's CPU, requests and body bytes sent. What each read returned is checked against the
local shard afterwards."""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Stats
from benchmarks.remote import RemotePlan, local_source, store


@dataclass
class RangesPlan:
    latencies_ms: tuple[int, ...] = RemotePlan.latencies_ms
    bandwidth_mb_s: float = RemotePlan.bandwidth_mb_s
    few: tuple[int, ...] = (1, 4, 16)  # samples read at random places of a shard, beside "all of them"
    connections: int = 8  # ranged GETs in flight (as many as a process keeps open per host: presigned.CONNECTIONS)
    reps: int = 3  # shards per row, each read once each way

    @classmethod
    def quick(cls) -> RangesPlan:
        return cls(latencies_ms=(20,), few=(1, 4), reps=1)


def _ranged(fs: Any, path: str, spans: list[tuple[int, int]], pool: Any, http: Any) -> list[bytes]:
    """Each (offset, nbytes) of object ``path``: one GET with a Range header each, of one presigned URL."""
    from nanovlm.data.presigned import presign

    url = presign(fs, path)

    def get(span: tuple[int, int]) -> bytes:
        start, size = span
        r = http.request("GET", url, headers={"Range": f"bytes={start}-{start + size - 1}"}, retries=False)
        if r.status != 206:
            raise RuntimeError(f"a ranged GET answered {r.status}")
        return r.data

    return list(pool.map(get, spans))


def _timed(s3: Any, ms: int, read: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """(wall seconds, client (this process's) and store CPU seconds and body bytes sent of ``read()``, what it
    returned); the garbage of the reads before collected first, not inside the timing."""
    gc.collect()
    sent0, store0 = s3.stats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    got = read()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sent1, store1 = s3.stats()
    return {"wall_s": wall, "client_cpu_s": cpu, "store_cpu_s": store1 - store0, "bytes": sent1[ms] - sent0[ms]}, got


def _read_both_ways(
    s3: Any, ms: int, fs: Any, path: str, spans: list[tuple[int, int]], local: bytes, dest: Path, pool: Any, http: Any
) -> dict:
    """{how: its timing}: ``spans`` of ``path`` read whole (into ``dest``) and by ranges (``pool`` threads over the
    ``http`` pool), each read checked against ``local``, the shard's bytes."""
    from nanovlm.data.remote import copy_object

    whole, _ = _timed(s3, ms, partial(copy_object, fs, path, dest))
    if dest.read_bytes() != local:
        raise RuntimeError(f"the whole GET of {path} differs from the local shard")
    ranges, got = _timed(s3, ms, partial(_ranged, fs, path, spans, pool, http))
    if got != [local[start : start + size] for start, size in spans]:
        raise RuntimeError(f"a ranged GET of {path} differs from the local shard's bytes")
    return {"whole": whole | {"requests": 1}, "ranges": ranges | {"requests": len(spans)}}


def measure(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Every row at every latency, on ``reps`` shards each; the JSON part of the section."""
    import fsspec
    import urllib3

    from nanovlm.data.remote import copy_object, filesystem

    plan = RangesPlan.quick() if args.quick else RangesPlan()
    plan.reps = min(plan.reps, args.reps) if args.quick else args.reps
    _, source, index, _ = local_source(args, 1)
    starts = index.shard_start
    offsets, nbytes = np.asarray(index.columns["offset"]), np.asarray(index.columns["nbytes"])
    rng = np.random.default_rng(args.seed)
    dest = Path(args.workdir) / "ranges_shard.tar"
    dest.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    http = urllib3.PoolManager(maxsize=plan.connections)
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(store({"bench": source}, {}, plan.latencies_ms, plan.bandwidth_mb_s, args.store_cpus))
        pool = stack.enter_context(ThreadPoolExecutor(plan.connections))
        stack.callback(fsspec.config.conf.pop, "s3", None)
        stack.callback(dest.unlink, missing_ok=True)
        for ms in plan.latencies_ms:
            fsspec.config.conf["s3"] = {"endpoint_url": s3.urls[ms]}  # a new client (cache key) per latency
            for rep in range(plan.reps):
                i = rep % len(index.shards)
                lo, hi = int(starts[i]), int(starts[i + 1])
                fs, path = filesystem(f"s3://bench/ds/{index.shards[i].name}")
                if rep == 0:  # the clients made before timing, as a worker's are after its first fetch
                    copy_object(fs, path, dest)
                local = (source / index.shards[i].name).read_bytes()
                for k in (hi - lo, *(n for n in plan.few if n < hi - lo)):
                    rows = np.sort(rng.choice(np.arange(lo, hi), k, replace=False))
                    spans = [(int(offsets[j]), int(nbytes[j])) for j in rows]
                    for how, r in _read_both_ways(s3, ms, fs, path, spans, local, dest, pool, http).items():
                        r |= {"samples": k, "sample_bytes": int(nbytes[rows].sum())}
                        runs.setdefault((ms, "all" if k == hi - lo else str(k), how), []).append(r)
            log(f"[ranges] +{ms} ms done")
    return {
        "plan": {**plan.__dict__, "latencies_ms": list(plan.latencies_ms), "few": list(plan.few)},
        "data": str(source),
        "samples_per_shard": int(np.median(np.diff(starts))),
        "rows": [_row(ms, what, how, rs) for (ms, what, how), rs in runs.items()],
    }


def _row(ms: int, what: str, how: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    """One (latency, samples read, whole or ranges) row: medians over its shards."""
    return {
        "latency_ms": ms,
        "read": what,
        "how": how,
        "samples": runs[0]["samples"],
        "requests": runs[0]["requests"],
        "wall_s": Stats.of([r["wall_s"] for r in runs]).to_dict(),
        "samples_per_s": Stats.of([r["samples"] / r["wall_s"] for r in runs]).to_dict(),
        "client_cpu_ms_per_sample": Stats.of([1e3 * r["client_cpu_s"] / r["samples"] for r in runs]).to_dict(),
        "store_cpu_ms_per_sample": Stats.of([1e3 * r["store_cpu_s"] / r["samples"] for r in runs]).to_dict(),
        "bytes_over_samples": Stats.of([r["bytes"] / r["sample_bytes"] for r in runs]).to_dict(),
    }
