"""Training callbacks: data-position bookkeeping, the per-step trace, telemetry, and the start summary.

Order matters: ``DataProgress`` must come before ``PeriodicCheckpoint`` in the callback list, so a checkpoint
written at the end of a step already counts that step's batch as consumed.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from nanovlm.config import Config, ModelConfig
from nanovlm.constants import IGNORE_INDEX
from nanovlm.dist import all_reduce_sum, rank_world
from nanovlm.model import batch_flops

# Dense bf16 peak TFLOP/s per device, by a substring of torch.cuda.get_device_name() (checked in order, so the
# more specific names come first). V100 and T4 have no bf16 units: their fp16 peaks.
PEAK_TFLOPS = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A6000", 155.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("4090", 165.0),
    ("3090", 71.0),
    ("V100", 125.0),
    ("T4", 65.0),
]


def peak_tflops(configured: float, device: torch.device) -> float | None:
    """Peak dense TFLOP/s per device for MFU: the configured value, else a guess from the GPU name.
    None on CPU or an unknown GPU (MFU is then not reported)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def batch_stats(batch: dict) -> dict[str, float]:
    """Real (non-padding) tokens, their samples' squared lengths (attention FLOPs), slots, samples, images and
    loss tokens of one batch. From ``meta`` (computed by the collate function, no device sync) when present."""
    meta = batch.get("meta") or {}
    slots = batch["input_ids"].numel()
    if "real_tokens" in meta:
        real = int(meta["real_tokens"])
    elif "cu_seqlens" in batch and "sample_keys" in batch:  # segments of the real samples (padding tail excluded)
        real = int(batch["cu_seqlens"][len(batch["sample_keys"])])
    else:
        real = slots
    if "seq_sq" in meta:
        seq_sq = int(meta["seq_sq"])
    elif "cu_seqlens" in batch and "sample_keys" in batch:
        cu = batch["cu_seqlens"][: len(batch["sample_keys"]) + 1].tolist()
        seq_sq = sum((b - a) ** 2 for a, b in zip(cu[:-1], cu[1:]))
    elif "attention_mask" in batch:  # padded rows: one sample each
        seq_sq = sum(n * n for n in batch["attention_mask"].sum(1).tolist())
    else:  # one sample per row
        seq_sq = real * batch["input_ids"].shape[-1]
    pixels = batch.get("pixel_values")
    if "loss_tokens" in meta:
        loss_tokens = int(meta["loss_tokens"])
    else:  # labels are unshifted: position t predicts labels[t + 1]
        labels = batch.get("labels")
        loss_tokens = 0 if labels is None else int((labels[:, 1:] != IGNORE_INDEX).sum())
    return {
        "real_tokens": real,
        "seq_sq": seq_sq,
        "slots": slots,
        "samples": len(batch.get("sample_keys", [])),
        # the collate's count: a static pack's pixel_values also hold blank slots, work that is not useful
        "images": int(meta["n_images"]) if "n_images" in meta else 0 if pixels is None else int(pixels.shape[0]),
        "loss_tokens": loss_tokens,
    }


class DataPositionCallback(pl.Callback):
    """Advances the DataModule's position after every trained batch.

    Lightning runs callbacks' ``on_train_batch_end`` before the LightningModule's and runs checkpoint callbacks
    last, so with this callback a checkpoint saved at a step holds the position after that step's batch.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dm = trainer.datamodule
        if dm is not None and hasattr(dm, "on_batch_consumed"):  # ours, or one that keeps its position the same way
            dm.on_batch_consumed(batch)


class DataProgress(DataPositionCallback):
    """Tells the DataModule which batch was trained (DataPositionCallback: a checkpoint stores the trained
    position, not the prefetched one) and appends one line per micro-batch to ``<run_dir>/steps.jsonl`` (rank r > 0:
    ``steps.rank<r>.jsonl``): optimizer step, micro-batch index, sample keys, loss (exact float)."""

    def __init__(self, run_dir: str | Path, accumulate: int) -> None:
        self.run_dir = Path(run_dir)
        self.accumulate = accumulate
        self.micro = 0
        self._file = None

    def path(self, rank: int) -> Path:
        return self.run_dir / ("steps.jsonl" if rank == 0 else f"steps.rank{rank}.jsonl")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank, _ = rank_world()
        self.micro = trainer.global_step * self.accumulate  # checkpoints are only written at step boundaries
        path = self.path(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Keep the trace of the steps this run continues from; drop what a killed run logged after its checkpoint.
        kept = []
        if self.micro > 0 and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["micro"] < self.micro]
        path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the whole run)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        loss = getattr(pl_module, "last_loss", None)
        record = {
            "step": self.micro // self.accumulate + 1,
            "micro": self.micro,
            "keys": list(batch.get("sample_keys", [])),
            "loss": None if loss is None else float(loss),
        }
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        self.micro += 1

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()


def model_flops_per_step(
    model: torch.nn.Module,
    real_tokens: float,
    images: float,
    head_tokens: float | None = None,
    seq_sq: float | None = None,
) -> float | None:
    """Training FLOPs of a step with these real tokens and images, by ``nanovlm.model.batch_flops`` (the
    benchmark's formula): decoder matmuls per real token, attention per the samples' squared lengths
    (``seq_sq``; default: no attention term), the LM head per token that gets logits (``head_tokens``: the
    loss tokens when the head runs on loss positions only; default every real token), vision encoder and
    projector per image. A model that is not a NanoVLM may define ``flops_per_token()`` instead; None when
    neither is there (MFU is then not reported)."""
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig):
        head = real_tokens if head_tokens is None else head_tokens
        return batch_flops(cfg, model.language.vocab_size, real_tokens, seq_sq or 0.0, images, head)
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token()) * real_tokens
    return None


class Telemetry(pl.Callback):
    """Every ``log_every_n_steps`` optimizer steps: loss, lr, grad norm, real tokens/s, samples/s, packing
    fill, data-wait fraction, MFU (GPU), peak memory, epoch; summed over all ranks, written to the loggers
    and printed as one line on rank 0.

    Data wait = time between the end of one training batch and the start of the next (the loop is waiting
    for the DataLoader), as a fraction of wall time."""

    KEYS = ("real_tokens", "seq_sq", "slots", "samples", "images", "loss_tokens", "wait_s", "loss_sum", "micro")

    def __init__(self, cfg: Config, print_lines: bool = True) -> None:
        self.every = max(1, cfg.trainer.log_every_n_steps)
        self.max_steps = cfg.trainer.max_steps
        self.peak_cfg = cfg.trainer.peak_tflops
        self.print_lines = print_lines
        self.history: list[dict[str, float]] = []  # the logged rows (rank 0), for the end-of-run summary
        self._reset()
        self._t_prev_end: float | None = None
        self._last_step = -1

    def _reset(self) -> None:
        self.acc = dict.fromkeys(self.KEYS, 0.0)
        self.t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._peak = peak_tflops(self.peak_cfg, pl_module.device)
        self._reset()
        self._t_prev_end = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        # The first batch of an interval is not counted: the time before it also holds checkpoint saving and
        # validation, which run after the previous interval was logged.
        if self._t_prev_end is not None:
            self.acc["wait_s"] += time.perf_counter() - self._t_prev_end

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        for k, v in batch_stats(batch).items():
            self.acc[k] += v
        loss = getattr(pl_module, "last_loss", None)
        if loss is not None:
            self.acc["loss_sum"] += float(loss)
        self.acc["micro"] += 1
        step = trainer.global_step
        self._t_prev_end = time.perf_counter()
        if step == self._last_step:
            return  # still accumulating gradients
        self._last_step = step
        if step % self.every == 0 or step >= self.max_steps:
            self._log(trainer, pl_module, step)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        dm = trainer.datamodule
        dt = dm.telemetry() if dm is not None and hasattr(dm, "telemetry") else {}
        skipped = float(sum((dt.get("skips_by_reason") or {}).values()))  # this rank's; summed with the rest
        remote = dt.get("remote") or {}  # remote datasets: this rank's workers' retries and fetches since the start
        values = [self.acc[k] for k in self.KEYS] + [skipped] + [remote.get(k, 0) for k in REMOTE_KEYS]
        values += [dt.get(k, 0) for k in DECODE_KEYS]  # data.image_decode=device: since the last call
        totals = torch.tensor(values, dtype=torch.float64, device=pl_module.device)
        all_reduce_sum(totals)
        _, world = rank_world()
        *summed, skipped, retries, fetched, wait_ms, fallbacks, failures = totals.tolist()
        t = dict(zip(self.KEYS, summed))
        optimizer = trainer.optimizers[0]
        lang_group = next((g for g in optimizer.param_groups if g["name"].startswith("language")), None)
        group = lang_group or optimizer.param_groups[0]
        metrics = {
            "train/loss": t["loss_sum"] / max(t["micro"], 1),
            "train/lr": group["lr"],
            "train/tokens_per_s": t["real_tokens"] / elapsed,
            "train/samples_per_s": t["samples"] / elapsed,
            "train/packing_fill": t["real_tokens"] / max(t["slots"], 1),
            "train/data_wait_frac": min(1.0, t["wait_s"] / (world * elapsed)),
            # vision-encoder inputs per pack: tiles with image splitting (an unsplit image is one tile)
            "train/tiles_per_pack": t["images"] / max(t["micro"], 1),
        }
        if getattr(pl_module, "last_grad_norm", None) is not None:
            metrics["train/grad_norm"] = pl_module.last_grad_norm
        if self._peak:
            head = t["loss_tokens"] if getattr(pl_module, "head_on_loss_positions", False) else None
            flops = model_flops_per_step(pl_module.model, t["real_tokens"], t["images"], head, t["seq_sq"])
            if flops is not None:
                metrics["train/mfu"] = flops / elapsed / (self._peak * 1e12 * world)
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            metrics["train/peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 1e9
        else:  # CPU: peak resident memory of this process
            metrics["train/peak_mem_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        if dt:
            if "epoch" in dt:
                metrics["train/data_epoch"] = float(dt["epoch"])
            metrics["train/skipped_samples"] = skipped
            if remote:
                metrics["train/remote_retries"] = retries
                metrics["train/remote_fetched_gb"] = fetched / 1e9
                metrics["train/remote_wait_s"] = wait_ms / 1e3  # all ranks' workers: opening shards not yet staged
            if DECODE_KEYS[0] in dt:
                metrics["train/device_decode_fallbacks"], metrics["train/device_decode_failures"] = fallbacks, failures
        if trainer.is_global_zero:
            self.history.append({"step": step, **metrics})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            pl_module.log_dict(
                {"tok/s": metrics["train/tokens_per_s"], "fill": metrics["train/packing_fill"]},
                prog_bar=True,
                logger=False,
                rank_zero_only=True,
            )
            if self.print_lines:
                line = format_line(step, trainer.max_steps, metrics)
                bar = trainer.progress_bar_callback
                if bar is not None and hasattr(bar, "print"):
                    bar.print(line)
                else:
                    print(line, flush=True)
        self._reset()
        self._t_prev_end = None


DECODE_KEYS = ("device_decode_fallbacks", "device_decode_failures")  # DataModule.telemetry, with device decode
REMOTE_KEYS = ("retries", "fetched_bytes", "wait_ms")  # of telemetry()["remote"], with URL datasets


def format_line(step: int, max_steps: int, m: dict[str, float]) -> str:
    parts = [
        f"step {step}/{max_steps}",
        f"loss {m['train/loss']:.4f}",
        f"lr {m['train/lr']:.2e}",
        f"{m['train/tokens_per_s']:,.0f} tok/s",
        f"{m['train/samples_per_s']:.1f} samples/s",
        f"fill {m['train/packing_fill']:.1%}",
        f"data wait {m['train/data_wait_frac']:.1%}",
    ]
    if "train/mfu" in m:
        parts.append(f"MFU {m['train/mfu']:.1%}")
    parts.append(f"mem {m['train/peak_mem_gb']:.2f} GB")
    return " | ".join(parts)


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def start_summary(cfg: Config, config_files: list[str], trainer: pl.Trainer, module: pl.LightningModule) -> str:
    """The one-screen summary printed when training starts."""
    from nanovlm.train.strategies import resolve_precision

    model = module.model
    lines = ["=" * 78, "nanovlm training run", "=" * 78]
    lines.append(
        f"config        : {', '.join(config_files) or '(schema defaults)'} -> {cfg.trainer.run_dir}/config.yaml"
    )
    parts = []
    for part in ("vision", "projector", "language"):
        sub = getattr(model, part, None)
        if sub is None:
            continue
        total = sum(p.numel() for p in sub.parameters())
        trainable = sum(p.numel() for p in sub.parameters() if p.requires_grad)
        parts.append(f"{part} {_fmt_count(total)}" + ("" if trainable == total else " (frozen)"))
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"model         : {_fmt_count(total)} params = {' + '.join(parts)}")
    m = cfg.model
    weights = [
        f"{part} from {path}"
        for part, path in (
            ("vision", m.vision_checkpoint),
            ("language", m.language_checkpoint),
            ("all", m.vlm_checkpoint),
        )
        if path
    ]
    if cfg.checkpoint.init_from:
        weights.append(f"all from {cfg.checkpoint.init_from} (checkpoint.init_from, when starting fresh)")
    lines.append(f"weights       : {'; '.join(weights) if weights else 'random init'}")
    precision = trainer.precision if trainer is not None else resolve_precision(cfg.trainer)
    device = module.device
    try:
        from nanovlm.model.attention import resolve_backend

        dtype = torch.bfloat16 if "bf16" in str(precision) else torch.float32
        backend = resolve_backend(cfg.model.attn_backend, device, dtype)
    except Exception as e:  # report, never fail the run over the summary
        backend = f"{cfg.model.attn_backend} ({e})"
    lines.append(f"attention     : {backend} (config: {cfg.model.attn_backend})")
    world = trainer.world_size
    lines.append(
        f"devices       : {world} x {device.type}"
        f" ({trainer.num_nodes} node(s)), strategy {cfg.trainer.strategy}, precision {precision}"
    )
    tokens_per_step = cfg.data.max_tokens * cfg.trainer.accumulate_grad_batches * world
    lines.append(
        f"batch         : {cfg.data.max_tokens} token slots/pack x {cfg.trainer.accumulate_grad_batches} accumulation"
        f" x {world} ranks = {tokens_per_step:,} token slots per optimizer step"
    )
    dm = trainer.datamodule
    summary: dict[str, Any] = dm.summary() if dm is not None and hasattr(dm, "summary") else {}
    if summary:
        shown = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in summary.items()
            if not isinstance(v, (dict, list))
        )
        lines.append(f"data          : {shown}")
        packs = summary.get("packs_per_epoch") or summary.get("estimated_packs_per_epoch")
        if packs:
            per_step = cfg.trainer.accumulate_grad_batches * world
            lines.append(f"steps/epoch   : ~{packs / per_step:,.0f} optimizer steps per data epoch (estimate)")
    lines.append(
        f"schedule      : {cfg.trainer.max_steps} steps, lr {cfg.optim.lr:g} ({cfg.optim.schedule}, "
        f"warmup {cfg.optim.warmup_steps}), checkpoints every {cfg.checkpoint.every_n_steps} steps"
    )
    if cfg.optim.warmup_steps > cfg.trainer.max_steps:
        peak = cfg.trainer.max_steps / max(1, cfg.optim.warmup_steps)
        lines.append(
            f"note          : optim.warmup_steps={cfg.optim.warmup_steps} > trainer.max_steps: the learning rate "
            f"never leaves warmup (it peaks at {peak:.0%} of optim.lr)"
        )
    lines.append("=" * 78)
    return "\n".join(lines)


class StartSummary(pl.Callback):
    def __init__(self, cfg: Config, config_files: list[str]) -> None:
        self.cfg = cfg
        self.config_files = config_files

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            print(start_summary(self.cfg, self.config_files, trainer, pl_module), flush=True)
