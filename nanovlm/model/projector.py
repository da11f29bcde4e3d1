"""Modality projector: pixel shuffle on the patch grid, then one linear map to the decoder width.

Pixel shuffle (space-to-depth) merges each f x f neighbourhood of patches into one token with f^2 times the
channels, so a 32x32 grid (1024 patches) becomes 8x8 = 64 decoder tokens with f = 4: the decoder sees f^2
fewer image tokens at no loss of information before the linear map.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nanovlm.config import ModelConfig


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[n, s*s, d] (row-major grid) -> [n, (s/f)^2, d*f^2]; each output token is one f x f block of patches."""
    n, p, d = x.shape
    side = int(round(p**0.5))
    if side * side != p or side % factor:
        raise ValueError(f"pixel shuffle needs a square patch grid whose side divides by {factor}; got {p} patches")
    g = side // factor
    x = x.view(n, g, factor, g, factor, d)  # [n, grid row, row in block, grid col, col in block, d]
    x = x.permute(0, 1, 3, 2, 4, 5)  # [n, grid row, grid col, row in block, col in block, d]
    return x.reshape(n, g * g, factor * factor * d)


class Projector(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.factor = cfg.projector.pixel_shuffle_factor
        self.proj = nn.Linear(cfg.vision.hidden_size * self.factor**2, cfg.language.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, P, vision hidden] -> [n, P / f^2, language hidden]."""
        return self.proj(pixel_shuffle(x, self.factor))
