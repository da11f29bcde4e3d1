#!/usr/bin/env python
"""Raw JSONL (one sample per line, see decode.py) -> a nanovlm dataset directory (shards + index).

    python scripts/prepare_data.py --input raw/train.jsonl --out data/{{ cookiecutter.package_name }}/train --build-tokenizer

A bad line (invalid JSON, a missing field, an unsafe or missing image path, an unreadable image) is skipped,
counted by reason and listed in ``<out>/rejected.jsonl`` with its ``file:line``; the other samples are written.
Samples are streamed: memory does not grow with the dataset.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanovlm.cli.prepare_data import Report  # noqa: E402
from nanovlm.config import image_token_count, load_config  # noqa: E402
from nanovlm.data.format import Record, SampleError  # noqa: E402
from nanovlm.data.index import remove_index  # noqa: E402
from nanovlm.data.prepare import write_dataset  # noqa: E402
from nanovlm.data.tokenizer import build_tokenizer, load_tokenizer  # noqa: E402

from {{ cookiecutter.package_name }}.decode import decode_sample  # noqa: E402

DEFAULT_CONFIGS = ["tiny_cpu.yaml", str(ROOT / "configs" / "experiment.yaml")]


def read_records(input_path: Path, skip: Callable[[SampleError, str], None]) -> Iterator[tuple[Record, str]]:
    """(record, "file:line") of every usable line of a JSONL file, in order; ``skip(error, "file:line")`` gets
    every bad one."""
    n = 0
    with input_path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            key, source = f"{input_path.stem}-{n:06d}", f"{input_path}:{line_no}"
            n += 1
            try:
                raw = json.loads(line)
                if not isinstance(raw, dict):
                    raise SampleError("bad_json", key, "a line must be a JSON object")
                yield decode_sample(raw, key, input_path.parent), source
            except json.JSONDecodeError as e:
                skip(SampleError("bad_json", key, str(e)), source)
            except SampleError as e:
                skip(e, source)


def prepare(input_path: Path, out_dir: Path, overrides: list[str], build: bool) -> Report:
    cfg = load_config(DEFAULT_CONFIGS, overrides)
    if build:  # a small offline BPE trained on this data (use a hub tokenizer for real projects)
        usable = (r for r, _ in read_records(input_path, lambda e, s: None))
        texts = [f"{m['role']}\n{m['content']}" for r in usable for m in r.messages]
        tokenizer = build_tokenizer(cfg.data.tokenizer, texts, vocab_size=512)
    else:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    report = Report()
    current = [str(input_path)]  # "file:line" of the record being written (write_dataset takes one at a time)

    def skip(e: SampleError, source: str) -> None:
        report.skip(e.key, source, e.reason, e.detail)

    def records() -> Iterator[Record]:
        for record, source in read_records(input_path, skip):
            current[0] = source
            yield record

    out_dir.mkdir(parents=True, exist_ok=True)
    index = write_dataset(
        records(),
        out_dir,
        tokenizer,
        image_token_count(cfg.model),
        on_skip=lambda e: skip(e, current[0]),  # found while writing, e.g. an unreadable image
        created_by="prepare_data",
    )
    report.written = index.num_samples
    report.write_rejected(out_dir)
    if report.written == 0:
        remove_index(out_dir)  # not a dataset: training would plan nothing
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", type=Path, required=True, help="JSONL of raw samples (paths relative to its folder)")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--build-tokenizer", action="store_true", help="train a small tokenizer at data.tokenizer first")
    p.add_argument("overrides", nargs="*", help="config overrides (model.* decides the image token count)")
    args = p.parse_args()
    report = prepare(args.input, args.out, args.overrides, args.build_tokenizer)
    skipped = sum(report.skips.values())
    print(f"wrote {report.written} of {report.written + skipped} samples to {args.out}")
    if skipped:
        print(f"skipped {skipped}: " + ", ".join(f"{r}={n}" for r, n in sorted(report.skips.items())))
        print(f"skipped samples and reasons: {args.out / 'rejected.jsonl'}")
    if report.written == 0:
        print("error: no sample could be written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
