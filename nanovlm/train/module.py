"""The LightningModule: a thin wrapper that turns the plain ``NanoVLM`` into a trainable, resumable unit.

What lives here (and only here): the loss step, AdamW with per-part groups and freezing, the lr schedule
(set from ``global_step`` before every optimizer step), gradient-norm clipping, validation loss, FSDP2 /
activation checkpointing / compile in ``configure_model``, and the per-rank RNG states in checkpoints.
"""

from __future__ import annotations

import inspect
import logging
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from nanovlm.config import Config
from nanovlm.dist import all_gather_object, all_reduce_sum, rank_world
from nanovlm.model import build_model
from nanovlm.train import optim, strategies

log = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` accepts (tensors, lists, ints)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_state_by_name(state: dict[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
    """``optimizer.state_dict()`` keyed by parameter name instead of by position, as FSDP2 writes it.

    Lightning's FSDP2 loader re-keys a position-keyed state by the *model's* parameter order, but the optimizer's
    groups (vision / projector / language, with and without weight decay) order the parameters otherwise, so a
    checkpoint written by one process or DDP failed to resume under FSDP2 (shape mismatch). Name-keyed, it
    loads under every strategy: ``Optimizer.load_state_dict`` pairs the keys with its parameters by position.
    An already name-keyed state (FSDP2's own) or an empty one (FSDP2 on ranks > 0) is returned as is.
    """
    saved_ids = [i for g in state.get("param_groups", ()) for i in g["params"]]
    if not saved_ids or not isinstance(saved_ids[0], int):
        return state
    params = [p for g in optimizer.param_groups for p in g["params"]]
    name = {i: names[id(p)] for i, p in zip(saved_ids, params)}
    return {
        "state": {name[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def warn_on_other_chat_format(checkpoint: str, chat_format: str) -> None:
    """Fine-tuning an instruct checkpoint in another chat format than it was tuned with is allowed (it relearns
    the framing) but rarely meant: say so once, at the start."""
    from nanovlm.model.pretrained import checkpoint_chat_format

    theirs = checkpoint_chat_format(checkpoint)
    if theirs is not None and theirs != chat_format:
        log.warning(
            "%s was tuned with the %s chat format but data.chat_format=%s: training teaches it another framing of "
            "turns (set data.chat_format=%s to keep its own, and prepare the data with that config)",
            checkpoint,
            theirs,
            chat_format,
            theirs,
        )


class VLMModule(pl.LightningModule):
    """Wraps ``NanoVLM`` for Lightning. ``model`` may be passed in (tests, custom projects); otherwise it is
    built from ``cfg.model`` and ``tokenizer``."""

    def __init__(self, cfg: Config, tokenizer: Any = None, model: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = model if model is not None else build_model(cfg.model, tokenizer)
        if model is None and cfg.model.vlm_checkpoint:
            warn_on_other_chat_format(cfg.model.vlm_checkpoint, cfg.data.chat_format)
        optim.apply_freezing(self.model, cfg.optim)
        # NanoVLM runs the LM head only where a loss is taken; a custom model without that option still works
        self.head_on_loss_positions = "return_logits" in inspect.signature(self.model.forward).parameters
        self.schedule = optim.Schedule.from_config(cfg.optim, cfg.trainer.max_steps)
        self.last_loss: torch.Tensor | None = None  # loss of the latest micro-batch (for telemetry / steps.jsonl)
        self.last_grad_norm: float | None = None
        self._configured = False
        self._val_sum: torch.Tensor | None = None
        self._val_tokens: torch.Tensor | None = None

    # -- model setup (called by Lightning once processes and devices exist) ----------------------------------
    def configure_model(self) -> None:
        if self._configured:
            return
        self._configured = True
        tcfg = self.cfg.trainer
        if tcfg.activation_checkpointing:
            strategies.apply_activation_checkpointing(self.model)
        if tcfg.compile == "blocks":
            strategies.apply_compile(self.model)
        elif tcfg.compile == "step":
            device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
            strategies.compile_step(self.model, device)
        if tcfg.strategy == "fsdp":
            device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
            strategies.shard_model(self.model, self.trainer.precision, device)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optim.build_optimizer(self.model, self.cfg.optim)

    # -- training ---------------------------------------------------------------------------------------------
    def _loss_forward(self, batch: dict) -> dict:
        return self.model(batch, return_logits=False) if self.head_on_loss_positions else self.model(batch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.cfg.trainer.compile == "step":
            torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graphs may reuse the last one's outputs
        out = self._loss_forward(batch)
        loss = out["loss"]
        self.last_loss = loss.detach().clone()  # a copy: a CUDA graph's next replay overwrites its outputs
        self.log("loss", self.last_loss, prog_bar=True, logger=False)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The lr of the step about to be taken is a pure function of the step count: exact after resume.
        optim.set_lr(optimizer, self.schedule(self.trainer.global_step))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip the global gradient norm to ``optim.grad_clip`` (0 = no clipping) and remember the norm."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        self.last_grad_norm = float(norm)

    # -- validation -------------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_tokens = torch.zeros((), dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self._loss_forward(batch)
        n = out["n_loss_tokens"].to(torch.float64)
        self._val_sum += out["loss"].detach().to(torch.float64) * n
        self._val_tokens += n

    def on_validation_epoch_end(self) -> None:
        """Token-weighted mean loss over all ranks' validation packs."""
        totals = torch.stack([self._val_sum, self._val_tokens])
        all_reduce_sum(totals)
        if totals[1] > 0:
            val_loss = (totals[0] / totals[1]).float()
            self.log("val_loss", val_loss, prog_bar=True, logger=False, sync_dist=False)
            if self.trainer.is_global_zero:
                for logger in self.trainer.loggers:
                    logger.log_metrics({"val/loss": float(val_loss)}, step=self.trainer.global_step)
                print(
                    f"[val] step {self.trainer.global_step}: val/loss {val_loss.item():.4f} over {int(totals[1])} tokens"
                )

    # -- checkpoint extras ------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the RNG states of every rank (a collective: Lightning calls this on all ranks), and key the
        optimizer state by parameter name (see ``optimizer_state_by_name``)."""
        optimizers = self.trainer.optimizers if self._trainer is not None else []
        states = checkpoint.get("optimizer_states") or []
        if len(states) == len(optimizers):
            names = {id(p): n for n, p in self.named_parameters()}
            checkpoint["optimizer_states"] = [optimizer_state_by_name(s, o, names) for s, o in zip(states, optimizers)]
        checkpoint["rng_states"] = all_gather_object(_rng_state())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("rng_states")
        if not states:
            return
        rank, world = rank_world()
        if len(states) == world:
            _set_rng_state(states[rank])
        elif rank == 0:
            print(f"[resume] checkpoint has RNG states of {len(states)} ranks, this run has {world}: RNG not restored")
