"""The sample table's length columns for the run's model, built once per node and memory-mapped.

Planning reads three int32 columns per sample (total tokens, encoder inputs, prompt tokens), derived from the
index for the model's image layout (``DatasetIndex.total_tokens`` and friends). At 100M samples they take 1.2 GB
and several seconds to derive; held in every rank's memory they would be most of a process's own footprint. So a
table of at least ``CACHE_MIN_SAMPLES`` samples is derived by the first process of a node (a file lock), saved
under ``<cache_dir>/tables/<key>/`` and mapped by every process after it: one copy in the page cache, shared.
The key hashes the indexes' content hashes and the layout, so another model or re-prepared data gets its own
entry. Entries are written to a temporary directory and renamed into place, so a crash never leaves one
half-written; one that fails its checks (a truncated file, another row count) is derived again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nanovlm.data.index import DatasetIndex
from nanovlm.data.tiling import ImageLayout

log = logging.getLogger(__name__)

CACHE_MIN_SAMPLES = 1 << 20  # smaller tables derive in well under 0.1 s: kept in memory, nothing written
CACHE_VERSION = 1
COLUMNS = ("length", "n_images", "prompt")  # int32 [N]: SampleTable's derived columns


def derive(idxs: Sequence[DatasetIndex], layout: ImageLayout) -> dict[str, np.ndarray]:
    """The derived columns of ``idxs`` concatenated in order (one directory: its mapped column where the layout
    needs no derivation)."""

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        if len(parts) == 1 and parts[0].dtype == np.int32:
            return parts[0]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    return {
        "length": cat([i.total_tokens(layout, np.int32) for i in idxs]),
        "n_images": cat([i.vision_inputs(layout) for i in idxs]),
        "prompt": cat([i.prompt_lengths(layout, np.int32) for i in idxs]),
    }


def _held(idxs: Sequence[DatasetIndex], layout: ImageLayout) -> dict[str, np.ndarray]:
    """Columns an index already maps as the table needs them (one directory without image splitting: its
    ``n_images``): the cache does not copy them."""
    if len(idxs) == 1 and not layout.splitting:
        col = idxs[0].vision_inputs(layout)
        if isinstance(col, np.memmap):
            return {"n_images": col}
    return {}


def cache_key(idxs: Sequence[DatasetIndex], layout: ImageLayout) -> str:
    """Names one table: the indexes' content (in order) and the layout the lengths were derived for."""
    parts = {"version": CACHE_VERSION, "indexes": [i.content_hash for i in idxs], "layout": dataclasses.asdict(layout)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load_columns(idxs: Sequence[DatasetIndex], layout: ImageLayout, cache_dir: str | os.PathLike | None) -> dict:
    """The derived columns: mapped from the node's cache when the table is large and ``cache_dir`` is given
    (derived and saved first when the entry is missing or fails its checks), else derived in memory."""
    n = sum(i.num_samples for i in idxs)
    if cache_dir is None or n < CACHE_MIN_SAMPLES or not all(i.content_hash for i in idxs):
        return derive(idxs, layout)
    from nanovlm.dist import file_lock

    root = Path(cache_dir) / "tables"
    entry = root / cache_key(idxs, layout)
    held = _held(idxs, layout)
    names = [c for c in COLUMNS if c not in held]
    with contextlib.ExitStack() as locked:
        try:
            locked.enter_context(file_lock(root / f"{entry.name}.lock"))
        except OSError as e:  # a read-only or full cache disk: correct, only not shared
            log.warning("the length columns cannot be cached in %s (%s): each process derives its own", root, e)
            return derive(idxs, layout)
        cols = _map(entry, n, names)
        if cols is None:
            cols = {c: v for c, v in derive(idxs, layout).items() if c in names}
            try:
                _save(entry, cols)
            except OSError as e:
                log.warning("the length columns cannot be saved in %s (%s): this process keeps its own", entry, e)
                return held | cols
            cols = _map(entry, n, names)
    if cols is None:
        raise RuntimeError(f"{entry}: the length columns just written fail their checks")
    return held | cols


def _map(entry: Path, n: int, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The entry's columns ``names`` mapped read-only, or None when one is missing or is not ``n`` int32 rows."""
    if not entry.is_dir():
        return None
    cols = {}
    for name in names:
        path = entry / f"{name}.npy"
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            log.warning("%s is unreadable (%s): deriving the length columns again", path, e)
            return None
        if arr.shape != (n,) or arr.dtype != np.int32:
            log.warning("%s holds %s %s, not %d int32 rows: deriving it again", path, arr.shape, arr.dtype, n)
            return None
        cols[name] = arr
    return cols


def _save(entry: Path, cols: dict[str, np.ndarray]) -> None:
    """Write ``cols`` into a temporary directory beside ``entry`` and rename it into place (under the entry's
    lock). A replaced entry is renamed aside first, so processes that mapped its files keep reading them; what
    crashed writers left beside the entry is removed."""
    for stale in entry.parent.glob(f"{entry.name}.*-*"):  # .tmp-<pid> / .old-<pid> of earlier writers
        shutil.rmtree(stale, ignore_errors=True)
    tmp, old = (entry.with_name(f"{entry.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
    tmp.mkdir(parents=True)
    for name, col in cols.items():
        with open(tmp / f"{name}.npy", "wb") as f:
            np.save(f, np.ascontiguousarray(col, np.int32))
            f.flush()
            os.fsync(f.fileno())
    if entry.exists():  # one that failed its checks
        os.replace(entry, old)
    os.replace(tmp, entry)
    shutil.rmtree(old, ignore_errors=True)
