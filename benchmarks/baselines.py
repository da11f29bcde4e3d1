"""What users would otherwise use, re-implemented over (length, n_images) lists for the packing benchmark.

- ``balanced_greedy_knapsack``: the packer of HF's mmdp / nanoVLM data pipelines (``ConstantLengthDataset``),
  written here from its published description: samples stream into a buffer until it holds
  ``num_sequences`` packs' worth of tokens; the buffer is sorted longest first; a pool of
  ``ceil(buffer tokens / L) + delta`` empty bins is pre-sized; each sample goes to the *least-loaded* bin
  that still has room for its tokens and images (worst-fit decreasing, which balances the bins), and a new
  bin is opened only when none has room. Samples at or above ``max_sample_length`` tokens, or with more
  than ``max_images_per_example`` images, are dropped; every sample carries one separator token. Each pack
  is padded to ``L``. Published defaults: delta 5, 18 images per pack, 4 images per sample; nanoVLM's
  ``train.py`` buffers ``batch_size * 4`` = 8 packs, the mmdp repository's class defaults to 1024.
- ``flattening_steps``: ``transformers.DataCollatorWithFlattening`` run for real on fixed-size batches. It
  never pads, so its fill is 100% by construction; what it trades away is a fixed token budget, so the
  benchmark reports how much tokens per step vary (memory must be provisioned for the largest step).

Every function returns a ``StepPlan``: which samples each step holds, and the slots (positions the model
computes) and real tokens of each step, so one ``plan_metrics`` scores them all the same way.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class StepPlan:
    """Steps of one strategy over one distribution: sample indices, slots and real tokens per step."""

    name: str
    steps: list[list[int]]
    slots: list[int]
    tokens: list[int]
    images: list[int]
    dropped: list[int] = field(default_factory=list)  # sample indices never trained on
    truncated_tokens: int = 0  # tokens cut from samples that were truncated to fit
    fixed_budget: bool = True  # False for strategies whose step size varies (no token budget)
    notes: dict = field(default_factory=dict)


def steps_from_groups(
    name: str,
    groups: Sequence[Sequence[int]],
    lengths: Sequence[int],
    n_images: Sequence[int],
    slots_per_step: int,
    dropped: Sequence[int] = (),
    **notes,
) -> StepPlan:
    """A plan where every step is one fixed-size pack of ``slots_per_step`` slots."""
    return StepPlan(
        name=name,
        steps=[list(g) for g in groups],
        slots=[slots_per_step] * len(groups),
        tokens=[sum(lengths[i] for i in g) for g in groups],
        images=[sum(n_images[i] for i in g) for g in groups],
        dropped=list(dropped),
        notes=dict(notes),
    )


# ------------------------------------------------------------------------------------------------------
# balanced greedy knapsack (mmdp / nanoVLM)


def _worst_fit_decreasing(items: list[tuple[int, int, int]], L: int, n_bins: int, max_images: int) -> list[list[int]]:
    """items = (index, size, images). Least-loaded bin with room for both budgets; new bin if none."""
    loads = [0] * n_bins
    imgs = [0] * n_bins
    members: list[list[int]] = [[] for _ in range(n_bins)]
    heap = [(0, b) for b in range(n_bins)]  # (load, bin): ties go to the lower bin, like a stable sort
    for idx, size, ni in sorted(items, key=lambda t: t[1], reverse=True):
        skipped = []
        target = None
        while heap:
            load, b = heapq.heappop(heap)
            if load + size > L:  # every remaining bin is at least this full
                heapq.heappush(heap, (load, b))
                break
            if imgs[b] + ni <= max_images:
                target = b
                break
            skipped.append((load, b))
        for entry in skipped:
            heapq.heappush(heap, entry)
        if target is None:
            loads.append(0)
            imgs.append(0)
            members.append([])
            target = len(loads) - 1
        loads[target] += size
        imgs[target] += ni
        members[target].append(idx)
        heapq.heappush(heap, (loads[target], target))
    return [m for m in members if m]


def balanced_greedy_knapsack(
    lengths: Sequence[int],
    n_images: Sequence[int],
    L: int,
    num_sequences: int = 8,
    delta: int = 5,
    max_images_per_knapsack: int = 18,
    max_images_per_example: int = 4,
    max_sample_length: int | None = None,
    separator_tokens: int = 1,
    seed: int = 0,
) -> StepPlan:
    """Re-implementation of the mmdp / nanoVLM balanced greedy knapsack over a stream of samples.

    Each pack is padded to ``L`` slots; the separator token each sample carries takes a slot but is not a
    real token. ``max_sample_length`` defaults to ``L`` (both published configurations set it to the
    sequence length).
    """
    max_sample_length = L if max_sample_length is None else max_sample_length
    rng = random.Random(seed)
    buffer_budget = L * num_sequences
    groups: list[list[int]] = []
    dropped: list[int] = []
    buf: list[tuple[int, int, int]] = []
    buf_tokens = 0

    def flush() -> None:
        nonlocal buf, buf_tokens
        if buf:
            n_bins = math.ceil(buf_tokens / L) + delta
            packed = _worst_fit_decreasing(buf, L, n_bins, max_images_per_knapsack)
            rng.shuffle(packed)
            groups.extend(packed)
        buf, buf_tokens = [], 0

    for i, (n, ni) in enumerate(zip(lengths, n_images)):
        size = n + separator_tokens
        if n >= max_sample_length or ni > max_images_per_example or size > L:
            dropped.append(i)
            continue
        buf.append((i, size, ni))
        buf_tokens += size
        if buf_tokens >= buffer_budget:
            flush()
    flush()
    name = f"mmdp knapsack (buffer {num_sequences} packs" + (f", delta {delta})" if delta != 5 else ")")
    return steps_from_groups(
        name,
        groups,
        lengths,
        n_images,
        L,
        dropped,
        num_sequences=num_sequences,
        delta=delta,
        max_images_per_knapsack=max_images_per_knapsack,
        max_images_per_example=max_images_per_example,
    )


# ------------------------------------------------------------------------------------------------------
# transformers.DataCollatorWithFlattening


def flattening_steps(
    lengths: Sequence[int], n_images: Sequence[int], batch_size: int, max_len: int | None = None
) -> StepPlan:
    """Run ``DataCollatorWithFlattening`` on consecutive fixed-size batches; record what each step holds.

    The collator concatenates the batch into one [1, sum(len)] row with restarting position ids, so the
    step's slots are exactly its real tokens. Samples above ``max_len`` are dropped first (as a user would
    filter them), which keeps the comparison with budgeted strategies fair.
    """
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    keep = [i for i, n in enumerate(lengths) if max_len is None or n <= max_len]
    dropped = sorted(set(range(len(lengths))) - set(keep))
    steps, slots, tokens, images = [], [], [], []
    for s in range(0, len(keep), batch_size):
        idx = keep[s : s + batch_size]
        # Token ids do not matter for shapes; zeros keep the collator's real code path and cost.
        feats = [{"input_ids": torch.zeros(lengths[i], dtype=torch.long).tolist()} for i in idx]
        out = collator(feats)
        t = int(out["input_ids"].shape[1])
        steps.append(idx)
        slots.append(t)
        tokens.append(sum(lengths[i] for i in idx))
        images.append(sum(n_images[i] for i in idx))
    return StepPlan(
        f"DataCollatorWithFlattening (batch {batch_size})",
        steps,
        slots,
        tokens,
        images,
        dropped=dropped,
        fixed_budget=False,
        notes={"batch_size": batch_size},
    )
