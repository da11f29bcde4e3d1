"""Data pipeline throughput, separated from training.

Three measurements over the same shards:

1. **Stage breakdown** (one process, no threads): the per-sample cost of each stage the producer runs --
   read (seek + read the sample's byte range + parse its tar members), decode (image bytes -> resized uint8
   tensor), tokenize (ChatML encoding + label mask + tensors), pack (online packing plan + collation into
   [1, T] batches) -- next to ``webdataset``'s own read + decode (``WebDataset(...).decode("pil")``) of the
   same shards.
2. **DataModule vs raw webdataset** with 0, 1 and 2 DataLoader workers: samples/s and real tokens/s out of
   ``PackedMultimodalDataModule.train_dataloader()`` against a DataLoader over ``WebDataset(...).decode("pil")``
   with the same worker count. Warm-up (worker start, first packs) is excluded; the DataModule's ratio to
   raw webdataset is the >= 90% target.
3. **Consumer queue wait** with a simulated training step (a sleep, which is what a GPU-bound step looks
   like to the CPU): how long the training loop waits per batch, and the peak RSS of the main process and
   of every worker.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

from nanovlm.bench.common import Stats, markdown_table, percentile
from nanovlm.bench.workloads import bench_config, demo_dirs
from nanovlm.config import Config, image_token_count


@dataclass
class PipelinePlan:
    stage_samples: int = 600  # samples per stage-breakdown pass
    packs: int = 60  # timed packs per DataModule pass
    warmup_packs: int = 4  # packs excluded at the start of every pass (worker start-up, first reads)
    workers: tuple[int, ...] = (0, 1, 2)
    step_s: float = 0.05  # simulated training step for the queue-wait measurement
    wait_packs: int = 40

    @classmethod
    def quick(cls) -> PipelinePlan:
        return cls(stage_samples=100, packs=8, warmup_packs=2, workers=(0, 1, 2), step_s=0.05, wait_packs=6)


# ------------------------------------------------------------------------------------------------------
# memory helpers (Linux /proc; 0.0 elsewhere)


def _proc_kb(pid: int | str, field: str, fname: str = "status") -> float:
    try:
        with open(f"/proc/{pid}/{fname}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM so the next peak is the measurement's own (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_pids() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return sorted(set(pids))


def worker_memory() -> list[dict[str, float]]:
    """Peak RSS and current private memory of each live child process (DataLoader workers)."""
    out = []
    for pid in child_pids():
        private = _proc_kb(pid, "Private_Clean", "smaps_rollup") + _proc_kb(pid, "Private_Dirty", "smaps_rollup")
        out.append({"pid": pid, "peak_rss_mb": _proc_kb(pid, "VmHWM"), "private_mb": private})
    return out


# ------------------------------------------------------------------------------------------------------
# inputs


def _data_config(args: argparse.Namespace, workers: int) -> Config:
    overrides = [f"data.num_workers={workers}", "data.val=[]"]
    if args.data:
        overrides += ["data.train=[" + ",".join(args.data) + "]", "data.make_demo_if_missing=false"]
    if args.tokenizer:
        overrides.append(f"data.tokenizer={args.tokenizer}")
    if args.budget:
        overrides.append(f"data.max_tokens={args.budget}")
    return bench_config(args, overrides)


def _shards(dirs: list[str]) -> list[tuple[str, Any]]:
    from nanovlm.data.index import load_index

    out = []
    for d in dirs:
        idx = load_index(d)
        for sh in idx.shards:
            out.append((str(idx.shard_path(sh)), sh))
    return out


# ------------------------------------------------------------------------------------------------------
# 1. stage breakdown


def stage_breakdown(cfg: Config, tokenizer, n_samples: int, reps: int) -> dict[str, Any]:
    """Per-sample microseconds of read / decode / tokenize / pack over the first ``n_samples`` samples."""
    from nanovlm.data import packing
    from nanovlm.data.collate import collate_packed
    from nanovlm.data.format import SampleError, members_to_record
    from nanovlm.data.processing import ProcessedSample, SampleProcessor, long_tensor
    from nanovlm.data.reader import ShardReader

    itc = image_token_count(cfg.model)
    proc = SampleProcessor(
        tokenizer, cfg.model.vision.image_size, itc, cfg.data.image_resize, cfg.data.max_image_pixels
    )
    refs = []
    for path, sh in _shards(list(cfg.data.train)):
        for k, off, nb in zip(sh.keys, sh.offsets, sh.nbytes):
            refs.append((path, off, nb, k))
            if len(refs) >= n_samples:
                break
        if len(refs) >= n_samples:
            break
    pad = int(tokenizer.pad_token_id or 0)

    def one_pass() -> dict[str, float]:
        t = {"read": 0.0, "decode": 0.0, "tokenize": 0.0, "pack": 0.0}
        reader = ShardReader()
        samples = []
        for path, off, nb, key in refs:
            t0 = time.perf_counter()
            try:
                rec = members_to_record(reader.read_members(path, off, nb, key), key)
            except SampleError:
                continue
            t1 = time.perf_counter()
            try:
                pixel_values = proc.images(rec.images, key)
            except SampleError:
                continue
            t2 = time.perf_counter()
            ids, labels = proc.encode(rec.messages)
            s = ProcessedSample(key, long_tensor(ids), long_tensor(labels), pixel_values)
            t3 = time.perf_counter()
            t["read"] += t1 - t0
            t["decode"] += t2 - t1
            t["tokenize"] += t3 - t2
            samples.append(s)
        reader.close()
        t0 = time.perf_counter()
        lengths = [int(s.input_ids.numel()) for s in samples]
        n_img = [int(s.pixel_values.shape[0]) for s in samples]
        res = packing.pack_online(
            lengths, n_img, cfg.data.max_tokens, cfg.data.max_images, cfg.data.lookahead, cfg.data.max_carry
        )
        for p in res.packs:
            collate_packed([samples[i] for i in p], cfg.data.max_tokens, pad, proc.image_size)
        t["pack"] = time.perf_counter() - t0
        t["n"] = len(samples)
        return t

    one_pass()  # warm-up: page cache, tokenizer caches
    runs = [one_pass() for _ in range(reps)]
    n = runs[0]["n"]
    stages = {
        k: Stats.of([r[k] * 1e6 / max(1, n) for r in runs]).to_dict() for k in ("read", "decode", "tokenize", "pack")
    }
    total = Stats.of([sum(r[k] for k in ("read", "decode", "tokenize", "pack")) * 1e6 / max(1, n) for r in runs])
    return {"samples": n, "us_per_sample": stages, "total_us_per_sample": total.to_dict()}


def raw_wds_stage(cfg: Config, n_samples: int, reps: int) -> dict[str, Any]:
    """webdataset's read + decode ("pil": full decode, RGB) of the same first ``n_samples``, one process."""
    import webdataset as wds

    urls = [p for p, _ in _shards(list(cfg.data.train))]

    def one_pass() -> tuple[float, int]:
        ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil")
        n = 0
        t0 = time.perf_counter()
        for _ in ds:
            n += 1
            if n >= n_samples:
                break
        return time.perf_counter() - t0, n

    one_pass()
    runs = [one_pass() for _ in range(reps)]
    return {"samples": runs[0][1], "us_per_sample": Stats.of([t * 1e6 / max(1, n) for t, n in runs]).to_dict()}


# ------------------------------------------------------------------------------------------------------
# 2. DataModule vs raw webdataset, by worker count


def raw_wds_rate(cfg: Config, workers: int, n_warm: int, n_timed: int, reps: int) -> dict[str, Any]:
    """Samples/s of a DataLoader over WebDataset(...).decode("pil") with ``workers`` workers.

    Measured like the DataModule: a fresh iterator per repetition, the first ``n_warm`` samples (worker
    start-up) excluded, then ``n_timed`` samples timed.
    """
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [p for p, _ in _shards(list(cfg.data.train))]
    if workers > len(urls):
        return {"workers": workers, "skipped": f"{len(urls)} shard(s) cannot feed {workers} webdataset workers"}
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False, workersplitter=wds.split_by_worker)
    ds = ds.decode("pil").repeat()  # endless, like the DataModule's stream
    dl = DataLoader(ds, batch_size=None, num_workers=workers)
    rates = []
    for _ in range(reps):
        it = iter(dl)
        for _ in range(n_warm):
            next(it)
        t0 = time.perf_counter()
        for _ in range(n_timed):
            next(it)
        rates.append(n_timed / (time.perf_counter() - t0))
        del it
    return {"workers": workers, "timed_samples": n_timed, "samples_per_s": Stats.of(rates).to_dict()}


def _iterate(loader, n_warm: int, n_timed: int, step_s: float = 0.0) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(n_warm):
        next(it)
    waits, samples, tokens, slots = [], 0, 0, 0
    t0 = time.perf_counter()
    for _ in range(n_timed):
        tw = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - tw)
        m = batch["meta"]
        samples += m["n_samples"]
        tokens += m["real_tokens"]
        slots += m["slots"]
        if step_s:
            time.sleep(step_s)
    dt = time.perf_counter() - t0
    mem = worker_memory()
    del it  # closes producers and stops workers
    return {
        "seconds": dt,
        "samples": samples,
        "real_tokens": tokens,
        "slots": slots,
        "waits": waits,
        "workers_mem": mem,
    }


def datamodule_rate(cfg: Config, tokenizer, plan: PipelinePlan, reps: int) -> dict[str, Any]:
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer=tokenizer, rank=0, world_size=1, pin_memory=False)
    dm.setup("fit")
    sps, tps, fills, main_peak, worker_peak, worker_private, n_samples = [], [], [], [], [], [], 0
    for _ in range(reps):
        reset_peak_rss()
        r = _iterate(dm.train_dataloader(), plan.warmup_packs, plan.packs)
        sps.append(r["samples"] / r["seconds"])
        n_samples = r["samples"]
        tps.append(r["real_tokens"] / r["seconds"])
        fills.append(r["real_tokens"] / max(1, r["slots"]))
        main_peak.append(_proc_kb("self", "VmHWM"))
        if r["workers_mem"]:
            worker_peak.append(max(w["peak_rss_mb"] for w in r["workers_mem"]))
            worker_private.append(max(w["private_mb"] for w in r["workers_mem"]))
    # queue wait with a simulated (sleeping) training step
    w = _iterate(dm.train_dataloader(), plan.warmup_packs, plan.wait_packs, step_s=plan.step_s)
    waits_ms = [x * 1e3 for x in w["waits"]]
    return {
        "workers": cfg.data.num_workers,
        "timed_packs": plan.packs,
        "timed_samples": n_samples,
        "samples_per_s": Stats.of(sps).to_dict(),
        "real_tokens_per_s": Stats.of(tps).to_dict(),
        "fill": Stats.of(fills).to_dict(),
        "main_peak_rss_mb": Stats.of(main_peak).to_dict(),
        "worker_peak_rss_mb": Stats.of(worker_peak).to_dict() if worker_peak else None,
        "worker_private_mb": Stats.of(worker_private).to_dict() if worker_private else None,
        "queue_wait": {
            "simulated_step_ms": plan.step_s * 1e3,
            "median_ms": percentile(waits_ms, 50),
            "p99_ms": percentile(waits_ms, 99),
            "frac_of_time_waiting": sum(w["waits"]) / w["seconds"],
        },
    }


# ------------------------------------------------------------------------------------------------------
# section


def run(args: argparse.Namespace, log=print) -> tuple[dict[str, Any], str]:
    from nanovlm.data.tokenizer import load_tokenizer

    plan = PipelinePlan.quick() if args.quick else PipelinePlan()
    cfg = _data_config(args, 0)
    if not args.data:
        demo_dirs(cfg)
    tokenizer = load_tokenizer(args.tokenizer or cfg.data.tokenizer)
    log(f"[pipeline] stage breakdown over {plan.stage_samples} samples of {list(cfg.data.train)}")
    stages = stage_breakdown(cfg, tokenizer, plan.stage_samples, args.reps)
    raw_stage = raw_wds_stage(cfg, plan.stage_samples, args.reps)
    by_workers = []
    for w in plan.workers:
        cfg_w = _data_config(args, w)
        log(f"[pipeline] workers={w}: DataModule")
        ours = datamodule_rate(cfg_w, tokenizer, plan, args.reps)
        log(f"[pipeline] workers={w}: raw webdataset")
        per_pack = ours["timed_samples"] / max(1, plan.packs)
        raw = raw_wds_rate(cfg_w, w, int(per_pack * plan.warmup_packs), ours["timed_samples"], args.reps)
        ratio = None
        if "samples_per_s" in raw:
            ratio = ours["samples_per_s"]["median"] / raw["samples_per_s"]["median"]
        by_workers.append({"workers": w, "raw_webdataset": raw, "datamodule": ours, "ratio_to_raw": ratio})

    md = ["## Data pipeline", ""]
    md.append(
        f"Data: {', '.join(cfg.data.train)}; image size {cfg.model.vision.image_size}, "
        f"{image_token_count(cfg.model)} tokens/image, L = {cfg.data.max_tokens}. Median [min-max] of {args.reps} "
        "runs after warm-up."
    )
    md += ["", "Per-sample cost by stage (one process):", ""]
    rows = [[k, Stats(**v).fmt(0)] for k, v in stages["us_per_sample"].items()]
    rows.append(["**total (ours)**", Stats(**stages["total_us_per_sample"]).fmt(0)])
    rows.append(["webdataset read + decode('pil')", Stats(**raw_stage["us_per_sample"]).fmt(0)])
    md.append(markdown_table(["stage", "us/sample"], rows))
    md += ["", "Throughput by worker count (samples/s; the ratio is the >= 90% target):", ""]
    rows = []
    for b in by_workers:
        d, r = b["datamodule"], b["raw_webdataset"]
        q = d["queue_wait"]
        rows.append(
            [
                b["workers"],
                Stats(**d["samples_per_s"]).fmt(0),
                Stats(**d["real_tokens_per_s"]).fmt(0),
                Stats(**r["samples_per_s"]).fmt(0) if "samples_per_s" in r else r.get("skipped", "-"),
                f"{100 * b['ratio_to_raw']:.0f}%" if b["ratio_to_raw"] is not None else "-",
                f"{q['median_ms']:.1f} / {q['p99_ms']:.1f} ({100 * q['frac_of_time_waiting']:.0f}%)",
                f"{d['main_peak_rss_mb']['median']:.0f}",
                f"{d['worker_peak_rss_mb']['median']:.0f} ({d['worker_private_mb']['median']:.0f} private)"
                if d["worker_peak_rss_mb"]
                else "-",
            ]
        )
    md.append(
        markdown_table(
            [
                "workers",
                "DataModule samples/s",
                "real tokens/s",
                "raw webdataset samples/s",
                "ratio",
                f"queue wait ms median / p99 (share), {plan.step_s * 1e3:.0f} ms step",
                "main peak RSS MB",
                "worker peak RSS MB",
            ],
            rows,
        )
    )
    ok = [b["ratio_to_raw"] >= 0.9 for b in by_workers if b["ratio_to_raw"] is not None]
    md += ["", f"Target (>= 90% of raw webdataset at every worker count): {'met' if ok and all(ok) else 'MISSED'}."]
    doc = {
        "plan": plan.__dict__,
        "data": list(cfg.data.train),
        "stage_breakdown": stages,
        "raw_webdataset_stage": raw_stage,
        "by_workers": by_workers,
        "target_met": bool(ok and all(ok)),
    }
    return doc, "\n".join(md)
