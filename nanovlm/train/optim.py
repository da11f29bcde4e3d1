"""Optimizer parameter groups, freezing, and the learning-rate schedule.

The schedule is a pure function of the optimizer step (``lr_factor``). The training module sets each group's
learning rate from ``trainer.global_step`` right before every optimizer step, so there is no scheduler state
that could drift on resume: the step restored from a checkpoint fully determines the learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nanovlm.config import OptimConfig

PARTS = ("vision", "projector", "language")


def part_of(name: str) -> str:
    """The model part a parameter belongs to, from its qualified name ('language.layers.0.attn.q.weight')."""
    head = name.split(".", 1)[0]
    return head if head in PARTS else "language"  # anything outside the three parts trains with the decoder


def apply_freezing(model: nn.Module, cfg: OptimConfig) -> dict[str, bool]:
    """Set ``requires_grad=False`` on the parts the config freezes. Returns {part: frozen}."""
    frozen = {"vision": cfg.freeze_vision, "projector": cfg.freeze_projector, "language": cfg.freeze_language}
    for name, p in model.named_parameters():
        if frozen[part_of(name)]:
            p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "optim.freeze_vision/freeze_projector/freeze_language freeze the whole model: nothing to train"
        )
    return frozen


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm weights, biases and embedding tables get no weight decay (nanoGPT / Llama convention)."""
    return p.ndim < 2 or "embed" in name or "norm" in name


def peak_lrs(cfg: OptimConfig) -> dict[str, float]:
    """Peak learning rate of each part (0 in the config means 'same as optim.lr')."""
    return {"vision": cfg.vision_lr or cfg.lr, "projector": cfg.projector_lr or cfg.lr, "language": cfg.lr}


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW groups: one per (part, decay/no-decay) with trainable parameters.

    Each group carries ``name`` and ``peak_lr``; ``lr`` is set from the schedule before every step.
    """
    lrs = peak_lrs(cfg)
    buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        buckets.setdefault((part_of(name), _no_decay(name, p)), []).append(p)
    groups = []
    for part in PARTS:
        for no_decay in (False, True):
            params = buckets.get((part, no_decay))
            if params:
                groups.append(
                    {
                        "params": params,
                        "name": f"{part}{'_no_decay' if no_decay else ''}",
                        "peak_lr": lrs[part],
                        "lr": lrs[part],
                        "weight_decay": 0.0 if no_decay else cfg.weight_decay,
                    }
                )
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (fused kernels on CUDA when every parameter is on the GPU)."""
    groups = param_groups(model, cfg)
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, betas=tuple(cfg.betas), eps=cfg.eps, fused=on_cuda or None)


@dataclass
class Schedule:
    """Linear warmup to 1.0, then cosine / linear decay to ``min_lr_ratio`` at ``max_steps`` (or constant)."""

    kind: str
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    @classmethod
    def from_config(cls, cfg: OptimConfig, max_steps: int) -> Schedule:
        return cls(cfg.schedule, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)

    def __call__(self, step: int) -> float:
        """Multiplier of the peak lr for optimizer step ``step`` (0-based: the step about to be taken)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif self.kind == "linear":
            shape = 1.0 - progress
        else:
            raise ValueError(f"unknown optim.schedule {self.kind!r}; choose cosine, linear or constant")
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's lr to its ``peak_lr`` times ``factor``."""
    for g in optimizer.param_groups:
        g["lr"] = g["peak_lr"] * factor
