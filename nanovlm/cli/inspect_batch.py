"""``python scripts/inspect_batch.py [DATASET_DIR] [--out FILE.png] [--config FILE] [key=value ...]``: see packs.

Builds the training DataModule (default config: tiny_cpu.yaml; DATASET_DIR replaces data.train) and shows
its first batches:

* as text: the epoch plan, then per batch the tensor shapes, fill, ``cu_seqlens`` and the first ``--samples``
  samples decoded, with ``[[...]]`` around the tokens that carry a loss and ``<image xN>`` for image tokens;
* with ``--out``, as a PNG: one row per pack, a colour per sample, image tokens dark, prompt (loss-masked)
  tokens light, unused slots grey, with the fill of each row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from nanovlm.constants import IGNORE_INDEX, IMAGE_TOKEN


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/inspect_batch.py",
        description="Show (and draw) the first packed batches the DataModule makes.",
    )
    p.add_argument("dataset", nargs="?", default=None, help="dataset directory (default: the config's data.train)")
    p.add_argument("--out", default=None, help="also draw the batches into this PNG")
    p.add_argument("--config", action="append", default=None, help="run config(s) (default: tiny_cpu.yaml)")
    p.add_argument("--batches", type=int, default=4, help="batches to show (default: 4)")
    p.add_argument("--samples", type=int, default=2, help="samples to decode per batch (default: 2)")
    p.add_argument("--val", action="store_true", help="show the validation loader instead")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.max_tokens=2048")
    args = p.parse_intermixed_args(argv)
    if args.dataset is not None and "=" in args.dataset and not Path(args.dataset).is_dir():
        # no directory given: argparse handed the first key=value override to the optional positional
        args.overrides.insert(0, args.dataset)
        args.dataset = None
    return args


def decode_marked(
    tokenizer, ids: list[int], labels: list[int], image_token_id: int, per_image: int | None = None
) -> str:
    """Decode one sample: ``[[...]]`` around runs of loss tokens, ``<image xN>`` for each image's run of image
    tokens (adjacent images are told apart by ``per_image``, the tokens of one image)."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        kind = "image" if ids[i] == image_token_id else ("loss" if labels[i] != IGNORE_INDEX else "text")
        j = i
        while j < len(ids):
            k = "image" if ids[j] == image_token_id else ("loss" if labels[j] != IGNORE_INDEX else "text")
            if k != kind:
                break
            j += 1
        if kind == "image":
            n = j - i
            step = per_image if per_image and n % per_image == 0 else n
            parts += [f"<image x{step}>"] * (n // step)
        else:
            text = tokenizer.decode(ids[i:j], skip_special_tokens=False)
            parts.append(f"[[{text}]]" if kind == "loss" else text)
        i = j
    return "".join(parts)


def _shape(x) -> str:
    return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"


def describe_batch(
    batch: dict, index: int, tokenizer, image_token_id: int, n_samples: int, per_image: int | None = None
) -> list[str]:
    meta = batch.get("meta", {})
    index = meta.get("index", index)  # the batch's place in its epoch (a run of batches can cross an epoch end)
    tensors = [
        k for k in ("input_ids", "labels", "position_ids", "attention_mask", "cu_seqlens", "pixel_values") if k in batch
    ]
    lines = [
        f"batch {index} of epoch {meta.get('epoch', '?')}: " + ", ".join(f"{k} {_shape(batch[k])}" for k in tensors)
    ]
    real, slots = meta.get("real_tokens", 0), meta.get("slots", batch["input_ids"].numel())
    skips = meta.get("skips") or []
    skip_text = ", ".join(f"{k} ({r})" for k, r, *_ in skips) if skips else "none"
    lines.append(
        f"  {len(batch['sample_keys'])} samples, {int(batch['pixel_values'].shape[0])} images, {real}/{slots} real "
        f"tokens (fill {real / max(1, slots):.1%}), {int((batch['labels'] != IGNORE_INDEX).sum())} loss tokens, "
        f"skips {skip_text}"
    )
    ids, labels = batch["input_ids"], batch["labels"]
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        lines.append(f"  cu_seqlens {cu}  max_seqlen {batch.get('max_seqlen')}")
        spans = [(0, cu[j], cu[j + 1]) for j in range(len(batch["sample_keys"]))]
    else:
        mask = batch.get("attention_mask")
        spans = [(r, 0, int(mask[r].sum()) if mask is not None else ids.shape[1]) for r in range(ids.shape[0])]
    for key, (row, a, b) in list(zip(batch["sample_keys"], spans))[:n_samples]:
        text = decode_marked(tokenizer, ids[row, a:b].tolist(), labels[row, a:b].tolist(), image_token_id, per_image)
        lines.append(f"  - {key} ({b - a} tokens): {text!r}")
    return lines


def describe_plan(summary: dict, max_tokens: int) -> list[str]:
    lines = [
        f"dataset {d['dir']}: {d['samples']} samples in {d['shards']} shards, weight {d['weight']}"
        for d in summary["datasets"]
    ]
    skips = summary.get("planned_skips") or {}
    fill = summary.get("planned_fill")
    lines.append(
        f"epoch plan: {summary['samples_per_epoch']} samples, {summary['tokens_per_epoch']} tokens -> "
        f"{summary['packs_per_epoch']} packs of {max_tokens} slots"
        + (f" (planned fill {fill:.1%} in this rank's first slot)" if fill is not None else "")
        + f"; {summary['batches_per_rank_per_epoch']} batches per rank; {summary['slot_carry_out']} samples "
        f"carried from that slot to the next epoch; planned skips {', '.join(f'{r}={n}' for r, n in skips.items()) or 'none'}; "
        f"queue memory {summary['queue_memory_mb']} MB"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is not None and not args.out.strip():
        raise SystemExit("error: --out must not be empty")
    if args.batches <= 0 or args.samples < 0:
        raise SystemExit("error: --batches must be positive and --samples non-negative")
    from nanovlm.config import ConfigError, load_config
    from nanovlm.data.index import load_index

    try:
        cfg = load_config(args.config or ["tiny_cpu.yaml"], args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.dataset is not None:  # the dataset given is what is shown, also with --val
        cfg.data.train = [args.dataset]
        cfg.data.val = [args.dataset] if args.val else []
    for d in cfg.data.val if args.val else cfg.data.train:
        try:
            load_index(d)
        except FileNotFoundError as e:
            if cfg.data.make_demo_if_missing and d in ("data/demo/train", "data/demo/val"):
                from nanovlm.data.demo import ensure_demo_data

                ensure_demo_data("data/demo")
                continue
            raise SystemExit(f"error: {e}") from None
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if args.val and not cfg.data.val:
        raise SystemExit("error: --val needs data.val directories")
    if args.out is not None:  # before the data work, not a traceback after it
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cfg.data.num_workers = 0  # read in this process: deterministic and quick

    from nanovlm.data.datamodule import PackedMultimodalDataModule
    from nanovlm.data.shards import PlanError
    from nanovlm.data.visualize import draw_packs

    dm = PackedMultimodalDataModule(cfg.data, cfg.model)
    dm.setup("fit")
    tok = dm.tokenizer
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    if args.val:  # the training plan would describe other data
        print(
            f"validation: {len(dm.val_table)} samples from {', '.join(cfg.data.val)}"
            + (f" (data.val_samples={cfg.data.val_samples})" if cfg.data.val_samples > 0 else "")
            + f", in stored order, each once; packs of {cfg.data.max_tokens} slots"
        )
    else:
        try:
            summary = dm.summary()
        except PlanError as e:
            raise SystemExit(f"error: {e}") from None
        print("\n".join(describe_plan(summary, cfg.data.max_tokens)))
    batches = []
    for batch in dm.val_dataloader() if args.val else dm.train_dataloader():
        print()
        print("\n".join(describe_batch(batch, len(batches), tok, image_token_id, args.samples, dm.image_token_count)))
        batches.append(batch)
        if len(batches) >= args.batches:
            break
    if args.out:
        fills = draw_packs(
            batches, args.out, image_token_id=image_token_id, max_rows=args.batches * cfg.data.batch_size
        )
        real = sum(b["meta"]["real_tokens"] for b in batches)
        slots = sum(b["meta"].get("slots", b["input_ids"].numel()) for b in batches)
        print(f"\ndrew {len(fills)} rows from {len(batches)} batches (packing={cfg.data.packing}, "
              f"max_tokens={cfg.data.max_tokens}): fill {real / max(1, slots):.1%} -> {args.out}")  # fmt: skip
    return 0
