"""The chunked LM head + cross-entropy (``model/loss.py``): the same loss and gradients as the plain head,
whatever the chunk size, with ignored rows, a tied head, and through the model's training forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovlm.constants import IGNORE_INDEX
from nanovlm.model.loss import linear_cross_entropy


def _grads(fn, hidden, weight, target):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, target)
    (loss * 0.37).backward()  # a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_chunked_equals_plain_loss_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    target = torch.randint(0, 50, (23,), generator=g)
    target[[2, 9, 10]] = IGNORE_INDEX

    def plain(h, w, t):
        return F.cross_entropy((h @ w.T).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    want = _grads(plain, hidden, weight, target)
    got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk), hidden, weight, target)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[1][[2, 9, 10]].abs().max() == 0  # ignored rows get no gradient


def test_no_rows_gives_zero_loss_with_a_graph():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long), 4)
    loss.backward()
    assert loss.item() == 0 and weight.grad.abs().max() == 0


def test_model_training_forward_chunked_equals_plain(tmp_path):
    """The whole model (tied head): loss and every parameter's gradient are the same with model.loss_chunk_rows."""
    from helpers.training import synthetic_batch, tiny_cfg, tiny_model

    results = []
    for extra in ((), ("model.loss_chunk_rows=2",)):
        cfg = tiny_cfg(tmp_path, *extra)
        model = tiny_model(cfg)
        out = model(synthetic_batch(3, cfg), return_logits=False)
        out["loss"].backward()
        results.append((out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a > 0
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_keeps_no_vocabulary_sized_activation_for_backward():
    """What autograd keeps: the plain head saves the [N, vocab] logits; the chunked one only [N, hidden] and
    [vocab, hidden] gradients."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 8, generator=g, requires_grad=True)
    weight = torch.randn(500, 8, generator=g, requires_grad=True)
    target = torch.randint(0, 500, (64,), generator=g)
    saved: dict[int, list[int]] = {}
    for chunk in (0, 16):
        sizes = saved.setdefault(chunk, [])
        with torch.autograd.graph.saved_tensors_hooks(lambda t, s=sizes: s.append(t.numel()) or t, lambda t: t):
            linear_cross_entropy(hidden, weight, target, chunk)
    assert max(saved[0]) >= 64 * 500
    assert max(saved[16]) <= 500 * 8


def test_loss_kernel_resolution_on_this_machine():
    """``auto`` takes the PyTorch path without CUDA (or without liger_kernel); ``liger`` says why it cannot run."""
    from nanovlm.model.loss import resolve_loss_kernel

    assert resolve_loss_kernel("auto", torch.device("cpu")) == "torch"
    assert resolve_loss_kernel("torch", torch.device("cuda")) == "torch"
    with pytest.raises(RuntimeError, match="loss_kernel=liger cannot run here: Liger's kernels need CUDA"):
        resolve_loss_kernel("liger", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown loss kernel"):
        resolve_loss_kernel("fused", torch.device("cpu"))


def test_liger_is_called_with_its_argument_order_and_a_summed_loss(monkeypatch):
    """The wiring to Liger's module, checked on CPU with a stand-in that has its signature (weight, input,
    target) and computes the reference loss: swapped arguments would fail.
    Liger's kernel itself is compared with the plain head in integration/test_gpu.py."""
    import nanovlm.model.loss as loss_mod

    class StandIn(torch.nn.Module):
        def forward(self, lin_weight, _input, target):
            return F.cross_entropy(_input @ lin_weight.T, target, ignore_index=IGNORE_INDEX, reduction="sum")

    monkeypatch.setattr(loss_mod, "_liger_loss", lambda: StandIn())
    assert loss_mod.resolve_loss_kernel("auto", torch.device("cuda")) == "liger"  # CUDA + importable
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g)
    target = torch.tensor([1, 2, IGNORE_INDEX, 4, 10, 0])
    want = linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, target, kernel="liger"), want)
