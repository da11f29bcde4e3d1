"""The ``stream`` section: the DataModule reading from S3 as a training run does. The store is the remote
section's (``remote.store``: moto's S3 server on loopback, a slow port per latency, in a process of its own). Two
caches: one of ``shards_per_worker`` shards per DataLoader worker, a node whose cache holds a fraction of the data,
so every epoch fetches the dataset again (cold, and evicting as it goes); and one that holds the dataset, so every
epoch after the first reads staged copies (warm). A control runs through the small cache with every shard staged
by a copy from local disk instead of a fetch (``staged_from``): all the cache's own work (the write, the CRC
check, eviction, locks, prefetch) without the transfer and the store. One loader per pass serves several epochs,
its workers carrying on across epoch ends as the train stream's do, and the pass is timed over the epochs after
the first: what a run pays once (worker start, client set-up, its first shards' fetch) is left out of the remote
and the local pass alike, and every byte of the timed epochs is fetched inside them. Each remote pass lies between
two local passes, and is compared with their mean: this machine's speed drifts over minutes."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import CpuReading, Stats, cpu_reading
from benchmarks.remote import RemotePlan, local_source, store
from benchmarks.workloads import data_config

COPIED = "small, copied"  # the control's cache: the small one, its shards staged by ``staged_from``


@dataclass
class StreamPlan:
    latencies_ms: tuple[int, ...] = RemotePlan.latencies_ms
    bandwidth_mb_s: float = RemotePlan.bandwidth_mb_s
    workers: int = RemotePlan.workers
    shards_per_worker: int = 2  # the small cache's size, in the dataset's largest shards
    epochs: int = 3  # per pass; the first is not timed
    reps: int = 5

    @classmethod
    def quick(cls) -> StreamPlan:
        return cls(latencies_ms=(20,), epochs=3, reps=1)


def stream_pass(
    cfg: Any,
    tokenizer: Any,
    epochs: int,
    store_stats: Callable[[], tuple[int, float]] | None = None,
    store_pid: int | None = None,
) -> dict[str, Any]:
    """``epochs`` epochs out of one fresh DataModule's loader, timed from the rank's last batch of the first epoch
    to its last batch of the last (``epoch_end`` in the batch's meta); ``store_stats``: the bytes the store's slow port
    has sent so far and the store process's CPU seconds. CPU per sample: the whole machine's, and the loader's
    (this process and its DataLoader workers; not the store's process, ``store_pid``)."""
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer=tokenizer, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    waited: dict[int, int] = {}  # worker slot -> its wait_ms so far
    marks: list[_Mark] = []  # one per epoch end
    samples = 0
    while len(marks) < epochs:
        meta = next(it)["meta"]
        samples += meta["n_samples"]
        waited[meta.get("worker_slot", 0)] = (meta.get("remote") or {}).get("wait_ms", 0)
        if meta.get("epoch_end"):
            stats = store_stats() if store_stats else (0, 0.0)
            cpu = cpu_reading([store_pid] if store_pid else [])
            marks.append(_Mark(time.perf_counter(), *stats, samples, dict(waited), cpu))
    del it
    a, b = marks[0], marks[-1]
    n = b.samples - a.samples
    out = {
        "t": (a.t + b.t) / 2,
        "seconds": b.t - a.t,
        "samples": n,
        "samples_per_s": n / (b.t - a.t),
        "sent_per_epoch": (b.sent - a.sent) / (epochs - 1),
        "store_cpu_per_epoch": (b.store_cpu - a.store_cpu) / (epochs - 1),
        "wait_s": sum(ms - a.waited.get(slot, 0) for slot, ms in b.waited.items()) / 1e3,
    }
    if a.cpu and b.cpu:  # per sample read (not off Linux)
        out |= {
            "machine_cpu_ms": 1e3 * (b.cpu.machine - a.cpu.machine) / n,
            "loader_cpu_ms": 1e3 * b.cpu.loader_since(a.cpu) / n,
        }
    return out


@dataclass
class _Mark:
    """What ``stream_pass`` reads at an epoch's end."""

    t: float
    sent: int  # bytes the store's slow port has sent
    store_cpu: float  # the store process's CPU seconds
    samples: int
    waited: dict[int, int]  # worker slot -> its wait_ms
    cpu: CpuReading | None


@contextlib.contextmanager
def staged_from(source: Path) -> Iterator[None]:
    """Remote shards staged by copying the same file from ``source`` (the dataset on local disk) instead of
    fetching it, in this process and the DataLoader workers it forks (``measure`` checks that the store sent
    nothing in the timed epochs: workers started another way would fetch); the index is still fetched."""
    from nanovlm.data import shard_cache

    fetch = shard_cache.copy_object

    def copy(fs: Any, path: str, dest: Path) -> int:
        shutil.copyfile(source / path.rsplit("/", 1)[-1], dest)
        return dest.stat().st_size

    shard_cache.copy_object = copy
    try:
        yield
    finally:
        shard_cache.copy_object = fetch


def _sent_and_cpu(s3: Any, ms: int) -> tuple[int, float]:
    """(bytes the slow port of ``ms`` has sent, the store process's CPU seconds) so far."""
    sent, cpu = s3.stats()
    return sent[ms], cpu


def _row_name(cache: str, ms: int, shards_per_worker: int) -> str:
    if cache == COPIED:
        return f"control: cache holds {shards_per_worker} shards/worker, staged by a local copy"
    return f"S3 +{ms} ms, cache holds " + (f"{shards_per_worker} shards/worker" if cache == "small" else "all")


def _cpu_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("machine_cpu_ms", "loader_cpu_ms")
    return {k: Stats.of([r[k] for r in runs]).to_dict() for k in keys if all(k in r for r in runs)}


def measure(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Rounds of a local pass, then for each cache and latency a remote pass and a local one; the JSON part of the
    section."""
    import fsspec

    plan = StreamPlan.quick() if args.quick else StreamPlan()
    plan.reps = min(plan.reps, args.reps) if args.quick else args.reps
    cfg, source, index, tokenizer = local_source(args, plan.workers)
    dataset_bytes = sum(s.size_bytes for s in index.shards)
    small = plan.shards_per_worker * plan.workers * max(s.size_bytes for s in index.shards)
    caches = {"small": small, "whole": max(2 * dataset_bytes, cfg.data.cache_max_bytes)}
    cache = Path(args.workdir) / "stream_cache"
    local: list[dict[str, Any]] = []
    remote: dict[tuple[str, int], list[dict[str, Any]]] = {(c, ms): [] for c in caches for ms in plan.latencies_ms}
    remote[COPIED, plan.latencies_ms[0]] = []  # the control, through the small cache
    with store({"bench": source}, {}, plan.latencies_ms, plan.bandwidth_mb_s, args.store_cpus) as s3:
        for i in range(plan.reps):
            local.append(stream_pass(cfg, tokenizer, plan.epochs, store_pid=s3.proc.pid))
            for which, ms in remote:
                fsspec.config.conf["s3"] = {"endpoint_url": s3.urls[ms]}  # a new client (cache key) per latency
                shutil.rmtree(cache, ignore_errors=True)
                remote_cfg = data_config(args, plan.workers)
                remote_cfg.data.train = ["s3://bench/ds"]  # the endpoint: fsspec's s3 config, set just above
                remote_cfg.data.cache_dir = str(cache)
                remote_cfg.data.cache_max_bytes = caches["small" if which == COPIED else which]
                with staged_from(source) if which == COPIED else contextlib.nullcontext():
                    r = stream_pass(
                        remote_cfg, tokenizer, plan.epochs, lambda ms=ms: _sent_and_cpu(s3, ms), s3.proc.pid
                    )
                if which == COPIED and r["sent_per_epoch"]:
                    raise RuntimeError("the control fetched shards: its DataLoader workers were not forked")
                local.append(stream_pass(cfg, tokenizer, plan.epochs, store_pid=s3.proc.pid))
                remote[which, ms].append(r | {"local": (local[-2]["samples_per_s"] + local[-1]["samples_per_s"]) / 2})
            log(f"[stream] round {i + 1}/{plan.reps}: local {local[-1]['samples_per_s']:.0f} samples/s")
    fsspec.config.conf.pop("s3", None)
    shutil.rmtree(cache, ignore_errors=True)
    rows = [
        {
            "name": _row_name(c, ms, plan.shards_per_worker),
            "latency_ms": ms,
            "cache": c,
            "samples_per_s": Stats.of([r["samples_per_s"] for r in runs]).to_dict(),
            "of_local": Stats.of([r["samples_per_s"] / r["local"] for r in runs]).to_dict(),
            "wait_s": Stats.of([r["wait_s"] for r in runs]).to_dict(),
            "bytes_per_epoch": Stats.of([r["sent_per_epoch"] / dataset_bytes for r in runs]).to_dict(),
            "store_cpu_s": Stats.of([r["store_cpu_per_epoch"] for r in runs]).to_dict(),
            **_cpu_stats(runs),
        }
        for (c, ms), runs in remote.items()
    ]
    rows.append(
        {
            "name": "local disk",
            "latency_ms": None,
            "samples_per_s": Stats.of([r["samples_per_s"] for r in local]).to_dict(),
            **_cpu_stats(local),
        }
    )
    return {
        "plan": {**plan.__dict__, "latencies_ms": list(plan.latencies_ms)},
        "data": str(source),
        "dataset_bytes": dataset_bytes,
        "cache_bytes": caches,
        "shards": len(index.shards),
        "samples": index.num_samples,
        "rows": rows,
    }
