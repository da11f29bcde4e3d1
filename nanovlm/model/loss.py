"""The LM head and cross-entropy in one chunked pass: [N, vocab] logits never exist whole.

With a 49K vocabulary, fp32 logits of 8,192 loss rows are 1.6 GB, and autograd keeps them (and their softmax)
for the backward. ``chunked_linear_cross_entropy`` computes the head, the loss and both gradients chunk by
chunk in the forward (the gradient of a sum of cross-entropies is known once the softmax is: p - onehot), so
the peak extra memory is one [chunk, vocab] fp32 block, and the backward only scales the stored gradients.
The result equals ``F.cross_entropy(hidden @ weight.T, target, reduction="sum")`` up to float summation order.

On CUDA, Liger's fused linear cross-entropy (``pip install -e .[liger]``, Triton kernels) does the same in fewer
launches and without the Python loop over chunks; ``model.loss_kernel`` picks it (``auto``: Liger when it
imports and the tensors are on CUDA, else the PyTorch path above). It is imported lazily: it has no CPU build.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from nanovlm.constants import IGNORE_INDEX, LOSS_KERNELS

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


@functools.cache
def _liger_loss() -> torch.nn.Module | str:
    """Liger's fused loss module (sum over rows, IGNORE_INDEX ignored), or why it cannot be imported."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # ImportError, or triton failing to import on a machine without CUDA
        return f"liger_kernel is not importable ({type(e).__name__}: {e}); pip install -e .[liger]"
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def resolve_loss_kernel(name: str, device: torch.device) -> str:
    """``model.loss_kernel`` -> ``torch`` | ``liger`` for tensors on ``device``; asking for Liger where it cannot
    run fails with the reason (``auto`` then takes the PyTorch path, also inside ``torch.compile``)."""
    if name not in LOSS_KERNELS:
        raise ValueError(f"unknown loss kernel {name!r}; choose one of {LOSS_KERNELS}")
    problem = "Liger's kernels need CUDA tensors" if device.type != "cuda" else None
    if name == "auto" and torch.compiler.is_compiling():  # not verified inside a compiled graph: keep it out
        problem = "inside a compiled step"
    if problem is None and name != "torch" and isinstance(_liger_loss(), str):
        problem = _liger_loss()
    if name == "liger" and problem:
        raise RuntimeError(f"model.loss_kernel=liger cannot run here: {problem} (model.loss_kernel=auto falls back)")
    chosen = "liger" if name != "torch" and problem is None else "torch"
    if (name, chosen) not in _logged and not torch.compiler.is_compiling():
        _logged.add((name, chosen))
        log.info("loss kernel: %s (requested %s, %s)", chosen, name, device.type)
    return chosen


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int) -> torch.Tensor:
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if needs_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk):
            h, t = hidden[lo : lo + chunk], target[lo : lo + chunk]
            logits = (h @ weight.T).float()  # [c, V]: the only vocabulary-sized block alive
            keep = t != IGNORE_INDEX
            safe = torch.where(keep, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, safe[:, None]).squeeze(1)) * keep).sum()
            if needs_h or needs_w:
                g = torch.softmax(logits, dim=-1)  # d(sum CE)/d logits = softmax - onehot, 0 on ignored rows
                g[torch.arange(len(t), device=g.device), safe] -= 1.0
                g *= keep[:, None]
                if needs_h:
                    grad_h[lo : lo + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
                if needs_w:
                    grad_w += g.T @ h.float()
        ctx.save_for_backward(grad_h if needs_h else None, grad_w if needs_w else None)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int = 0, kernel: str = "torch"
) -> torch.Tensor:
    """Sum of the cross-entropies of ``hidden @ weight.T`` [N, V] against ``target`` [N] (``IGNORE_INDEX`` rows
    count 0). ``kernel`` (resolved, see ``resolve_loss_kernel``) ``liger``: Liger's fused kernel. ``torch``:
    ``chunk`` > 0, at most ``chunk`` rows of logits at a time (see the module docstring); 0, the plain head +
    ``F.cross_entropy`` (fp32 logits of all N rows)."""
    if kernel == "liger":
        return _liger_loss()(weight, hidden, target)  # its argument order: (weight, input, target)
    if chunk <= 0:
        logits = hidden @ weight.T
        return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return _ChunkedLinearCE.apply(hidden, weight, target, chunk)
