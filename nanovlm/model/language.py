"""Llama / SmolLM2-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, optional tied head.

Three ways to run attention, chosen by the inputs:

- packed (training): one [1, T] row of concatenated samples with ``cu_seqlens``; varlen attention keeps the
  samples apart and RoPE reads ``position_ids``, which restart at 0 for every sample, so each sample is
  computed exactly as if it were alone;
- padded (the pad-to-longest baseline): [B, T] rows with ``attention_mask`` [B, T] (1 = real token); causal
  attention with key padding through SDPA;
- cached (generation): one sample, keys/values appended to a preallocated ``KVCache``.

Parameter names follow transformers' ``LlamaForCausalLM``, except that q/k/v and gate/up are fused into
``qkv_proj`` and ``gate_up_proj`` (``pretrained.py`` stacks the checkpoint's tensors).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanovlm.config import LanguageConfig
from nanovlm.model.attention import attention, compute_dtype, expand_kv, resolve_backend


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 (as Llama does).

    When x and the weight share a dtype this is ``F.rms_norm``: one fused kernel forward and one backward on CUDA,
    instead of about eight launches each way, and bitwise the same result on fp32 inputs. Otherwise (bf16
    activations with an fp32 weight) x is normalised in fp32, cast back, then scaled, as transformers' Llama does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary:
    """cos and sign-folded sin of every position, [B, T, 1, head_dim], made once per forward for all layers.

    Llama's half-split rotation is x * cos + cat(-x2, x1) * sin; folding the sign into sin
    (sin_signed = cat(-s, s)) makes it x * cos + cat(x2, x1) * sin_signed, exactly the same numbers without the
    negation kernel. The tables are cast up front to every dtype q and k can have (``dtypes``: the activations'
    and the autocast dtype), so no layer casts them again.
    """

    def __init__(self, position_ids: torch.Tensor, head_dim: int, theta: float, dtypes=()) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat([cos, cos], -1)[:, :, None], torch.cat([-sin, sin], -1)[:, :, None]
        self.tables = {dt: (cos.to(dt), sin.to(dt)) for dt in {torch.float32, *dtypes}}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, T, H, D] by position (pairs (i, i + D/2), as in transformers' Llama)."""
        cos, sin = self.tables.get(x.dtype) or (t.to(x.dtype) for t in self.tables[torch.float32])
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([x2, x1], dim=-1) * sin


class KVCache:
    """Preallocated keys and values of every decoder layer for one sample, for incremental decoding."""

    def __init__(self, cfg: LanguageConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        head_dim = cfg.hidden_size // cfg.num_heads
        shape = (cfg.num_layers, 1, max_len, cfg.num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens stored so far (advanced by LanguageModel after each forward)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [1, T, Hkv, D] at positions length..length+T; return all keys/values so far."""
        end = self.length + k.shape[1]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; cannot store up to {end}")
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


class DecoderAttention(nn.Module):
    """Grouped-query attention with one fused projection for queries, keys and values.

    ``qkv_proj`` holds transformers' q_proj, k_proj and v_proj stacked by rows ([q; k; v], see ``pretrained.py``):
    one GEMM instead of three (and one autocast cast of the input instead of three), and RoPE runs once over the
    query and key heads together: eager GPU steps of small models are bound by kernel launches.
    """

    def __init__(self, cfg: LanguageConfig, attn_backend: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attn_backend = attn_backend
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, rope, cu_seqlens=None, max_seqlen=None, pad_mask=None, cache=None, layer_idx=0, kernel=None):
        b, t, _ = x.shape
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * hkv, self.head_dim)
        qk, v = qkv.split([h + hkv, hkv], dim=2)  # [B, T, Hq + Hkv, D], [B, T, Hkv, D] (split: backward is one cat)
        q, k = rope(qk).split([h, hkv], dim=2)
        if cache is not None:  # one sample, new tokens attend to everything cached so far plus themselves
            start = cache.length
            k, v = cache.update(layer_idx, k, v)
            mask = None
            if t > 1:  # query i sits at position start + i and sees keys 0..start + i
                mask = torch.arange(k.shape[1], device=x.device) <= (start + torch.arange(t, device=x.device))[:, None]
            out = self._sdpa(q, k, v, mask)
        elif cu_seqlens is not None:  # packed [1, T]: varlen attention within each sample
            if b != 1:
                raise ValueError(f"a packed batch has one row; got input of shape {tuple(x.shape[:2])}")
            # squeeze, not [0]: a view whose backward is a view (indexing's backward writes a zero tensor)
            q, k, v = q.squeeze(0), k.squeeze(0), v.squeeze(0)
            out = attention(q, k, v, cu_seqlens, max_seqlen, True, self.attn_backend, kernel).unsqueeze(0)
        else:  # padded [B, T] (pad_mask [B, 1, T, T]) or a single unpadded row (pad_mask None: plain causal)
            out = self._sdpa(q, k, v, pad_mask, causal=pad_mask is None)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def _sdpa(self, q, k, v, mask, causal=False):
        """[B, T, H, D] tensors through SDPA (kv heads expanded for GQA); returns [B, T, Hq, D]."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = expand_kv(k, self.num_heads, 1), expand_kv(v, self.num_heads, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        return out.transpose(1, 2)


class DecoderMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one GEMM (``gate_up_proj`` = [gate; up])."""

    def __init__(self, cfg: LanguageConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LanguageConfig, attn_backend: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, attn_backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DecoderMLP(cfg)

    def forward(self, x, rope, **attn_kwargs):
        x = x + self.self_attn(self.input_layernorm(x), rope, **attn_kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head (tied to the embeddings when configured)."""

    def __init__(self, cfg: LanguageConfig, vocab_size: int, attn_backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attn_backend = attn_backend
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, attn_backend) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        static: bool = False,
    ) -> torch.Tensor:
        """inputs_embeds [B, T, hidden], position_ids [B, T] -> logits [B, T, vocab].

        Give ``cu_seqlens``/``max_seqlen`` for a packed row, ``attention_mask`` [B, T] for padded rows, ``cache``
        for generation; with none of them each row is one causal sequence. ``return_hidden`` returns the final
        normed hidden states [B, T, hidden] instead, for a caller that applies ``lm_head`` to a few positions.
        ``static``: a static pack (collate.StaticLayout), whose attention must not read segment lengths on the host.
        """
        dtypes = {inputs_embeds.dtype, compute_dtype(inputs_embeds)}  # the RoPE tables are cast to each once
        rope = Rotary(position_ids, self.head_dim, self.cfg.rope_theta, dtypes)
        pad_mask = None
        if attention_mask is not None and cu_seqlens is None and cache is None:
            t = attention_mask.shape[1]
            keep = attention_mask.bool()
            causal = torch.ones(t, t, dtype=torch.bool, device=keep.device).tril()
            # [B, 1, T, T]: causal and key is real; a padding query also sees itself so no row is all-masked
            pad_mask = (causal & keep[:, None, :]) | torch.eye(t, dtype=torch.bool, device=keep.device)
            pad_mask = pad_mask[:, None]
        x = inputs_embeds
        kernel = None  # packed rows: the attention backend, chosen once here rather than in every (compiled) layer
        if cu_seqlens is not None and cache is None:
            kernel = resolve_backend(self.attn_backend, x.device, compute_dtype(x))
            if static and kernel == "sdpa":
                kernel = "sdpa_masked"
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                rope,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                pad_mask=pad_mask,
                cache=cache,
                layer_idx=i,
                kernel=kernel,
            )
        if cache is not None:
            cache.length += inputs_embeds.shape[1]
        x = self.norm(x)
        return x if return_hidden else self.lm_head(x)
