"""Inputs shared by the benchmark sections: the config, the demo data, and datasets given on the command line."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from benchmarks import distributions as dist
from nanovlm.config import Config, image_token_count, load_config


def bench_config(args: argparse.Namespace, overrides: list[str] | None = None) -> Config:
    """The config the data/model sections use: ``--config`` files (default tiny_cpu.yaml), the section's
    overrides, then the user's ``--set`` overrides."""
    files = args.config or ["tiny_cpu.yaml"]
    return load_config(files, [*(overrides or []), *args.set])


def data_config(args: argparse.Namespace, workers: int, with_budget: bool = True) -> Config:
    """``bench_config`` for the sections that read samples: ``--data``, ``--tokenizer`` and ``--budget`` applied,
    ``workers`` DataLoader workers, no validation set. ``with_budget=False`` leaves ``--budget`` to a caller that
    loads a model preset on top (a budget above the small config's context would be refused here)."""
    overrides = [f"data.num_workers={workers}", "data.val=[]"]
    if args.data:
        overrides += ["data.train=[" + ",".join(args.data) + "]", "data.make_demo_if_missing=false"]
    if args.tokenizer:
        overrides.append(f"data.tokenizer={args.tokenizer}")
    if args.budget and with_budget:
        overrides.append(f"data.max_tokens={args.budget}")
    return bench_config(args, overrides)


def shard_paths(dirs: list[str]) -> list[str]:
    """Every shard of the dataset dirs, in index order."""
    from nanovlm.data.index import load_index

    return [str(idx.shard_path(sh)) for idx in map(load_index, dirs) for sh in idx.shards]


def sample_refs(dirs: list[str]) -> Iterator[tuple[str, int, int, str]]:
    """(shard path, byte offset, byte size, key) of every sample of the dataset dirs, in index order."""
    from nanovlm.data.index import load_index

    for idx in map(load_index, dirs):
        yield from idx.sample_refs()


def demo_dirs(cfg: Config) -> tuple[list[str], str]:
    """Train dirs and tokenizer of ``cfg``, building the procedural demo dataset first when it is missing."""
    from nanovlm.train.run import ensure_data

    ensure_data(cfg)
    return list(cfg.data.train), cfg.data.tokenizer


def index_length_sets(args: argparse.Namespace) -> tuple[list[dist.LengthSet], dict[str, tuple[int, ...]]]:
    """Length sets for the packing section: the demo data (unless --index is given) and every --index dir.

    Budgets: ``--budget`` or the config's ``data.max_tokens``; image cap, lookahead and carry: the config's
    ``data`` section; image tokens per image: the config's model (the same formula training uses).
    """
    cfg = bench_config(args)
    L = args.budget or cfg.data.max_tokens
    itc = image_token_count(cfg.model)
    sets: list[dist.LengthSet] = []
    budgets: dict[str, tuple[int, ...]] = {}
    dirs = list(args.index)
    if not dirs:
        train, _ = demo_dirs(cfg)
        dirs = train
    for d in dirs:
        ls = dist.from_index(d, image_token_count=itc, name=f"index:{Path(d).parent.name}/{Path(d).name}")
        sets.append(ls)
        budgets[ls.name] = (L, cfg.data.max_images, cfg.data.lookahead, cfg.data.max_carry)
    return sets, budgets
