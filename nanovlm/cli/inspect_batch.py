"""``python scripts/inspect_batch.py DATASET_DIR --out FILE.png [--config FILE] [key=value ...]``: see packs.

Builds the training DataModule on DATASET_DIR with the given config (default: tiny_cpu.yaml) and draws its
first packed batches: one row per pack, a colour per sample, image tokens dark, prompt (loss-masked) tokens
light, unused slots grey, with the fill of each row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/inspect_batch.py",
        description="Draw the first packed batches the DataModule makes from a dataset directory.",
    )
    p.add_argument("dataset", help="dataset directory (shards + index.json)")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--config", action="append", default=None, help="run config(s) (default: tiny_cpu.yaml)")
    p.add_argument("--batches", type=int, default=8, help="packs to draw (default: 8)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.max_tokens=2048")
    return p.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.out:
        raise SystemExit("error: --out must not be empty")
    if args.batches <= 0:
        raise SystemExit("error: --batches must be positive")
    from nanovlm.config import ConfigError, load_config
    from nanovlm.data.index import load_index

    try:
        cfg = load_config(args.config or ["tiny_cpu.yaml"], args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        load_index(args.dataset)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    cfg.data.train = [args.dataset]
    cfg.data.val = []
    cfg.data.num_workers = 0  # draw in this process: deterministic and quick

    try:
        from nanovlm.data.datamodule import PackedMultimodalDataModule
    except ImportError as e:  # pragma: no cover - only in a partial checkout
        raise SystemExit(f"error: the DataModule is not available ({e})") from None
    from nanovlm.data.visualize import draw_packs

    dm = PackedMultimodalDataModule(cfg.data, cfg.model)
    dm.setup("fit")
    image_token_id = dm.tokenizer.convert_tokens_to_ids("<image>")
    batches = []
    for batch in dm.train_dataloader():
        batches.append(batch)
        if len(batches) >= args.batches:
            break
    fills = draw_packs(batches, args.out, image_token_id=image_token_id, max_rows=args.batches * cfg.data.batch_size)
    print(
        f"drew {len(fills)} rows from {len(batches)} batches of {args.dataset} (packing={cfg.data.packing}, "
        f"max_tokens={cfg.data.max_tokens}): mean fill {sum(fills) / len(fills):.1%} -> {args.out}"
    )
    for b in batches[:3]:
        print(
            f"  {len(b['sample_keys'])} samples, {int(b['pixel_values'].shape[0])} images: "
            f"{', '.join(b['sample_keys'][:6])}{' ...' if len(b['sample_keys']) > 6 else ''}"
        )
    return 0
