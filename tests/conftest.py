"""Shared fixtures (both layers, ``unit/`` and ``integration/``, see them); plain helpers are in ``helpers/``.

* ``tiny_tokenizer``: a byte-level BPE trained here with ``build_tokenizer``;
* ``make_dataset``: small synthetic multimodal datasets written through ``nanovlm.data.prepare.write_dataset``,
  exactly as prepare_data writes them;
* ``dataset``: one such dataset (3 shards) in a fresh directory, for tests that break it;
* ``served``: a directory whose dataset ``a`` (60 samples, shards of 16) the remote tests serve from loopback;
* ``small_demo``: the procedural demo dataset for ``scripts/train.py`` runs (``helpers.runs``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.synthetic import synthetic_records, tiny_corpus

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE (vocab <= 512) with the project's special tokens and ChatML template, built offline."""
    from nanovlm.data.tokenizer import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok", tiny_corpus(), vocab_size=512)


@pytest.fixture(scope="session")
def make_dataset(tiny_tokenizer):
    """Factory: ``make_dataset(path, n, samples_per_shard=16, seed=0, image_token_count=16, ...)`` writes a
    synthetic dataset with ``write_dataset`` and returns its DatasetIndex."""
    from nanovlm.data.prepare import write_dataset

    def _make(path, n: int, samples_per_shard: int = 16, seed: int = 0, image_token_count: int = 16, **kwargs):
        records = synthetic_records(n, seed=seed, **kwargs)
        return write_dataset(records, path, tiny_tokenizer, image_token_count, samples_per_shard=samples_per_shard)

    return _make


@pytest.fixture
def dataset(tmp_path, make_dataset):
    """A 3-shard dataset (8 samples per shard) in a fresh directory."""
    path = tmp_path / "ds"
    make_dataset(path, 24, samples_per_shard=8)
    return path


@pytest.fixture(scope="session")
def served(tmp_path_factory, make_dataset) -> Path:
    from helpers.data import IMAGE_TOKENS

    root = tmp_path_factory.mktemp("served")
    make_dataset(root / "a", 60, samples_per_shard=16, seed=3, image_token_count=IMAGE_TOKENS)
    return root


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory) -> Path:
    from nanovlm.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("demo_small")
    make_demo_data(root, train_samples=160, val_samples=24, samples_per_shard=40, image_token_count=4)
    return root
