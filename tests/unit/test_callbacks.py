"""Training callbacks: telemetry FLOPs / MFU (the benchmark's formula), peak TFLOPs per GPU, the skipped-samples
metric summed over ranks (2 forked gloo ranks), and the step trace cut at a resumed micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.processes import run_forked_ranks
from helpers.training import synthetic_batch, tiny_cfg, tiny_model

from nanovlm.config import load_config
from nanovlm.train.module import VLMModule


def test_mfu_flops_count_the_lm_head_on_the_positions_that_get_logits(tmp_path):
    """Telemetry's FLOPs: the LM head (tied or not) counts once per token that gets logits; the trained module
    runs it on the loss positions only, and a batch reports its loss tokens."""
    from nanovlm.train.callbacks import batch_stats, model_flops_per_step

    cfg = tiny_cfg(tmp_path)
    model = tiny_model(cfg)
    assert model.language.lm_head.weight is model.language.embed_tokens.weight  # MICRO_MODEL ties them
    head = model.language.lm_head.weight.numel()
    every = model_flops_per_step(model, real_tokens=100, images=2)
    some = model_flops_per_step(model, real_tokens=100, images=2, head_tokens=20)
    assert every - some == pytest.approx(6 * head * 80, rel=1e-12)
    blocks = sum(m.weight.numel() for m in model.language.layers.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_step(model, 100, 0, head_tokens=0) == pytest.approx(6 * blocks * 100, rel=1e-12)

    batch = synthetic_batch(0, cfg)
    assert batch_stats(batch)["loss_tokens"] == 6  # two samples with a 3-token answer
    assert batch_stats({k: v for k, v in batch.items() if k != "meta"})["loss_tokens"] == 6
    assert VLMModule(cfg, model=model).head_on_loss_positions


def test_telemetry_mfu_flops_are_the_benchmark_formula_attention_included(tmp_path):
    """Training telemetry and the benchmark report the same MFU for the same work: one formula, with the
    attention term from the samples' squared lengths (the telemetry used to leave attention out)."""
    from nanovlm.data.collate import collate_packed
    from nanovlm.model import flops_per_image, flops_per_token
    from nanovlm.train.callbacks import batch_stats, model_flops_per_step

    cfg = tiny_cfg(tmp_path)
    model = tiny_model(cfg)
    batch = synthetic_batch(0, cfg)
    stats = batch_stats(batch)
    lengths = [b - a for a, b in zip(batch["cu_seqlens"].tolist(), batch["cu_seqlens"].tolist()[1:])]
    real = lengths[: len(batch["sample_keys"])]
    assert stats["seq_sq"] == sum(n * n for n in real) > 0
    assert batch_stats({k: v for k, v in batch.items() if k != "meta"})["seq_sq"] == stats["seq_sq"]
    tokens, images, head = stats["real_tokens"], stats["images"], stats["loss_tokens"]
    got = model_flops_per_step(model, tokens, images, head, stats["seq_sq"])
    vocab = model.language.vocab_size
    by_hand = flops_per_token(cfg.model, vocab, stats["seq_sq"] / tokens, head_fraction=head / tokens) * tokens
    by_hand += images * flops_per_image(cfg.model)
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert got > model_flops_per_step(model, tokens, images, head)  # the attention term is counted
    empty = collate_packed([], 8, 0, cfg.model.vision.image_size)
    assert batch_stats(empty)["seq_sq"] == 0 and batch_stats(empty)["real_tokens"] == 0


def test_peak_tflops_tell_the_h100_variants_apart(monkeypatch):
    from nanovlm.train.callbacks import peak_tflops

    cuda = torch.device("cuda", 0)
    for name, want in [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Some Future GPU", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_tflops(0.0, cuda) == want, name
    assert peak_tflops(123.0, cuda) == 123.0
    assert peak_tflops(0.0, torch.device("cpu")) is None


def _telemetry_rank(rank: int, port: int, skips: dict, out: Path) -> None:
    """One rank of a 2-process gloo group logging one telemetry interval with a stand-in trainer and module."""
    import os
    import traceback
    from types import SimpleNamespace

    from nanovlm.train.callbacks import Telemetry

    class Logger:
        rows: list = []

        def log_metrics(self, metrics, step):
            self.rows.append(metrics)

    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        tel = Telemetry(load_config(["tiny_cpu.yaml"]), print_lines=False)
        tel._peak = None
        remote = {"retries": rank + 1, "fetched_bytes": 10**9 * (rank + 1), "wait_ms": 500 * (rank + 1)}
        datamodule = SimpleNamespace(telemetry=lambda: {"epoch": 0, "skips_by_reason": skips[rank], "remote": remote})
        optimizer = SimpleNamespace(param_groups=[{"name": "language", "lr": 1e-3}])
        logger = Logger()
        trainer = SimpleNamespace(
            optimizers=[optimizer], datamodule=datamodule, is_global_zero=rank == 0, loggers=[logger]
        )
        trainer.progress_bar_callback, trainer.max_steps = None, 10
        module = SimpleNamespace(device=torch.device("cpu"), last_grad_norm=None, log_dict=lambda *a, **k: None)
        tel.acc.update(micro=1, loss_sum=1.0, slots=10, real_tokens=5)
        tel._log(trainer, module, 1)
        if rank == 0:
            out.write_text(json.dumps(logger.rows))
        torch.distributed.destroy_process_group()
    except BaseException:
        (out.parent / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


@pytest.mark.distributed
def test_skipped_samples_and_remote_metrics_sum_every_rank(tmp_path):
    """``train/skipped_samples`` counts the skips of all ranks, like the other summed metrics (it was rank 0's), and
    the remote counters (retries, bytes fetched, the readers' wait) are summed over the ranks too."""
    skips = {0: {"overlength": 1}, 1: {"unreadable_image": 5, "overlength": 2}}
    run_forked_ranks(_telemetry_rank, 2, tmp_path, skips, tmp_path / "rows.json")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["train/skipped_samples"] == 8.0 and rows[0]["train/tokens_per_s"] > 0
    assert rows[0]["train/remote_retries"] == 3.0 and rows[0]["train/remote_fetched_gb"] == 3.0
    assert rows[0]["train/remote_wait_s"] == 1.5


def test_steps_trace_is_cut_at_the_resumed_micro_batch(tmp_path):
    from types import SimpleNamespace

    from nanovlm.train.callbacks import DataProgress

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"micro": i}) + "\n" for i in range(6)))
    progress = DataProgress(tmp_path, accumulate=2)
    progress.on_train_start(SimpleNamespace(global_step=2), None)
    progress._close()
    assert [json.loads(line)["micro"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
