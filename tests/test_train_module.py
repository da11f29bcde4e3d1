"""The training module in-process on CPU: optimizer groups, freezing, lr schedule, checkpoint IO, and a real
Lightning fit + exact resume with a tiny NanoVLM on synthetic packed batches (built with the real collator)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import MICRO_MODEL, run_forked_ranks
from torch.utils.data import DataLoader, IterableDataset

from nanovlm.config import Config, image_token_count, load_config
from nanovlm.data.collate import collate_packed
from nanovlm.model.vlm import NanoVLM
from nanovlm.train import optim
from nanovlm.train.checkpoint import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    checkpoint_name,
    list_checkpoints,
    resolve_resume,
)
from nanovlm.train.module import VLMModule
from nanovlm.train.run import build_trainer

VOCAB = 96
IMAGE_ID = 95
PAD_ID = 0

TINY = [
    *MICRO_MODEL,
    "model.attn_backend=sdpa",
    "data.max_tokens=64",
    "data.val=[]",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.progress_bar=false",
    "trainer.logger=none",
    "trainer.log_every_n_steps=2",
    "trainer.eval_at_end=false",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
]


def tiny_cfg(tmp_path: Path, *extra: str) -> Config:
    return load_config([], [*TINY, f"trainer.run_dir={tmp_path}", *extra])


@dataclass
class Sample:
    key: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor


def synthetic_batch(index: int, cfg: Config) -> dict:
    """Pack ``index`` of a deterministic stream: 2 samples, each one image + a random prompt + the same
    3-token answer (learnable in a few steps)."""
    g = torch.Generator().manual_seed(index)
    itc = image_token_count(cfg.model)
    size = cfg.model.vision.image_size
    samples = []
    for j in range(2):
        prompt = torch.randint(1, 40, (6,), generator=g)
        answer = torch.tensor([50, 51, 52])
        ids = torch.cat([torch.full((itc,), IMAGE_ID), prompt, answer])
        labels = torch.full_like(ids, -100)
        labels[-3:] = answer
        pixels = torch.randint(0, 256, (1, 3, size, size), generator=g, dtype=torch.uint8)
        samples.append(Sample(f"s{index:05d}_{j}", ids, labels, pixels))
    return collate_packed(samples, cfg.data.max_tokens, PAD_ID, size, meta={"index": index})


class _Stream(IterableDataset):
    def __init__(self, cfg: Config, start: int) -> None:
        self.cfg, self.start = cfg, start

    def __iter__(self):
        i = self.start
        while True:
            yield synthetic_batch(i, self.cfg)
            i += 1


class StreamDataModule(pl.LightningDataModule):
    """Infinite deterministic stream whose state is the index of the next untrained pack."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg, self.position = cfg, 0

    def train_dataloader(self):
        return DataLoader(_Stream(self.cfg, self.position), batch_size=None)

    def on_batch_consumed(self, batch: dict) -> None:
        self.position = batch["meta"]["index"] + 1

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def tiny_model(cfg: Config) -> NanoVLM:
    torch.manual_seed(0)
    return NanoVLM(cfg.model, VOCAB, IMAGE_ID)


def fit(cfg: Config, ckpt_path=None):
    pl.seed_everything(cfg.trainer.seed, verbose=False)
    module = VLMModule(cfg, model=tiny_model(cfg))
    dm = StreamDataModule(cfg)
    trainer, ckpt, telemetry = build_trainer(cfg)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    return trainer, module, ckpt, telemetry


def read_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------


def test_param_groups_split_parts_and_decay(tmp_path):
    cfg = tiny_cfg(tmp_path, "optim.vision_lr=1e-4", "optim.projector_lr=5e-3")
    model = tiny_model(cfg)
    groups = optim.param_groups(model, cfg.optim)
    names = [g["name"] for g in groups]
    assert names == ["vision", "vision_no_decay", "projector", "language", "language_no_decay"]  # projector: no bias
    lrs = {g["name"]: g["peak_lr"] for g in groups}
    assert lrs["vision"] == 1e-4 and lrs["projector"] == 5e-3 and lrs["language"] == 3e-3
    # every trainable parameter is in exactly one group; norms/biases/embeddings have no weight decay
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    for g in groups:
        assert g["weight_decay"] == (0.0 if g["name"].endswith("no_decay") else cfg.optim.weight_decay)
    emb = model.language.embed_tokens.weight
    assert any(p is emb for g in groups if g["name"] == "language_no_decay" for p in g["params"])


def test_freezing_removes_parts_from_optimizer(tmp_path):
    cfg = tiny_cfg(tmp_path, "optim.freeze_vision=true", "optim.freeze_projector=true")
    model = tiny_model(cfg)
    optim.apply_freezing(model, cfg.optim)
    assert not any(p.requires_grad for p in model.vision.parameters())
    assert not any(p.requires_grad for p in model.projector.parameters())
    assert all(p.requires_grad for p in model.language.parameters())
    assert [g["name"] for g in optim.param_groups(model, cfg.optim)] == ["language", "language_no_decay"]
    cfg_all = tiny_cfg(
        tmp_path, "optim.freeze_vision=true", "optim.freeze_projector=true", "optim.freeze_language=true"
    )
    with pytest.raises(ValueError, match="freeze the whole model"):
        optim.apply_freezing(tiny_model(cfg_all), cfg_all.optim)


def test_schedule_warmup_cosine_linear_constant():
    s = optim.Schedule("cosine", warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert [s(i) for i in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert s(10) == 1.0
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    lin = optim.Schedule("linear", 0, 100, 0.0)
    assert lin(0) == 1.0 and lin(50) == pytest.approx(0.5) and lin(100) == 0.0
    assert optim.Schedule("constant", 5, 100, 0.1)(99) == 1.0


def test_atomic_io_roundtrip_and_write_error_keeps_previous(tmp_path):
    io = AtomicCheckpointIO()
    good = tmp_path / checkpoint_name(10)
    io.save_checkpoint({"w": torch.arange(4), "step": 10}, good)
    assert torch.equal(io.load_checkpoint(good)["w"], torch.arange(4))
    assert not list(tmp_path.glob("*.tmp"))
    # a write that fails (its temp path is a directory) names the path and leaves the good checkpoint alone
    bad = tmp_path / checkpoint_name(20)
    (tmp_path / (bad.name + ".tmp")).mkdir()
    with pytest.raises(CheckpointWriteError, match=r"step-00000020\.ckpt"):
        io.save_checkpoint({"w": torch.zeros(2)}, bad)
    assert not bad.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert io.load_checkpoint(good)["step"] == 10


def test_load_refuses_pickled_code(tmp_path):
    path = tmp_path / checkpoint_name(1)
    torch.save({"obj": Sample}, path)  # a class reference: needs unpickling of arbitrary globals
    with pytest.raises(Exception, match="(?i)weights_only"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_resolve_resume_modes(tmp_path):
    cfg = tiny_cfg(tmp_path)
    assert resolve_resume(cfg) is None  # auto, empty dir
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    for step in (5, 20, 10):
        (ck / checkpoint_name(step)).write_bytes(b"x")
    (ck / (checkpoint_name(30) + ".tmp")).write_bytes(b"partial")  # an interrupted save is never picked
    assert resolve_resume(cfg) == ck / checkpoint_name(20)
    cfg.checkpoint.resume = "none"
    assert resolve_resume(cfg) is None
    cfg.checkpoint.resume = str(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        resolve_resume(cfg)


def test_fit_learns_keeps_last_checkpoints_and_logs_steps(tmp_path):
    cfg = tiny_cfg(tmp_path, "trainer.max_steps=12", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2")
    trainer, module, ckpt, telemetry = fit(cfg)
    assert trainer.global_step == 12
    # periodic at 4 and 8, final at 12; keep_last=2
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [8, 12]
    steps = read_steps(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert steps[0]["keys"] == ["s00000_0", "s00000_1"] and steps[11]["keys"] == ["s00011_0", "s00011_1"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # it learns
    rows = telemetry.history
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    for r in rows:
        assert 0 < r["train/packing_fill"] <= 1 and r["train/tokens_per_s"] > 0 and 0 <= r["train/data_wait_frac"] <= 1
    # lr followed the schedule: the last logged lr is the one of step index 11
    assert rows[-1]["train/lr"] == pytest.approx(cfg.optim.lr * module.schedule(11))
    sd = torch.load(tmp_path / "checkpoints" / checkpoint_name(12), weights_only=True)
    assert sd["global_step"] == 12 and sd["StreamDataModule"] == {"position": 12}
    assert len(sd["rng_states"]) == 1


def test_exact_resume_in_process_with_accumulation(tmp_path):
    common = ["trainer.max_steps=6", "trainer.accumulate_grad_batches=2", "checkpoint.every_n_steps=3"]
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    fit(tiny_cfg(full_dir, *common))
    # the interrupted run stops after step 3 (max_steps=3 with the schedule of a 6-step run is what a kill at
    # step 3 leaves behind: the checkpoint of step 3)
    cfg_part = tiny_cfg(part_dir, *common)
    pl.seed_everything(cfg_part.trainer.seed, verbose=False)
    module = VLMModule(cfg_part, model=tiny_model(cfg_part))
    trainer, _, _ = build_trainer(cfg_part)
    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(module, datamodule=StreamDataModule(cfg_part), weights_only=True)
    assert [s for s, _ in list_checkpoints(part_dir / "checkpoints")] == [3]
    trainer, _, _, _ = fit(cfg_part, ckpt_path=resolve_resume(cfg_part))
    assert trainer.global_step == 6
    full, resumed = read_steps(full_dir), read_steps(part_dir)
    assert len(full) == 12
    assert [(r["micro"], r["keys"], r["loss"]) for r in resumed] == [(r["micro"], r["keys"], r["loss"]) for r in full]
    a = torch.load(full_dir / "checkpoints" / checkpoint_name(6), weights_only=True)["state_dict"]
    b = torch.load(part_dir / "checkpoints" / checkpoint_name(6), weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_saves_and_stops(tmp_path):
    """A SIGTERM during training saves a checkpoint at the next step boundary and stops cleanly."""
    import os
    import signal

    class KillAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = tiny_cfg(tmp_path, "trainer.max_steps=10", "checkpoint.every_n_steps=0")
    module = VLMModule(cfg, model=tiny_model(cfg))
    trainer, ckpt, _ = build_trainer(cfg)
    trainer.callbacks.insert(0, KillAt())
    trainer.fit(module, datamodule=StreamDataModule(cfg), weights_only=True)
    assert ckpt.preempted and trainer.global_step == 3
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3]


def test_activation_checkpointing_keeps_names_and_gradients(tmp_path):
    from nanovlm.train.strategies import apply_activation_checkpointing

    cfg = tiny_cfg(tmp_path)
    plain, ckpt = tiny_model(cfg), tiny_model(cfg)
    apply_activation_checkpointing(ckpt)
    assert list(plain.state_dict()) == list(ckpt.state_dict())  # checkpoints load either way
    batch = synthetic_batch(0, cfg)
    for m in (plain, ckpt):
        m(batch)["loss"].backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


@pytest.mark.slow
def test_compiled_blocks_keep_names_and_match_eager(tmp_path):
    """``trainer.compile``: each block is compiled in place; names (so checkpoints) and the packed loss and
    gradients stay those of the eager model (the CPU sdpa path, with its per-segment loop as graph breaks)."""
    from nanovlm.train.strategies import apply_compile

    cfg = tiny_cfg(tmp_path)
    eager, compiled = tiny_model(cfg), tiny_model(cfg)
    apply_compile(compiled)
    assert list(eager.state_dict()) == list(compiled.state_dict())
    batch = synthetic_batch(0, cfg)
    losses = [m(batch)["loss"] for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


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
        datamodule = SimpleNamespace(telemetry=lambda: {"epoch": 0, "skips_by_reason": skips[rank]})
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
def test_skipped_samples_metric_sums_every_rank(tmp_path):
    """``train/skipped_samples`` counts the skips of all ranks, like the other summed metrics (it was rank 0's)."""
    skips = {0: {"overlength": 1}, 1: {"unreadable_image": 5, "overlength": 2}}
    run_forked_ranks(_telemetry_rank, 2, tmp_path, skips, tmp_path / "rows.json")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["train/skipped_samples"] == 8.0 and rows[0]["train/tokens_per_s"] > 0


def test_optimizer_state_keyed_by_name_loads_back_into_the_same_parameters():
    """Groups that order the parameters otherwise than the model (as ours do: by part and weight decay) keep
    every state on its own parameter."""
    from nanovlm.train.module import optimizer_state_by_name

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    groups = [{"params": [model[1].weight, model[0].bias]}, {"params": [model[0].weight, model[1].bias], "lr": 0.1}]
    opt = torch.optim.AdamW(groups, lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = optimizer_state_by_name(opt.state_dict(), opt, names)
    assert set(by_name["state"]) == {"1.weight", "0.bias", "0.weight", "1.bias"}
    assert by_name["param_groups"][0]["params"] == ["1.weight", "0.bias"]
    assert torch.equal(by_name["state"]["1.weight"]["exp_avg"], opt.state[model[1].weight]["exp_avg"])
    assert optimizer_state_by_name(by_name, opt, names) is by_name and optimizer_state_by_name({}, opt, names) == {}
    fresh = torch.optim.AdamW(
        [{"params": [model[1].weight, model[0].bias]}, {"params": [model[0].weight, model[1].bias], "lr": 0.1}],
        lr=0.01,
    )
    fresh.load_state_dict(by_name)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_gradient_clipping_clips_to_optim_grad_clip_and_reports_the_norm_before():
    from types import SimpleNamespace

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 10.0)
    opt = torch.optim.SGD([p], lr=0.1)
    me = SimpleNamespace(cfg=SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0)), last_grad_norm=None)
    VLMModule.configure_gradient_clipping(me, opt)
    assert float(me.last_grad_norm) == pytest.approx(20.0) and float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)


def test_validation_loss_is_the_token_weighted_mean():
    from types import SimpleNamespace

    outs = iter(
        [
            {"loss": torch.tensor(1.0), "n_loss_tokens": torch.tensor(1)},
            {"loss": torch.tensor(4.0), "n_loss_tokens": torch.tensor(3)},
        ]
    )
    me = SimpleNamespace(
        _loss_forward=lambda b: next(outs),
        _val_sum=torch.zeros((), dtype=torch.float64),
        _val_tokens=torch.zeros((), dtype=torch.float64),
    )
    VLMModule.validation_step(me, {}, 0)
    VLMModule.validation_step(me, {}, 1)
    assert float(me._val_sum / me._val_tokens) == pytest.approx((1 * 1 + 4 * 3) / 4)


def test_steps_trace_is_cut_at_the_resumed_micro_batch(tmp_path):
    from types import SimpleNamespace

    from nanovlm.train.callbacks import DataProgress

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"micro": i}) + "\n" for i in range(6)))
    progress = DataProgress(tmp_path, accumulate=2)
    progress.on_train_start(SimpleNamespace(global_step=2), None)
    progress._close()
    assert [json.loads(line)["micro"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


class WithVal(StreamDataModule):
    def val_dataloader(self):
        return DataLoader([synthetic_batch(1000 + i, self.cfg) for i in range(2)], batch_size=None)


def fit_with_validation(tmp_path, capsys, *overrides: str):
    """Fit the stand-in data with two validation batches; returns (trainer, checkpoint callback, the
    '[val] step N' prefixes printed, all stdout)."""
    cfg = tiny_cfg(tmp_path, *overrides, "data.val=[unused]")  # the stand-in DataModule brings its own batches
    pl.seed_everything(cfg.trainer.seed, verbose=False)
    trainer, ckpt, _ = build_trainer(cfg)
    trainer.fit(VLMModule(cfg, model=tiny_model(cfg)), datamodule=WithVal(cfg), weights_only=True)
    out = capsys.readouterr().out
    return trainer, ckpt, [line.split(":")[0] for line in out.splitlines() if line.startswith("[val] step")], out


def test_periodic_validation_counts_optimizer_steps_under_accumulation(tmp_path, capsys):
    """trainer.val_every_n_steps is in optimizer steps; Lightning's interval is in micro-batches."""
    _, _, validated, _ = fit_with_validation(
        tmp_path, capsys, "trainer.max_steps=4", "trainer.accumulate_grad_batches=2", "trainer.val_every_n_steps=2"
    )
    assert validated == ["[val] step 2", "[val] step 4"]


def test_a_run_stopped_early_does_not_validate_at_the_stop(tmp_path, capsys):
    """Lightning validates when should_stop is set; a stopped (preempted) run must not spend its grace time so."""
    trainer, ckpt, validated, out = fit_with_validation(
        tmp_path, capsys, "trainer.max_steps=6", "trainer.val_every_n_steps=2", "trainer.stop_at_step=3"
    )
    assert ckpt.preempted and trainer.global_step == 3 and "trainer.stop_at_step reached" in out
    assert validated == ["[val] step 2"]


def test_a_validation_scheduled_at_the_stop_step_still_runs_and_is_not_repeated(tmp_path, capsys):
    """Skipping it would lose it: the resumed run restores Lightning's loop past a validation due at its step."""
    extra = ["trainer.max_steps=6", "trainer.val_every_n_steps=2", "checkpoint.every_n_steps=0"]
    _, ckpt, validated, _ = fit_with_validation(tmp_path, capsys, *extra, "trainer.stop_at_step=4")
    assert ckpt.preempted and validated == ["[val] step 2", "[val] step 4"]
    cfg = tiny_cfg(tmp_path, *extra, "data.val=[unused]")
    trainer, _, _ = build_trainer(cfg)
    trainer.fit(VLMModule(cfg, model=tiny_model(cfg)), datamodule=WithVal(cfg), ckpt_path=ckpt.last_saved,
                weights_only=True)  # fmt: skip
    resumed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("[val] step")]
    assert resumed == ["[val] step 6"]
