"""Custom sample decoding: the one place that knows this project's raw data format.

``decode_sample`` turns one raw sample (here: a JSON object with an image path, a question and an answer)
into nanovlm's ``Record`` (ChatML messages with one ``<image>`` placeholder per image, the image bytes, and
extra fields kept beside the messages). ``scripts/prepare_data.py`` runs it over a JSONL file and writes
sharded WebDataset tars + index with ``nanovlm.data.prepare.write_dataset``; training then reads those.
Change this function (and only this) to support another format: CSV rows, several images, captions, ...
"""

from __future__ import annotations

from pathlib import Path

from nanovlm.data.format import Record


def decode_sample(raw: dict, key: str, image_root: Path) -> Record:
    """One raw sample -> Record. ``raw`` = {"image": "relative/path.png", "question": str, "answer": str}."""
    missing = [f for f in ("image", "question", "answer") if f not in raw]
    if missing:
        raise ValueError(f"sample {key}: missing field(s) {missing}")
    image = (image_root / raw["image"]).read_bytes()
    messages = [
        {"role": "user", "content": f"<image>\n{raw['question']}"},
        {"role": "assistant", "content": raw["answer"]},
    ]
    # "answer" is also kept in the sample json: nanovlm's end-of-run evaluation compares generations with it
    return Record(key=key, messages=messages, images=[image], extra={"answer": raw["answer"]})
