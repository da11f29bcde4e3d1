"""Length distributions the packing benchmark runs over.

A distribution is two aligned integer lists: total decoder tokens per sample (text + image tokens, what a
pack's token budget counts) and images per sample (what the image budget counts). They come from

- a dataset index (the demo data, or any directory made by ``scripts/prepare_data.py``): no pass over the
  shards is needed, the index already holds ``text_tokens`` and ``n_images`` per sample;
- seeded synthetic long-tailed distributions, which stress packers the way real instruction mixtures do
  (many short captions, a thin tail of long multi-turn or multi-image samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class LengthSet:
    """One distribution: per-sample total tokens and image counts, plus where it came from."""

    name: str
    lengths: list[int]
    n_images: list[int]
    source: str = ""
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.n_images):
            raise ValueError(f"{self.name}: {len(self.lengths)} lengths but {len(self.n_images)} image counts")
        if not self.lengths:
            raise ValueError(f"{self.name}: no samples")
        if min(self.lengths) <= 0:
            raise ValueError(f"{self.name}: every sample needs a positive token length")

    def describe(self) -> dict:
        a = np.asarray(self.lengths)
        return {
            "name": self.name,
            "source": self.source,
            "samples": len(a),
            "tokens": int(a.sum()),
            "mean": float(a.mean()),
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
            "max": int(a.max()),
            "images_mean": float(np.mean(self.n_images)),
            **self.notes,
        }


def from_index(directory: str | Path, image_token_count: int | None = None, name: str | None = None) -> LengthSet:
    """Lengths of every sample of a dataset directory, read from its index (no shard is opened).

    Total tokens = text_tokens + n_images * (image_token_count - 1), what the packer plans without image
    splitting (``benchmarks/tiles.py`` covers splitting); ``image_token_count`` defaults to the value the index
    was prepared with.
    """
    from nanovlm.data.index import load_index

    idx = load_index(directory, check_files=False)
    itc = int(image_token_count if image_token_count is not None else idx.image_token_count)
    lengths, images = idx.total_tokens(itc).tolist(), idx.columns["n_images"].tolist()
    return LengthSet(name or Path(directory).name, lengths, images, source=str(directory), notes={"image_tokens": itc})


def _image_counts(rng: np.random.Generator, n: int) -> np.ndarray:
    # Mostly single-image samples, some text-only, a few multi-image ones (as in LLaVA-style mixtures).
    return rng.choice([0, 1, 2, 3, 4], size=n, p=[0.10, 0.75, 0.08, 0.04, 0.03])


def _with_images(name: str, text: np.ndarray, rng: np.random.Generator, seed: int, image_tokens: int, notes: dict):
    """A synthetic LengthSet: ``text`` tokens plus seeded image counts of ``image_tokens`` each."""
    imgs = _image_counts(rng, len(text))
    total = text + imgs * image_tokens
    notes = {"image_tokens": image_tokens, **notes}
    return LengthSet(name, total.tolist(), imgs.tolist(), source=f"synthetic seed={seed}", notes=notes)


def lognormal(
    n: int, seed: int = 0, median_text: float = 160.0, sigma: float = 1.0, image_tokens: int = 64
) -> LengthSet:
    """Text tokens ~ lognormal (a heavy right tail), plus ``image_tokens`` per image."""
    rng = np.random.default_rng(seed)
    text = np.maximum(8, rng.lognormal(np.log(median_text), sigma, size=n)).astype(np.int64)
    return _with_images(f"lognormal(median={int(median_text)},sigma={sigma})", text, rng, seed, image_tokens, {})


def mixture(
    n: int, seed: int = 0, long_frac: float = 0.03, long_range: tuple[int, int] = (1500, 7000), image_tokens: int = 64
) -> LengthSet:
    """Short captions (lognormal, median ~100 text tokens) with a rare long tail (uniform in ``long_range``).

    The long samples are large relative to small budgets: they are what makes online packing hard.
    """
    rng = np.random.default_rng(seed)
    text = np.maximum(8, rng.lognormal(np.log(100.0), 0.5, size=n)).astype(np.int64)
    is_long = rng.random(n) < long_frac
    text[is_long] = rng.integers(long_range[0], long_range[1], size=int(is_long.sum()))
    notes = {"long_frac": long_frac, "long_range": list(long_range)}
    return _with_images(f"mixture({100 * long_frac:g}% long)", text, rng, seed, image_tokens, notes)
