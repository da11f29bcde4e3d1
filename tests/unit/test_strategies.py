"""Activation checkpointing and ``trainer.compile=blocks`` keep parameter names (so checkpoints) and the eager numbers."""

from __future__ import annotations

import pytest
import torch
from helpers.training import synthetic_batch, tiny_cfg, tiny_model


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
    """``trainer.compile=blocks``: each block is compiled in place; names (so checkpoints) and the packed loss and
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
