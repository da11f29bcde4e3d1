"""Shared fixtures: a tiny offline tokenizer and a factory for small synthetic multimodal datasets.

Both are real: the tokenizer is a byte-level BPE trained here with ``build_tokenizer``; datasets are written
through ``nanovlm.data.prepare.write_dataset``, exactly as prepare_data writes them.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


# A ~80K-parameter model (16 px images, 4 tokens per image): the shape every multi-step training test uses.
MICRO_MODEL = [
    "model.vision.image_size=16",
    "model.vision.patch_size=4",
    "model.vision.hidden_size=32",
    "model.vision.num_layers=1",
    "model.vision.num_heads=2",
    "model.vision.intermediate_size=64",
    "model.language.hidden_size=48",
    "model.language.num_layers=2",
    "model.language.num_heads=4",
    "model.language.num_kv_heads=2",
    "model.language.intermediate_size=96",
]


def run_forked_ranks(target, world_size: int, out_dir, *args, timeout: float = 120) -> None:
    """Run ``target(rank, port, *args)`` in ``world_size`` forked processes (a gloo group on a free port) and
    assert that every rank exited 0. A rank that fails writes its traceback to ``out_dir/error<rank>.txt``."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    errors = [f.read_text() for f in sorted(out_dir.glob("error*.txt"))]
    assert not errors and all(p.exitcode == 0 for p in procs), errors


def tiny_corpus(n: int = 300) -> list[str]:
    """A small deterministic text corpus (enough for a few hundred BPE merges)."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(3, 16)))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE (vocab <= 512) with the project's special tokens and ChatML template, built offline."""
    from nanovlm.data.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok", tiny_corpus(), vocab_size=512)


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


@pytest.fixture(scope="session")
def make_dataset(tiny_tokenizer):
    """Factory: ``make_dataset(path, n, samples_per_shard=16, seed=0, image_token_count=16, ...)`` writes a
    synthetic dataset with ``write_dataset`` and returns its DatasetIndex."""
    from nanovlm.data.prepare import write_dataset

    def _make(path, n: int, samples_per_shard: int = 16, seed: int = 0, image_token_count: int = 16, **kwargs):
        records = synthetic_records(n, seed=seed, **kwargs)
        return write_dataset(records, path, tiny_tokenizer, image_token_count, samples_per_shard=samples_per_shard)

    return _make
