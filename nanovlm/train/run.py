"""One training run from a resolved ``Config``: data, model, Lightning Trainer, fit, end-of-run evaluation.

``scripts/train.py`` (via ``nanovlm.cli.train``) and projects created from ``template/`` call ``train``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nanovlm.config import Config, save_config
from nanovlm.dist import file_lock, global_rank_from_env
from nanovlm.train import strategies
from nanovlm.train.callbacks import DataProgress, StartSummary, Telemetry
from nanovlm.train.checkpoint import (
    AtomicCheckpointIO,
    PeriodicCheckpoint,
    check_checkpoint_fits,
    check_no_later_checkpoints,
    check_resume_strategy,
    checkpoint_dir,
    checkpoint_step,
    load_weights,
    resolve_resume,
)
from nanovlm.train.metrics_csv import MetricsCSV
from nanovlm.train.module import VLMModule


@dataclass
class TrainResult:
    run_dir: Path
    global_step: int
    preempted: bool  # stopped early by SIGTERM / SIGUSR1 or trainer.stop_at_step (a checkpoint was saved)
    last_checkpoint: Path | None
    resumed_from: Path | None
    stopped_by_signal: bool = False  # preempted by a signal (on any rank), not by trainer.stop_at_step
    telemetry: list[dict[str, float]] = field(default_factory=list)  # rank 0's logged rows
    eval: dict[str, Any] | None = None


def ensure_data(cfg: Config) -> None:
    """Build the procedural demo dataset and tokenizer on first use when the config asks for it.

    Only the demo's own paths (the schema defaults, ``data/demo/...``) are ever built: a missing directory or
    tokenizer of your own is left to the loaders, which name it and the command that makes it, instead of
    being filled with demo samples.
    """
    if not cfg.data.make_demo_if_missing:
        return
    from nanovlm.config import DataConfig, image_token_count
    from nanovlm.data.demo import ensure_demo_data

    demo = DataConfig()
    demo_paths = {Path(p).resolve() for p in (*demo.train, *demo.val, demo.tokenizer)}
    needed = [Path(p) for p in (*cfg.data.train, *cfg.data.val, cfg.data.tokenizer)]
    missing = [p for p in needed if not p.exists()]
    if not missing or any(p.resolve() not in demo_paths for p in missing):
        return
    root = Path(demo.tokenizer).parent  # data/demo holds tokenizer/, train/ and val/
    print(f"[data] building the procedural demo dataset and tokenizer into {root}/ (first use, offline)", flush=True)
    with file_lock(root.parent / f".{root.name}.lock"):
        ensure_demo_data(root, image_token_count=image_token_count(cfg.model))


def build_loggers(cfg: Config, resume_step: int = 0) -> list[Any]:
    """CSV (``<run_dir>/csv/metrics.csv``, continued from ``resume_step`` on resume), plus TensorBoard
    (``<run_dir>/tb``) when it is installed."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if cfg.trainer.logger == "none":
        return []
    loggers: list[Any] = [MetricsCSV(cfg.trainer.run_dir, resume_step)]
    try:
        import tensorboard  # noqa: F401

        has_tb = True
    except ImportError:
        has_tb = False
    if cfg.trainer.logger == "tensorboard" and not has_tb:
        raise RuntimeError("trainer.logger=tensorboard needs the tensorboard package: pip install tensorboard")
    if has_tb:
        loggers.append(TensorBoardLogger(cfg.trainer.run_dir, name="", version="tb"))
    return loggers


def build_trainer(
    cfg: Config, config_files: list[str] | None = None, resume_step: int = 0
) -> tuple[pl.Trainer, PeriodicCheckpoint, Telemetry]:
    """The Lightning Trainer for ``cfg`` with the project's callbacks (in the order they must run);
    ``resume_step``: the step a resumed run continues from (its logs are kept up to there)."""
    t = cfg.trainer
    ckpt = PeriodicCheckpoint(
        checkpoint_dir(cfg), cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last, t.stop_at_step, t.val_every_n_steps
    )
    telemetry = Telemetry(cfg)
    callbacks: list[pl.Callback] = [
        StartSummary(cfg, config_files or []),
        DataProgress(t.run_dir, t.accumulate_grad_batches),  # before the checkpoint callback (see callbacks.py)
        telemetry,
        ckpt,
    ]
    if t.progress_bar:
        from lightning.pytorch.callbacks import TQDMProgressBar

        callbacks.append(TQDMProgressBar(refresh_rate=max(1, min(10, t.log_every_n_steps))))
    accum = t.accumulate_grad_batches
    # The training stream is infinite: periodic validation is scheduled in micro-batches; the final one is run
    # by ``train`` after fit (see there).
    has_val = bool(cfg.data.val) and t.val_batches != 0
    periodic_val = has_val and t.val_every_n_steps > 0
    plugins: list[Any] = [AtomicCheckpointIO()]
    if "SLURM_NTASKS" in os.environ:
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=False))  # preemption is handled by PeriodicCheckpoint
    devices, num_nodes = strategies.launcher_topology(t.devices, t.num_nodes)
    trainer = pl.Trainer(
        accelerator=strategies.resolve_accelerator(t),
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategies.build_strategy(t, cfg.checkpoint),
        precision=strategies.resolve_precision(t),
        max_steps=t.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=accum,
        gradient_clip_val=cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else None,
        val_check_interval=t.val_every_n_steps * accum if periodic_val else None,
        check_val_every_n_epoch=None,
        limit_val_batches=(t.val_batches if t.val_batches > 0 else 1.0) if has_val else 0,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        logger=build_loggers(cfg, resume_step) or False,
        enable_checkpointing=True,  # PeriodicCheckpoint (a Checkpoint: Lightning adds no default one, and runs it last)
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the DataModule splits the data over ranks itself
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=t.run_dir,
    )
    return trainer, ckpt, telemetry


def resumed_finished(resume: Path | None, t: Any) -> bool:
    """True when the run resumed from the checkpoint of its last step (nothing was trained in this call)."""
    return resume is not None and resume.name == f"step-{t.max_steps:08d}.ckpt"


def quiet_known_warnings() -> None:
    """Warnings that do not apply to this template (validation loss is all-reduced by the module itself)."""
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")


def train(
    cfg: Config,
    config_files: list[str] | None = None,
    datamodule: pl.LightningDataModule | None = None,
    module: VLMModule | None = None,
) -> TrainResult:
    """Train (or resume) the run described by ``cfg``; evaluate at the end when ``trainer.eval_at_end``."""
    quiet_known_warnings()
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    ensure_data(cfg)
    if datamodule is None:
        from nanovlm.data.datamodule import PackedMultimodalDataModule

        datamodule = PackedMultimodalDataModule(cfg.data, cfg.model)
    if module is None:
        module = VLMModule(cfg, datamodule.tokenizer)
    resume = resolve_resume(cfg)
    check_resume_strategy(resume, cfg.trainer.strategy)
    resume_step = checkpoint_step(resume) if resume is not None else 0
    check_no_later_checkpoints(cfg, resume, resume_step)
    trainer, ckpt, telemetry = build_trainer(cfg, config_files, resume_step)
    if global_rank_from_env() == 0:
        save_config(cfg, cfg.trainer.run_dir)
        if resume is not None:
            print(f"[resume] from {resume}", flush=True)
            if resume_step >= cfg.trainer.max_steps:
                print(
                    f"[resume] the checkpoint is at step {resume_step}, trainer.max_steps={cfg.trainer.max_steps}: "
                    "nothing left to train (raise trainer.max_steps to continue)",
                    flush=True,
                )
    if resume is not None:
        check_checkpoint_fits(resume, module.state_dict())
    elif cfg.checkpoint.init_from:  # a new stage: weights only, before the model is sharded or wrapped
        load_weights(cfg.checkpoint.init_from, module)
        if global_rank_from_env() == 0:
            print(f"[init] model weights from {cfg.checkpoint.init_from} (new optimizer, step 0)", flush=True)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    t = cfg.trainer
    finished = not ckpt.preempted and trainer.global_step >= t.max_steps
    validated_last = t.val_every_n_steps > 0 and t.max_steps % t.val_every_n_steps == 0
    if finished and cfg.data.val and t.val_batches != 0 and not validated_last and not resumed_finished(resume, t):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    result = TrainResult(
        run_dir=Path(cfg.trainer.run_dir),
        global_step=trainer.global_step,
        preempted=ckpt.preempted,
        last_checkpoint=ckpt.last_saved,
        resumed_from=resume,
        stopped_by_signal=ckpt.by_signal,
        telemetry=telemetry.history,
    )
    if t.eval_at_end and finished:
        from nanovlm.train.evaluate import evaluate_at_end

        result.eval = evaluate_at_end(cfg, module, datamodule, trainer)
    return result
