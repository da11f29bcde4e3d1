"""The ``remote`` section: the DataModule reading a dataset from an S3 API server (moto's, on loopback) that
adds a fixed latency to every request and caps the bandwidth (``SlowStore``), against the same shards on local
disk, beside the peers (benchmarks/peers.py) reading the same samples from the same server. The server runs in a
process of its own (``store``), as a store would, whose CPU each pass reports.

Per row: samples/s over one epoch with ``workers`` DataLoader workers, with a cold cache (emptied before the
pass) and a warm one (the pass after), prefetch on and off, and the bytes the store sent per epoch against the
dataset's size. The passes run in rounds (``Readers.run_round``): every reader cold, then every reader warm, each
round between two passes of every reader from local disk (``Readers.local_round``), so each remote pass is compared
with its own reader's local rate at that moment (``bracketed``) and with the other readers' passes of the same row
seconds apart: this machine's speed drifts by up to a third over minutes. Each pass starts fresh DataLoader
workers and is timed whole, from its loader's start to its last batch, in every row alike (``epoch_times``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common import Stats, epoch_times, pinned
from benchmarks.workloads import data_config, demo_dirs

CHUNK = 1 << 18  # the slow store's write size: the bandwidth cap is kept per chunk


@dataclass
class RemotePlan:
    latencies_ms: tuple[int, ...] = (0, 20, 100)
    bandwidth_mb_s: float = 200.0  # shared by all requests in flight
    workers: int = 2
    reps: int = 5  # rounds per latency (and fresh processes per transfer measurement)
    transfer_shards: int = 16  # fetched one after another by each fresh process of ``transfer_cpu``

    @classmethod
    def quick(cls) -> RemotePlan:
        return cls(latencies_ms=(20,), reps=1)


class RateLimit:
    """A shared token bucket: the bytes of all responses together stay under ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate, self.next_free, self.lock = bytes_per_s, time.monotonic(), threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            start = max(self.next_free, time.monotonic())
            self.next_free = start + n / self.rate
            wait = self.next_free - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class SlowStore:
    """moto's WSGI app with a fixed latency before every answer and a bandwidth cap on the bodies, both kept in
    the server's own request threads: the store stands for a far one, whose CPU is not the loaders'. A proxy in
    front of the server (a second HTTP hop, every body read and written again) would add to the store's CPU, on
    the cores the loaders run on. Counts the body bytes it hands the server.
    werkzeug's server closes the connection after every answer, so each request opens one (on loopback: no
    latency, a little CPU on both sides), where S3 would keep it open."""

    def __init__(self, app: Callable, latency_ms: float, bandwidth_mb_s: float) -> None:
        self.app, self.latency_s, self.limit = app, latency_ms / 1000, RateLimit(bandwidth_mb_s * 1e6)
        self.bytes_out, self.lock = 0, threading.Lock()

    def __call__(self, environ: dict, start_response: Callable) -> Iterator[bytes]:
        time.sleep(self.latency_s)  # the round trip to a far store: before the first byte
        body = self.app(environ, start_response)
        return body if environ["REQUEST_METHOD"] == "HEAD" else self._paced(body)

    def _paced(self, body: Any) -> Iterator[bytes]:
        try:
            for part in body:
                for i in range(0, len(part), CHUNK):
                    chunk = part[i : i + CHUNK]
                    self.limit.take(len(chunk))
                    with self.lock:  # counted before it is sent: a client may have it all before the next line
                        self.bytes_out += len(chunk)
                    yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()


@contextlib.contextmanager
def s3_servers(
    sources: dict[str, Path], extra: dict[str, Path], latencies: tuple[int, ...], bandwidth_mb_s: float
) -> Iterator[tuple[tuple[str, int], dict[int, tuple[str, SlowStore]]]]:
    """moto's S3 server on 127.0.0.1 with each ``sources`` directory uploaded to s3://BUCKET/ds and each ``extra``
    file to its BUCKET/KEY, answering on one port as is and on one more per latency as a ``SlowStore``; yields
    ((host, port) of the plain one, {latency: (its URL, its SlowStore)})."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # its server logs every request otherwise
    app = DomainDispatcherApplication(create_backend_app)  # every port serves the same app
    slow = {ms: SlowStore(app, ms, bandwidth_mb_s) for ms in latencies}
    with contextlib.ExitStack() as stack:
        host, port = _serving(stack, app)
        urls = {ms: "http://{}:{}".format(*_serving(stack, s)) for ms, s in slow.items()}
        with aws_env(f"http://{host}:{port}"):
            _upload(sources, extra)
        yield (host, port), {ms: (urls[ms], slow[ms]) for ms in slow}


def _serving(stack: contextlib.ExitStack, app: Callable) -> tuple[str, int]:
    """``app`` served by a threaded werkzeug server on a free port of 127.0.0.1 until ``stack`` closes."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    stack.callback(server.server_close)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.callback(server.shutdown)  # (callbacks run last first: shut down, then closed)
    host, port = server.server_address[:2]
    return str(host), port


def _upload(sources: dict[str, Path], extra: dict[str, Path]) -> None:
    """Each ``sources`` directory to s3://BUCKET/ds, each ``extra`` file to its BUCKET/KEY, through the endpoint
    in this process's environment."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    for bucket, local_dir in sources.items():
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                fs.put_file(str(p), f"{bucket}/ds/{p.relative_to(local_dir).as_posix()}")
    for key, p in extra.items():
        fs.put_file(str(p), key)


@contextlib.contextmanager
def aws_env(endpoint: str):
    """The benchmark's S3 credentials and ``endpoint`` in this process's environment, restored afterwards."""
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    env["AWS_ENDPOINT_URL"] = endpoint
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _serve(
    conn: Connection, sources: dict[str, Path], extra: dict[str, Path], latencies: tuple[int, ...], bandwidth: float
) -> None:
    """The store's process (``store``): ``s3_servers``, answering each ``stats`` with what each slow port
    has sent and this process's CPU seconds so far, until told anything else."""
    with s3_servers(sources, extra, latencies, bandwidth) as (upstream, slow):
        conn.send((upstream, {ms: url for ms, (url, _) in slow.items()}))
        while conn.recv() == "stats":
            conn.send(({ms: s.bytes_out for ms, (_, s) in slow.items()}, time.process_time()))


@dataclass
class Store:
    """The S3 server, running in a child process: what a pass costs the store is that process's CPU, and its
    threads never hold the measuring process's interpreter lock (a store on another machine does neither). The
    endpoint in this process's environment is the server's plain port, without latency."""

    proc: Any  # its multiprocessing Process
    conn: Connection
    urls: dict[int, str]  # latency ms -> the URL of its slow port

    def stats(self) -> tuple[dict[int, int], float]:
        """(bytes each slow port has sent, by latency; the store process's CPU seconds), so far."""
        try:
            self.conn.send("stats")
            if self.conn.poll(60):  # (an exited store is an EOF at once)
                return self.conn.recv()
        except (EOFError, OSError):  # its end closed: it exited
            pass
        raise RuntimeError(f"the S3 server's process stopped answering (exit code {self.proc.exitcode})")


@contextlib.contextmanager
def store(
    sources: dict[str, Path],
    extra: dict[str, Path],
    latencies: tuple[int, ...],
    bandwidth_mb_s: float,
    cpus: frozenset[int] | None = None,
) -> Iterator[Store]:
    """``s3_servers`` in a child process, on ``cpus`` if given (``--store-cpus``: a store on cores the loader does
    not use, as on another machine), it and every thread it starts; yields its Store."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's threads or imports
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, sources, extra, latencies, bandwidth_mb_s), daemon=True)
    with pinned(cpus):  # the child inherits the CPUs of the thread that starts it
        proc.start()
    child.close()  # the child's end lives in the child only: its exit is then an EOF here, never a silent wait
    try:
        if not wait([conn, proc.sentinel], 600):
            raise RuntimeError("the S3 server's process did not start within 600 s")
        try:
            upstream, urls = conn.recv()
        except EOFError:
            proc.join(10)
            raise RuntimeError(f"the S3 server's process failed (exit code {proc.exitcode})") from None
        with aws_env("http://{}:{}".format(*upstream)):
            yield Store(proc, conn, urls)
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        conn.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def epoch_rate(cfg, tokenizer, on_first: Callable[[], None] | None = None) -> dict[str, Any]:
    """One epoch out of a fresh DataModule, timed from its iterator's start (``epoch_times``); ``on_first`` runs
    when the first batch is in."""
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer=tokenizer, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    n_batches = dm.current_split().batches_per_rank()
    it = iter(dm.train_dataloader())
    t_start = time.perf_counter()
    metas = [next(it)["meta"]]
    t_first = time.perf_counter()
    if on_first is not None:
        on_first()
    metas += [next(it)["meta"] for _ in range(n_batches - 1)]
    t_end = time.perf_counter()
    del it
    counts = [m["n_samples"] for m in metas]
    return epoch_times(t_start, t_first, t_end, counts[0], sum(counts)) | {"wait_s": _wait_after_first_batch(metas)}


def _wait_after_first_batch(metas: list[dict]) -> float:
    """Seconds the workers waited to open shards after each one's first batch (the batches carry each worker's
    ``wait_ms`` so far): the wait prefetch did not hide in the timed part of the epoch."""
    waited: dict[int, list[int]] = {}  # worker slot -> its wait_ms at its first batch, at its last
    for meta in metas:
        ms = (meta.get("remote") or {}).get("wait_ms", 0)
        waited.setdefault(meta.get("worker_slot", 0), [ms, ms])[1] = ms
    return sum(last - first for first, last in waited.values()) / 1e3


class Rows(list):
    """The section's rows, each logged as it is recorded."""

    def __init__(self, log: Callable) -> None:
        super().__init__()
        self.log = log

    def record(self, name: str, latency: int | None, prefetch: bool | None, cold: bool | None, runs: list) -> None:
        """``runs``: that row's passes, in round order, each with its ``local`` rate (and ``sent`` bytes if cold)."""
        sent = [r["sent"] for r in runs if "sent" in r]
        self.append(
            {
                "name": name,
                "latency_ms": latency,
                "prefetch": prefetch,
                "cold": cold,
                "samples_per_s": Stats.of([r["samples_per_s"] for r in runs]).to_dict(),
                "of_local": Stats.of([r["samples_per_s"] / r["local"] for r in runs]).to_dict(),
                "steady_samples_per_s": Stats.of([r["steady_samples_per_s"] for r in runs]).to_dict(),
                "steady_of_local": Stats.of([r["steady_samples_per_s"] / r["local_steady"] for r in runs]).to_dict(),
                "first_batch_s": Stats.of([r["first_batch_s"] for r in runs]).to_dict(),
                "store_cpu_s": Stats.of([r["store_cpu_s"] for r in runs]).to_dict(),
                "wait_s": Stats.of([r.get("wait_s", 0.0) for r in runs]).to_dict(),
                "bytes_per_epoch": (sum(sent) / len(sent)) if sent else None,
                "by_first_batch": Stats.of([r["sent_by_first"] / r["sent"] for r in runs if r.get("sent")]).to_dict()
                if any(sent)
                else None,  # the share of a cold epoch's bytes fetched before its first batch
                "runs": [r["samples_per_s"] for r in runs],
            }
        )
        self.log(f"[remote] {name}: {self[-1]['samples_per_s']['median']:.0f} samples/s")


OURS, OURS_NO_PREFETCH = "ours", "ours, prefetch off"


def local_of(name: str) -> str:
    """The reader whose local passes ``name``'s remote passes are compared with (prefetch is moot on disk)."""
    return OURS if name == OURS_NO_PREFETCH else name


RATES = {"local": "samples_per_s", "local_steady": "steady_samples_per_s"}  # a pass's local rate -> its own


def bracketed(runs: dict[tuple, list], brackets: list[dict[str, tuple[float, dict[str, float]]]]) -> None:
    """Set each remote pass's ``local`` and ``local_steady``: its reader's local rates (whole epoch, after the first
    batch) at the pass's time, interpolated between the local passes before and after its round (``brackets[i]``:
    reader -> (time, {rate: samples/s}) of the i-th local round). The machine's drift over the minute between them
    is then in both sides of the ratio, not in one."""
    for (name, latency, _), passes in runs.items():
        if latency is None:
            continue
        for r in passes:
            (t0, a), (t1, b) = (brackets[i][local_of(name)] for i in (r["after"], r["after"] + 1))
            assert t0 < r["t"] < t1, f"a pass of {name} outside its round's local passes"
            for local, rate in RATES.items():
                r[local] = a[rate] + (b[rate] - a[rate]) * (r["t"] - t0) / (t1 - t0)


@dataclass
class Readers:
    """Every loader the section times: ours with prefetch on and off, and the peers that import here. Each reads
    one epoch from local disk (``url`` None) or from the S3 server's slow port at ``url``."""

    args: argparse.Namespace
    cfg: Any
    tokenizer: Any
    workers: int
    cache: Path
    peer: Peers
    brackets: list[dict[str, tuple[float, float]]] = field(default_factory=list)  # see ``local_round``

    def names(self, flip: bool = False) -> list[str]:
        """The readers, in the order of a round (reversed when ``flip``: every other round, so none always goes
        first)."""
        names = [OURS, OURS_NO_PREFETCH, *self.peer.dirs]
        return names[::-1] if flip else names

    def epoch(self, name: str, url: str | None, on_first: Callable[[], None] | None = None) -> dict[str, Any]:
        """One epoch of reader ``name``: from local disk, or from S3 through the slow port at ``url``."""
        if name not in (OURS, OURS_NO_PREFETCH):
            if url is None:
                return self.peer.epoch(name, str(self.peer.dirs[name]), on_first=on_first)
            remote = f"msc://{name}/ds" if name == "energon" else f"s3://{name}/ds"
            return self.peer.epoch(name, remote, self.cache_of(name), url, on_first)
        if url is None:
            return epoch_rate(self.cfg, self.tokenizer, on_first)
        cfg = data_config(self.args, self.workers)
        cfg.data.train = ["s3://bench/ds"]  # the endpoint: fsspec's s3 config, set per latency in ``measure``
        cfg.data.cache_dir = str(self.cache_of(name))
        cfg.data.prefetch_shards = 2 if name == OURS else 0
        return epoch_rate(cfg, self.tokenizer, on_first)

    def cache_of(self, name: str) -> Path:
        """Each reader's own cache directory: one reader's warm pass never finds another's copies."""
        return self.cache / name.replace(", ", "_").replace(" ", "_")

    def local_round(self, runs: dict[tuple, list], store: Store) -> None:
        """One pass of every reader from local disk: the bracket that closes one round and opens the next."""
        rates = {}
        for n in dict.fromkeys(map(local_of, self.names(flip=len(self.brackets) % 2 == 1))):
            r = self._pass(n, None, store)
            runs.setdefault((n, None, None), []).append(r | {local: r[rate] for local, rate in RATES.items()})
            rates[n] = (r["t"], {rate: r[rate] for rate in RATES.values()})
        self.brackets.append(rates)

    def run_round(self, runs: dict[tuple, list], latency: int, store: Store, flip: bool) -> None:
        """A cold pass of every reader (its cache emptied first), then a warm one of each, after a ``local_round``
        (and before the next): the passes of one row lie seconds apart, so the ratios between readers are not
        swamped by the machine's drift over minutes, nor their ratios to local disk (``bracketed``)."""
        for cold in (True, False):
            for n in self.names(flip):
                if cold:
                    shutil.rmtree(self.cache_of(n), ignore_errors=True)
                r = self._pass(n, latency, store) | {"after": len(self.brackets) - 1}
                if not cold:
                    del r["sent"], r["sent_by_first"]  # bytes per epoch: the cold pass's
                runs.setdefault((n, latency, cold), []).append(r)

    def _pass(self, name: str, latency: int | None, store: Store) -> dict[str, Any]:
        """``epoch`` (from local disk where ``latency`` is None), with its time (the middle of the pass), the
        store's CPU seconds during it, the bytes its slow port sent, and those it had sent by the first batch."""
        sent0, cpu0 = store.stats()
        at_first: list[dict[int, int]] = []
        t0 = time.perf_counter()
        if latency is None:
            r = self.epoch(name, None)
        else:
            r = self.epoch(name, store.urls[latency], lambda: at_first.append(store.stats()[0]))
        r["t"] = (t0 + time.perf_counter()) / 2
        sent1, cpu1 = store.stats()
        r["store_cpu_s"] = cpu1 - cpu0
        if latency is not None:
            r["sent"] = sent1[latency] - sent0[latency]
            r["sent_by_first"] = at_first[0][latency] - sent0[latency]
        return r


GET_FILE, PRESIGNED = "s3fs get_file", "presigned GET (ours)"


def _fetch_cpu(how: str, urls: list[str], dest: str, out: Any) -> None:
    """In a fresh process, as in a DataLoader worker: the CPU seconds of each whole-object fetch of ``urls`` (the
    first one includes the client's set-up), put on ``out``."""
    from nanovlm.data.presigned import get_presigned
    from nanovlm.data.remote import filesystem

    cpu = []
    for url in urls:
        t = time.process_time()
        fs, path = filesystem(url)
        if how == GET_FILE:
            fs.get_file(path, dest)
        else:
            get_presigned(fs, path, dest)
        cpu.append(time.process_time() - t)
    out.put(cpu)


def transfer_cpu(shards: list[str], big: str, big_bytes: int, work: Path, reps: int) -> dict[str, Any]:
    """What receiving costs the reader's process, by s3fs's own transfer and by the presigned GET the shard cache
    uses (data/presigned.py), straight from the S3 server (no proxy): the CPU of the first fetch of a fresh
    process forked after s3fs is imported (its own client set-up included), of each further shard, and per MB of
    one large object (``big``)."""
    import multiprocessing as mp

    import s3fs  # noqa: F401 - imported before the forks, as in a trainer that has read its index over S3

    ctx, rows = mp.get_context("fork"), {}
    for how in (GET_FILE, PRESIGNED):
        first, per_shard, per_mb = [], [], []
        for _ in range(reps):
            out = ctx.Queue()
            proc = ctx.Process(target=_fetch_cpu, args=(how, [*shards, big], str(work / "transfer.tmp"), out))
            proc.start()
            proc.join(600)  # (what it puts on ``out`` is small: the queue lets it exit first)
            if proc.exitcode != 0:
                raise RuntimeError(f"the {how} transfer process failed (exit code {proc.exitcode})")
            cpu = out.get(timeout=10)
            first.append(cpu[0] * 1e3)
            per_shard += [c * 1e3 for c in cpu[1:-1]]
            per_mb.append(cpu[-1] * 1e3 / (big_bytes / 1e6))
        rows[how] = {
            k: Stats.of(v).to_dict() for k, v in (("first_ms", first), ("shard_ms", per_shard), ("mb_ms", per_mb))
        }
    (work / "transfer.tmp").unlink(missing_ok=True)
    return rows


def local_source(args: argparse.Namespace, workers: int) -> tuple[Any, Path, Any, Any]:
    """(data config, the local dataset directory the store serves, its index, the tokenizer): ``--data`` and
    ``--tokenizer``, else the demo data, built first when it is missing."""
    from nanovlm.data.index import load_index
    from nanovlm.data.tokenizer import load_tokenizer

    cfg = data_config(args, workers)
    if not args.data:
        demo_dirs(cfg)
    source = Path(cfg.data.train[0])
    tokenizer = load_tokenizer(args.tokenizer or cfg.data.tokenizer, cfg.model.vision.image_splitting)
    return cfg, source, load_index(source), tokenizer


def measure(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Rounds of every reader (``Readers.run_round``) at each latency; the JSON part of the section."""
    import fsspec

    plan = RemotePlan.quick() if args.quick else RemotePlan()
    plan.reps = min(plan.reps, args.reps) if args.quick else args.reps
    cfg, source, index, tokenizer = local_source(args, plan.workers)
    peer = Peers.prepare(source, Path(args.workdir), cfg, tokenizer, index.num_samples, log)
    readers = Readers(args, cfg, tokenizer, plan.workers, Path(args.workdir) / "remote_cache", peer)
    runs: dict[tuple, list[dict[str, Any]]] = {}
    big = Path(args.workdir) / "transfer_big.bin"  # one large object: the first shards end to end
    big.parent.mkdir(parents=True, exist_ok=True)
    with open(big, "wb") as f:
        for s in index.shards[: max(1, len(index.shards) // 2)]:
            f.write((source / s.name).read_bytes())
    sources, extra = {"bench": source, **peer.dirs}, {"bench/transfer/big.bin": big}
    with store(sources, extra, plan.latencies_ms, plan.bandwidth_mb_s, args.store_cpus) as s3:
        shard_urls = [f"s3://bench/ds/{s.name}" for s in index.shards[: plan.transfer_shards]]
        transfer = transfer_cpu(shard_urls, "s3://bench/transfer/big.bin", big.stat().st_size, big.parent, plan.reps)
        per_shard = ", ".join(f"{k} {v['shard_ms']['median']:.1f} ms" for k, v in transfer.items())
        log(f"[remote] transfer CPU per shard: {per_shard}")
        readers.local_round(runs, s3)
        for latency in plan.latencies_ms:
            fsspec.config.conf["s3"] = {"endpoint_url": s3.urls[latency]}  # a new client (cache key) per latency
            for i in range(plan.reps):
                readers.run_round(runs, latency, s3, flip=i % 2 == 1)
                readers.local_round(runs, s3)
            log(f"[remote] +{latency} ms: {plan.reps} rounds")
    bracketed(runs, readers.brackets)
    fsspec.config.conf.pop("s3", None)
    shutil.rmtree(readers.cache, ignore_errors=True)
    big_bytes = big.stat().st_size
    big.unlink()
    rows, peer_rows = Rows(log), Rows(log)
    for (name, latency, cold), row_runs in runs.items():
        where = "local disk" if latency is None else f"S3 +{latency} ms, {'cold' if cold else 'warm'}"
        if name in (OURS, OURS_NO_PREFETCH):
            rows.record(where, latency, None if latency is None else name == OURS, cold, row_runs)
        else:
            peer_rows.record(f"{name}: {where}", latency, None, cold, row_runs)
    return {
        "plan": {**plan.__dict__, "latencies_ms": list(plan.latencies_ms)},
        "data": str(source),
        "dataset_bytes": sum(s.size_bytes for s in index.shards),
        "shards": len(index.shards),
        "samples": index.num_samples,
        "transfer": {"big_bytes": big_bytes, "shards": plan.transfer_shards, "rows": transfer},
        "rows": _local_last(rows),
        "peers": {"prepared": peer.prepared, "missing": peer.missing, "rows": _local_last(peer_rows)},
    }


def _local_last(rows: Rows) -> list[dict[str, Any]]:
    """The rows as the tables show them: the remote ones first, in round order, then the local one."""
    return [r for r in rows if r["latency_ms"] is not None] + [r for r in rows if r["latency_ms"] is None]


@dataclass
class Peers:
    """The peers (benchmarks/peers.py) that import here, prepared from ``source`` into the work directory."""

    work: Path
    processor: Any
    expected: int
    dirs: dict[str, Path] = field(default_factory=dict)  # name -> its prepared dataset (uploaded as s3://NAME/ds)
    prepared: dict[str, dict[str, float]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    workers: int = 2

    @classmethod
    def prepare(cls, source: Path, work: Path, cfg: Any, tokenizer: Any, expected: int, log: Callable) -> Peers:
        from benchmarks import peers
        from nanovlm.data.processing import SampleProcessor

        processor = SampleProcessor.from_config(tokenizer, cfg.model, cfg.data)
        out = cls(work / "peers", processor, expected, workers=cfg.data.num_workers)
        for name, ok in peers.available().items():
            if not ok:
                out.missing.append(name)
                continue
            prepare = peers.prepare_energon if name == "energon" else peers.prepare_litdata
            out.dirs[name], seconds = prepare(source, out.work)
            size = sum(p.stat().st_size for p in out.dirs[name].rglob("*") if p.is_file())
            out.prepared[name] = {"seconds": seconds, "bytes": size}
            log(f"[remote] {name}: prepared in {seconds:.1f} s, {size / 1e6:.1f} MB")
        if out.missing:
            log(f"[remote] peers not installed: {', '.join(out.missing)} ({peers.PEERS_INSTALL})")
        return out

    def epoch(
        self, name: str, path: str, cache: Path | None = None, url: str = "", on_first: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        from benchmarks import peers

        cache_dir = str(cache) if cache is not None else None
        if name == "energon":
            msc = {"config": self.work / "msc.yaml", "endpoint_url": url, "cache_dir": cache_dir} if url else None
            return peers.energon_epoch(path, self.processor, self.expected, self.workers, msc, on_first)
        return peers.litdata_epoch(path, self.processor, self.expected, self.workers, cache_dir, url, on_first)
