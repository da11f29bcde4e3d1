"""Packing with image splitting: token and tile budgets on realistic image-size distributions.

With splitting an image costs ``rows * cols (+ 1)`` tiles and the matching tokens (``nanovlm.data.tiling``), so
both budgets vary per sample: the case where two-budget packing matters most. Two distributions:

- **photos**: the (width, height) and text lengths of a real dataset's index (``--index DIR``, e.g. COCO prepared
  with ``scripts/prepare_data.py``), resampled with replacement to ``--tiles-samples`` samples;
- **documents**: a seeded long tail of pages, screenshots, receipts, charts and thumbnails, 1-3 images a sample,
  with long-tailed text.

Lengths come from sizes alone (``DatasetIndex.total_tokens`` / ``ImageLayout.costs``), as training plans them.
Every strategy of the packing section runs on the same samples (``packing.run_cell``) at two tile budgets (one
that binds before the token budget, one that leaves the tokens binding), the tile budget as its image cap; the
knapsack baseline's per-sample image filter is set to that cap too, so it drops nothing the others keep.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.distributions import LengthSet
from benchmarks.packing import run_cell
from nanovlm.data.tiling import ImageLayout, per_sample

# nanoVLM-460M's vision side (SigLIP2-B/16-512, pixel shuffle 4): 64 tokens per 512-px tile; SmolVLM's 4x4 grid
LAYOUT = ImageLayout(image_size=512, tokens_per_tile=64, max_tiles=16, newline_tokens=1, double_newline_tokens=1)
BUDGET_TOKENS = 8192
BUDGET_TILES = (64, 128)  # encoder inputs per pack: 64 binds before the tokens do, 128 leaves the tokens binding

# documents: (weight, aspect range (w/h), long side range px)
DOC_KINDS = {
    "page": (0.40, (0.70, 0.78), (1000, 3300)),
    "screenshot": (0.20, (1.6, 1.8), (1280, 2560)),
    "receipt": (0.15, (0.12, 0.33), (900, 3000)),
    "chart": (0.15, (1.2, 1.5), (500, 1600)),
    "thumbnail": (0.10, (0.6, 1.6), (100, 400)),
}


def _per_sample(layout: ImageLayout, sizes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: (tokens its images add beyond one placeholder each, tiles)."""
    tiles, tokens = layout.costs(sizes)
    return per_sample(tokens - 1, counts), per_sample(tiles, counts)


def documents(n: int, seed: int, layout: ImageLayout = LAYOUT) -> LengthSet:
    rng = np.random.default_rng(seed)
    counts = rng.choice([1, 2, 3], size=n, p=[0.8, 0.15, 0.05])
    kinds = list(DOC_KINDS)
    weights = np.array([DOC_KINDS[k][0] for k in kinds])
    kind = rng.choice(len(kinds), size=int(counts.sum()), p=weights / weights.sum())
    aspect = np.array([rng.uniform(*DOC_KINDS[kinds[k]][1]) for k in kind])
    long = np.array([rng.uniform(*DOC_KINDS[kinds[k]][2]) for k in kind])
    w = np.where(aspect >= 1, long, long * aspect)
    h = np.where(aspect >= 1, long / aspect, long)
    sizes = np.maximum(1, np.stack([w, h], 1).astype(np.int64))
    text = np.minimum(6000, rng.lognormal(np.log(150), 1.0, n).astype(np.int64) + 20)
    extra, tiles = _per_sample(layout, sizes, counts)
    notes = {"image_sizes": "synthetic documents", "tiles_mean": float(tiles.mean())}
    return LengthSet("documents", (text + counts + extra).tolist(), tiles.tolist(), f"synthetic seed={seed}", notes)


def photos(directory: str, n: int, seed: int, layout: ImageLayout = LAYOUT) -> LengthSet:
    """A real index's samples (sizes and text lengths), resampled with replacement to ``n``."""
    from nanovlm.data.index import load_index

    idx = load_index(directory, check_files=False)
    if idx.num_samples == 0:
        raise ValueError(f"{directory}: the index lists no samples")
    total, tiles = idx.total_tokens(layout), idx.vision_inputs(layout).astype(np.int64)
    pick = np.random.default_rng(seed).integers(0, idx.num_samples, n)
    notes = {"image_sizes": f"{idx.num_samples} samples of {directory}", "tiles_mean": float(tiles[pick].mean())}
    return LengthSet("photos", total[pick].tolist(), tiles[pick].tolist(), str(directory), notes)


@dataclass
class TilesResult:
    layout: dict[str, int]
    cells: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "cells": self.cells}


def measure(args: argparse.Namespace, log) -> TilesResult:
    n = args.tiles_samples or (2000 if args.quick else 20000)
    sets = [photos(d, n, args.seed) for d in args.index] + [documents(n, args.seed)]
    result = TilesResult({k: int(v) for k, v in LAYOUT.__dict__.items()})
    for ls in sets:
        for tiles in BUDGET_TILES:
            log(f"tiles: {ls.name} ({len(ls.lengths)} samples), L={BUDGET_TOKENS}, <= {tiles} tiles per pack")
            cell = run_cell(
                ls,
                BUDGET_TOKENS,
                max_images=tiles,
                reps=1 if args.quick else 3,
                seed=args.seed,
                max_images_per_example=tiles,
            )
            result.cells.append(cell)
    return result
