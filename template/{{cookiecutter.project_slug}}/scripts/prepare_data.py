#!/usr/bin/env python
"""Raw JSONL (one sample per line, see decode.py) -> a nanovlm dataset directory (shards + index.json).

    python scripts/prepare_data.py --input raw/train.jsonl --out data/{{ cookiecutter.package_name }}/train --build-tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanovlm.config import image_token_count, load_config  # noqa: E402
from nanovlm.data.prepare import write_dataset  # noqa: E402
from nanovlm.data.tokenizer import build_tokenizer, load_tokenizer  # noqa: E402

from {{ cookiecutter.package_name }}.decode import decode_sample  # noqa: E402

DEFAULT_CONFIGS = ["tiny_cpu.yaml", str(ROOT / "configs" / "experiment.yaml")]


def prepare(input_path: Path, out_dir: Path, overrides: list[str], build: bool) -> dict:
    cfg = load_config(DEFAULT_CONFIGS, overrides)
    lines = [json.loads(line) for line in input_path.read_text().splitlines() if line.strip()]
    records = [decode_sample(raw, f"{input_path.stem}-{i:06d}", input_path.parent) for i, raw in enumerate(lines)]
    if build:  # a small offline BPE trained on this data (use a hub tokenizer for real projects)
        texts = [f"{m['role']}\n{m['content']}" for r in records for m in r.messages]
        tokenizer = build_tokenizer(cfg.data.tokenizer, texts, vocab_size=512)
    else:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    index = write_dataset(records, out_dir, tokenizer, image_token_count(cfg.model), created_by="prepare_data")
    return {"samples": index.num_samples, "out": str(out_dir), "tokenizer": cfg.data.tokenizer}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", type=Path, required=True, help="JSONL of raw samples (paths relative to its folder)")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--build-tokenizer", action="store_true", help="train a small tokenizer at data.tokenizer first")
    p.add_argument("overrides", nargs="*", help="config overrides (model.* decides the image token count)")
    args = p.parse_args()
    print(prepare(args.input, args.out, args.overrides, args.build_tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
