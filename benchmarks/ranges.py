"""The ``ranges`` section: whole shards or byte ranges, measured. Reading a remote dataset, a loader either stages
each shard whole (one GET) and reads its samples from disk, as the shard cache does, or asks the store for each
sample's bytes (one ranged GET per sample, from the index's offset and size). Which costs less depends on how many
of a shard's samples are read: training epochs read every sample of a shard one after another (the epoch plan's
order, docs/data.md); a look at a few samples reads a handful.

Each row reads ``k`` samples of one shard (all of them, or a few at random places) from the remote section's store
(``remote.store``: moto's S3 server on loopback, a slow port per latency and a bandwidth cap, in its own process)
both ways: whole through ``remote.copy_object`` (the cache's own transfer: one GET of a presigned URL), ranges as
GETs of presigned URLs with a ``Range`` header, ``connections`` in flight (plain urllib3 GETs, as the cache's
transfer). Timed per shard: wall seconds, the measuring process's CPU
(the client) and the store process's CPU, requests and bytes sent."""

from __future__ import annotations

import argparse
import gc
import time
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
    few: tuple[int, ...] = (1, 16)  # samples read at random places of a shard, beside "all of them"
    connections: int = 8  # ranged GETs in flight (as many as a process keeps open per host: presigned.CONNECTIONS)
    reps: int = 3  # shards per row, each read once each way

    @classmethod
    def quick(cls) -> RangesPlan:
        return cls(latencies_ms=(20,), few=(1, 4), reps=1)


def _ranged(fs: Any, path: str, spans: list[tuple[int, int]], pool: Any, http: Any) -> int:
    """GET each (offset, nbytes) of object ``path`` by a presigned URL with a Range header; returns the bytes."""

    def get(span: tuple[int, int]) -> int:
        start, size = span
        url = fs.url(path, expires=900)
        r = http.request("GET", url, headers={"Range": f"bytes={start}-{start + size - 1}"}, retries=False)
        if r.status != 206 or len(r.data) != size:
            raise RuntimeError(f"a ranged GET answered {r.status} with {len(r.data)} of {size} bytes")
        return size

    return sum(pool.map(get, spans))


def _timed(s3: Any, ms: int, read: Any) -> dict[str, float]:
    """Wall seconds, client (this process's) and store CPU seconds and bytes sent of ``read()``; the garbage of the
    reads before collected first, not inside the timing."""
    gc.collect()
    sent0, store0 = s3.stats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    read()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sent1, store1 = s3.stats()
    return {"wall_s": wall, "client_cpu_s": cpu, "store_cpu_s": store1 - store0, "bytes": sent1[ms] - sent0[ms]}


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
    rng = np.random.default_rng(0)
    dest = Path(args.workdir) / "ranges_shard.tar"
    dest.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    http = urllib3.PoolManager(maxsize=plan.connections)
    s3_store = store({"bench": source}, {}, plan.latencies_ms, plan.bandwidth_mb_s)
    with s3_store as s3, ThreadPoolExecutor(plan.connections) as pool:
        for ms in plan.latencies_ms:
            fsspec.config.conf["s3"] = {"endpoint_url": s3.urls[ms]}  # a new client (cache key) per latency
            for rep in range(plan.reps):
                i = rep % len(index.shards)
                lo, hi = int(starts[i]), int(starts[i + 1])
                fs, path = filesystem(f"s3://bench/ds/{index.shards[i].name}")
                if rep == 0:  # the clients made before timing, as a worker's are after its first fetch
                    copy_object(fs, path, dest)
                    fs.url(path)
                for k in (hi - lo, *(k for k in plan.few if k < hi - lo)):
                    rows = np.sort(rng.choice(np.arange(lo, hi), k, replace=False))
                    spans = [(int(offsets[j]), int(nbytes[j])) for j in rows]
                    read = {
                        "whole": partial(copy_object, fs, path, dest),
                        "ranges": partial(_ranged, fs, path, spans, pool, http),
                    }
                    for how, fetch in read.items():
                        r = _timed(s3, ms, fetch) | {"samples": k, "sample_bytes": int(nbytes[rows].sum())}
                        r["requests"] = 1 if how == "whole" else k
                        runs.setdefault((ms, "all" if k == hi - lo else str(k), how), []).append(r)
            log(f"[ranges] +{ms} ms done")
    fsspec.config.conf.pop("s3", None)
    dest.unlink(missing_ok=True)
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
