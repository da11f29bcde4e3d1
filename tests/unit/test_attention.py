"""Varlen attention: the sdpa backend equals a naive per-segment reference; backend selection and errors."""

import importlib
import logging
import math

import pytest
import torch

from nanovlm.model.attention import BackendUnavailableError, _logged, attention, resolve_backend


def naive_attention(q, k, v, cu_seqlens, causal):
    """Explicit softmax(q k^T / sqrt(d)) v per segment, kv heads repeated for GQA, fp64 accumulation."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].double().transpose(0, 1)  # [H, L, D]
        ks = k[a:b].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[a:b].double().repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        if causal:
            length = b - a
            scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def make_inputs(lengths, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "lengths,hq,hkv",
    [([5, 17, 1, 9], 4, 4), ([5, 17, 1, 9], 6, 2), ([8, 8, 8], 4, 2), ([23], 3, 1), ([5, 9, 5, 1, 9, 0, 5, 12], 6, 2)],
    ids=["mha-ragged", "gqa-ragged", "equal-segments", "single", "repeated-lengths"],
)
def test_sdpa_matches_naive_forward_and_backward(lengths, hq, hkv, causal):
    q, k, v, cu, max_len = make_inputs(lengths, hq, hkv, 16)
    grad_out = torch.randn(sum(lengths), hq, 16, generator=torch.Generator().manual_seed(1))
    out = attention(q, k, v, cu, max_len, causal=causal, backend="sdpa")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = naive_attention(q, k, v, cu, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[6, 10, 4], [6, 10, 6, 10]], ids=["distinct", "repeated"])
def test_segments_do_not_see_each_other(lengths):
    """Changing one segment's keys/values leaves every other segment's output bit-identical."""
    q, k, v, cu, max_len = make_inputs(lengths, 4, 2, 8)
    base = attention(q, k, v, cu, max_len, causal=True, backend="sdpa")
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[6:16] += 3.0
    v2[6:16] -= 2.0
    changed = attention(q, k2, v2, cu, max_len, causal=True, backend="sdpa")
    assert torch.equal(base[:6], changed[:6]) and torch.equal(base[16:], changed[16:])
    assert not torch.allclose(base[6:16], changed[6:16])


def test_auto_on_cpu_is_sdpa_and_logged_once(caplog):
    _logged.clear()
    with caplog.at_level(logging.INFO, logger="nanovlm.model.attention"):
        for _ in range(3):
            assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
            assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert all("attention backend: sdpa" in m for m in messages)


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
def test_unavailable_backend_says_why_and_how_to_fix(name):
    q, k, v, cu, max_len = make_inputs([4, 4], 2, 2, 8)
    with pytest.raises(BackendUnavailableError) as e:
        attention(q, k, v, cu, max_len, causal=True, backend=name)
    msg = str(e.value)
    assert name in msg and "needs a CUDA device" in msg and "attn_backend=sdpa" in msg


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
def test_gpus_before_ampere_get_sdpa_not_a_flash_kernel(monkeypatch, name):
    """Both kernels are FlashAttention, which refuses compute capability < 8.0 (T4, V100) at the first step."""
    import nanovlm.model.attention as attn_mod

    monkeypatch.setattr(attn_mod, "_flash_attn_import_error", lambda: None)  # as if flash-attn were installed
    monkeypatch.setattr(attn_mod, "_torch_varlen_fn", lambda: varlen_attn_2_13)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(BackendUnavailableError, match=r"Ampere or newer GPU .*has 7\.5"):
        resolve_backend(name, cuda, torch.bfloat16)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_backend(name, cuda, torch.bfloat16) == name
    assert resolve_backend("auto", cuda, torch.bfloat16) == "flash_attn"


def test_unknown_backend_and_bad_shapes():
    q, k, v, cu, max_len = make_inputs([4], 3, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_backend("flash", "cpu", torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q, k, v, cu, max_len, causal=True, backend="sdpa")
    with pytest.raises(ValueError, match="THD"):
        attention(q[None], k[None], v[None], cu, max_len, causal=True, backend="sdpa")
    # int64 boundaries work with the sdpa loop but not with the GPU kernels: refused on every backend
    q, k, v, cu, max_len = make_inputs([4], 2, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        attention(q, k, v, cu.long(), max_len, causal=True, backend="sdpa")


def _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, gqa_allowed):
    assert cu_seq_q is cu_seq_k and max_q == max_k
    if key.shape[1] != query.shape[1] and not gqa_allowed:
        raise RuntimeError("this signature has no GQA: kv heads must have been expanded")
    return naive_attention(query, key, value, cu_seq_q, causal)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    """The keyword signature of torch 2.10's varlen_attn (no window_size, no enable_gqa)."""
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, gqa_allowed=False)


def varlen_attn_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """The keyword signature of torch 2.13's varlen_attn (window_size (-1, 0) = causal, enable_gqa)."""
    assert window_size in ((-1, -1), (-1, 0))
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), enable_gqa)


@pytest.mark.parametrize("fn", [varlen_attn_2_10, varlen_attn_2_13], ids=["torch-2.10", "torch-2.13"])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_adapter_handles_both_signatures(monkeypatch, fn, causal):
    """The CUDA kernel cannot run here; its Python signature can. The adapter must pass causality and GQA in
    the form each torch version understands (a signature-faithful stand-in computes the reference)."""
    attn_mod = importlib.import_module("nanovlm.model.attention")

    attn_mod._torch_varlen_params.cache_clear()
    monkeypatch.setattr(attn_mod, "_torch_varlen_fn", lambda: fn)
    try:
        q, k, v, cu, max_len = make_inputs([5, 9, 3], 6, 2, 8)
        got = attn_mod._torch_varlen(q, k, v, cu, max_len, causal)
        torch.testing.assert_close(got, naive_attention(q, k, v, cu, causal), atol=1e-6, rtol=1e-6)
    finally:
        attn_mod._torch_varlen_params.cache_clear()


@torch.library.custom_op("nanovlm_test::varlen", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool) -> torch.Tensor:
    return naive_attention(q, k, v, cu, causal)


@_varlen_op.register_fake
def _(q, k, v, cu, causal):
    return torch.empty_like(q)


def test_a_compiled_block_with_the_varlen_kernel_is_one_graph(monkeypatch):
    """trainer.compile=blocks on CUDA: the kernel path inside a block must not split the graph (the backend resolver's
    lazy import and log call did, about five graphs per block, until the model resolved it outside the blocks).
    CUDA's kernel is stood in by a traceable CPU op with torch 2.13's signature, found by the real lookup."""
    from torch._dynamo.utils import counters

    import nanovlm.model.attention as attn_mod
    from nanovlm.config import LanguageConfig
    from nanovlm.model.language import DecoderLayer, Rotary

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        return _varlen_op(query, key, value, cu_seq_q, window_size == (-1, 0))

    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)  # found by the real lookup
    attn_mod._torch_varlen_fn.cache_clear()
    attn_mod._torch_varlen_params.cache_clear()
    torch.manual_seed(0)
    layer = DecoderLayer(
        LanguageConfig(hidden_size=48, num_layers=1, num_heads=6, num_kv_heads=2, intermediate_size=96), "torch_varlen"
    )
    lengths = [20, 30, 14]
    cu = torch.tensor([0, 20, 50, 64], dtype=torch.int32)
    rope = Rotary(torch.cat([torch.arange(n) for n in lengths])[None], 8, 1e4, {torch.float32})
    x = torch.randn(1, 64, 48)
    kwargs = dict(cu_seqlens=cu, max_seqlen=30, kernel="torch_varlen")
    eager = layer(x, rope, **kwargs)
    layer.compile(backend="eager")
    counters.clear()
    for _ in range(2):
        compiled = layer(x, rope, **kwargs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(compiled, eager)
    attn_mod._torch_varlen_fn.cache_clear()  # forget the stand-in
    attn_mod._torch_varlen_params.cache_clear()
