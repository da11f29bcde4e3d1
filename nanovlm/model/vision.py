"""SigLIP-style vision encoder: conv patch embedding, learned positions, pre-norm ViT blocks, final LayerNorm.

No CLS token and no pooling head: the projector consumes every patch embedding. Module and parameter names
follow transformers' ``SiglipVisionModel``, except that q/k/v_proj are fused into ``qkv_proj`` (``pretrained.py``
stacks them when loading SigLIP weights). Attention is non-causal within each image; the images of a batch are
independent sequences of equal length, handed to the varlen ``attention`` as equal segments.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanovlm.config import VisionConfig
from nanovlm.model.attention import attention, compute_dtype, resolve_backend


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, attn_backend: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attn_backend = attn_backend
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # SigLIP's q/k/v_proj stacked: one GEMM
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        n, p, d = x.shape  # [images, patches, hidden]
        q, k, v = self.qkv_proj(x).view(n * p, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [n*p, H, hd]
        cu_seqlens = torch.arange(0, (n + 1) * p, p, dtype=torch.int32, device=x.device)  # one segment per image
        out = attention(q, k, v, cu_seqlens, p, False, self.attn_backend, kernel)  # [n*p, H, hd]
        return self.out_proj(out.reshape(n, p, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: VisionConfig, attn_backend: str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg, attn_backend)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), kernel)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """[n, 3, H, W] normalised pixels -> [n, (H/patch)^2, hidden] patch embeddings (row-major patch order)."""

    def __init__(self, cfg: VisionConfig, attn_backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.attn_backend = attn_backend
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(self.num_patches, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg, attn_backend) for _ in range(cfg.num_layers)])
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2:] != (self.cfg.image_size, self.cfg.image_size):
            raise ValueError(
                f"vision encoder expects {self.cfg.image_size}x{self.cfg.image_size} images, got {tuple(pixels.shape[-2:])}"
            )
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, P, hidden]
        x = x + self.position_embedding.weight
        # the attention backend, chosen once here rather than in every (compiled) block
        kernel = resolve_backend(self.attn_backend, x.device, compute_dtype(x))
        for block in self.blocks:
            x = block(x, kernel)
        return self.post_layernorm(x)
