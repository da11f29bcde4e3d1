"""Training throughput: the same samples and the same model, laid out three ways.

The samples are read and processed once (the data pipeline is measured on its own in ``pipeline_bench``),
then batched by

- ``packed``: ``pack_online`` + ``collate_packed`` -> [1, L] rows with cu_seqlens (varlen attention);
- ``pad_to_longest``: ``B`` consecutive samples padded to the longest -> [B, longest] with attention_mask;
- ``constrained``: ``B`` samples, those above a cutoff dropped, padded to the cutoff -> [B, cutoff].

``B = round(L / mean sample length)``, so a padded step holds as many real tokens on average as a pack.
Each mode trains a freshly seeded copy of the model (forward + backward + AdamW step), warm-up steps
excluded, over the same batch list ``reps`` times. Reported: real (non-padding) tokens/s, step time
median and p99, peak memory, and the ratio check: packed tokens/s over pad-to-longest tokens/s should
reach at least 90% of the ideal ratio fill(packed) / fill(pad-to-longest).

On ``--device cuda`` the model is the ``--preset`` (default model_222m.yaml) in bf16, and the packed mode is
repeated for every available attention backend, with MFU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from nanovlm.bench.common import Stats, markdown_table, percentile
from nanovlm.bench.pipeline_bench import _data_config, _proc_kb, _shards, reset_peak_rss
from nanovlm.bench.workloads import demo_dirs
from nanovlm.config import Config, load_config


def load_samples(cfg: Config, tokenizer, n: int) -> list:
    """The first ``n`` processable samples of the dataset (over-length ones dropped, as training does)."""
    from nanovlm.config import image_token_count
    from nanovlm.data.format import SampleError
    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.reader import ShardReader

    proc = SampleProcessor(
        tokenizer,
        cfg.model.vision.image_size,
        image_token_count(cfg.model),
        cfg.data.image_resize,
        cfg.data.max_image_pixels,
    )
    reader = ShardReader()
    out = []
    for path, sh in _shards(list(cfg.data.train)):
        for k, off, nb in zip(sh.keys, sh.offsets, sh.nbytes):
            try:
                out.append(proc.process(reader.read(path, off, nb, k), cfg.data.max_tokens, "drop"))
            except SampleError:
                continue
            if len(out) >= n:
                reader.close()
                return out
    reader.close()
    return out


def make_batches(samples: list, cfg: Config, pad_id: int) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Batches of every mode over the same samples, and the layout parameters used."""
    from nanovlm.data import packing
    from nanovlm.data.collate import collate_packed, collate_padded

    L, size = cfg.data.max_tokens, cfg.model.vision.image_size
    lengths = [int(s.input_ids.numel()) for s in samples]
    n_img = [int(s.pixel_values.shape[0]) for s in samples]
    B = max(1, round(L / statistics.mean(lengths)))
    cutoff = cfg.data.pad_cutoff or min(L, int(math.ceil(sorted(lengths)[int(0.95 * (len(lengths) - 1))] / 64) * 64))
    packed = packing.pack_online(lengths, n_img, L, cfg.data.max_images, cfg.data.lookahead, cfg.data.max_carry)
    ptl = packing.pad_to_longest(lengths, n_img, B, L)
    con = packing.constrained(lengths, n_img, B, cutoff)
    out = {
        "packed": [collate_packed([samples[i] for i in p], L, pad_id, size) for p in packed.packs if p],
        "pad_to_longest": [collate_padded([samples[i] for i in p], pad_id, size) for p in ptl.packs if p],
        "constrained": [
            _pad_to(collate_padded([samples[i] for i in p], pad_id, size), cutoff, pad_id) for p in con.packs if p
        ],
    }
    return out, {"batch_size": B, "cutoff": cutoff, "samples": len(samples), "max_tokens": L}


def _pad_to(batch: dict, width: int, pad_id: int) -> dict:
    """Right-pad a [B, l] padded batch to [B, width] (constrained padding pads every row to the cutoff)."""
    extra = width - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    batch["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=pad_id)
    batch["labels"] = F.pad(batch["labels"], (0, extra), value=-100)
    batch["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
    batch["position_ids"] = F.pad(batch["position_ids"], (0, extra), value=0)
    batch["meta"]["slots"] = int(batch["input_ids"].numel())
    return batch


def _to(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _fill(batches: list[dict]) -> float:
    return sum(b["meta"]["real_tokens"] for b in batches) / max(1, sum(b["meta"]["slots"] for b in batches))


def train_mode(
    cfg: Config, tokenizer, batches: list[dict], device: torch.device, reps: int, warmup: int, seed: int
) -> dict[str, Any]:
    """Train over ``batches`` ``reps`` times (after ``warmup`` steps); tokens/s per pass, step times pooled."""
    from nanovlm.model import build_model

    torch.manual_seed(seed)
    model = build_model(cfg.model, tokenizer).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    dev_batches = [_to(b, device) for b in batches]

    def step(b: dict) -> None:
        with amp:
            loss = model(b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(dev_batches[i % len(dev_batches)])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    rates, step_ms = [], []
    tokens = sum(b["meta"]["real_tokens"] for b in batches)
    for _ in range(reps):
        t_pass = time.perf_counter()
        for b in dev_batches:
            t0 = time.perf_counter()
            step(b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        rates.append(tokens / (time.perf_counter() - t_pass))
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else _proc_kb("self", "VmHWM")
    return {
        "steps_per_pass": len(batches),
        "real_tokens_per_pass": tokens,
        "fill": _fill(batches),
        "real_tokens_per_s": Stats.of(rates).to_dict(),
        "step_ms_median": percentile(step_ms, 50),
        "step_ms_p99": percentile(step_ms, 99),
        "peak_memory_mb": peak,
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
    }


def _mfu(cfg: Config, vocab: int, batches: list[dict], tokens_per_s: float, device: torch.device) -> float | None:
    from nanovlm.model import flops_per_token
    from nanovlm.train.callbacks import peak_tflops

    peak = peak_tflops(cfg.trainer.peak_tflops, device)
    if not peak:
        return None
    seg_sq = seg = images = 0
    for b in batches:
        cu = b["cu_seqlens"].tolist()
        real = [e - s for s, e in zip(cu[:-1], cu[1:])][: len(b["sample_keys"])]
        seg_sq += sum(x * x for x in real)
        seg += sum(real)
        images += b["meta"]["n_images"]
    fpt = flops_per_token(cfg.model, vocab, seg_sq / max(1, seg), images / max(1, seg))
    return fpt * tokens_per_s / (peak * 1e12)


def run(args: argparse.Namespace, log=print) -> tuple[dict[str, Any], str]:
    from nanovlm.data.tokenizer import load_tokenizer
    from nanovlm.model import resolve_backend, resolve_vocab_size

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    quick = args.quick
    cfg = _data_config(args, 0)
    if not args.data:
        demo_dirs(cfg)
    if device.type == "cuda":  # larger preset; same data
        preset = args.preset or "model_222m.yaml"
        files = [*(args.config or ["tiny_cpu.yaml"]), preset]
        ov = [f"data.train=[{','.join(cfg.data.train)}]", f"data.tokenizer={cfg.data.tokenizer}", "data.val=[]"]
        ov.append(f"data.max_tokens={args.budget or 4096}")
        cfg = load_config(files, ov)
    tokenizer = load_tokenizer(args.tokenizer or cfg.data.tokenizer)
    pad_id = int(tokenizer.pad_token_id or 0)
    n = (80 if quick else 400) if device.type == "cpu" else (400 if quick else 3000)
    log(f"[train] loading {n} samples for L={cfg.data.max_tokens} on {device}")
    samples = load_samples(cfg, tokenizer, n)
    if not samples:
        raise ValueError(f"no usable sample in {cfg.data.train} for max_tokens={cfg.data.max_tokens}")
    batches, layout = make_batches(samples, cfg, pad_id)
    reps, warmup = args.reps, 2 if quick else 3
    results: dict[str, Any] = {}
    backend = cfg.model.attn_backend
    for mode in ("packed", "pad_to_longest", "constrained"):
        log(f"[train] {mode}: {len(batches[mode])} steps x {reps}")
        results[mode] = train_mode(cfg, tokenizer, batches[mode], device, reps, warmup, args.seed)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    vocab = resolve_vocab_size(cfg.model, tokenizer)
    results["packed"]["mfu"] = _mfu(
        cfg, vocab, batches["packed"], results["packed"]["real_tokens_per_s"]["median"], device
    )
    backends = []
    if device.type == "cuda":
        names = [b for b in (args.backends or "sdpa,torch_varlen,flash_attn").split(",") if b]
        for name in names:
            try:
                resolve_backend(name, device, torch.bfloat16)
            except Exception as e:  # unavailable backend: reported, not fatal
                backends.append({"backend": name, "unavailable": str(e).splitlines()[0]})
                continue
            cfg.model.attn_backend = name
            log(f"[train] packed with attention backend {name}")
            r = train_mode(cfg, tokenizer, batches["packed"], device, reps, warmup, args.seed)
            r["mfu"] = _mfu(cfg, vocab, batches["packed"], r["real_tokens_per_s"]["median"], device)
            backends.append({"backend": name, **r})
        cfg.model.attn_backend = backend
    p, q = results["packed"], results["pad_to_longest"]
    ideal = p["fill"] / q["fill"]
    actual = p["real_tokens_per_s"]["median"] / q["real_tokens_per_s"]["median"]
    check = {
        "ideal_ratio": ideal,
        "actual_ratio": actual,
        "fraction_of_ideal": actual / ideal,
        "target_met": actual / ideal >= 0.9,
    }

    from nanovlm.model import build_model, num_parameters

    params = num_parameters(build_model(cfg.model, tokenizer))["total"]
    md = ["## Training throughput", ""]
    md.append(
        f"Model: {params / 1e6:.1f}M parameters ({'tiny_cpu' if device.type == 'cpu' else args.preset or 'model_222m.yaml'}, "
        f"attention backend {backend}), device {device}, L = {cfg.data.max_tokens}, {layout['samples']} samples; "
        f"padded modes use B = {layout['batch_size']}, constrained cutoff {layout['cutoff']}. Tokens/s: median "
        f"[min-max] of {reps} passes after {warmup} warm-up steps; step times pooled over all passes."
    )
    md.append("")
    rows = []
    for mode in ("packed", "pad_to_longest", "constrained"):
        r = results[mode]
        rows.append(
            [
                mode,
                f"{100 * r['fill']:.1f}%",
                r["steps_per_pass"],
                Stats(**r["real_tokens_per_s"]).fmt(0),
                f"{r['step_ms_median']:.1f}",
                f"{r['step_ms_p99']:.1f}",
                f"{r['peak_memory_mb']:.0f}",
                f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-",
            ]
        )
    md.append(
        markdown_table(
            ["layout", "fill", "steps", "real tokens/s", "step ms median", "step ms p99", "peak memory MB", "MFU"], rows
        )
    )
    md += [
        "",
        f"Packed / pad-to-longest real tokens/s: {actual:.2f}x; ideal (ratio of fills) {ideal:.2f}x; "
        f"{100 * actual / ideal:.0f}% of ideal (target >= 90%: {'met' if check['target_met'] else 'MISSED'}).",
    ]
    if backends:
        md += ["", "Attention backends (packed):", ""]
        brow = []
        for b in backends:
            if "unavailable" in b:
                brow.append([b["backend"], "unavailable: " + b["unavailable"][:80], "-", "-", "-", "-"])
            else:
                brow.append(
                    [
                        b["backend"],
                        Stats(**b["real_tokens_per_s"]).fmt(0),
                        f"{b['step_ms_median']:.1f}",
                        f"{b['step_ms_p99']:.1f}",
                        f"{b['peak_memory_mb']:.0f}",
                        f"{100 * b['mfu']:.1f}%" if b.get("mfu") else "-",
                    ]
                )
        md.append(markdown_table(["backend", "real tokens/s", "step ms median", "p99", "peak MB", "MFU"], brow))
    doc = {
        "device": str(device),
        "parameters": params,
        "layout": layout,
        "modes": results,
        "backends": backends,
        "ratio_check": check,
    }
    return doc, "\n".join(md)
