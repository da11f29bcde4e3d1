"""Indexing existing WebDataset shards (``prepare_data --input DIR``), one shard at a time, at any scale.

``index_shard`` is the work of one process on one shard: its samples' byte ranges, token and image counts as
numpy columns (an ``index.shard_block``), the skips with their reasons, and a 64-bit hash per key. Nothing a
run keeps grows as Python objects per sample, so indexing 100M samples holds about the index's own size.
``save_part`` / ``load_part`` keep each finished shard in ``OUT/.index-parts/`` (``.npz``, no pickle) so a
killed run resumes; ``merge`` drops keys seen in an earlier shard (found by sorting the hashes, confirmed on
the keys themselves) and returns what ``DatasetIndex.from_blocks`` needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tarfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanovlm.data.format import SampleError
from nanovlm.data.index import (
    COLUMNS,
    SAMPLE_COLUMNS,
    ShardEntry,
    ShardIndex,
    TarSample,
    crc32,
    crc32_file,
    decode_key,
    scan_tar,
    shard_block,
)
from nanovlm.data.prepare import index_tar_sample
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.reader import scan_bytes

PARTS_DIR = ".index-parts"
PART_VERSION = 1  # bump when a part's layout changes: older parts are then indexed again, not misread
IN_MEMORY_MAX = 1 << 30  # shards up to this size are read whole and scanned in memory (the fast path)


@dataclass
class ShardResult:
    """One indexed shard: its columns, its skips ([key, source, reason, detail], in order) and key hashes."""

    block: dict[str, np.ndarray]
    skips: list[list[str]]
    hashes: np.ndarray  # uint64 [num_samples]
    crc32: str = ""  # of the shard file


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """A 64-bit hash per key (blake2b): duplicates are found by sorting these, not by a set of strings."""
    digests = b"".join(hashlib.blake2b(k.encode(), digest_size=8).digest() for k in keys)
    return np.frombuffer(digests, np.uint64).copy()


def index_shard(path: str, processor: SampleProcessor, max_pixels: int, decode: bool = True) -> ShardResult:
    """Index one shard. A damaged tar keeps the samples before the damage; the rest is one ``corrupt_shard``."""
    name = Path(path).name
    rows = ShardIndex(name, 0, 0)
    skips: list[list[str]] = []
    seen: dict[str, str] = {}  # _samples puts the shard's CRC here when it reads the shard whole
    try:
        for ts, members in _samples(path, seen):
            try:
                _check_key(ts.key)
                bad = [d for d in members.values() if isinstance(d, SampleError)]
                if bad:
                    raise bad[0]
                counts, sizes = index_tar_sample(members, ts.key, processor, max_pixels, decode)
            except SampleError as e:
                skips.append([e.key or ts.key, f"{name}@{ts.offset}", e.reason, e.detail])  # e.key: printable
                continue
            rows.keys.append(ts.key)
            rows.offsets.append(ts.offset)
            rows.nbytes.append(ts.nbytes)
            rows.text_tokens.append(counts[0])
            rows.n_images.append(len(sizes))
            rows.image_sizes.append(sizes)
            rows.prompt_tokens.append(counts[1])
            rows.prompt_images.append(counts[2])
    except (tarfile.TarError, OSError, EOFError) as e:
        kept = len(rows.keys) + len(skips)
        detail = (
            f"{type(e).__name__}: {e}. The {kept} sample(s) before the damage are indexed; everything after it in "
            "this shard is NOT (not counted above: its samples cannot be read). Rewrite the shard from its source"
        )
        skips.append([name, name, "corrupt_shard", detail])
    rows.num_samples = len(rows.keys)
    crc = seen.get("crc", "")  # of the bytes just indexed, when the shard was read whole
    with contextlib.suppress(OSError):  # an unreadable file has no sample to keep: its skip says why
        crc = crc or crc32_file(path)
    return ShardResult(shard_block(rows), skips, key_hashes(rows.keys), crc)


def _check_key(key: str) -> None:
    try:
        key.encode()
    except UnicodeEncodeError:  # a member name that is not UTF-8 (tarfile keeps its bytes as surrogates)
        raise SampleError("bad_key", key.encode(errors="backslashreplace").decode(), "the key is not UTF-8") from None


def _samples(path: str, seen: dict) -> Iterator[tuple[TarSample, dict]]:
    """(TarSample, {suffix: bytes | memoryview | SampleError}) of each sample of a shard, in order.

    A well-formed shard up to ``IN_MEMORY_MAX`` is read once into a buffer this thread reuses and scanned in
    memory (its CRC-32 taken from those bytes into ``seen["crc"]``, not from a second read); its members are
    views into that buffer (no copy of a shard's images), valid until the next shard. Anything else goes through
    ``scan_tar``, which raises where the tar breaks after yielding the samples before it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= IN_MEMORY_MAX:
            blob = _shard_buffer(size)
            got = f.readinto(blob)
            samples = scan_bytes(blob) if got == size else None
            if samples is not None:
                seen["crc"] = f"{crc32(blob):08x}"
                for ts in samples:
                    yield ts, {suffix: blob[o : o + n] for suffix, o, n in ts.members}
                return
            del blob
        for ts in scan_tar(path):
            members: dict = {}
            for suffix, offset, size in ts.members:
                f.seek(offset)
                members[suffix] = f.read(size)
                if len(members[suffix]) != size:
                    members[suffix] = SampleError("corrupt_member", ts.key, f"member {suffix} truncated")
            yield ts, members


_buffers = threading.local()


def _shard_buffer(size: int) -> memoryview:
    """``size`` bytes of a buffer kept per thread, instead of a fresh bytes object of tens of MB per shard whose
    members are then copied out again (together about 5% of header-only indexing on COCO-like shards).
    Replaced (never resized) by a larger one when a shard needs it, so no view into an older shard blocks it."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _buffers.buf = bytearray(size)
    return memoryview(buf)[:size]


# ----------------------------------------------------------------------------------------------------------
# parts: finished shards kept for a resumed run


def _part_path(parts: Path, shard: Path) -> Path:
    return parts / f"{shard.name}.npz"


def save_part(parts: Path, shard: Path, result: ShardResult, stamp: list) -> None:
    """Keep a finished shard (atomically: a part is complete or absent)."""
    path = _part_path(parts, shard)
    tmp = path.with_name(path.name + ".tmp.npz")
    meta = json.dumps({"version": PART_VERSION, "stamp": stamp, "skips": result.skips}, ensure_ascii=False)
    np.savez(tmp, meta=np.array(meta), hashes=result.hashes, **result.block)
    os.replace(tmp, path)


def load_part(parts: Path, shard: Path, stamp: list) -> ShardResult | None:
    """A kept shard, or None when there is none, it is unreadable, or it was made from other bytes, settings
    or code."""
    try:
        with np.load(_part_path(parts, shard), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("version") != PART_VERSION or meta.get("stamp") != stamp:
                return None
            return ShardResult({name: z[name] for name in COLUMNS}, list(meta["skips"]), z["hashes"])
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):  # cut short, not ours
        return None


# ----------------------------------------------------------------------------------------------------------
# merging the shards


def merge(
    names: Sequence[str],
    sizes: Sequence[int],
    results: Sequence[ShardResult],
    on_skip: Callable[[str, str, str, str], None],
) -> tuple[list[ShardEntry], list[dict[str, np.ndarray]]]:
    """Entries and column blocks of the shards in order, each key kept once (its first occurrence); every skip
    reported through ``on_skip`` in input order (a shard's duplicates among its other skips, by offset)."""
    dup = _later_duplicates(results)
    entries, blocks, first = [], [], 0
    for name, size, res in zip(names, sizes, results):
        n = len(res.hashes)
        drop = dup[(dup >= first) & (dup < first + n)] - first
        first += n
        block = res.block
        listed = [(_offset(s[1]), s) for s in res.skips]
        for i in drop.tolist():
            key = decode_key(block, i)
            source = f"{Path(name).name}@{int(block['offset'][i])}"
            listed.append(
                (int(block["offset"][i]), [key, source, "duplicate_key", "keys must be unique within a dataset"])
            )
        for _, skip in sorted(listed, key=lambda x: x[0]):
            on_skip(*skip)
        if len(drop):
            keep = np.ones(n, bool)
            keep[drop] = False
            block = _filter(block, keep)
        kept = len(block["offset"])
        if kept:
            entries.append(ShardEntry(name, size, kept, res.crc32))
            blocks.append(block)
    return entries, blocks


def _offset(source: str) -> float:
    """Order of a skip within its shard: the sample's byte offset; a whole-shard skip comes last."""
    _, at, off = source.rpartition("@")
    return int(off) if at and off.isdigit() else float("inf")


def _later_duplicates(results: Sequence[ShardResult]) -> np.ndarray:
    """Global rows whose key occurred in an earlier row: equal hashes, confirmed on the keys themselves."""
    hashes = np.concatenate([r.hashes for r in results]) if results else np.zeros(0, np.uint64)
    order = np.argsort(hashes, kind="stable")  # equal hashes: in row order
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if not len(same):
        return np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum([len(r.hashes) for r in results])])
    rows = np.unique(np.concatenate([order[same], order[same + 1]]))

    def key_of(row: int) -> str:
        shard = int(np.searchsorted(starts, row, side="right")) - 1
        return decode_key(results[shard].block, row - int(starts[shard]))

    seen: dict[str, int] = {}
    later = []
    for row in rows.tolist():  # only rows whose hash collides: a handful
        key = key_of(row)
        if key in seen:
            later.append(row)
        else:
            seen[key] = row
    return np.asarray(later, np.int64)


def _filter(block: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of a block where ``keep`` is True (their images and key bytes with them)."""
    out = {c: block[c][keep] for c in SAMPLE_COLUMNS}
    out["image_sizes"] = block["image_sizes"][np.repeat(keep, block["n_images"])]
    ends = block["key_ends"]
    starts = np.concatenate([[0], ends[:-1]])
    out["keys"] = np.concatenate(
        [block["keys"][s:e] for s, e in zip(starts[keep], ends[keep])] or [np.zeros(0, np.uint8)]
    )
    out["key_ends"] = np.cumsum((ends - starts)[keep], dtype=np.int64)
    return out
