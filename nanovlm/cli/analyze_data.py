"""``python scripts/analyze_data.py DIR [DIR ...] --out REPORT_DIR [--max-tokens N]``: look at lengths before training.

Reads only each directory's index (fast on millions of samples) and writes PNG histograms, the token
waste of padding vs packing at a budget, and summary.md with a recommended data.max_tokens and over-length
policy.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/analyze_data.py",
        description="Length histograms, padding/packing waste and a recommended max_tokens, from the index only.",
    )
    p.add_argument("dirs", nargs="+", help="dataset directories (each with an index)")
    p.add_argument("--out", required=True, help="report directory (PNGs + summary.md)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="budget to evaluate (default: the config's data.max_tokens)"
    )
    p.add_argument(
        "--image-token-count",
        type=int,
        default=None,
        help="tokens per image (default: from --config; the index's value when it differs is reported)",
    )
    p.add_argument("--config", action="append", default=None, help="run config(s) (default: tiny_cpu.yaml)")
    p.add_argument("--batch-size", type=int, default=None, help="padded-baseline batch size (default: data.batch_size)")
    p.add_argument(
        "--max-budget",
        type=int,
        default=16384,
        help="largest max_tokens to recommend (what activation memory allows; default: 16384)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated sample order")
    p.add_argument("--verify", action="store_true", help="also re-hash every index column against meta.json")
    return p.parse_args(argv)  # fmt: skip


def _layout(cfg, itc: int):
    """The image layout of the config (tokens per image or tile: ``itc``). Splitting needs the tokenizer: split
    grids hold newlines, whose token count is the tokenizer's."""
    import dataclasses

    from nanovlm.data.tiling import ImageLayout

    if not cfg.model.vision.image_splitting:
        return ImageLayout(cfg.model.vision.image_size, itc)
    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.tokenizer import load_tokenizer

    try:  # split grids' newline counts are the tokenizer's
        tok = load_tokenizer(cfg.data.tokenizer, image_splitting=True)
        layout = SampleProcessor.from_config(tok, cfg.model, cfg.data).layout
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: image splitting needs the run's tokenizer: {e}") from None
    return dataclasses.replace(layout, tokens_per_tile=itc)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.out:
        raise SystemExit("error: --out must not be empty")
    from nanovlm.config import ConfigError, image_token_count, load_config
    from nanovlm.data.analysis import collect, write_report
    from nanovlm.data.index import DatasetIndexError, load_index

    try:
        cfg = load_config(args.config or ["tiny_cpu.yaml"])
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    indexes = []
    for d in args.dirs:
        try:
            indexes.append(load_index(d, check_files=False, verify=args.verify))
        except (FileNotFoundError, DatasetIndexError) as e:
            raise SystemExit(f"error: {e}") from None
    itc = args.image_token_count if args.image_token_count is not None else image_token_count(cfg.model)
    budget = args.max_tokens if args.max_tokens is not None else cfg.data.max_tokens
    batch = args.batch_size if args.batch_size is not None else cfg.data.batch_size
    if budget <= 0 or batch <= 0 or itc <= 0 or args.max_budget <= 0:
        raise SystemExit("error: --max-tokens, --batch-size, --image-token-count and --max-budget must be positive")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"error: --out {args.out} is a file; give a directory for the report")
    context = cfg.model.language.max_position_embeddings  # train.py refuses a data.max_tokens above it
    cap = min(args.max_budget, context)
    if budget > context:
        print(
            f"note: max_tokens={budget} exceeds model.language.max_position_embeddings={context}: training refuses it"
        )
    differing = {
        d: idx.image_token_count for d, idx in zip(args.dirs, indexes) if idx.image_token_count not in (0, itc)
    }
    for d, n in differing.items():  # lengths are recomputed with itc; say so when the data was made for another count
        print(f"note: {d} was prepared for {n} tokens per image; this analysis uses {itc} (--image-token-count)")
    stats = collect(indexes, _layout(cfg, itc))
    if stats.num_samples == 0:
        raise SystemExit(f"error: the index of {', '.join(args.dirs)} lists no samples: nothing to analyse")
    res = write_report(stats, args.out, budget, batch, cfg.data.max_images, cfg.data.lookahead, args.seed, cap)
    w = res["waste"]
    print(
        f"{res['num_samples']} samples; total tokens p50={res['total_tokens']['p50']:.0f} "
        f"p99={res['total_tokens']['p99']:.0f} max={res['total_tokens']['max']:.0f} ({itc} tokens per "
        f"{'tile' if stats.unit == 'tiles' else 'image'}); {stats.unit} per sample "
        f"p50={res['vision_inputs']['p50']:.0f} p99={res['vision_inputs']['p99']:.0f} max={res['vision_inputs']['max']:.0f}"
    )
    print(
        f"waste at max_tokens={budget}: pad-to-longest {w['pad_to_longest']:.1%}, constrained "
        f"{w['constrained']:.1%}, packing {w['packing']:.1%} (FFD {w['packing_ffd']:.1%}); "
        f"{w['over_budget']} samples over budget"
        + (
            f"; packing cannot place {w['packing_lost']} samples ({w['packing_lost_tokens']:.1%} of tokens: over the "
            "token or image budget)"
            if w["packing_lost"]
            else ""
        )
    )
    print(
        f"recommended: data.max_tokens={res['recommended_max_tokens']} data.overlength={res['recommended_overlength']} "
        f"data.max_images={res['recommended_max_images']} ({stats.unit})"
        + (
            f" (capped at the model's context, model.language.max_position_embeddings={context})"
            if res["recommended_max_tokens"] == cap < args.max_budget
            else ""
        )
    )
    print(f"report: {args.out}/summary.md and {', '.join(res['plots'])}")
    res["index_image_token_counts"] = {d: idx.image_token_count for d, idx in zip(args.dirs, indexes)}
    with open(f"{args.out}/report.json", "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    return 0
