"""Synthetic data built offline: a small text corpus (for the tokenizer fixture) and multimodal records with
traceable keys (for the ``make_dataset`` fixture and tests that write their own dataset)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

_WORDS = [
    "a",
    "the",
    "red",
    "green",
    "blue",
    "yellow",
    "white",
    "black",
    "square",
    "circle",
    "triangle",
    "cross",
    "star",
    "image",
    "picture",
    "shows",
    "what",
    "colour",
    "shape",
    "is",
    "in",
    "on",
    "of",
    "and",
    "with",
    "left",
    "right",
    "top",
    "bottom",
    "small",
    "large",
    "one",
    "two",
    "three",
    "four",
    "five",
    "describe",
    "answer",
    "question",
    "how",
    "many",
    "which",
    "larger",
    "there",
    "are",
    "background",
]


def tiny_corpus(n: int = 300) -> list[str]:
    """A small deterministic text corpus (enough for a few hundred BPE merges)."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(3, 16)))) + "." for _ in range(n)]


def synthetic_image(rng: np.random.Generator, w: int, h: int, fmt: str = "PNG") -> bytes:
    """A w x h image of random blocks, encoded as ``fmt``."""
    arr = rng.integers(0, 256, size=(max(1, h // 4), max(1, w // 4), 3), dtype=np.uint8)
    img = Image.fromarray(arr).resize((w, h), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def synthetic_records(n: int, seed: int = 0, max_answer_words: int = 60, key_prefix: str = "s"):
    """``n`` Records with traceable keys (``s00000``...), 0/1/2 images (i % 3), varied lengths.

    Sample i's answer is ``"answer <i> ..."`` so a test can tell which sample a token came from;
    ``extra`` holds ``{"answer": <first word>, "i": i}``.
    """
    from nanovlm.data.format import Record

    rng = np.random.default_rng(seed)
    for i in range(n):
        n_images = i % 3
        images = [
            synthetic_image(rng, int(rng.integers(8, 48)), int(rng.integers(8, 48)), "PNG" if (i + j) % 2 else "JPEG")
            for j in range(n_images)
        ]
        # Long-tailed answer length: mostly short, every 7th long.
        n_words = int(rng.integers(1, 6)) if i % 7 else int(rng.integers(10, max_answer_words + 1))
        words = [str(x) for x in rng.choice(_WORDS, size=n_words)]
        question = " ".join(str(x) for x in rng.choice(_WORDS, size=int(rng.integers(2, 8))))
        user = "".join("<image>" for _ in range(n_images)) + f"question {i}: {question}?"
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"answer {i} " + " ".join(words)},
        ]
        if i % 5 == 4:  # some two-turn conversations
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": words[0]}]
        yield Record(f"{key_prefix}{i:05d}", messages, images, {"answer": words[0], "i": i})
