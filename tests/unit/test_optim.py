"""Optimizer parameter groups (per part, no decay on norms / biases / embeddings), freezing, lr schedule."""

from __future__ import annotations

import math

import pytest
from helpers.training import tiny_cfg, tiny_model

from nanovlm.train import optim


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
