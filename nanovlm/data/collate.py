"""Processed samples -> the batch dicts the model consumes.

``collate_packed`` builds the packed batch of docs/data.md: one row of exactly ``max_tokens`` slots (a fixed
shape, so compiled kernels and memory stay steady), samples concatenated, the padding tail its own segment,
positions restarting per segment, and each sample's first label set to -100 so the shifted loss never predicts
across a sample boundary. ``collate_padded`` is the [B, L] layout of the padded baselines.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from nanovlm.constants import IGNORE_INDEX


class _Sample(Protocol):  # structural view of processing.ProcessedSample
    key: str
    input_ids: torch.Tensor  # [L] int64
    labels: torch.Tensor  # [L] int64
    pixel_values: torch.Tensor  # [n_img, 3, H, W] uint8


def _pixels(samples: Sequence[_Sample], image_size: int) -> torch.Tensor:
    imgs = [s.pixel_values for s in samples if s.pixel_values.numel()]
    if not imgs:
        return torch.zeros(0, 3, image_size, image_size, dtype=torch.uint8)
    return torch.cat(imgs, 0)


def collate_packed(
    samples: Sequence[_Sample], max_tokens: int, pad_id: int, image_size: int, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Pack ``samples`` into one [1, max_tokens] row. An empty list gives an all-padding, loss-free pack."""
    lens = [int(s.input_ids.numel()) for s in samples]
    total = sum(lens)
    if total > max_tokens:
        raise ValueError(f"pack of {total} tokens exceeds data.max_tokens={max_tokens}: {[s.key for s in samples]}")
    # A handful of whole-pack ops instead of several per sample (per-sample slicing cost ~40 us a sample).
    seg_lens = lens + [max_tokens - total] if total < max_tokens else list(lens)  # padding tail: own segment
    seg = [0, *itertools.accumulate(seg_lens)]
    input_ids = torch.full((max_tokens,), pad_id, dtype=torch.long)
    labels = torch.full((max_tokens,), IGNORE_INDEX, dtype=torch.long)
    if samples:
        input_ids[:total] = torch.cat([s.input_ids for s in samples])
        labels[:total] = torch.cat([s.labels for s in samples])
        labels[seg[: len(samples)]] = IGNORE_INDEX  # no prediction crosses into a sample
    starts = torch.tensor(seg[:-1], dtype=torch.long)
    # positions restart at 0 in every segment: slot index minus its segment's start
    position_ids = torch.arange(max_tokens) - starts.repeat_interleave(torch.tensor(seg_lens), output_size=max_tokens)
    cu = torch.tensor(seg, dtype=torch.int32)
    pixel_values = _pixels(samples, image_size)
    info = {
        "real_tokens": total,
        "seq_sq": sum(n * n for n in lens),  # sum of squared sample lengths: the attention FLOPs (MFU)
        "slots": max_tokens,
        "n_samples": len(samples),
        "n_images": int(pixel_values.shape[0]),
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
    }
    info.update(meta or {})
    return {
        "input_ids": input_ids[None],  # [1, T]
        "labels": labels[None],  # [1, T]
        "position_ids": position_ids[None],  # [1, T]
        "cu_seqlens": cu,  # [N(+1) + 1] int32
        "max_seqlen": max(seg_lens, default=0),
        "pixel_values": pixel_values,  # [n_img, 3, H, W] uint8
        "sample_keys": [s.key for s in samples],
        "meta": info,
    }


def collate_padded(
    samples: Sequence[_Sample], pad_id: int, image_size: int, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Baseline layout: [B, L] right-padded to the longest sample, with ``attention_mask``."""
    lens = [int(s.input_ids.numel()) for s in samples]
    b, longest = len(samples), max(lens, default=1)
    input_ids = torch.full((max(b, 1), longest), pad_id, dtype=torch.long)
    labels = torch.full((max(b, 1), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((max(b, 1), longest), dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lens)):
        input_ids[i, :n] = s.input_ids
        labels[i, :n] = s.labels
        labels[i, 0] = IGNORE_INDEX
        attention_mask[i, :n] = 1
    position_ids = torch.arange(longest).expand(max(b, 1), longest).clone() * attention_mask
    pixel_values = _pixels(samples, image_size)
    info = {
        "real_tokens": sum(lens),
        "seq_sq": sum(n * n for n in lens),
        "slots": max(b, 1) * longest,
        "n_samples": b,
        "n_images": int(pixel_values.shape[0]),
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
    }
    info.update(meta or {})
    return {
        "input_ids": input_ids,  # [B, L]
        "labels": labels,  # [B, L]
        "position_ids": position_ids,  # [B, L]
        "attention_mask": attention_mask,  # [B, L]
        "pixel_values": pixel_values,
        "sample_keys": [s.key for s in samples],
        "meta": info,
    }
