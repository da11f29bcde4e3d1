"""The training module in-process on CPU: a real Lightning fit + exact resume with a tiny NanoVLM on synthetic
packed batches (built with the real collator), SIGTERM and ``trainer.stop_at_step``, the validation schedule,
gradient clipping, the token-weighted validation loss, and the optimizer state keyed by parameter name."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.training import synthetic_batch, tiny_cfg, tiny_model
from torch.utils.data import DataLoader, IterableDataset

from nanovlm.config import Config
from nanovlm.train.checkpoint import checkpoint_name, list_checkpoints, resolve_resume
from nanovlm.train.module import VLMModule
from nanovlm.train.run import build_trainer


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
