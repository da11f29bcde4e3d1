"""Custom sample decoding: the one place that knows this project's raw data format.

``decode_sample`` turns one raw sample (here: a JSON object with an image path, a question and an answer)
into nanovlm's ``Record`` (ChatML messages with one ``<image>`` placeholder per image, the image bytes, and
extra fields kept beside the messages). ``scripts/prepare_data.py`` runs it over a JSONL file and writes
sharded WebDataset tars + index with ``nanovlm.data.prepare.write_dataset``; training then reads those.
Change this function (and only this) to support another format: CSV rows, several images, captions, ...
"""

from __future__ import annotations

from pathlib import Path

from nanovlm.data.format import Record, SampleError
from nanovlm.data.prepare import resolve_image_path


def decode_sample(raw: dict, key: str, image_root: Path) -> Record:
    """One raw sample -> Record. ``raw`` = {"image": "relative/path.png", "question": str, "answer": str}.

    A sample that cannot be used raises ``SampleError(reason, key, detail)``: prepare_data skips it, counts it
    and lists it in ``rejected.jsonl``. Image paths must stay inside ``image_root`` (``../`` and symlinks out
    are refused as ``unsafe_path``).
    """
    missing = [f for f in ("image", "question", "answer") if not isinstance(raw.get(f), str)]
    if missing:
        raise SampleError("missing_field", key, f"missing or not a string: {missing}")
    image = resolve_image_path(raw["image"], image_root, key=key).read_bytes()
    messages = [
        {"role": "user", "content": f"<image>\n{raw['question']}"},
        {"role": "assistant", "content": raw["answer"]},
    ]
    # "answer" is also kept in the sample json: nanovlm's end-of-run evaluation compares generations with it
    return Record(key=key, messages=messages, images=[image], extra={"answer": raw["answer"]})
