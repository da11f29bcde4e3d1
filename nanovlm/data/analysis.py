"""Length analysis of a dataset from its index alone: histograms, padding/packing waste, a recommended budget.

Everything here reads index columns (never a shard), so it runs in seconds on millions of samples.
Waste is simulated with the same algorithms training uses (``nanovlm.data.packing``), on the samples in a
seeded random order (training shuffles; an index in sorted order would flatter padding).

Definitions (for a token budget ``L`` = data.max_tokens and padded batches of ``batch_size`` samples):

* pad-to-longest: each batch is padded to its longest sample, no cutoff. waste = pad / slots.
* constrained padding: the same with lengths capped at a cutoff (= L); longer samples are truncated (tokens
  lost) or dropped (samples lost).
* packing: samples concatenated into [1, L] packs by the online packer (what training does); waste = empty
  slots / slots. The offline first-fit-decreasing optimum is reported as the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nanovlm.data import packing
from nanovlm.data.index import DatasetIndex
from nanovlm.data.tiling import ImageLayout, as_layout

SIM_SAMPLES = 100_000  # waste simulations run on at most this many samples (seeded subsample)


@dataclass
class LengthStats:
    text_tokens: np.ndarray  # per sample, <image> counted once
    total_tokens: np.ndarray  # per sample, images expanded
    n_images: np.ndarray  # per sample: encoder inputs, what data.max_images counts (images, or tiles)
    image_token_count: int  # tokens per image (per tile with splitting)
    sources: list[str] = field(default_factory=list)
    prompt_tokens: np.ndarray | None = None  # per sample, before the first loss token, images expanded
    unit: str = "images"  # what n_images counts: images, or tiles with image splitting

    @property
    def num_samples(self) -> int:
        return len(self.total_tokens)


def collect(indexes: list[DatasetIndex], layout: ImageLayout | int) -> LengthStats:
    """The length columns of one or more indexes, concatenated, for an image ``layout`` (an int: that many
    tokens per image, no splitting)."""
    layout = as_layout(layout)

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return LengthStats(
        text_tokens=cat([i.columns["text_tokens"] for i in indexes]),
        total_tokens=cat([i.total_tokens(layout) for i in indexes]),
        n_images=cat([i.vision_inputs(layout) for i in indexes]),
        image_token_count=layout.tokens_per_tile,
        sources=[str(i.root) for i in indexes],
        prompt_tokens=cat([i.prompt_lengths(layout) for i in indexes]),
        unit=layout.unit,
    )


def percentiles(x: np.ndarray, qs=(50, 90, 99, 99.9)) -> dict[str, float]:
    if len(x) == 0:
        return {f"p{q:g}": 0.0 for q in qs} | {"max": 0.0, "mean": 0.0}
    out = {f"p{q:g}": float(np.percentile(x, q)) for q in qs}
    out["max"] = float(x.max())
    out["mean"] = float(x.mean())
    return out


@dataclass
class WasteReport:
    budget: int
    batch_size: int
    simulated: int  # samples the simulation used
    pad_to_longest: float  # wasted fraction of slots
    constrained: float  # wasted fraction of slots (truncate variant)
    constrained_truncated_samples: int
    constrained_lost_tokens: float  # fraction of real tokens cut by truncation
    packing: float  # wasted fraction of slots, online packer (as in training)
    packing_ffd: float  # offline first-fit-decreasing reference
    over_budget: int  # samples longer than the budget (dropped with overlength=drop), in the full dataset
    over_budget_tokens: float  # fraction of all tokens in those samples
    over_images: int  # samples with more images than max_images
    max_images: int = 0  # the image budget per pack used in the simulation
    image_bound_packs: float = 0.0  # fraction of online packs that reached max_images (the image budget binds)
    packing_lost: int = 0  # samples the packer can never place (over the budget or over max_images), full dataset
    packing_lost_tokens: float = 0.0  # fraction of all tokens in those samples


def _sim_order(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    return np.sort(order[:SIM_SAMPLES]) if n > SIM_SAMPLES else order


def waste(
    stats: LengthStats,
    budget: int,
    batch_size: int = 8,
    max_images: int = 1 << 30,
    lookahead: int = 64,
    seed: int = 0,
    reference: bool = True,
) -> WasteReport:
    """Simulate the three batching strategies at ``budget`` and report the wasted fractions.

    ``reference=False`` skips the offline FFD reference (the slowest part; ``packing_ffd`` is then NaN)."""
    order = _sim_order(stats.num_samples, seed)
    if stats.num_samples > SIM_SAMPLES:  # subsample, then shuffle it
        order = np.random.default_rng(seed + 1).permutation(order)
    lengths = stats.total_tokens[order].tolist()
    imgs = stats.n_images[order].tolist()
    real = float(sum(lengths)) or 1.0

    longest = max(lengths) if lengths else 1
    ptl = packing.constrained(lengths, imgs, batch_size, max(1, longest), "truncate")
    con = packing.constrained(lengths, imgs, batch_size, budget, "truncate")
    onl = packing.pack_online(lengths, imgs, budget, max_images, lookahead=lookahead, overlength="drop")
    ffd = packing.ffd_reference(lengths, imgs, budget, max_images, overlength="drop") if reference else None

    def padded_waste(r: packing.PackResult) -> float:
        slots = packing.padded_slots(r)
        return 1.0 - r.real_tokens() / slots if slots else 0.0

    def pack_waste(r: packing.PackResult) -> float:
        return 1.0 - r.fill(budget) if r.packs else 0.0

    over = stats.total_tokens > budget
    lost = over | (stats.n_images > max_images) | (stats.total_tokens <= 0)  # what overlength=drop packing skips
    total = float(stats.total_tokens.sum()) or 1.0
    full_of_images = sum(1 for p in onl.packs if sum(imgs[i] for i in p) >= max_images)
    return WasteReport(
        budget=budget,
        batch_size=batch_size,
        simulated=len(lengths),
        pad_to_longest=padded_waste(ptl),
        constrained=padded_waste(con),
        constrained_truncated_samples=len(con.truncated),
        constrained_lost_tokens=1.0 - con.real_tokens() / real,
        packing=pack_waste(onl),
        packing_ffd=pack_waste(ffd) if ffd is not None else float("nan"),
        over_budget=int(over.sum()),
        over_budget_tokens=float(stats.total_tokens[over].sum()) / total,
        over_images=int((stats.n_images > max_images).sum()),
        max_images=max_images,
        image_bound_packs=full_of_images / max(1, len(onl.packs)),
        packing_lost=int(lost.sum()),
        packing_lost_tokens=float(stats.total_tokens[lost].sum()) / total,
    )


def _round_budget(x: float) -> int:
    """Round up to a 'nice' budget: a multiple of 256 below 2048, of 1024 above."""
    step = 256 if x <= 2048 else 1024
    return max(step, int(math.ceil(x / step) * step))


@dataclass
class Recommendation:
    max_tokens: int
    overlength: str
    reasons: list[str]
    max_images: int = 0  # an encoder-input budget (images or tiles) that a full pack rarely reaches; 0 = none


def recommend(
    stats: LengthStats,
    min_samples_per_pack: int = 8,
    keep_quantile: float = 99.9,
    max_images: int = 1 << 30,
    cap: int = 16384,
) -> Recommendation:
    """The smallest nice budget that keeps ``keep_quantile`` % of samples whole and fits
    ``min_samples_per_pack`` median samples (so the packer has enough small items to fill packs), at most ``cap``
    (what activation memory allows). Past the cap, the long tail is truncated rather than dropped when it is
    more than 0.5% of the data."""
    if stats.num_samples == 0:
        return Recommendation(1024, "drop", ["the dataset is empty; any budget works"])
    p = percentiles(stats.total_tokens)
    # the length of the k-th shortest sample, k = the samples that make up keep_quantile %: a budget at or above it
    # does keep that share whole (an interpolated percentile can fall between the two longest samples of a small
    # dataset and leave the longest out)
    k = max(1, math.ceil(keep_quantile / 100 * stats.num_samples - 1e-9))
    q = float(np.sort(stats.total_tokens)[k - 1])
    med = p["p50"]
    wanted = _round_budget(max(q, min_samples_per_pack * med))
    budget = min(wanted, cap)
    over = int((stats.total_tokens > budget).sum())
    frac = over / stats.num_samples
    reasons = [
        f"p{keep_quantile:g} of total tokens is {q:.0f}: a budget at or above it keeps {keep_quantile:g}% of samples whole",
        f"median sample is {med:.0f} tokens: {min_samples_per_pack} median samples need {min_samples_per_pack * med:.0f}; "
        "packs of many small samples fill to ~99% or more with the online packer",
        f"rounded up to {wanted}"
        + (f", capped at {cap} (--max-budget for memory, or the model's context)" if wanted > cap else "")
        + f": {over} {'sample is' if over == 1 else 'samples are'} longer ({frac:.3%}; max {p['max']:.0f})",
    ]
    if over == 0:
        policy = "drop"
        reasons.append("no sample exceeds it, so the over-length policy never triggers (drop is the safe default)")
    elif frac <= 0.005:
        policy = "drop"
        reasons.append(
            f"dropping {over} samples ({frac:.3%}) loses little; truncation would cut answers mid-way "
            "(the loss is on answers, usually at the end)"
        )
    else:
        policy = "truncate"
        reasons.append(
            f"{frac:.2%} of samples exceed it: dropping them would bias the data against long answers; truncating "
            "keeps their images and prompts (or raise max_tokens if memory allows)"
        )
        if stats.prompt_tokens is not None and (no_answer := int((stats.prompt_tokens >= budget).sum())):
            reasons.append(
                f"{no_answer} of them {'has' if no_answer == 1 else 'have'} a prompt of {budget} tokens or more: "
                "truncation keeps no answer of those, so they are skipped (counted as overlength) all the same"
            )
    images_per_pack = budget / max(1.0, float(stats.total_tokens.mean())) * float(stats.n_images.mean())
    # room for a full pack's usual count with a margin, and for all but the rarest samples whole
    keep = int(np.ceil(np.percentile(stats.n_images, keep_quantile)))
    vision_budget = max(1, math.ceil(images_per_pack * 1.25), keep)
    if (over := int((stats.n_images > max_images).sum())) and max_images < (1 << 30):
        reasons.append(
            f"{over} samples have more {stats.unit} than data.max_images={max_images}: each is skipped "
            f"(too_many_{stats.unit}); data.max_images={vision_budget} keeps {keep_quantile:g}% of samples"
        )
    if images_per_pack > max_images:
        reasons.append(
            f"a full pack holds ~{images_per_pack:.0f} {stats.unit} on average but data.max_images={max_images}: the "
            f"{stats.unit} budget will end packs early; raise data.max_images to ~{math.ceil(images_per_pack * 1.25)} if the vision "
            "encoder's memory allows"
        )
    return Recommendation(budget, policy, reasons, vision_budget)


# ----------------------------------------------------------------------------------------------------------
# plots and report


def _hist(ax, x: np.ndarray, title: str, xlabel: str, budget: int | None = None) -> None:
    if len(x):
        bins = min(80, max(10, int(np.sqrt(len(x)))))
        ax.hist(x, bins=bins, color="#4C72B0")
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            v = np.percentile(x, q)
            ax.axvline(v, color="k", linestyle=style, linewidth=1, label=f"p{q} = {v:.0f}")
        if budget is not None:
            ax.axvline(budget, color="#C44E52", linewidth=2, label=f"max_tokens = {budget}")
        ax.legend(fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    if len(x) and x.max() > 20 * max(1.0, np.median(x)):
        ax.set_yscale("log")


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_lengths(stats: LengthStats, out: Path, budget: int) -> dict[str, str]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    _hist(ax, stats.text_tokens, "Text tokens per sample (<image> counted once)", "tokens")
    _save(fig, out / "text_tokens.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    per = "tile" if stats.unit == "tiles" else "image"
    _hist(ax, stats.total_tokens, f"Total tokens per sample ({stats.image_token_count} per {per})", "tokens", budget)
    _save(fig, out / "total_tokens.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    vals, counts = np.unique(stats.n_images, return_counts=True) if stats.num_samples else ([], [])
    ax.bar([str(v) for v in vals], counts, color="#55A868")
    ax.set_title(f"{stats.unit.capitalize()} per sample")
    ax.set_xlabel(stats.unit)
    ax.set_ylabel("samples")
    _save(fig, out / f"{stats.unit}_per_sample.png")
    return {
        "text_tokens.png": "histogram of text tokens per sample",
        "total_tokens.png": "histogram of total tokens (images expanded) with the budget",
        f"{stats.unit}_per_sample.png": f"bar chart of {stats.unit} per sample",
    }


def _plot_waste(w: WasteReport, out: Path, budget: int, batch_size: int) -> dict[str, str]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["pad to longest", "constrained\n(truncate)", "packing\n(online)", "packing\n(FFD reference)"]
    values = [w.pad_to_longest, w.constrained, w.packing, w.packing_ffd]
    bars = ax.bar(names, [100 * v for v in values], color=["#C44E52", "#DD8452", "#4C72B0", "#8172B3"])
    for b, v in zip(bars, values):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{v:.1%}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("% of token slots wasted")
    ax.set_title(f"Waste at max_tokens={budget} (padded batches of {batch_size})")
    _save(fig, out / "waste.png")
    return {"waste.png": "wasted slot fraction per batching strategy at the budget"}


def _plot_sweep(stats: LengthStats, out: Path, budget: int, recommended: int, **waste_args) -> dict[str, str]:
    import matplotlib.pyplot as plt

    budgets = sorted({b for b in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, budget, recommended)})
    if stats.num_samples:
        med = float(np.median(stats.total_tokens))
        budgets = [b for b in budgets if b >= med] or [budget]
    sweep = [waste(stats, b, **waste_args, reference=False) for b in budgets]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(budgets, [100 * s.packing for s in sweep], "o-", label="packing waste (online)")
    ax.plot(budgets, [100 * s.constrained for s in sweep], "s-", label="constrained padding waste")
    over = [100 * s.over_budget / max(1, stats.num_samples) for s in sweep]
    ax.plot(budgets, over, "^-", label="% samples over budget")
    ax.axvline(recommended, color="#55A868", linestyle="--", label=f"recommended {recommended}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_tokens (cutoff)")
    ax.set_ylabel("%")
    ax.set_title("Waste and over-length samples vs budget")
    ax.legend(fontsize=8)
    _save(fig, out / "waste_vs_budget.png")
    return {"waste_vs_budget.png": "waste and samples over budget for a range of budgets"}


def render_summary(
    stats: LengthStats, w: WasteReport, rec: Recommendation, budget: int, batch_size: int, plots: dict[str, str]
) -> str:
    """summary.md: length percentiles, waste per strategy at the budget, the recommendation, the plots."""
    lines = [
        "# Dataset length report",
        "",
        f"Sources: {', '.join(stats.sources)}  ",
        f"Samples: {stats.num_samples:,}; image tokens per {'tile' if stats.unit == 'tiles' else 'image'}: "
        f"{stats.image_token_count}; "
        f"total tokens: {int(stats.total_tokens.sum()):,}",
        "",
        "| | mean | p50 | p90 | p99 | p99.9 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in (
        ("text tokens", stats.text_tokens),
        ("total tokens", stats.total_tokens),
        (stats.unit, stats.n_images),
    ):
        p = percentiles(x)
        lines.append(
            f"| {name} | {p['mean']:.1f} | {p['p50']:.0f} | {p['p90']:.0f} | {p['p99']:.0f} | {p['p99.9']:.0f} | {p['max']:.0f} |"
        )
    sim = "" if w.simulated == stats.num_samples else f" (simulated on a random {w.simulated:,}-sample subset)"
    lines += [
        "",
        f"## Waste at max_tokens = {budget}{sim}",
        "",
        "| strategy | wasted slots | samples lost | tokens lost |",
        "|---|---|---|---|",
        f"| pad to longest (batches of {batch_size}) | {w.pad_to_longest:.1%} | 0 | 0 |",
        f"| constrained padding, truncate at {budget} | {w.constrained:.1%} | 0 ({w.constrained_truncated_samples} truncated) | {w.constrained_lost_tokens:.2%} |",
        f"| constrained padding, drop above {budget} | - | {w.over_budget} | {w.over_budget_tokens:.2%} |",
        f"| packing, online packer (training) | {w.packing:.1%} | {w.packing_lost} (overlength=drop) | {w.packing_lost_tokens:.2%} |",
        f"| packing, offline FFD reference | {w.packing_ffd:.1%} | {w.packing_lost} | {w.packing_lost_tokens:.2%} |",
        "",
    ]
    if w.over_images:
        lines.append(f"{w.over_images} samples have more {stats.unit} than max_images and can never be placed.\n")
    if w.image_bound_packs > 0.5:
        lines.append(
            f"{w.image_bound_packs:.0%} of packs reached the image budget (max_images={w.max_images}) before the "
            "token budget: packing waste here comes from the image budget, not from lengths.\n"
        )
    lines += ["## Recommendation", ""]
    lines += [f"`data.max_tokens={rec.max_tokens} data.overlength={rec.overlength} data.max_images={rec.max_images}`"]
    lines += ["", f"(data.max_images counts {stats.unit}.)", ""]
    lines += [*[f"- {r}" for r in rec.reasons], "", "## Plots", ""]
    lines += [*[f"- `{name}`: {what}" for name, what in plots.items()], ""]
    return "\n".join(lines)


def write_report(
    stats: LengthStats,
    out_dir: str | Path,
    budget: int,
    batch_size: int = 8,
    max_images: int = 1 << 30,
    lookahead: int = 64,
    seed: int = 0,
    max_budget: int = 16384,
) -> dict:
    """Write the PNG plots and summary.md into ``out_dir``; return the numbers as a dict."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    w = waste(stats, budget, batch_size, max_images, lookahead, seed)
    rec = recommend(stats, max_images=max_images, cap=max_budget)
    plots = _plot_lengths(stats, out, budget) | _plot_waste(w, out, budget, batch_size)
    waste_args = {"batch_size": batch_size, "max_images": max_images, "lookahead": lookahead, "seed": seed}
    plots |= _plot_sweep(stats, out, budget, rec.max_tokens, **waste_args)
    (out / "summary.md").write_text(render_summary(stats, w, rec, budget, batch_size, plots))
    return {
        "num_samples": stats.num_samples,
        "text_tokens": percentiles(stats.text_tokens),
        "total_tokens": percentiles(stats.total_tokens),
        "waste": w.__dict__,
        "recommended_max_tokens": rec.max_tokens,
        "recommended_overlength": rec.overlength,
        "recommended_max_images": rec.max_images,
        "unit": stats.unit,
        "vision_inputs": percentiles(stats.n_images),
        "plots": sorted(plots),
    }
