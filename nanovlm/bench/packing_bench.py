"""Packing quality: every strategy on the same samples in the same order, scored the same way.

For each distribution x token budget ``L`` the strategies are

- ``ours``: ``nanovlm.data.packing.pack_online`` (online subset-sum fill over a lookahead buffer, bounded carry-over);
- ``mmdp knapsack``: the balanced greedy knapsack of HF's mmdp / nanoVLM (``baselines.py``), with the
  buffer nanoVLM's ``train.py`` uses (8 packs) and the one the mmdp class defaults to (1024 packs), both with
  the published ``delta`` of 5 spare bins, plus the 8-pack buffer with ``delta`` 0 (a tuned variant);
- ``DataCollatorWithFlattening``: padding-free, fixed samples per step, no token budget;
- ``pad_to_longest``: fixed samples per step, each step padded to its longest sample;
- ``constrained``: fixed samples per step, samples above a cutoff dropped, every sample padded to the cutoff;
- ``FFD (offline)``: ``ffd_reference``, first-fit-decreasing over the whole dataset: the practical optimum.

Fixed-samples-per-step strategies use ``B = round(L / mean length)`` samples, so that a step holds about
``L`` real tokens on average, like a pack. The packed strategies share one image cap per pack.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nanovlm.bench.baselines import StepPlan, balanced_greedy_knapsack, flattening_steps
from nanovlm.bench.common import Stats, markdown_table, pct
from nanovlm.bench.distributions import LengthSet
from nanovlm.data import packing


def _from_pack_result(name: str, res: packing.PackResult, n_images, slots_fn: Callable[[list[int]], int]) -> StepPlan:
    dropped = sorted(i for idx in res.skipped.values() for i in idx)
    steps = [list(p) for p in res.packs if p]
    return StepPlan(
        name=name,
        steps=steps,
        slots=[slots_fn(p) for p in steps],
        tokens=[sum(res.lengths[i] for i in p) for p in steps],
        images=[sum(int(n_images[i]) for i in p) for p in steps],
        dropped=dropped,
        truncated_tokens=0,
    )


def ours(ls: LengthSet, L: int, max_images: int, lookahead: int, max_carry: int) -> StepPlan:
    res = packing.pack_online(ls.lengths, ls.n_images, L, max_images, lookahead=lookahead, max_carry=max_carry)
    plan = _from_pack_result("ours (online exact fill)", res, ls.n_images, lambda p: L)
    plan.notes = {"lookahead": lookahead, "max_carry": max_carry, "max_wait_packs": res.max_wait}
    return plan


def ffd(ls: LengthSet, L: int, max_images: int) -> StepPlan:
    res = packing.ffd_reference(ls.lengths, ls.n_images, L, max_images)
    return _from_pack_result("FFD (offline reference)", res, ls.n_images, lambda p: L)


def pad_to_longest(ls: LengthSet, L: int, batch_size: int) -> StepPlan:
    res = packing.pad_to_longest(ls.lengths, ls.n_images, batch_size, L)
    plan = _from_pack_result(
        f"pad-to-longest (batch {batch_size})", res, ls.n_images, lambda p: len(p) * max(res.lengths[i] for i in p)
    )
    plan.fixed_budget = False
    return plan


def constrained(ls: LengthSet, L: int, batch_size: int, cutoff: int) -> StepPlan:
    res = packing.constrained(ls.lengths, ls.n_images, batch_size, cutoff)
    plan = _from_pack_result(
        f"constrained (batch {batch_size}, cutoff {cutoff})", res, ls.n_images, lambda p: len(p) * cutoff
    )
    plan.notes = {"cutoff": cutoff}
    return plan


def plan_metrics(plan: StepPlan, ls: LengthSet, L: int, bound_fill: float, ffd_fill: float) -> dict[str, Any]:
    """Fill, slots and tokens per step, images per step, drops, and the gaps to the bound and to FFD."""
    tokens, slots = sum(plan.tokens), sum(plan.slots)
    n_steps = len(plan.steps)
    fill = tokens / max(1, slots)
    peak = max(plan.slots) if plan.slots else 0
    total_tokens = sum(ls.lengths)
    dropped_tokens = sum(ls.lengths[i] for i in plan.dropped)
    cv = (statistics.pstdev(plan.slots) / statistics.mean(plan.slots)) if n_steps > 1 else 0.0
    return {
        "strategy": plan.name,
        "steps": n_steps,
        "fill": fill,
        "fill_at_peak": tokens / max(1, n_steps * peak),  # memory is provisioned for the largest step
        "slots_per_step_mean": slots / max(1, n_steps),
        "slots_per_step_cv": cv,
        "slots_per_step_max": peak,
        "steps_over_budget": sum(1 for s in plan.slots if s > L),
        "samples_per_step": sum(len(s) for s in plan.steps) / max(1, n_steps),
        "images_per_step_mean": sum(plan.images) / max(1, n_steps),
        "images_per_step_max": max(plan.images) if plan.images else 0,
        "dropped_samples": len(plan.dropped),
        "dropped_tokens_frac": dropped_tokens / max(1, total_tokens),
        "gap_to_bound_pp": 100.0 * (bound_fill - fill),
        "gap_to_ffd_pp": 100.0 * (ffd_fill - fill),
        "fixed_budget": plan.fixed_budget,
        **{f"note_{k}": v for k, v in plan.notes.items()},
    }


def _time_us_per_sample(fn: Callable[[], Any], n: int, reps: int) -> Stats:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6 / max(1, n))
    return Stats.of(times)


def run_cell(
    ls: LengthSet,
    L: int,
    max_images: int = 18,
    lookahead: int = 64,
    max_carry: int = 8,
    reps: int = 5,
    mmdp_variants: tuple[tuple[int, int], ...] = ((8, 5), (1024, 5), (8, 0)),
    seed: int = 0,
) -> dict[str, Any]:
    """All strategies on one distribution at one budget. Returns the bound, FFD fill and a row per strategy."""
    fits = [i for i, (n, m) in enumerate(zip(ls.lengths, ls.n_images)) if n <= L and m <= max_images]
    fit_tokens = sum(ls.lengths[i] for i in fits)
    fit_images = sum(ls.n_images[i] for i in fits)
    # no packing needs fewer packs than the tokens or the images need: the bound is the larger of the two
    token_bound = math.ceil(fit_tokens / L)
    image_bound = math.ceil(fit_images / max_images) if max_images > 0 else 0
    lower_bound_packs = max(1, token_bound, image_bound)
    bound_fill = fit_tokens / (lower_bound_packs * L)
    mean_len = statistics.mean(ls.lengths[i] for i in fits)
    batch = max(1, round(L / mean_len))
    cutoff = min(L, int(math.ceil(np.percentile(ls.lengths, 95) / 64.0) * 64))
    n = len(ls.lengths)

    ffd_plan = ffd(ls, L, max_images)
    ffd_fill = sum(ffd_plan.tokens) / max(1, sum(ffd_plan.slots))

    runners: list[tuple[Callable[[], StepPlan], bool]] = [
        (lambda: ours(ls, L, max_images, lookahead, max_carry), True),
        *[
            (
                lambda nb=nb, dl=dl: balanced_greedy_knapsack(
                    ls.lengths,
                    ls.n_images,
                    L,
                    num_sequences=nb,
                    delta=dl,
                    max_images_per_knapsack=max_images,
                    seed=seed,
                ),
                True,
            )
            for nb, dl in mmdp_variants
        ],
        (lambda: flattening_steps(ls.lengths, ls.n_images, batch, max_len=L), False),
        (lambda: pad_to_longest(ls, L, batch), True),
        (lambda: constrained(ls, L, batch, cutoff), True),
    ]
    rows = []
    for fn, timed in runners:
        plan = fn()
        row = plan_metrics(plan, ls, L, bound_fill, ffd_fill)
        if timed:
            row["us_per_sample"] = _time_us_per_sample(fn, n, reps).to_dict()
        else:  # the flattening collator builds tensors: time it on a bounded prefix, report it as collation
            prefix = LengthSet(ls.name, ls.lengths[: 200 * batch], ls.n_images[: 200 * batch])
            row["collate_us_per_sample"] = _time_us_per_sample(
                lambda p=prefix: flattening_steps(p.lengths, p.n_images, batch, max_len=L), len(prefix.lengths), reps
            ).to_dict()
            row["us_per_sample"] = None
        rows.append(row)
    ffd_row = plan_metrics(ffd_plan, ls, L, bound_fill, ffd_fill)
    ffd_row["us_per_sample"] = _time_us_per_sample(lambda: ffd(ls, L, max_images), n, max(1, min(reps, 3))).to_dict()
    rows.append(ffd_row)
    return {
        "distribution": ls.describe(),
        "budget_tokens": L,
        "max_images": max_images,
        "batch_size_for_fixed_count": batch,
        "constrained_cutoff": cutoff,
        "samples_fitting_budget": len(fits),
        "lower_bound_packs": lower_bound_packs,
        "bound_binding": "images" if image_bound > token_bound else "tokens",
        "bound_fill": bound_fill,
        "ffd_packs": len(ffd_plan.steps),
        "ffd_fill": ffd_fill,
        "rows": rows,
    }


def cell_table(cell: dict[str, Any]) -> str:
    """Markdown table of one cell (distribution x budget)."""
    headers = [
        "strategy",
        "fill",
        "fill at peak",
        "slots/step (cv)",
        "samples/step",
        "images/step (max)",
        "dropped tok",
        "gap to bound",
        "gap to FFD",
        "cost us/sample",
    ]
    out = []
    for r in cell["rows"]:
        if r.get("us_per_sample"):
            s = Stats(**r["us_per_sample"])
            cost = s.fmt(2)
        elif r.get("collate_us_per_sample"):
            cost = "collate " + Stats(**r["collate_us_per_sample"]).fmt(1)
        else:
            cost = "-"
        out.append(
            [
                r["strategy"],
                pct(r["fill"], 2),
                pct(r["fill_at_peak"], 1),
                f"{r['slots_per_step_mean']:.0f} ({r['slots_per_step_cv']:.2f})",
                f"{r['samples_per_step']:.1f}",
                f"{r['images_per_step_mean']:.1f} ({r['images_per_step_max']})",
                pct(r["dropped_tokens_frac"], 1),
                f"{r['gap_to_bound_pp']:+.2f} pp",
                f"{r['gap_to_ffd_pp']:+.2f} pp",
                cost,
            ]
        )
    d = cell["distribution"]
    title = (
        f"**{d['name']}**, L = {cell['budget_tokens']}, <= {cell['max_images']} images/pack: {d['samples']} samples, "
        f"mean {d['mean']:.0f} / p99 {d['p99']:.0f} / max {d['max']} tokens; bound fill "
        f"{pct(cell['bound_fill'], 2)} ({cell['lower_bound_packs']} packs"
        + (", the image cap binds" if cell.get("bound_binding") == "images" else "")
        + f"), FFD {pct(cell['ffd_fill'], 2)} "
        f"({cell['ffd_packs']} packs)"
    )
    return title + "\n\n" + markdown_table(headers, out)


def lookahead_sweep(
    ls: LengthSet, L: int, max_images: int, lookaheads: tuple[int, ...], max_carry: int = 8
) -> list[dict[str, Any]]:
    """Ours with one factor changed: the lookahead buffer (fill, worst wait, gap to FFD)."""
    ffd_fill = ffd(ls, L, max_images)
    ffd_f = sum(ffd_fill.tokens) / max(1, sum(ffd_fill.slots))
    rows = []
    for la in lookaheads:
        res = packing.pack_online(ls.lengths, ls.n_images, L, max_images, lookahead=la, max_carry=max_carry)
        fill = res.fill(L)
        rows.append(
            {
                "distribution": ls.name,
                "budget_tokens": L,
                "lookahead": la,
                "max_carry": max_carry,
                "fill": fill,
                "gap_to_ffd_pp": 100.0 * (ffd_f - fill),
                "max_wait_packs": res.max_wait,
            }
        )
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["distribution", "L", "lookahead", "fill", "gap to FFD", "longest wait (packs)"],
        [
            [
                r["distribution"],
                r["budget_tokens"],
                r["lookahead"],
                pct(r["fill"], 2),
                f"{r['gap_to_ffd_pp']:+.2f} pp",
                r["max_wait_packs"],
            ]
            for r in rows
        ],
    )
