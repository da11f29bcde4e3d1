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
import itertools
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Stats, percentile, proc_mb, reset_peak_rss, worker_memory
from benchmarks.workloads import data_config, demo_dirs, sample_refs, shard_paths
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
# 1. stage breakdown

STAGES = ("read", "decode", "tokenize", "pack")


def _first_refs(cfg: Config, n_samples: int) -> list[tuple[str, int, int, str]]:
    """(shard path, offset, bytes, key) of the first ``n_samples`` samples of the dataset."""
    return list(itertools.islice(sample_refs(list(cfg.data.train)), n_samples))


def _read_decode_tokenize(proc, refs: list[tuple[str, int, int, str]], t: dict[str, float]) -> list:
    """Process every sample, adding each stage's seconds to ``t``; samples that fail to read or decode are skipped."""
    from nanovlm.data.format import SampleError, members_to_record
    from nanovlm.data.processing import ProcessedSample, long_tensor
    from nanovlm.data.reader import ShardReader

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
    return samples


def _pack_and_collate(cfg: Config, samples: list, pad: int, image_size: int) -> None:
    from nanovlm.data import packing
    from nanovlm.data.collate import collate_packed

    lengths = [int(s.input_ids.numel()) for s in samples]
    n_img = [int(s.pixel_values.shape[0]) for s in samples]
    res = packing.pack_online(
        lengths, n_img, cfg.data.max_tokens, cfg.data.max_images, cfg.data.lookahead, cfg.data.max_carry
    )
    for p in res.packs:
        collate_packed([samples[i] for i in p], cfg.data.max_tokens, pad, image_size)


def stage_breakdown(cfg: Config, tokenizer, n_samples: int, reps: int) -> dict[str, Any]:
    """Per-sample microseconds of read / decode / tokenize / pack over the first ``n_samples`` samples."""
    from nanovlm.data.processing import SampleProcessor

    proc = SampleProcessor.from_config(tokenizer, cfg.model, cfg.data)
    refs = _first_refs(cfg, n_samples)
    pad = int(tokenizer.pad_token_id or 0)

    def one_pass() -> dict[str, float]:
        t = dict.fromkeys(STAGES, 0.0)
        samples = _read_decode_tokenize(proc, refs, t)
        t0 = time.perf_counter()
        _pack_and_collate(cfg, samples, pad, proc.image_size)
        t["pack"] = time.perf_counter() - t0
        t["n"] = len(samples)
        return t

    one_pass()  # warm-up: page cache, tokenizer caches
    runs = [one_pass() for _ in range(reps)]
    n = runs[0]["n"]
    stages = {k: Stats.of([r[k] * 1e6 / max(1, n) for r in runs]).to_dict() for k in STAGES}
    total = Stats.of([sum(r[k] for k in STAGES) * 1e6 / max(1, n) for r in runs])
    return {"samples": n, "us_per_sample": stages, "total_us_per_sample": total.to_dict()}


def raw_wds_stage(cfg: Config, n_samples: int, reps: int) -> dict[str, Any]:
    """webdataset's read + decode ("pil": full decode, RGB) of the same first ``n_samples``, one process."""
    import webdataset as wds

    urls = shard_paths(list(cfg.data.train))

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

    urls = shard_paths(list(cfg.data.train))
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
    """Samples/s, real tokens/s, fill and peak memory out of the DataModule over ``reps`` passes, then the queue
    wait behind a simulated (sleeping) training step."""
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
        main_peak.append(proc_mb("self", "VmHWM"))
        if r["workers_mem"]:
            worker_peak.append(max(w["peak_rss_mb"] for w in r["workers_mem"]))
            worker_private.append(max(w["private_mb"] for w in r["workers_mem"]))
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
        "queue_wait": queue_wait(dm, plan),
    }


def queue_wait(dm, plan: PipelinePlan) -> dict[str, float]:
    """How long the training loop waits per batch behind a simulated (sleeping) training step."""
    w = _iterate(dm.train_dataloader(), plan.warmup_packs, plan.wait_packs, step_s=plan.step_s)
    waits_ms = [x * 1e3 for x in w["waits"]]
    return {
        "simulated_step_ms": plan.step_s * 1e3,
        "median_ms": percentile(waits_ms, 50),
        "p99_ms": percentile(waits_ms, 99),
        "frac_of_time_waiting": sum(w["waits"]) / w["seconds"],
    }


# ------------------------------------------------------------------------------------------------------
# the section


@dataclass
class PipelineResult:
    """What the pipeline section measured, and the setting its report states."""

    plan: PipelinePlan
    data: list[str]
    image_size: int
    image_tokens: int
    max_tokens: int
    reps: int
    stages: dict[str, Any]
    raw_stage: dict[str, Any]
    by_workers: list[dict[str, Any]]

    @property
    def target_met(self) -> bool:
        return target_met(self.by_workers)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.__dict__,
            "data": self.data,
            "stage_breakdown": self.stages,
            "raw_webdataset_stage": self.raw_stage,
            "by_workers": self.by_workers,
            "target_met": self.target_met,
        }


def target_met(by_workers: list[dict[str, Any]]) -> bool:
    """The DataModule reaches >= 90% of raw webdataset's samples/s at every worker count that ran."""
    ok = [b["ratio_to_raw"] >= 0.9 for b in by_workers if b["ratio_to_raw"] is not None]
    return bool(ok and all(ok))


def measure(args: argparse.Namespace, log=print) -> PipelineResult:
    from nanovlm.data.tokenizer import load_tokenizer

    plan = PipelinePlan.quick() if args.quick else PipelinePlan()
    cfg = data_config(args, 0)
    if not args.data:
        demo_dirs(cfg)
    tokenizer = load_tokenizer(args.tokenizer or cfg.data.tokenizer, cfg.model.vision.image_splitting)
    log(f"[pipeline] stage breakdown over {plan.stage_samples} samples of {list(cfg.data.train)}")
    stages = stage_breakdown(cfg, tokenizer, plan.stage_samples, args.reps)
    raw_stage = raw_wds_stage(cfg, plan.stage_samples, args.reps)
    by_workers = [compare_workers(args, w, tokenizer, plan, log) for w in plan.workers]
    return PipelineResult(
        plan=plan,
        data=list(cfg.data.train),
        image_size=cfg.model.vision.image_size,
        image_tokens=image_token_count(cfg.model),
        max_tokens=cfg.data.max_tokens,
        reps=args.reps,
        stages=stages,
        raw_stage=raw_stage,
        by_workers=by_workers,
    )


def compare_workers(args: argparse.Namespace, workers: int, tokenizer, plan: PipelinePlan, log) -> dict[str, Any]:
    """The DataModule and raw webdataset with ``workers`` workers, over the same number of samples."""
    cfg_w = data_config(args, workers)
    log(f"[pipeline] workers={workers}: DataModule")
    ours = datamodule_rate(cfg_w, tokenizer, plan, args.reps)
    log(f"[pipeline] workers={workers}: raw webdataset")
    per_pack = ours["timed_samples"] / max(1, plan.packs)
    raw = raw_wds_rate(cfg_w, workers, int(per_pack * plan.warmup_packs), ours["timed_samples"], args.reps)
    ratio = None
    if "samples_per_s" in raw:
        ratio = ours["samples_per_s"]["median"] / raw["samples_per_s"]["median"]
    return {"workers": workers, "raw_webdataset": raw, "datamodule": ours, "ratio_to_raw": ratio}
