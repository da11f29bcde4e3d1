"""Processed samples -> the batch dicts the model consumes.

``collate_packed`` builds the packed batch of docs/data.md: one row of exactly ``max_tokens`` slots (a fixed
shape, so compiled kernels and memory stay steady), samples concatenated, the padding tail its own segment,
positions restarting per segment, and each sample's first label set to -100 so the shifted loss never predicts
across a sample boundary. ``collate_padded`` is the [B, L] layout of the padded baselines.

With a ``StaticLayout`` (``data.static_shapes``) every tensor of every pack has one shape for the whole run, so one
compiled graph (or one CUDA graph) serves every step: ``cu_seqlens`` has a fixed length, its unused tail repeating
T (empty segments, which attend to nothing), ``max_seqlen`` is T, and ``pixel_values`` has a fixed number of image
slots, the unused ones blank (encoded, but no placeholder reads them). The number of segments comes from the
shortest sample of the run's datasets (``StaticLayout.for_lengths``), so no pack can hold more.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from nanovlm.constants import DEFERRED_JPEGS, IGNORE_INDEX
from nanovlm.data.device_decode import Deferred


class _Sample(Protocol):  # structural view of processing.ProcessedSample
    key: str
    input_ids: torch.Tensor  # [L] int64
    labels: torch.Tensor  # [L] int64
    pixel_values: torch.Tensor  # [n_img, 3, H, W] uint8


@dataclass(frozen=True)
class StaticLayout:
    """The fixed shapes of a static pack (see the module docstring)."""

    segments: int  # entries of cu_seqlens minus one: the most samples a pack can hold, plus the padding tail
    image_slots: int  # rows of pixel_values: the pack's image (or tile) budget, data.max_images
    image_token_id: int  # the placeholder id, to check placeholders against images here (the model cannot: no
    image_tokens: int  # host sync in a compiled step) ... and the placeholders per image

    @classmethod
    def for_lengths(
        cls, lengths: np.ndarray, max_tokens: int, image_slots: int, image_token_id: int, image_tokens: int
    ) -> StaticLayout:
        """The layout for datasets whose samples have ``lengths`` [N] tokens (0 = empty: never packed)."""
        positive = lengths[lengths > 0]
        shortest = min(int(positive.min()), max_tokens) if positive.size else max_tokens
        return cls(max_tokens // shortest + 1, image_slots, image_token_id, image_tokens)


def carve(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised tensors of these (shape, dtype)s, all views of one uint8 storage.

    A DataLoader worker hands each storage of a batch over as a shared-memory segment of its own, created and
    filled in the worker and mapped in the training process: a fixed cost per storage that, per packed batch of
    five tensors, came to more CPU than collating it. With one storage per batch the segment is made once (each
    view still passes its file descriptor, which costs little)."""
    sizes = [math.prod(shape) * dt.itemsize for shape, dt in shapes]
    starts = [0]
    for n in sizes:  # each view starts 8-byte aligned: the batch's int64, int32 and uint8 tensors can view its bytes
        starts.append(starts[-1] + -(-n // 8) * 8)
    buf = torch.empty(starts[-1], dtype=torch.uint8)
    return [buf[a : a + n].view(dt).view(shape) for (shape, dt), a, n in zip(shapes, starts, sizes)]


def _pixels(samples: Sequence[_Sample], n: int, out: torch.Tensor) -> None:
    """Fill ``out`` [slots, 3, H, W] uint8 with the samples' ``n`` images in order of appearance, blank after them.
    (``cat`` into a view of the wrong shape would resize the view and leave ``out`` unwritten: checked first.)"""
    if n > out.shape[0]:
        raise ValueError(f"pack of {n} images exceeds its {out.shape[0]} image slots (data.max_images)")
    with_images = [s for s in samples if s.pixel_values.numel()]
    for s in with_images:
        if s.pixel_values.shape[1:] != out.shape[1:]:
            shape = tuple(s.pixel_values.shape[1:])
            raise ValueError(f"sample {s.key!r} has images of shape {shape}, not {tuple(out.shape[1:])}")
    if with_images:
        torch.cat([s.pixel_values for s in with_images], 0, out=out[:n])
    out[n:].zero_()


def _n_images(samples: Sequence[_Sample]) -> int:
    """Encoder inputs of the samples (images, or tiles): the rows of the pack's pixel_values."""
    return sum(int(s.pixel_values.shape[0]) for s in samples if s.pixel_values.numel())


def _deferred(samples: Sequence[_Sample]) -> list[Deferred]:
    """(bytes, row in the batch's pixel_values, box, sample key) of every deferred JPEG (a sample's ``jpegs``,
    see processing.DeferredJpeg), for device_decode.py."""
    out, row = [], 0
    for s in samples:
        out += [(j.data, row + j.view, j.box, s.key) for j in getattr(s, "jpegs", ())]
        row += int(s.pixel_values.shape[0])
    return out


def _with_deferred(batch: dict[str, Any], samples: Sequence[_Sample]) -> dict[str, Any]:
    deferred = _deferred(samples)
    if deferred:  # only then: batches without deferred JPEGs keep their keys
        batch[DEFERRED_JPEGS] = deferred
    return batch


def collate_packed(
    samples: Sequence[_Sample],
    max_tokens: int,
    pad_id: int,
    image_size: int,
    meta: dict[str, Any] | None = None,
    static: StaticLayout | None = None,
) -> dict[str, Any]:
    """Pack ``samples`` into one [1, max_tokens] row. An empty list gives an all-padding, loss-free pack."""
    lens = [int(s.input_ids.numel()) for s in samples]
    total = sum(lens)
    if total > max_tokens:
        raise ValueError(f"pack of {total} tokens exceeds data.max_tokens={max_tokens}: {[s.key for s in samples]}")
    # A handful of whole-pack ops instead of several per sample (per-sample slicing cost ~40 us a sample).
    seg_lens = lens + [max_tokens - total] if total < max_tokens else list(lens)  # padding tail: own segment
    seg = [0, *itertools.accumulate(seg_lens)]
    if static is not None:
        _check_segments(len(seg) - 1, static, samples)
    n_images = _n_images(samples)
    n_cu = static.segments + 1 if static else len(seg)
    input_ids, labels, position_ids, cu, pixel_values = carve(
        [((1, max_tokens), torch.long)] * 3
        + [
            ((n_cu,), torch.int32),
            ((static.image_slots if static else n_images, 3, image_size, image_size), torch.uint8),
        ]
    )
    input_ids.fill_(pad_id)
    labels.fill_(IGNORE_INDEX)
    if samples:
        torch.cat([s.input_ids for s in samples], out=input_ids[0, :total])
        torch.cat([s.labels for s in samples], out=labels[0, :total])
        labels[0, seg[: len(samples)]] = IGNORE_INDEX  # no prediction crosses into a sample
    starts = torch.tensor(seg[:-1], dtype=torch.long)
    # positions restart at 0 in every segment: slot index minus its segment's start
    torch.sub(
        torch.arange(max_tokens),
        starts.repeat_interleave(torch.tensor(seg_lens), output_size=max_tokens),
        out=position_ids[0],
    )
    cu[: len(seg)] = torch.tensor(seg, dtype=torch.int32)
    cu[len(seg) :] = max_tokens  # static: the unused segments are empty, at the end
    _pixels(samples, n_images, pixel_values)
    if static is not None:
        _check_placeholders(input_ids, n_images, static, samples)
    info = {
        "real_tokens": total,
        "seq_sq": sum(n * n for n in lens),  # sum of squared sample lengths: the attention FLOPs (MFU)
        "slots": max_tokens,
        "n_samples": len(samples),
        "n_images": n_images,
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
    }
    info.update(meta or {})
    batch = {
        "input_ids": input_ids,  # [1, T]
        "labels": labels,  # [1, T]
        "position_ids": position_ids,  # [1, T]
        "cu_seqlens": cu,  # [N(+1) + 1] int32; static: [segments + 1]
        "max_seqlen": max_tokens if static else max(seg_lens, default=0),
        "pixel_values": pixel_values,  # [n_img, 3, H, W] uint8; static: [image_slots, 3, H, W]
        "sample_keys": [s.key for s in samples],
        "meta": info,
    }
    if static is not None:
        batch["static"] = True  # the model takes its static path (vlm.NanoVLM.forward)
    return _with_deferred(batch, samples)


def _check_segments(n: int, static: StaticLayout, samples: Sequence[_Sample]) -> None:
    """A pack of ``n`` segments (samples and the padding tail) must fit the static layout's cu_seqlens."""
    if n > static.segments:
        raise ValueError(
            f"pack of {len(samples)} samples needs {n} segments but the static layout has "
            f"{static.segments}: a sample is shorter than any the index listed ({[s.key for s in samples]})"
        )


def _check_placeholders(input_ids: torch.Tensor, n_images: int, static: StaticLayout, samples) -> None:
    """Placeholders must match images: the static model path splices without checking (no host sync)."""
    n = int((input_ids == static.image_token_id).sum())
    if n != n_images * static.image_tokens:
        raise ValueError(
            f"pack has {n} image placeholder tokens but {n_images} images of {static.image_tokens} tokens each "
            f"({[s.key for s in samples]})"
        )


def collate_padded(
    samples: Sequence[_Sample], pad_id: int, image_size: int, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Baseline layout: [B, L] right-padded to the longest sample, with ``attention_mask``."""
    lens = [int(s.input_ids.numel()) for s in samples]
    b, longest = max(len(samples), 1), max(lens, default=1)
    n_images = _n_images(samples)
    input_ids, labels, position_ids, attention_mask, pixel_values = carve(
        [((b, longest), torch.long)] * 4 + [((n_images, 3, image_size, image_size), torch.uint8)]
    )
    input_ids.fill_(pad_id)
    labels.fill_(IGNORE_INDEX)
    attention_mask.zero_()
    for i, (s, n) in enumerate(zip(samples, lens)):
        input_ids[i, :n] = s.input_ids
        labels[i, :n] = s.labels
        labels[i, 0] = IGNORE_INDEX
        attention_mask[i, :n] = 1
    torch.mul(torch.arange(longest), attention_mask, out=position_ids)
    _pixels(samples, n_images, pixel_values)
    info = {
        "real_tokens": sum(lens),
        "seq_sq": sum(n * n for n in lens),
        "slots": b * longest,
        "n_samples": len(samples),
        "n_images": n_images,
        "loss_tokens": int((labels != IGNORE_INDEX).sum()),
    }
    info.update(meta or {})
    batch = {
        "input_ids": input_ids,  # [B, L]
        "labels": labels,  # [B, L]
        "position_ids": position_ids,  # [B, L]
        "attention_mask": attention_mask,  # [B, L]
        "pixel_values": pixel_values,
        "sample_keys": [s.key for s in samples],
        "meta": info,
    }
    return _with_deferred(batch, samples)
