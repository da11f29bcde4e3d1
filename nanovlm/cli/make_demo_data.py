"""``python scripts/make_demo_data.py [--output data/demo]``: build the offline demo dataset and tokenizer.

Writes ``<output>/tokenizer`` (a byte-level BPE trained on the demo text), ``<output>/train`` and
``<output>/val`` (held out: drawn from a different random stream). Deterministic: re-running gives the same
bytes. The default training run builds this automatically when it is missing (data.make_demo_if_missing).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from nanovlm.data.demo import TRAIN_SAMPLES, VAL_SAMPLES


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/make_demo_data.py", description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--output", default="data/demo", help="output directory (default: data/demo)")
    p.add_argument("--train-samples", type=int, default=TRAIN_SAMPLES, help=f"training samples ({TRAIN_SAMPLES})")
    p.add_argument("--val-samples", type=int, default=VAL_SAMPLES, help=f"held-out samples ({VAL_SAMPLES})")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    p.add_argument(
        "--mix", default="default", choices=["default", "detail", "detail_shape"], help="task mix (default: default)"
    )
    p.add_argument("--samples-per-shard", type=int, default=500, help="samples per tar shard (default: 500)")
    p.add_argument(
        "--image-token-count",
        type=int,
        default=16,
        help="image tokens of the target model, recorded in the index (default: 16, the tiny config)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.output:
        raise SystemExit("error: --output must not be empty")
    if args.train_samples <= 0 or args.val_samples < 0 or args.samples_per_shard <= 0:
        raise SystemExit("error: --train-samples and --samples-per-shard must be positive, --val-samples >= 0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from nanovlm.data.demo import make_demo_data

    t0 = time.perf_counter()
    info = make_demo_data(
        args.output,
        args.train_samples,
        args.val_samples,
        args.seed,
        args.image_token_count,
        args.samples_per_shard,
        args.mix,
    )
    print(
        f"demo data in {info['root']}: {info['train_samples']} train / {info['val_samples']} val samples, "
        f"tokenizer vocab {info['vocab_size']}, chance accuracy {info['chance_accuracy']:.1%} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    return 0
