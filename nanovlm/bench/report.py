"""Output of the benchmark: the JSON document, the markdown report and the fill-per-strategy plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _short(name: str) -> str:
    """Strategy label without its parameters, for plot legends."""
    return name.split(" (batch")[0]


def _is_flattening(row: dict[str, Any]) -> bool:
    return row["strategy"].startswith("DataCollatorWithFlattening")


def plot_fill(cells: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Grouped bars: fill of every strategy in every (distribution, budget) cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not cells:
        raise ValueError("no packing cells to plot")
    strategies: list[str] = []
    for c in cells:
        for r in c["rows"]:
            if _short(r["strategy"]) not in strategies:
                strategies.append(_short(r["strategy"]))
    labels = [
        f"{c['distribution']['name'].split('(')[0]}\nL={c['budget_tokens']}\nimages<={c['max_images']}" for c in cells
    ]
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(cells)), 5.0))
    cmap = plt.get_cmap("tab10")
    for k, s in enumerate(strategies):
        xs, ys = [], []
        for j, c in enumerate(cells):
            for r in c["rows"]:
                if _short(r["strategy"]) == s:
                    xs.append(j + (k - (len(strategies) - 1) / 2) * width)
                    # Padding-free flattening has no budget: plot its fill at the provisioned (peak) step size.
                    ys.append(100.0 * (r["fill_at_peak"] if _is_flattening(r) else r["fill"]))
        label = s + (" (at peak step)" if s.startswith("DataCollatorWithFlattening") else "")
        ax.bar(xs, ys, width, label=label, color=cmap(k % 10))
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("fill: real tokens / slots (%)")
    ax.set_ylim(0, 105)
    ax.axhline(99, color="grey", lw=0.6, ls="--")
    ax.set_title("Packing fill per strategy (higher is better; dashed line: 99%)")
    ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, -0.42))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def write_json(doc: dict[str, Any], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str))
    os.replace(tmp, out)
    return out
