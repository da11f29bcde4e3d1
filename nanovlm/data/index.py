"""The dataset index: per sample, everything planning, reading and resumption need, without opening a tar.

A dataset directory holds its shards and ``index/``: one ``.npy`` file per column plus ``meta.json`` (format in
docs/internals.md). Columns are memory-mapped, so opening an index costs its headers and a few vectorised
checks (a fraction of a second at 100M samples), the processes of a node share one copy in the page cache, and
no column is ever turned into Python objects: a sample's key is decoded from ``keys.npy`` only when it is asked for. ``.npy`` because
numpy maps it with no other dependency and any tool reads it; parquet pages are compressed (not mappable) and
Arrow IPC would add pyarrow for the same layout.

``DatasetIndex`` is the one reader (``load_index``) and the one writer (``from_shards`` / ``from_blocks`` +
``save``); a writer builds it from ``ShardIndex`` rows (one shard's fields as lists) or, at scale, from one
block of numpy columns per shard (``shard_block``). Shard ``name`` is a path relative to the
dataset directory (``../other/x.tar`` when the shards live elsewhere).

``scan_tar`` groups a tar's members by sample key and records each sample's byte range, so a reader can seek
straight to one sample (``reader.ShardReader``) instead of streaming the shard. The index of a dataset at a URL is
fetched into a local copy first (``fetch_index``) and read from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from zlib_ng.zlib_ng import crc32 as _crc32

from nanovlm.data.presigned import CONNECTIONS
from nanovlm.data.remote import (
    LocalCacheError,
    RemoteError,
    RemoteGoneError,
    RetryPolicy,
    cache_name,
    default_cache_dir,
    download,
    is_remote,
    join,
    read_bytes,
    redact,
)
from nanovlm.data.tiling import ImageLayout, as_layout, per_sample
from nanovlm.dist import file_lock

log = logging.getLogger(__name__)

INDEX_DIR = "index"
META_FILE = "meta.json"
INDEX_VERSION = 3
_BLOCK = 512

# column -> (dtype, rows): rows counts samples, images (one row [width, height] per image) or key bytes.
# key i is keys[key_ends[i - 1]:key_ends[i]] (utf-8); sample i's images are the n_images[i] rows after the
# images of the samples before it.
COLUMNS: dict[str, tuple[str, str]] = {
    "offset": ("<i8", "samples"),  # byte offset of the sample's first tar header in its shard
    "nbytes": ("<i8", "samples"),  # bytes from that header to the end of its last member
    "text_tokens": ("<i4", "samples"),  # tokens with each <image> counted once
    "n_images": ("<i4", "samples"),
    # before the first loss token: tokens (each <image> counted once) and images; data.overlength=truncate
    # skips a sample whose prompt alone fills the limit, without reading it
    "prompt_tokens": ("<i4", "samples"),
    "prompt_images": ("<i4", "samples"),
    "image_sizes": ("<i4", "images"),  # [num_images, 2]
    "key_ends": ("<i8", "samples"),
    "keys": ("|u1", "key_bytes"),
}
_ROW_FIELDS = ("offsets", "nbytes", "text_tokens", "n_images", "prompt_tokens", "prompt_images")
SAMPLE_COLUMNS = ("offset", "nbytes", "text_tokens", "n_images", "prompt_tokens", "prompt_images")


class DatasetIndexError(ValueError):
    """An index is malformed or does not match the shards next to it."""


@dataclass
class ShardIndex:
    """One shard's rows, as a writer collects them (every list has ``num_samples`` entries)."""

    name: str
    size_bytes: int
    num_samples: int
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    text_tokens: list[int] = field(default_factory=list)
    n_images: list[int] = field(default_factory=list)
    image_sizes: list[list[list[int]]] = field(default_factory=list)  # per sample, per image: [width, height]
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_images: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ShardEntry:
    """One shard as ``meta.json`` lists it."""

    name: str
    size_bytes: int
    num_samples: int
    crc32: str = ""  # of the whole shard file: a staged copy of a remote shard is trusted only if it matches


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` continuing from ``value``: enough to catch a damaged or half-fetched shard.

    Taken from zlib-ng (the same checksum as zlib's, an order of magnitude faster on x86): prepare_data checks
    every byte of every shard, and a remote shard is checked when it is staged."""
    return _crc32(data, value)


def crc32_file(path: str | os.PathLike) -> str:
    """``crc32`` of a file as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = crc32(chunk, crc)
    return f"{crc:08x}"


@dataclass
class DatasetIndex:
    """A dataset directory's index: shard list and per-sample columns (memory-mapped when loaded)."""

    root: Path
    tokenizer: str  # tokenizer fingerprint the text_tokens were counted with
    image_token_count: int  # tokens per image of the model the data was prepared for (informational)
    created_by: str
    shards: list[ShardEntry]
    columns: dict[str, np.ndarray]
    content_hash: str = ""  # of the columns and shard list: names the data in checkpoints (set by save/load)
    version: int = INDEX_VERSION
    mapped: bool = False  # the columns are mapped from root/index/ (load_index)
    source: str = ""  # the dataset's URL when it is remote (root is then the index's local copy)

    def __reduce_ex__(self, protocol):
        """A loaded index travels (to spawned DataLoader workers) as its path and hash, and is mapped again
        there: pickling the mapped columns would copy them all into every worker."""
        if not self.mapped:
            return super().__reduce_ex__(protocol)
        return _remap, (self.root, self.content_hash, self.source)

    @property
    def num_samples(self) -> int:
        return len(self.columns["offset"])

    @property
    def shard_start(self) -> np.ndarray:
        """int64 [num_shards + 1]: shard i holds samples shard_start[i]:shard_start[i + 1]."""
        return np.concatenate([[0], np.cumsum([s.num_samples for s in self.shards], dtype=np.int64)])

    def shard_path(self, shard: int | ShardEntry) -> Path:
        s = self.shards[shard] if isinstance(shard, int) else shard
        return self.root / s.name

    def shard_location(self, shard: int | ShardEntry) -> str:
        """Where a shard is read from: its URL for a remote dataset, else its absolute local path."""
        s = self.shards[shard] if isinstance(shard, int) else shard
        if self.source:
            return join(self.source, s.name)
        return str((self.root / s.name).resolve())

    def key(self, i: int) -> str:
        """Sample ``i``'s key, decoded from the key bytes."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of an index of {self.num_samples}")
        return decode_key(self.columns, i)

    def key_list(self, lo: int = 0, hi: int | None = None) -> list[str]:
        """Keys of samples lo:hi (decoded on demand: never call it for a whole large index)."""
        return [self.key(i) for i in range(lo, self.num_samples if hi is None else hi)]

    def sample_refs(self) -> Iterator[tuple[str, int, int, str]]:
        """(shard path, byte offset, byte size, key) of every sample, in index order (one read at a time)."""
        offsets, nbytes = self.columns["offset"], self.columns["nbytes"]
        for s, (lo, hi) in enumerate(zip(self.shard_start[:-1].tolist(), self.shard_start[1:].tolist())):
            path = self.shard_location(s)
            for i in range(lo, hi):
                yield path, int(offsets[i]), int(nbytes[i]), self.key(i)

    def shard(self, i: int) -> ShardIndex:
        """Shard ``i``'s rows as lists (for tools and tests that walk one shard)."""
        lo, hi = (int(x) for x in self.shard_start[i : i + 2])
        c = self.columns
        first = int(c["n_images"][:lo].sum())
        counts = c["n_images"][lo:hi].tolist()
        sizes = c["image_sizes"][first : first + sum(counts)].tolist()
        per_sample, at = [], 0
        for n in counts:
            per_sample.append(sizes[at : at + n])
            at += n
        rows = {f: c[col][lo:hi].tolist() for f, col in zip(_ROW_FIELDS, SAMPLE_COLUMNS)}
        e = self.shards[i]
        return ShardIndex(e.name, e.size_bytes, e.num_samples, self.key_list(lo, hi), image_sizes=per_sample, **rows)

    def total_tokens(self, layout: ImageLayout | int, dtype: type = np.int64) -> np.ndarray:
        """[N]: tokens per sample with its images expanded by ``layout`` (an int: that many tokens per image)."""
        return self._expanded("text_tokens", "n_images", as_layout(layout), dtype, tokens=True)

    def prompt_lengths(self, layout: ImageLayout | int, dtype: type = np.int64) -> np.ndarray:
        """[N]: tokens before each sample's first loss token, images expanded."""
        return self._expanded("prompt_tokens", "prompt_images", as_layout(layout), dtype, tokens=True)

    def vision_inputs(self, layout: ImageLayout | int, dtype: type = np.int32) -> np.ndarray:
        """[N]: encoder inputs per sample, what ``data.max_images`` counts: images, or tiles with splitting."""
        layout = as_layout(layout)
        if not layout.splitting:
            return self.columns["n_images"] if dtype == np.int32 else self.columns["n_images"].astype(dtype)
        return self._expanded(None, "n_images", layout, dtype, tokens=False)

    def _expanded(self, base: str | None, images: str, layout: ImageLayout, dtype: type, tokens: bool) -> np.ndarray:
        """``base`` (each ``<image>`` counted once) plus what the first ``images`` images of each sample add.

        In pieces of 1M samples (int64 temporaries under malloc's 32 MB mmap threshold, so reused rather than
        faulted in again each piece; none of a whole 100M column). Without splitting every image adds
        ``tokens_per_tile - 1`` tokens; with it the images' sizes decide (``ImageLayout.costs``).
        """
        c = self.columns
        out = np.empty(self.num_samples, dtype)
        limit = np.iinfo(dtype).max
        first_image = 0  # row of image_sizes where the current piece's first sample starts
        for lo in range(0, self.num_samples, 1 << 20):
            hi = min(lo + (1 << 20), self.num_samples)
            take = c[images][lo:hi].astype(np.int64)
            part = np.zeros(hi - lo, np.int64) if base is None else c[base][lo:hi].astype(np.int64)
            if not layout.splitting:
                part += take * (layout.tokens_per_tile - 1)
            else:
                counts = c["n_images"][lo:hi].astype(np.int64)
                n_rows = int(counts.sum())
                sizes = c["image_sizes"][first_image : first_image + n_rows]
                if (take > counts).any() or (sizes <= 0).any():
                    raise DatasetIndexError(
                        f"{self.root / 'index'}: a sample lists more prompt images than images, or an image size "
                        "that is not positive; re-run scripts/prepare_data.py"
                    )
                tiles, toks = layout.costs(sizes)
                part += per_sample(toks - 1 if tokens else tiles, counts, take)
                first_image += n_rows
            if len(part) and int(part.max()) > limit:
                raise DatasetIndexError(f"a sample has {int(part.max())} tokens, more than {np.dtype(dtype)} holds")
            out[lo:hi] = part
        return out

    @classmethod
    def from_shards(
        cls,
        root: str | os.PathLike,
        tokenizer: str,
        image_token_count: int,
        created_by: str,
        shards: Sequence[ShardIndex],
    ) -> DatasetIndex:
        """Build (in memory) from a writer's per-shard rows."""
        entries = [ShardEntry(s.name, int(s.size_bytes), int(s.num_samples)) for s in shards]
        return cls.from_blocks(
            root, tokenizer, image_token_count, created_by, entries, [shard_block(s) for s in shards]
        )

    @classmethod
    def from_blocks(
        cls,
        root: str | os.PathLike,
        tokenizer: str,
        image_token_count: int,
        created_by: str,
        entries: Sequence[ShardEntry],
        blocks: Sequence[dict[str, np.ndarray]],
    ) -> DatasetIndex:
        """Build from one ``shard_block`` per shard: numpy columns, so a large index is never Python objects."""
        for e, blk in zip(entries, blocks, strict=True):
            if any(len(blk[c]) != e.num_samples for c in (*SAMPLE_COLUMNS, "key_ends")):
                raise DatasetIndexError(f"shard {e.name}: its columns do not all have {e.num_samples} rows")
        cols = {}
        for name, (dtype, _) in COLUMNS.items():
            parts = [np.asarray(blk[name], dtype) for blk in blocks]
            if name == "key_ends":  # per shard from 0: shift by the key bytes of the shards before
                shift = np.cumsum([0] + [len(blk["keys"]) for blk in blocks[:-1]], dtype=np.int64)
                parts = [p + off for p, off in zip(parts, shift)]
            empty = np.zeros((0, 2) if name == "image_sizes" else 0, dtype)
            cols[name] = np.ascontiguousarray(np.concatenate(parts) if parts else empty)
        out = cls(Path(root), tokenizer, image_token_count, created_by, list(entries), cols)
        out.content_hash = _content_hash(out.shards, _column_meta(cols))
        return out

    def save(self) -> Path:
        """Write ``root/index/`` (deterministic bytes) and return it; also sets ``content_hash``.

        The columns are written to a temp directory that replaces the old index only when complete, so a crash
        leaves the old index or none, never a mix (a reader that finds none says how to make one; one that maps
        the columns while they are swapped notices and reads again: ``load_index``)."""
        final = self.root / INDEX_DIR
        tmp, old = (self.root / f".{INDEX_DIR}.{what}-{os.getpid()}" for what in ("tmp", "old"))
        for stale in (tmp, old):  # left by a save of this pid that died
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for name, (dtype, _) in COLUMNS.items():
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(self.columns[name], dtype))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        col_meta = _column_meta(self.columns)
        self.content_hash = _content_hash(self.shards, col_meta)
        meta = {
            "version": self.version,
            "tokenizer": self.tokenizer,
            "image_token_count": self.image_token_count,
            "created_by": self.created_by,
            "shards": [vars(s) for s in self.shards],
            "columns": col_meta,
            "content_hash": self.content_hash,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return final


def decode_key(columns: dict[str, np.ndarray], i: int) -> str:
    """Key ``i`` of a ``keys`` / ``key_ends`` column pair (an index's, or one shard block's)."""
    return decode_keys(columns, np.array([i]))[0]


def decode_keys(columns: dict[str, np.ndarray], rows: np.ndarray) -> list[str]:
    """The keys of ``rows`` [n]: key ``i`` is ``keys[key_ends[i - 1]:key_ends[i]]`` (from 0 for the first), looked
    up with a few numpy calls for all rows, not several per key."""
    ends = columns["key_ends"]
    hi = ends[rows]
    lo = np.where(rows > 0, ends[np.maximum(rows - 1, 0)], 0)
    keys = np.asarray(columns["keys"])  # a plain view: slicing a memmap costs more than the slice
    return [keys[a:b].tobytes().decode() for a, b in zip(lo.tolist(), hi.tolist())]


def shard_block(s: ShardIndex) -> dict[str, np.ndarray]:
    """One shard's rows as the index's columns (``key_ends`` counted from the shard's first key)."""
    for f in ("keys", *_ROW_FIELDS, "image_sizes"):
        if len(getattr(s, f)) != s.num_samples:
            raise DatasetIndexError(f"shard {s.name} has {len(getattr(s, f))} {f} for {s.num_samples} samples")
    block = {col: np.asarray(getattr(s, f), COLUMNS[col][0]) for f, col in zip(_ROW_FIELDS, SAMPLE_COLUMNS)}
    sizes = [wh for per in s.image_sizes for wh in per]
    block["image_sizes"] = np.asarray(sizes, COLUMNS["image_sizes"][0]).reshape(len(sizes), 2)
    encoded = [k.encode() for k in s.keys]
    block["key_ends"] = np.cumsum([len(k) for k in encoded], dtype=np.int64)
    block["keys"] = np.frombuffer(b"".join(encoded), np.uint8).copy()
    return block


def _remap(root: Path, content_hash: str, source: str = "") -> DatasetIndex:
    idx = load_index(root, check_files=False)
    if idx.content_hash != content_hash:
        raise DatasetIndexError(f"{root / INDEX_DIR} changed while the run was using it: restart the run")
    idx.source = source
    return idx


def remove_index(directory: str | os.PathLike) -> None:
    """Delete a directory's index (its shards stay): training and the tools then refuse the directory."""
    shutil.rmtree(Path(directory) / INDEX_DIR, ignore_errors=True)


def _column_meta(columns: dict[str, np.ndarray]) -> dict[str, dict]:
    return {
        name: {"dtype": dtype, "shape": list(columns[name].shape), "sha1": _digest(columns[name])}
        for name, (dtype, _) in COLUMNS.items()
    }


def _digest(arr: np.ndarray) -> str:
    """sha1 of an array's bytes, read in 64 MB pieces (a mapped column is never read whole into memory)."""
    h = hashlib.sha1()
    flat = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)
    for lo in range(0, len(flat), 1 << 26):
        h.update(memoryview(flat[lo : lo + (1 << 26)]))
    return h.hexdigest()


def _content_hash(shards: Sequence[ShardEntry], col_meta: dict) -> str:
    """Names the data: the columns' hashes and the shard list, shard names without their directory (the same
    data indexed in another place is the same data for a resume)."""
    named = [(Path(s.name).name, s.size_bytes, s.num_samples) for s in shards]
    return hashlib.sha1(repr((named, {k: v["sha1"] for k, v in sorted(col_meta.items())})).encode()).hexdigest()


def load_index(
    directory: str | os.PathLike, check_files: bool = True, verify: bool = False, cache_dir: str | None = None
) -> DatasetIndex:
    """Open ``directory/index/``: read ``meta.json``, map every column and check its type and length.

    A URL (``remote.is_remote``) is fetched first into ``cache_dir`` (``fetch_index``: checked column by
    column against its meta.json) and mapped from there; its shards are then read through the shard cache, which
    checks each one's size and CRC when it stages it (``check_files`` does not apply).

    ``check_files``: every shard must exist with its recorded size. ``verify``: also re-hash every column
    against ``meta.json`` (reads all of it; ``scripts/analyze_data.py --verify``). Raises FileNotFoundError
    when there is no index (with the command that makes one) and DatasetIndexError naming the file that is
    malformed, truncated or disagrees with the rest.
    """
    if is_remote(directory):
        idx = load_index(fetch_index(str(directory), cache_dir), check_files=False, verify=verify)
        idx.source = str(directory)
        return idx
    root = Path(directory)
    meta_path = root / INDEX_DIR / META_FILE
    for _ in range(3):  # a save that swapped the directory while we mapped it: read the new one
        before = _stamp(meta_path)
        idx = _load(root, meta_path, check_files, verify)
        if _stamp(meta_path) == before:
            return idx
    raise DatasetIndexError(f"{meta_path} kept changing while it was read: is prepare_data still writing it?")


def fetch_index(url: str, cache_dir: str | os.PathLike | None = None, policy: RetryPolicy | None = None) -> Path:
    """A local copy of a remote dataset's ``index/`` (a directory ``load_index`` maps), fetched when the copy is
    missing or its meta.json differs from the remote one. A fetched copy replaces the old one only once every
    column matches its hash in meta.json, so a failed or partial fetch is never used. The columns are fetched
    at once, one request each: a large index is not held to one connection's bandwidth, nor a small one to a
    round trip per column."""
    policy = policy or RetryPolicy()
    root = Path(cache_dir or default_cache_dir()) / "indexes" / cache_name(url)
    meta_url = join(url, f"{INDEX_DIR}/{META_FILE}")
    try:
        meta = read_bytes(meta_url, policy)
    except RemoteGoneError as e:  # (a store that keeps failing is a RemoteError of its own)
        raise FileNotFoundError(
            f"no index at {redact(url)} ({e}): prepare the dataset with scripts/prepare_data.py and upload the "
            "directory (its shards and index/)"
        ) from None
    local_meta = root / INDEX_DIR / META_FILE
    with file_lock(root.parent / f"{root.name}.lock"):
        if local_meta.is_file() and local_meta.read_bytes() == meta:
            return root
        tmp, old = (root.parent / f".{root.name}.{os.getpid()}.{what}" for what in ("tmp", "old"))
        for stale in (tmp, old):
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / INDEX_DIR).mkdir(parents=True)
        try:
            # the pool's exit waits for every fetch, so none writes into tmp after it is removed below; map
            # raises the error of the first column (in COLUMNS' order) that failed
            with ThreadPoolExecutor(min(len(COLUMNS), CONNECTIONS), thread_name_prefix="index-fetch") as pool:
                names = (f"{INDEX_DIR}/{c}.npy" for c in COLUMNS)  # our column names, never names read remotely
                list(pool.map(lambda n: download(join(url, n), tmp / n, policy), names))
            (tmp / INDEX_DIR / META_FILE).write_bytes(meta)
            load_index(tmp, check_files=False, verify=True)
        except (DatasetIndexError, RemoteError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DatasetIndexError(f"the index of {redact(url)} cannot be used: {redact(str(e))}") from None
        except LocalCacheError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RemoteError(f"cannot copy the index of {redact(url)} into {root.parent}: {e}") from None
        if root.exists():
            os.replace(root, old)
        os.replace(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    log.info("fetched the index of %s into %s", redact(url), root)
    return root


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _load(root: Path, meta_path: Path, check_files: bool, verify: bool) -> DatasetIndex:
    meta = _read_meta(root, meta_path)
    try:
        shards = [
            ShardEntry(str(s["name"]), int(s["size_bytes"]), int(s["num_samples"]), str(s.get("crc32", "")))
            for s in meta["shards"]
        ]
        col_meta = meta["columns"]
        header = (str(meta["tokenizer"]), int(meta["image_token_count"]), str(meta["created_by"]))
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetIndexError(f"{meta_path}: missing or bad field {e}") from None
    n = sum(s.num_samples for s in shards)
    columns = {name: _map_column(meta_path.parent, name, col_meta) for name in COLUMNS}
    _check_rows(meta_path, columns, n)
    if verify:
        for name, arr in columns.items():
            if _digest(arr) != col_meta[name].get("sha1"):
                raise DatasetIndexError(
                    f"{meta_path.parent / (name + '.npy')}: content does not match its hash in "
                    f"{META_FILE} (the file is corrupt: re-run scripts/prepare_data.py)"
                )
    if check_files:
        for s in shards:
            sp = root / s.name
            if not sp.is_file():
                raise DatasetIndexError(f"{meta_path}: shard {s.name} is missing")
            if sp.stat().st_size != s.size_bytes:
                raise DatasetIndexError(
                    f"{meta_path}: shard {s.name} has {sp.stat().st_size} bytes, index says {s.size_bytes} "
                    "(the shard changed after indexing: re-run prepare_data)"
                )
    content_hash = _content_hash(shards, col_meta)  # from meta's column hashes: cheap, and it must agree
    if meta.get("content_hash") != content_hash:
        raise DatasetIndexError(f"{meta_path}: content_hash does not match its shards and column hashes")
    return DatasetIndex(root, *header, shards, columns, content_hash, INDEX_VERSION, mapped=True)


def _read_meta(root: Path, path: Path) -> dict:
    if not path.is_file():
        old = " (index.json is an older index format)" if (root / "index.json").is_file() else ""
        raise FileNotFoundError(
            f"no {INDEX_DIR}/{META_FILE} in {root}{old}: prepare the dataset with `python scripts/prepare_data.py "
            f"--input ... --output {root}` (or `--input {root}` to index existing WebDataset shards)"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetIndexError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("version") != INDEX_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else meta
        raise DatasetIndexError(
            f"{path}: unsupported index version {version!r} (this nanovlm reads version {INDEX_VERSION}: re-run "
            "scripts/prepare_data.py)"
        )
    return meta


def _map_column(directory: Path, name: str, col_meta: dict) -> np.ndarray:
    """Memory-map one column, refusing a missing, truncated or mistyped file by name."""
    path = directory / f"{name}.npy"
    dtype = COLUMNS[name][0]
    want = col_meta.get(name) if isinstance(col_meta, dict) else None
    if not isinstance(want, dict) or want.get("dtype") != dtype:
        raise DatasetIndexError(f"{directory / META_FILE}: no {dtype} column {name!r}")
    if not path.is_file():
        raise DatasetIndexError(f"{path} is missing (re-run scripts/prepare_data.py)")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # bad header, or fewer bytes than the header promises
        raise DatasetIndexError(f"{path} is not a readable .npy column (truncated or corrupt: {e})") from None
    if arr.dtype != np.dtype(dtype) or list(arr.shape) != want.get("shape"):
        raise DatasetIndexError(
            f"{path}: {arr.dtype} {list(arr.shape)} where {META_FILE} says {dtype} {want.get('shape')}"
        )
    return arr


def _check_rows(meta_path: Path, c: dict[str, np.ndarray], n: int) -> None:
    """Row counts agree with the shard list, and the columns that index others point inside them."""
    for name, (_, rows) in COLUMNS.items():
        if rows == "samples" and len(c[name]) != n:
            raise DatasetIndexError(
                f"{meta_path.parent / (name + '.npy')} has {len(c[name])} rows, but the shards in {META_FILE} "
                f"hold {n} samples"
            )
    n_images = int(c["n_images"].sum(dtype=np.int64))
    if c["image_sizes"].ndim != 2 or c["image_sizes"].shape != (n_images, 2):
        raise DatasetIndexError(
            f"{meta_path.parent / 'image_sizes.npy'}: shape {c['image_sizes'].shape}, "
            f"expected ({n_images}, 2) for the images n_images.npy counts"
        )
    if n and int(c["key_ends"][-1]) != len(c["keys"]):
        raise DatasetIndexError(
            f"{meta_path.parent / 'key_ends.npy'} ends at {int(c['key_ends'][-1])}, but "
            f"keys.npy holds {len(c['keys'])} bytes"
        )


def split_member_name(name: str) -> tuple[str, str]:
    """WebDataset convention: ``dir/key.suffix.ext`` -> (``dir/key``, ``suffix.ext``): split at the first dot
    of the base name."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


@dataclass
class TarSample:
    """One sample's members as found in a tar: key, byte range, and (name, data offset, size) per member."""

    key: str
    offset: int
    nbytes: int
    members: list[tuple[str, int, int]]


def scan_tar(path: str | os.PathLike) -> Iterator[TarSample]:
    """Yield the samples of a tar in file order, grouping consecutive members with the same key.

    Reads headers only (tarfile seeks over the data). Non-file members are skipped. A corrupt tar raises
    tarfile.TarError from the point where it breaks, after yielding the samples before it: tarfile alone would
    treat a bad header as the end of the archive and silently lose the rest, so the bytes after the last
    member are checked to be the zero blocks that really end an archive.
    """
    with tarfile.open(path, mode="r:") as tf:
        current: TarSample | None = None
        for info in tf:
            if not info.isfile():
                continue
            key, suffix = split_member_name(info.name)
            end = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
            if current is not None and key == current.key:
                current.members.append((suffix, info.offset_data, info.size))
                current.nbytes = end - current.offset
                continue
            if current is not None:
                yield current
            current = TarSample(key, info.offset, end - info.offset, [(suffix, info.offset_data, info.size)])
        if current is not None:
            yield current
        end = tf.offset  # where tarfile stopped: the end-of-archive blocks, or a header it could not parse
    _check_archive_end(path, end)


def _check_archive_end(path: str | os.PathLike, offset: int) -> None:
    """Raise tarfile.ReadError unless everything from ``offset`` to the end of the file is zero bytes."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        while chunk := f.read(1 << 16):
            if chunk.count(0) != len(chunk):
                bad = pos + next(i for i, b in enumerate(chunk) if b)
                raise tarfile.ReadError(
                    f"{path}: unreadable tar header at byte {offset} (data continues at byte {bad}); "
                    "the samples from there on are lost"
                )
            pos += len(chunk)
