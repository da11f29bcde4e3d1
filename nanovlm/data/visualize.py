"""Draw packed batches: one row per pack, a colour per sample, image and loss-masked tokens marked, fill %.

Works on the batch dicts of docs/data.md: packed ``[1, T]`` batches (segments from ``cu_seqlens``; the
segments after the ``len(sample_keys)`` real ones are the padding tail) and the ``[B, L]`` padded baselines
(one sample per row, real length from ``attention_mask``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from nanovlm.constants import IGNORE_INDEX

# Token categories of a row.
UNUSED, PROMPT, LOSS, IMAGE = 0, 1, 2, 3


@dataclass
class PackRow:
    """One drawn row: per slot its category and the sample it belongs to (-1 for unused slots)."""

    category: np.ndarray  # int8 [T]
    sample: np.ndarray  # int32 [T]
    keys: list[str]
    fill: float  # real tokens / slots


def _row(input_ids: np.ndarray, labels: np.ndarray, bounds: list[tuple[int, int]], keys, image_token_id) -> PackRow:
    t = len(input_ids)
    category = np.full(t, UNUSED, dtype=np.int8)
    sample = np.full(t, -1, dtype=np.int32)
    for j, (a, b) in enumerate(bounds):
        seg_ids, seg_labels = input_ids[a:b], labels[a:b]
        cat = np.where(seg_labels != IGNORE_INDEX, LOSS, PROMPT).astype(np.int8)
        if image_token_id is not None:
            cat[seg_ids == image_token_id] = IMAGE
        category[a:b] = cat
        sample[a:b] = j
    real = sum(b - a for a, b in bounds)
    return PackRow(category, sample, list(keys), real / t if t else 0.0)


def pack_rows(batches: Iterable[dict], image_token_id: int | None = None) -> list[PackRow]:
    """Batch dicts -> rows to draw (one per pack, or one per row of a padded batch)."""
    rows: list[PackRow] = []
    for batch in batches:
        ids = np.asarray(batch["input_ids"])
        labels = np.asarray(batch["labels"])
        keys = list(batch.get("sample_keys", []))
        if "cu_seqlens" in batch and ids.shape[0] == 1:
            cu = np.asarray(batch["cu_seqlens"]).tolist()
            n_real = len(keys) if keys else len(cu) - 1
            bounds = [(cu[j], cu[j + 1]) for j in range(min(n_real, len(cu) - 1))]
            rows.append(_row(ids[0], labels[0], bounds, keys, image_token_id))
        else:  # padded [B, L]
            mask = np.asarray(batch["attention_mask"]) if "attention_mask" in batch else np.ones_like(ids)
            for i in range(ids.shape[0]):
                n = int(mask[i].sum())
                rows.append(_row(ids[i], labels[i], [(0, n)] if n else [], keys[i : i + 1], image_token_id))
    return rows


_PALETTE = np.array(
    [
        (0.122, 0.467, 0.706),
        (1.000, 0.498, 0.055),
        (0.173, 0.627, 0.173),
        (0.839, 0.153, 0.157),
        (0.580, 0.404, 0.741),
        (0.549, 0.337, 0.294),
        (0.890, 0.467, 0.761),
        (0.737, 0.741, 0.133),
        (0.090, 0.745, 0.812),
    ]
)
_GREY = np.array((0.85, 0.85, 0.85))


_NO_SLOT = np.array((1.0, 1.0, 1.0))  # past the end of a row shorter than the widest (padded batches differ)


def row_rgb(row: PackRow, width: int) -> np.ndarray:
    """RGB [width, 3]: sample colour for loss tokens, lighter for prompt tokens, darker for image tokens; unused
    slots grey, and white past the row's own length (not a slot at all)."""
    rgb = np.tile(_NO_SLOT, (width, 1))
    t = len(row.category)
    base = _PALETTE[np.maximum(row.sample, 0) % len(_PALETTE)]
    cat = row.category
    colour = np.where((cat == PROMPT)[:, None], 0.45 * base + 0.55, base)  # towards white
    colour = np.where((cat == IMAGE)[:, None], 0.45 * base, colour)  # towards black
    colour = np.where((cat == UNUSED)[:, None], _GREY, colour)
    rgb[:t] = colour
    return rgb


def rows_title(rows: list[PackRow]) -> str:
    """'N packs of T slots, fill F' (padded rows of different widths: 'N rows of up to T slots'); the fill is
    real tokens over slots of all rows, not a mean of the rows' fills."""
    slots = np.array([len(r.category) for r in rows])
    width = int(slots.max())
    fill = float(np.dot([r.fill for r in rows], slots) / max(1, slots.sum()))
    shape = (
        f"{len(rows)} packs of {width} slots" if (slots == width).all() else f"{len(rows)} rows of up to {width} slots"
    )
    return f"{shape}, fill {fill:.1%}"


def draw_packs(
    batches: Iterable[dict],
    out_png: str | os.PathLike,
    image_token_id: int | None = None,
    max_rows: int = 32,
    title: str | None = None,
) -> list[float]:
    """Draw the first ``max_rows`` packs of ``batches`` into ``out_png``; return each row's fill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = pack_rows(batches, image_token_id)[:max_rows]
    if not rows:
        raise ValueError("no batch to draw")
    width = max(len(r.category) for r in rows)
    img = np.stack([row_rgb(r, width) for r in rows])  # [rows, T, 3]
    fig_h = 1.2 + 0.32 * len(rows)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, width, len(rows), 0))
    for i, r in enumerate(rows):  # white lines between samples
        starts = np.flatnonzero(np.diff(r.sample) != 0) + 1
        for s in starts:
            if r.sample[s] >= 0:
                ax.plot([s, s], [i, i + 1], color="white", linewidth=0.6)
        ax.text(width * 1.005, i + 0.5, f"{r.fill:.1%}", va="center", fontsize=8)
    ax.set_yticks(np.arange(len(rows)) + 0.5)
    ax.set_yticklabels([f"{i}: {len(r.keys)} samples" for i, r in enumerate(rows)], fontsize=7)
    ax.set_xlabel("token slot")
    ax.set_title(title or rows_title(rows))
    ax.legend(
        handles=[
            Patch(color=_PALETTE[0], label="answer tokens (loss)"),
            Patch(color=0.45 * _PALETTE[0] + 0.55, label="prompt tokens (no loss)"),
            Patch(color=0.45 * _PALETTE[0], label="image tokens"),
            Patch(color=_GREY, label="unused slots"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.9 / fig_h),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [r.fill for r in rows]
