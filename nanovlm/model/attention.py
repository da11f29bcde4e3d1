"""Varlen attention: one entry point for packed (THD) sequences, three backends.

A packed batch concatenates N samples into one sequence of T tokens. ``cu_seqlens`` (int32, [N+1]) holds
the segment boundaries, and attention must stay inside each segment: a token never sees another sample.
Tensors use the THD layout of flash-attn: ``q`` is [T, Hq, D], ``k`` and ``v`` are [T, Hkv, D] with Hkv
dividing Hq (grouped-query attention: query head h reads kv head h // (Hq / Hkv), as in Llama).

Backends (``model.attn_backend``):

- ``flash_attn``   ``flash_attn.flash_attn_varlen_func``: CUDA, bf16/fp16, optional extra (``pip install flash-attn``).
- ``torch_varlen`` ``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10): CUDA, bf16/fp16, no extra package.
- ``sdpa``         ``F.scaled_dot_product_attention`` run once per segment: any device and dtype; the CPU path and
                   the fp32 reference the GPU kernels are tested against.
- ``auto``         flash_attn, else torch_varlen, for CUDA bf16/fp16; sdpa otherwise. The choice is logged once.
                   Segments that all have the same length (the images of the vision encoder, a pack of one
                   sample) go to one batched SDPA call instead: on an H200 (torch 2.11, bf16, fwd + bwd) that
                   took 0.67 ms vs 1.15 ms for torch_varlen on 16 images x 1024 patches, 0.69 vs 1.10 ms on
                   64 x 196, while for 8 / 64 ragged segments of an 8192-token pack torch_varlen took
                   0.91 / 0.92 ms vs 3.5 / 26.8 ms for the sdpa loop.

Why the sdpa backend loops over segments instead of one call with a block-diagonal mask: a [T, T] mask makes
SDPA compute all T^2 scores, while the per-segment loop
computes sum(L_i^2) with the fused causal kernel. Measured on 2 shared CPU cores, fp32, causal, 6 heads x 32
dims, packs of 1024 tokens, forward + backward: mask 54 / 53 / 46 / 49 ms vs loop 28 / 20 / 14 / 22 ms for
2 / 4 / 8 / 32 segments, and the mask needs O(T^2) memory, so only the loop is kept.
When all segments have the same length (the images of the vision encoder, a single sample) they run as one
batched call with no loop at all.

Static packs (``data.static_shapes``, for a compiled step) need attention whose graph does not depend on the
segment lengths. flash_attn and torch_varlen take them as data already; on CPU the ``sdpa_masked`` kernel runs one
SDPA call with a [T, T] same-segment causal mask (O(T^2) memory, so only where a static graph is wanted).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from nanovlm.constants import BACKENDS

log = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


class BackendUnavailableError(RuntimeError):
    """The requested attention backend cannot run here; the message says why and how to fix it."""


# ----------------------------------------------------------------------------------------------------------
# availability


@cache
def _flash_attn_import_error() -> str | None:
    """None when ``flash_attn`` imports, else the import error (imported lazily: it is an optional extra)."""
    try:
        importlib.import_module("flash_attn")
    except Exception as e:  # ImportError, or an ABI mismatch raising OSError/RuntimeError at import
        return f"{type(e).__name__}: {e}"
    return None


@cache
def _torch_varlen_fn():
    """``torch.nn.attention.varlen.varlen_attn`` or None when this PyTorch lacks it (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _unavailable_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why backend ``name`` cannot run on (device, dtype), with the fix; None when it can."""
    if name == "sdpa":
        return None
    fix = "set model.attn_backend=sdpa (or auto)"
    if device.type != "cuda":
        return f"{name} needs a CUDA device but the tensors are on {device.type}; {fix}"
    if dtype not in _HALF:
        return f"{name} supports only bf16/fp16 but got {dtype}; train with trainer.precision=bf16-mixed, or {fix}"
    if name == "flash_attn":
        err = _flash_attn_import_error()
        if err is not None:
            return f"flash_attn is not importable ({err}); install it with `pip install flash-attn --no-build-isolation` (or `pip install -e .[flash]`), or {fix}"
    if name == "torch_varlen" and _torch_varlen_fn() is None:
        return f"torch.nn.attention.varlen is missing in torch {torch.__version__} (needs >= 2.10); upgrade torch, or {fix}"
    # Both kernels are FlashAttention (torch's varlen_attn calls aten::_flash_attention_forward): sm80 and up.
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"{name} needs an Ampere or newer GPU (compute capability >= 8.0, this one has {major}.{minor}); {fix}"
    return None


_logged: set[tuple[str, str, str, str]] = set()


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The concrete backend for ``name`` on (device, dtype). ``auto`` picks the fastest available.

    Logs the choice once per (name, device type, dtype). Raises BackendUnavailableError for an explicit backend
    that cannot run here, and ValueError for an unknown name.
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKENDS)}")
    if name == "auto":
        chosen = next(
            b for b in ("flash_attn", "torch_varlen", "sdpa") if _unavailable_reason(b, device, dtype) is None
        )
    else:
        reason = _unavailable_reason(name, device, dtype)
        if reason is not None:
            raise BackendUnavailableError(f"attention backend '{name}' is unavailable: {reason}")
        chosen = name
    key = (name, device.type, str(dtype), chosen)
    if key not in _logged and not torch.compiler.is_compiling():  # a log call would split a compiled graph
        _logged.add(key)
        log.info("attention backend: %s (requested %s, %s, %s)", chosen, name, device.type, dtype)
    return chosen


# ----------------------------------------------------------------------------------------------------------
# backends


def expand_kv(x: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """Repeat kv heads along ``dim`` so kv head j serves query heads j*g .. j*g+g-1 (g = num_heads / Hkv)."""
    groups = num_heads // x.shape[dim]
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _sdpa(q, k, v, cu_seqlens, max_seqlen, causal):
    total, heads, dim = q.shape
    k, v = expand_kv(k, heads, 1), expand_kv(v, heads, 1)
    n = cu_seqlens.numel() - 1
    if n * max_seqlen == total:  # every segment has length max_seqlen: one batched call [n, H, L, D]
        q4, k4, v4 = (t.view(n, max_seqlen, heads, dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
        return out.transpose(1, 2).reshape(total, heads, dim)
    return _sdpa_by_length(q, k, v, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), causal)


def _sdpa_by_length(q, k, v, lengths: list[int], causal: bool) -> torch.Tensor:
    """Per-segment SDPA with the segments grouped by length: one [n, H, L, D] call per distinct length.

    Packs of short samples hold many segments of few distinct lengths (templated prompts, short answers): on 2 CPU
    cores a pack of ~40 segments spent more time in per-segment call overhead than in attention. Tokens are
    gathered into length order once, attended, and put back; each segment still sees only itself."""
    total, heads, dim = q.shape
    starts = np.cumsum([0, *lengths[:-1]])
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(i)
    groups = sorted(by_length.items())
    order = np.concatenate([starts[i] + np.arange(n) for n, idx in groups for i in idx])
    perm = torch.from_numpy(order).to(q.device)  # [T'] token indices, grouped by segment length
    qs, ks, vs = (t.index_select(0, perm) for t in (q, k, v))
    outs, at = [], 0
    for n, idx in groups:
        size = n * len(idx)
        q4, k4, v4 = (t[at : at + size].view(len(idx), n, heads, dim).transpose(1, 2) for t in (qs, ks, vs))
        outs.append(
            F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal).transpose(1, 2).reshape(size, heads, dim)
        )
        at += size
    return q.new_zeros(total, heads, dim).index_copy(0, perm, torch.cat(outs, dim=0))


def _sdpa_masked(q, k, v, cu_seqlens, max_seqlen, causal):
    """One SDPA call over the whole row with a same-segment (and causal) mask: no lengths on the host."""
    total, heads, _ = q.shape
    pos = torch.arange(total, dtype=cu_seqlens.dtype, device=q.device)
    seg = torch.searchsorted(cu_seqlens, pos, right=True)  # [T] segment of each token (empty segments own none)
    mask = seg[:, None] == seg[None, :]  # [T, T] query x key
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    q4, k4, v4 = (expand_kv(t, heads, 1).transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T, D]
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
    return out[0].transpose(0, 1)


def _flash_attn(q, k, v, cu_seqlens, max_seqlen, causal):
    from flash_attn import flash_attn_varlen_func  # lazy: optional extra

    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal)


@cache
def _torch_varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal):
    fn, params = _torch_varlen_fn(), _torch_varlen_params()
    kwargs = {}
    # torch 2.10 takes is_causal=; later versions replaced it with window_size=(left, right), (-1, 0) = causal.
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = expand_kv(k, q.shape[1], 1), expand_kv(v, q.shape[1], 1)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


_IMPLS = {"sdpa": _sdpa, "sdpa_masked": _sdpa_masked, "flash_attn": _flash_attn, "torch_varlen": _torch_varlen}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the projections of ``x`` will have: autocast's when it is on for x's device, else x's own.
    Lets a caller resolve the attention backend once, before the layers run."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    backend: str = "auto",
    kernel: str | None = None,
) -> torch.Tensor:
    """Attention within each segment of a packed sequence.

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int32 [N+1] (0, ..., T) on q's device, max_seqlen = longest
    segment. Returns [T, Hq, D]. Softmax scale is 1/sqrt(D).

    ``kernel``: ``resolve_backend(backend, ...)`` done once by the caller (the model, for all its layers), or
    ``sdpa_masked``. A compiled block then never runs the resolver, whose lazy import and log call would split
    its graph.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention expects THD tensors [tokens, heads, dim]; got q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(
            f"cu_seqlens must be int32 on the device of q ({q.device}); got {cu_seqlens.dtype} on {cu_seqlens.device}"
        )
    name = kernel if kernel is not None else resolve_backend(backend, q.device, q.dtype)
    max_seqlen = int(max_seqlen)
    if backend == "auto" and name != "sdpa_masked" and (cu_seqlens.numel() - 1) * max_seqlen == q.shape[0]:
        name = "sdpa"  # equal segments: one batched SDPA call beats the varlen kernels (measured above)
    return _IMPLS[name](q, k, v, cu_seqlens, max_seqlen, causal)
