"""Scale: what a process pays before its first read as the dataset grows, and the memory it holds.

For each size, a synthetic index (lognormal text lengths, one image per sample, 1,000 shards) is written once
into ``--workdir/scale/<n>`` and reused; its shards are sparse files of the recorded size (the index checks
stat them, planning never reads them). A fresh child process per size then times, as a training rank does:

* opening the index (``load_index``: meta.json, every column mapped and checked), measured twice: first with
  whatever the page cache holds, then again with the columns cached (the second process of a node),
* building the sample table: the length columns for the run's model, derived and saved into the node's cache by
  the first run (``--workdir/cache``, cleared first), mapped from it by the second,
* what a DataLoader worker of 64 ranks x 8 workers does before its first read: the epoch's split and pack count
  (vectorised, every process) and the packing of its own slot, fresh and resumed mid-epoch; and after an
  elastic resume of a half-consumed epoch onto 48 x 8 (the old slots' frontiers, of the size workers report,
  say what each left: vectorised; skipped above ``--scale-plan-max`` samples),

and reports its proportional set size (PSS, ``/proc/self/smaps_rollup``) split into anonymous memory (its own)
and file-backed pages (the mapped columns, shared by every process of a node), plus the PSS of a process
forked from it that touches the length columns (a DataLoader worker). Then, on an index of the same size whose
shards link to the demo data's real shards (``make_real_index``), the time to a worker's first batch through the
DataModule, fresh, resumed mid-epoch and after an elastic resume (``first_batch``). Separately, ``prepare_data`` in
index-only mode is timed on real shards in one process (samples/s per core), decoding every image and reading
headers only (``--image-check``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
N_SHARDS = 1000
KEY_WIDTH = 12  # "s" + 11 digits


def parse_size(text: str) -> int:
    """``100k``, ``1M``, ``1e6`` or ``250000`` -> samples."""
    t = text.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def make_index(directory: Path, n: int, seed: int = 0, chunk: int = 1 << 22) -> None:
    """Write a synthetic index of ``n`` samples over ``N_SHARDS`` sparse shard files (once; reused after)."""
    from nanovlm.data.index import COLUMNS, DatasetIndex, ShardEntry

    if (directory / "index" / "meta.json").is_file():
        return
    build = directory / ".build"
    build.mkdir(parents=True, exist_ok=True)
    rows = {"samples": (n,), "images": (n, 2), "key_bytes": (n * KEY_WIDTH,)}
    cols = {
        name: np.lib.format.open_memmap(build / f"{name}.npy", "w+", np.dtype(dt), rows[kind])
        for name, (dt, kind) in COLUMNS.items()
    }
    per_shard = -(-n // N_SHARDS)
    rng = np.random.default_rng(seed)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        i = np.arange(lo, hi)
        text = np.clip(rng.lognormal(5.0, 0.9, hi - lo), 8, 6000).astype(np.int32)
        nbytes = (2 + (text // 200)) * 512 + 60 * 1024  # a ~60 KB image plus the json member
        cols["text_tokens"][lo:hi], cols["nbytes"][lo:hi] = text, nbytes
        cols["n_images"][lo:hi], cols["prompt_images"][lo:hi] = 1, 1
        cols["prompt_tokens"][lo:hi] = np.minimum(text, 24)
        cols["image_sizes"][lo:hi] = (640, 480)
        cols["key_ends"][lo:hi] = (i + 1) * KEY_WIDTH
        digits = (i[:, None] // 10 ** np.arange(KEY_WIDTH - 2, -1, -1)) % 10 + ord("0")
        keys = np.concatenate([np.full((hi - lo, 1), ord("s")), digits], axis=1).astype(np.uint8)
        cols["keys"][lo * KEY_WIDTH : hi * KEY_WIDTH] = keys.reshape(-1)
    shards = []
    for s, lo in enumerate(range(0, n, per_shard)):
        hi = min(n, lo + per_shard)
        ends = np.cumsum(cols["nbytes"][lo:hi], dtype=np.int64)
        cols["offset"][lo:hi] = ends - cols["nbytes"][lo:hi]
        name = f"shard-{s:06d}.tar"
        with open(directory / name, "wb") as f:
            f.truncate(int(ends[-1]) + 1024)  # sparse: no blocks on disk
        shards.append(ShardEntry(name, int(ends[-1]) + 1024, hi - lo))
    DatasetIndex(directory, "synthetic", 64, "benchmarks/scale.py", shards, cols).save()
    del cols
    for f in build.iterdir():
        f.unlink()
    build.rmdir()


def make_real_index(directory: Path, n: int, source: Path) -> None:
    """An index of ``n`` samples over ``N_SHARDS`` links to the real shards of ``source`` (a prepared dataset), its
    rows repeated: every read is real (tar members, image decoding, tokenizing), only the size is not. Written
    once; reused after."""
    from nanovlm.data.index import COLUMNS, DatasetIndex, ShardEntry, load_index

    if (directory / "index" / "meta.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    src = load_index(source)
    c, starts = src.columns, src.shard_start
    img_start = np.concatenate([[0], np.cumsum(c["n_images"], dtype=np.int64)])
    key_start = np.concatenate([[0], c["key_ends"]]).astype(np.int64)
    per_shard = -(-n // N_SHARDS)
    rows = []  # per shard entry: the real rows it repeats
    for s, lo in enumerate(range(0, n, per_shard)):
        r = s % len(src.shards)
        rows.append(starts[r] + np.arange(min(per_shard, n - lo)) % (starts[r + 1] - starts[r]))
    n_img = sum(int(c["n_images"][x].sum()) for x in rows)
    n_key = sum(int((key_start[x + 1] - key_start[x]).sum()) for x in rows)
    build = directory / ".build"
    build.mkdir(exist_ok=True)
    sizes = {"samples": (n,), "images": (n_img, 2), "key_bytes": (n_key,)}
    cols = {
        name: np.lib.format.open_memmap(build / f"{name}.npy", "w+", np.dtype(dt), sizes[kind])
        for name, (dt, kind) in COLUMNS.items()
    }
    shards, lo, img, key = [], 0, 0, 0
    for s, x in enumerate(rows):
        hi = lo + len(x)
        for name in ("offset", "nbytes", "text_tokens", "n_images", "prompt_tokens", "prompt_images"):
            cols[name][lo:hi] = c[name][x]
        cols["image_sizes"][img : img + int(c["n_images"][x].sum())] = c["image_sizes"][_ranges(img_start, x)]
        k = _ranges(key_start, x)
        cols["keys"][key : key + len(k)] = c["keys"][k]
        cols["key_ends"][lo:hi] = key + np.cumsum(key_start[x + 1] - key_start[x])
        real = src.shards[s % len(src.shards)]
        link = directory / f"shard-{s:06d}.tar"
        if not link.exists():
            link.symlink_to(src.shard_path(real).resolve())
        shards.append(ShardEntry(link.name, real.size_bytes, len(x), real.crc32))
        lo, img, key = hi, img + int(c["n_images"][x].sum()), key + len(k)
    DatasetIndex(directory, src.tokenizer, src.image_token_count, "benchmarks/scale.py", shards, cols).save()
    del cols
    for f in build.iterdir():
        f.unlink()
    build.rmdir()


def _ranges(start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The concatenated index ranges ``start[r]:start[r + 1]`` of ``rows``."""
    lengths = start[rows + 1] - start[rows]
    offsets = np.repeat(start[rows] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum())) + offsets


def first_batch(directory: str, tokenizer: str, scenario: str, cache: str) -> dict[str, Any]:
    """Time to one worker's first batch through ``PackedMultimodalDataModule``, in a fresh process (``python -m
    benchmarks.scale --first-batch DIR TOKENIZER fresh|resumed|elastic CACHE``), for 64 ranks x 8 workers (48 x 8 after
    an elastic resume of a half-consumed epoch). Timed from the DataModule's construction (imports excluded):
    setup (index, table), the split, then the worker's first pack planned, read, decoded, tokenized, collated."""
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule
    from nanovlm.data.shards import ConsumedPart, Topology, plan_split
    from nanovlm.data.state import Position

    overrides = [f"data.train=[{directory}]", "data.val=[]", f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}"]
    cfg = load_config(["tiny_cpu.yaml"], overrides)
    cfg.data.num_workers = 8
    world = 48 if scenario == "elastic" else 64
    scenario = "fresh" if scenario == "warm-up" else scenario
    t0 = time.perf_counter()
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, rank=5, world_size=world)
    dm.setup("fit")
    t_setup = time.perf_counter()
    if scenario != "fresh":
        old = plan_split(dm.table, dm.spec, Topology(64, 8), cfg.data.seed, 0, shuffle_buffer=cfg.data.shuffle_buffer)
        half = old.batches_per_rank() // 2
        if scenario == "resumed":
            dm.position = Position(0, half)
        else:
            dm.position = Position(0, 0, history=(ConsumedPart(64, 8, half, _frontiers(dm.table, dm.spec, old)),))
        del old
        t0 += time.perf_counter() - t_setup  # the state's frontiers are made up here, not timed
        t_setup = time.perf_counter()
    stream = dm.train_dataloader().dataset  # the rank's split (its main process), handed to the worker
    t_split = time.perf_counter()
    it = iter(stream)  # the worker (in this process): its slot packed, its first pack read
    batch = next(it)
    t_first = time.perf_counter()
    it.close()
    assert batch["meta"]["epoch"] == 0 and batch["sample_keys"]
    return {
        "scenario": scenario,
        "setup_s": t_setup - t0,
        "split_s": t_split - t_setup,
        "first_pack_s": t_first - t_split,
        "total_s": t_first - t0,
        "pss_mb": _pss(),
    }


def _pss() -> dict[str, float]:
    """This process's PSS in MB: total, anonymous (its own heap) and file-backed (mapped files, shared)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
                out[name] = int(rest.split()[0]) / 1024.0
    return out


def child(directory: str, plan_max: int, cache: str) -> dict[str, Any]:
    """The measurement of one size, run in a fresh process (``python -m benchmarks.scale DIR PLAN_MAX CACHE``)."""
    from nanovlm.data.index import load_index
    from nanovlm.data.shards import ConsumedPart, PackSpec, SampleTable, Topology, pack_slot, plan_split

    t0 = time.perf_counter()
    idx = load_index(directory)
    t_open = time.perf_counter()
    table = SampleTable.from_indexes([(directory, idx)], 64, cache)
    t_table = time.perf_counter()
    out: dict[str, Any] = {"n": len(table), "open_s": t_open - t0, "table_s": t_table - t_open}
    spec, topo = PackSpec(max_tokens=8192, max_images=64), Topology(64, 8)

    def worker_plan(topology: Topology, slot: int, history=()) -> tuple[float, float, Any]:
        """What one DataLoader worker does before its first read: the epoch's split, then its own slot packed."""
        t = time.perf_counter()
        split = plan_split(table, spec, topology, seed=0, epoch=0, history=history)
        t_split = time.perf_counter()
        pack_slot(table, spec, split, slot)
        return t_split - t, time.perf_counter() - t_split, split

    out["split_s"], out["slot_s"], split = worker_plan(topo, 0)
    out["packs_per_slot"] = split.packs_per_slot
    half = split.batches_per_rank() // 2  # resumed mid-epoch: the same split, a slot halfway through the ranks
    out["resume_split_s"], out["resume_slot_s"], _ = worker_plan(topo, topo.num_slots // 2 + 3)
    out["pss_mb"] = _pss()  # a worker's steady state: the index, the table, its slot's plan
    if len(table) <= plan_max:  # elastic onto 48 x 8: the old slots' frontiers say what is left (no packing)
        history = [ConsumedPart(64, 8, half, _frontiers(table, spec, split))]
        out["elastic_split_s"], out["elastic_slot_s"], _ = worker_plan(Topology(48, 8), 5, history)
    del split
    out["elastic_pss_mb"] = _pss()  # after packing every old slot (freed, but the heap may keep the pages)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked DataLoader worker: reads the length columns, reports its own PSS
        int(table.length.sum()) + int(table.n_images.sum())
        os.write(write, json.dumps(_pss()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out["worker_pss_mb"] = json.loads(f.read())
    os.waitpid(pid, 0)
    out["peak_rss_mb"] = _status_mb("VmHWM")
    return out


def _frontiers(table, spec, split) -> tuple[tuple[int, ...], ...]:
    """Frontiers of the size a half-consumed epoch's slots report (top halfway through the chunk, 32 holes below
    it): the elastic timing depends on their sizes, not on which packs made them, so none is packed here."""
    from nanovlm.data.shards import packable

    rng, out = np.random.default_rng(0), []
    for slot in range(split.topology.num_slots):
        ok = np.flatnonzero(packable(table, spec, split.chunk(slot)))
        top = int(ok[len(ok) // 2])
        holes = np.sort(rng.choice(ok[ok < top], min(32, int((ok < top).sum())), replace=False))
        out.append((top, *holes.tolist()))
    return tuple(out)


def carry_growth(directory: Path, epochs: int, max_tokens: int) -> list[dict[str, Any]]:
    """Samples all slots carry into each next epoch, over ``epochs`` epochs of 64 x 8 slots (every slot packed, as
    the workers together do): the price of agreeing on K from a bound, for a budget the packs fill (8,192 tokens)
    and one whose packs the long-tailed samples cannot fill as well (512 tokens)."""
    from nanovlm.data.index import load_index
    from nanovlm.data.shards import Carry, PackSpec, SampleTable, Topology, build_epoch_plan

    table = SampleTable.from_indexes([(str(directory), load_index(directory))], 64)
    spec, carry, out = PackSpec(max_tokens=max_tokens, max_images=64), Carry(), []
    for e in range(epochs):
        plan = build_epoch_plan(table, spec, Topology(64, 8), seed=0, epoch=e, carry=carry)
        packs = [plan.pack(s, k) for s in range(plan.topology.num_slots) for k in range(plan.packs_per_slot)]
        fill = float(plan.lengths[np.concatenate(packs)].sum()) / (len(packs) * spec.max_tokens)
        out.append(
            {"epoch": e, "packs_per_slot": plan.packs_per_slot, "carried": int(plan.carry_out.size), "fill": fill}
        )
        carry = plan.carry()
    return out


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


@dataclass
class ScaleResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    prepare: dict[str, Any] = field(default_factory=dict)
    carry: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # max_tokens -> per epoch

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "prepare": self.prepare, "carry": self.carry}


def measure_prepare(shards_dir: Path, tokenizer: str, log, min_seconds: float = 3.0) -> dict[str, Any]:
    """``prepare_data`` index-only on real shards: samples/s per core of its per-shard work (one process, shards
    indexed again until ``min_seconds`` have passed), with every image decoded and with headers only."""
    from nanovlm.cli import prepare_data

    shards = sorted(str(p) for p in shards_dir.iterdir() if p.name.endswith(".tar"))
    out: dict[str, Any] = {"shards": str(shards_dir), "n_shards": len(shards)}
    for check in ("decode", "header"):
        prepare_data._init_worker(tokenizer, "chatml", 0, False, check == "decode")
        prepare_data._shard_work(shards[0])  # warm-up: imports, page cache
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_seconds:
            for path in shards:
                n += len(prepare_data._shard_work(path).hashes)
        rate = n / (time.perf_counter() - t0)
        out[f"{check}_samples_per_s"] = rate
        log(f"[scale] prepare_data index-only, --image-check {check}: {rate:.0f} samples/s per core")
    return out


def measure(args: argparse.Namespace, log) -> ScaleResult:
    sizes = [parse_size(s) for s in (args.scale_sizes or ("100k" if args.quick else "1M,10M,100M")).split(",")]
    result = ScaleResult()
    from benchmarks.workloads import bench_config, demo_dirs

    train, tokenizer = demo_dirs(bench_config(args))
    for n in sizes:
        directory = Path(args.workdir) / "scale" / str(n)
        t0 = time.perf_counter()
        make_index(directory, n, args.seed)
        log(f"[scale] index of {n:,} samples ready in {time.perf_counter() - t0:.1f} s")
        cache = Path(args.workdir) / "cache"
        shutil.rmtree(cache / "tables", ignore_errors=True)  # the first run derives the length columns
        cmd = [sys.executable, "-m", "benchmarks.scale", str(directory), str(args.scale_plan_max), str(cache)]
        runs = []
        for _ in range(2):  # the first run reads the columns from disk (or a cold page cache), the second does not
            proc = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        row = runs[0] | {"again": {k: runs[1][k] for k in ("open_s", "table_s", "split_s", "slot_s") if k in runs[1]}}
        row["index_bytes"] = sum(f.stat().st_size for f in (directory / "index").iterdir())
        real = Path(args.workdir) / "scale-real" / str(n)
        make_real_index(real, n, Path(train[0]))
        row["first_batch"] = {}
        for scenario in ("warm-up", "fresh", "resumed", "elastic"):  # the warm-up reads the columns into the cache
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.scale",
                "--first-batch",
                str(real),
                tokenizer,
                scenario,
                str(cache),
            ]
            proc = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
            if scenario != "warm-up":
                row["first_batch"][scenario] = json.loads(proc.stdout.strip().splitlines()[-1])
        result.rows.append(row)
        log(f"[scale] {n:,}: {row}")
    smallest = Path(args.workdir) / "scale" / str(sizes[0])
    epochs = 2 if args.quick else 3
    result.carry = {m: carry_growth(smallest, epochs, m) for m in (8192, 512)}
    log(f"[scale] carry over {epochs} epochs of {sizes[0]:,} samples: {result.carry}")
    if args.real_shards:
        shards, tokenizer = Path(args.real_shards), args.tokenizer or tokenizer
    else:
        shards = Path(train[0])
    result.prepare = measure_prepare(shards, tokenizer, log, 0.3 if args.quick else 3.0)
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--first-batch":
        print(json.dumps(first_batch(*sys.argv[2:6])))
    else:
        print(json.dumps(child(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
