"""Checkpoint files: atomic writes, safe loads, periodic saving with keep-last-N, resume, preemption.

A checkpoint is Lightning's checkpoint dict (model, optimizer, loop progress incl. the step, callbacks), plus
the DataModule state of every rank (saved by Lightning from ``datamodule.state_dict()``) and the RNG states
of every rank (``VLMModule.on_save_checkpoint``). The learning rate is a pure function of the step, so no
scheduler state is needed. Checkpoints are named ``step-00000200.ckpt`` in ``checkpoint.dir``: a file, or with
``checkpoint.format=sharded`` a directory of per-rank shards (``sharded.py``); every reader here takes both.

Atomicity: the file is written to ``<name>.tmp`` in the same directory, fsynced, then ``os.replace``d over the
final name and the directory fsynced, so a crash (or ``kill -9``) mid-save leaves the previous checkpoints
intact and never a truncated ``.ckpt``. Loading uses ``torch.load(weights_only=True)``: a checkpoint can
never execute code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from nanovlm.config import Config
from nanovlm.dist import any_rank
from nanovlm.train import sharded

log = logging.getLogger(__name__)

CKPT_RE = re.compile(r"^step-(\d+)\.ckpt$")


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.trainer.run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint: from its name when it is ``step-N.ckpt``, else read from the file."""
    if m := CKPT_RE.match(Path(path).name):
        return int(m.group(1))
    ckpt = (
        sharded.read_meta(path) if sharded.is_sharded(path) else torch.load(path, "cpu", weights_only=True, mmap=True)
    )
    return int(ckpt.get("global_step", 0))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A complete checkpoint of either format (a save in progress is a ``.tmp`` beside it)."""
    return Path(path).is_file() or sharded.is_sharded(path)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``directory``, oldest first (temp files are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / p.name) for p in d.iterdir() if (m := CKPT_RE.match(p.name)) and is_checkpoint(p)]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(directory)
    return ckpts[-1][1] if ckpts else None


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint to resume from: ``auto`` = newest in the checkpoint dir (None if empty), ``none`` = None,
    anything else is a path that must exist."""
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    if mode == "auto":
        return latest_checkpoint(checkpoint_dir(cfg))
    path = Path(mode)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"checkpoint.resume={mode!r}: no such checkpoint (file or sharded directory)")
    return path


def check_resume_strategy(path: Path | None, strategy: str) -> None:
    """A sharded checkpoint holds FSDP shards and a name-keyed sharded optimizer state: only FSDP resumes it."""
    if path is not None and sharded.is_sharded(path) and strategy != "fsdp":
        raise CheckpointModelMismatchError(
            f"{path} is a sharded checkpoint (checkpoint.format=sharded): resume it with trainer.strategy=fsdp (on "
            "any number of processes), or start a new run from its weights with checkpoint.init_from"
        )


class RunDirConflictError(RuntimeError):
    """The run directory holds checkpoints of a later step than the run starts from (another run's)."""


def check_no_later_checkpoints(cfg: Config, resume: Path | None, start: int) -> None:
    """Refuse to start (fresh, or from an explicit older checkpoint ``resume`` at step ``start``) next to
    checkpoints of later steps.

    They belong to another run: keep-last-N would delete the new run's checkpoints first (theirs have the
    higher steps), and a later ``checkpoint.resume=auto`` would pick theirs up.
    """
    directory = checkpoint_dir(cfg)
    later = [step for step, _ in list_checkpoints(directory) if step > start]
    if later:
        how = "starts over (checkpoint.resume=none)" if resume is None else f"starts from step {start} ({resume})"
        raise RunDirConflictError(
            f"{directory} holds checkpoints of steps {later[0]}..{later[-1]} from an earlier run, and this run {how}: "
            "the two runs would mix (keep-last cleanup would delete the new run's checkpoints first). Use another "
            "trainer.run_dir (an explicit checkpoint.resume path may point into this one), or delete those "
            "checkpoints to start over here."
        )


class CheckpointModelMismatchError(RuntimeError):
    """The checkpoint's model tensors do not fit the model this run builds."""


def check_model_tensors(saved: dict[str, Any], expected: dict[str, Any], shown: int = 4) -> None:
    """Raise one readable error when a checkpoint's model tensors differ from the model's in names or shapes.

    Torch's own error lists every key of every layer; this names a few and says what usually causes it: a
    changed ``model.*`` config.
    """
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    if not (missing or extra or shapes):
        return
    parts = []
    for what, items in (("missing", missing), ("not in this model", extra), ("of another shape", shapes)):
        if items:
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            parts.append(f"{len(items)} tensor(s) {what}: {', '.join(items[:shown])}{more}")
    raise CheckpointModelMismatchError(
        f"the checkpoint does not fit this model ({'; '.join(parts)}): the model.* config differs from the one it "
        "was trained with (compare with the run's config.yaml). Resume with the config and code "
        "that wrote it, or start a new trainer.run_dir (or set checkpoint.resume=none)."
    )


def check_checkpoint_fits(path: Path, expected: dict[str, Any]) -> None:
    """Check the model tensors of the checkpoint to resume from against the model, before training starts.

    One place for every strategy (Lightning's DDP/single path and ModelParallelStrategy load the weights at
    different points). Only names and shapes are read (the file is memory-mapped; a sharded checkpoint's come from
    its metadata). A checkpoint torch cannot read is left to the real load, which reports it.
    """
    try:
        if sharded.is_sharded(path):
            saved: dict[str, Any] = {k: torch.empty(s, device="meta") for k, s in sharded.weight_shapes(path).items()}
        else:
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("state_dict") or {}
    except Exception:
        return
    if saved:
        check_model_tensors(saved, expected)


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint of either format, on the CPU ({} when it holds none)."""
    if sharded.is_sharded(path):
        return sharded.read_sharded_weights(path)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("state_dict") or {}


def load_weights(path: str | Path, module: torch.nn.Module) -> None:
    """``checkpoint.init_from``: the model weights of a checkpoint file into ``module`` (nothing else: no
    optimizer state, step or data position), after the same fit check as a resume."""
    path = Path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"checkpoint.init_from={str(path)!r}: no such checkpoint (file or sharded directory)")
    saved = read_weights(path)
    if not saved:
        raise CheckpointModelMismatchError(f"checkpoint.init_from={str(path)!r} holds no model weights (state_dict)")
    check_model_tensors(saved, module.state_dict())
    module.load_state_dict(saved)


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions, ...). Earlier checkpoints are untouched."""


class AtomicCheckpointIO(CheckpointIO):
    """torch.save to a temp file + fsync + os.replace; torch.load with weights_only=True."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except (OSError, RuntimeError) as e:
            if tmp.is_file():
                tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {e}. Earlier checkpoints in {path.parent} are kept."
            ) from e

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = True
    ) -> Any:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        # Never fall back to unsafe unpickling: a checkpoint that needs it is refused with torch's message.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        Path(path).unlink(missing_ok=True)


class PeriodicCheckpoint(Checkpoint):
    """Save every ``every_n_steps`` optimizer steps and at the end, keep the newest ``keep_last``, and save then
    stop cleanly on SIGTERM / SIGUSR1 (SLURM preemption, ``kill``, ``scancel``), with or without SLURM.

    Lightning's own SIGTERM handling raises out of the loop without saving, so this callback replaces the
    handlers once training starts: the handler only sets a flag; at the next optimizer-step boundary all ranks
    agree on it (one all-reduce), save a checkpoint and stop.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every_n_steps: int,
        keep_last: int,
        stop_at_step: int = 0,
        val_every_n_steps: int = 0,
    ) -> None:
        self.dir = Path(directory)
        self.stop_at_step = stop_at_step  # behave as if a signal arrived at this step (0 = never)
        self.val_every_n_steps = val_every_n_steps  # the validation schedule (0 = at the end only)
        self.every_n_steps = every_n_steps
        self.keep_last = max(1, keep_last)
        self.preempted = False  # set when training stopped early: a signal, or trainer.stop_at_step
        self.by_signal = False  # ... and it was a signal (on any rank)
        self.last_saved: Path | None = None
        self.last_saved_step = -1
        self._signal_received = False
        self._last_step = -1
        self._old_handlers: dict[int, Any] = {}

    # -- signals --------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_received = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            with contextlib.suppress(ValueError):  # not in the main thread: leave signals to Lightning
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    # -- saving ---------------------------------------------------------------------------------------------
    def save(self, trainer: pl.Trainer, wait: bool = False) -> Path:
        """Write ``step-<global_step>.ckpt`` (all ranks must call this), then prune old ones on rank 0. ``wait``:
        a save the strategy writes in the background (``checkpoint.async_save``) is finished before returning."""
        path = self.dir / checkpoint_name(trainer.global_step)
        trainer.save_checkpoint(path, weights_only=False)
        finish = getattr(trainer.strategy, "finish_checkpoint", None)
        if wait and finish is not None:
            finish()
        self.last_saved, self.last_saved_step = path, trainer.global_step
        if trainer.is_global_zero:
            for _, old in list_checkpoints(self.dir)[: -self.keep_last]:
                sharded.remove(old)
        return path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # inside a gradient-accumulation window: not a step boundary
            return
        self._last_step = step
        signalled = any_rank(self._signal_received, pl_module.device)  # on any rank: the same answer on all
        if (signalled or step == self.stop_at_step) and step < trainer.max_steps:
            path = self.save(trainer, wait=True)
            self.preempted, self.by_signal = True, signalled
            trainer.should_stop = True
            # Lightning validates when a run stops early: an unscheduled validation that a preempted run pays for in
            # grace time, so it is skipped. One scheduled at this very step runs: the resumed run would count it
            # as done (Lightning restores the loop past it) and it would be lost. Same decision on every rank.
            if not (self.val_every_n_steps > 0 and step % self.val_every_n_steps == 0):
                trainer.limit_val_batches = 0
            if trainer.is_global_zero:
                why = "signal received" if signalled else "trainer.stop_at_step reached"
                print(f"[checkpoint] {why}: saved {path} at step {step}; stopping (rerun to resume)", flush=True)
            return
        if self.every_n_steps > 0 and step % self.every_n_steps == 0 and step < trainer.max_steps:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_signals()
        if self.preempted or trainer.global_step == 0:
            return
        if self.last_saved_step != trainer.global_step:  # same decision on every rank (no filesystem check)
            self.save(trainer, wait=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_signals()
