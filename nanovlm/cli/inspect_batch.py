"""``python scripts/inspect_batch.py [--config FILE ...] [--batches N] [key=value ...]``: look at packed batches.

Builds the run's PackedMultimodalDataModule exactly as training does and prints its plan summary, then the first
batches: shapes, the segments of each pack, fill, and every sample decoded with what the loss sees marked:
``[[...]]`` = tokens with a loss label, ``<image x16>`` = a run of image tokens.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nanovlm.config import ConfigError, load_config

DEFAULT_CONFIG = "tiny_cpu.yaml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/inspect_batch.py", description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--config", action="append", default=None, metavar="FILE", help=f"default: {DEFAULT_CONFIG}")
    p.add_argument("--batches", type=int, default=2, help="batches to print (default: 2)")
    p.add_argument("--samples", type=int, default=3, help="samples decoded per batch (default: 3)")
    p.add_argument("--val", action="store_true", help="inspect the validation loader instead")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.max_tokens=512")
    return p.parse_args(argv)


def render_sample(tokenizer, input_ids: list[int], labels: list[int], image_token_id: int) -> str:
    """Decode one sample, collapsing image-token runs and bracketing the tokens that carry a loss."""
    out: list[str] = []
    i = 0
    while i < len(input_ids):
        j = i
        if input_ids[i] == image_token_id:
            while j < len(input_ids) and input_ids[j] == image_token_id:
                j += 1
            out.append(f"<image x{j - i}>")
        else:
            loss = labels[i] != -100
            while j < len(input_ids) and input_ids[j] != image_token_id and (labels[j] != -100) == loss:
                j += 1
            text = tokenizer.decode(input_ids[i:j], skip_special_tokens=False)
            out.append(f"[[{text}]]" if loss else text)
        i = j
    return "".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    files = args.config or [DEFAULT_CONFIG]
    try:
        cfg = load_config(files, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from nanovlm.data.datamodule import PackedMultimodalDataModule
    from nanovlm.data.tokenizer import IMAGE_TOKEN
    from nanovlm.train.run import ensure_data

    ensure_data(cfg)
    dm = PackedMultimodalDataModule(cfg.data, cfg.model)
    dm.setup("fit")
    s = dm.summary()
    for d in s["datasets"]:
        print(f"dataset {d['dir']}: {d['samples']} samples in {d['shards']} shards, weight {d['weight']}")
    print(
        f"epoch plan: {s['samples_per_epoch']} samples, {s['tokens_per_epoch']} tokens -> {s['packs_per_epoch']} packs "
        f"of {cfg.data.max_tokens} slots (planned fill {s['planned_fill']:.1%}); {s['batches_per_rank_per_epoch']} "
        f"batches per rank; {s['carried_to_next_epoch']} samples carried to the next epoch; planned skips "
        f"{s['planned_skips'] or 'none'}; queue memory {s['queue_memory_mb']} MB"
    )
    tok = dm.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    loader = dm.val_dataloader() if args.val else dm.train_dataloader()
    for n, batch in enumerate(loader):
        if n == args.batches:
            break
        m = batch["meta"]
        cu = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else None
        print(
            f"\nbatch {m['index']} of epoch {m['epoch']}: "
            + ", ".join(
                f"{k} {tuple(batch[k].shape)} {str(batch[k].dtype).replace('torch.', '')}"
                for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "attention_mask", "pixel_values")
                if k in batch
            )
        )
        print(
            f"  {m['n_samples']} samples, {m['n_images']} images, {m['real_tokens']}/{m['slots']} real tokens "
            f"(fill {m['real_tokens'] / m['slots']:.1%}), {m['loss_tokens']} loss tokens, skips {m['skips'] or 'none'}"
        )
        if cu is not None:
            print(f"  cu_seqlens {cu}  max_seqlen {batch['max_seqlen']}")
        for j, key in enumerate(batch["sample_keys"][: args.samples]):
            if cu is not None:
                a, b = cu[j], cu[j + 1]
                ids, labels = batch["input_ids"][0, a:b].tolist(), batch["labels"][0, a:b].tolist()
            else:
                keep = batch["attention_mask"][j].bool()
                ids, labels = batch["input_ids"][j][keep].tolist(), batch["labels"][j][keep].tolist()
            print(f"  - {key} ({len(ids)} tokens): {render_sample(tok, ids, labels, image_id)!r}")
        if not args.val:
            dm.on_batch_consumed(batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
