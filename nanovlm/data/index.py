"""The dataset index: per shard and per sample, everything packing and resumption need, without reading tars.

``index.json`` in a dataset directory (format in docs/internals.md) is columnar per shard, so millions of
samples load in a second. Shard ``name`` is a path relative to the index's directory (usually a bare file
name; ``../other/x.tar`` when an index was written for shards that live elsewhere).

``scan_tar`` groups a tar's members by sample key and records each sample's byte range, so a reader can
seek straight to one sample (``reader.ShardReader``) instead of streaming the shard.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

INDEX_FILE = "index.json"
INDEX_VERSION = 2
_BLOCK = 512


class DatasetIndexError(ValueError):
    """An index file is malformed or does not match the shards next to it."""


@dataclass
class ShardIndex:
    """One shard: columnar per-sample fields (all lists have ``num_samples`` entries)."""

    name: str
    size_bytes: int
    num_samples: int
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of the sample's first tar header
    nbytes: list[int] = field(default_factory=list)  # bytes from that header to the end of its last member
    text_tokens: list[int] = field(default_factory=list)  # tokens with each <image> counted once
    n_images: list[int] = field(default_factory=list)
    image_sizes: list[list[list[int]]] = field(default_factory=list)  # per sample, per image: [width, height]
    # Before the first loss token: tokens (each <image> counted once) and images; data.overlength=truncate skips
    # a sample whose prompt alone fills the limit, without reading it.
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_images: list[int] = field(default_factory=list)

    def total_tokens(self, image_token_count: int) -> list[int]:
        """Tokens per sample after image expansion, for a model with ``image_token_count`` tokens per image."""
        return [t + n * (image_token_count - 1) for t, n in zip(self.text_tokens, self.n_images)]

    def prompt_lengths(self, image_token_count: int) -> list[int]:
        """Tokens before each sample's first loss token after image expansion."""
        return [t + n * (image_token_count - 1) for t, n in zip(self.prompt_tokens, self.prompt_images)]


@dataclass
class DatasetIndex:
    """A dataset directory's index. ``root`` is the directory (not stored in the file)."""

    root: Path
    tokenizer: str  # tokenizer fingerprint the text_tokens were counted with
    image_token_count: int  # tokens per image of the model the data was prepared for (informational)
    created_by: str
    shards: list[ShardIndex]
    version: int = INDEX_VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def shard_path(self, shard: int | ShardIndex) -> Path:
        s = self.shards[shard] if isinstance(shard, int) else shard
        return self.root / s.name

    def total_tokens(self, image_token_count: int) -> list[int]:
        """Tokens per sample after image expansion, over all shards in order."""
        return [t for s in self.shards for t in s.total_tokens(image_token_count)]

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "tokenizer": self.tokenizer,
            "image_token_count": self.image_token_count,
            "created_by": self.created_by,
            "shards": [asdict(s) for s in self.shards],
        }

    def save(self) -> Path:
        """Write ``root/index.json`` atomically (temp file + rename); deterministic bytes."""
        path = self.root / INDEX_FILE
        tmp = path.with_name(INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        return path


_LIST_FIELDS = ("keys", "offsets", "nbytes", "text_tokens", "n_images", "image_sizes", "prompt_tokens", "prompt_images")


def load_index(directory: str | os.PathLike, check_files: bool = True) -> DatasetIndex:
    """Read and validate ``directory/index.json``; with ``check_files``, every shard must exist with its size.

    Raises FileNotFoundError when there is no index (with the command that makes one) and DatasetIndexError
    when the file is malformed or disagrees with the shards.
    """
    root = Path(directory)
    path = root / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {INDEX_FILE} in {root}: prepare the dataset with `python scripts/prepare_data.py --input ... "
            f"--output {root}` (or `--input {root}` to index existing WebDataset shards)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetIndexError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("version") != INDEX_VERSION:
        raise DatasetIndexError(
            f"{path}: unsupported index version {raw.get('version') if isinstance(raw, dict) else raw!r} (this "
            f"nanovlm reads version {INDEX_VERSION}: re-run scripts/prepare_data.py, or it is not an index)"
        )
    shards = []
    for i, s in enumerate(raw.get("shards", [])):
        try:
            shard = ShardIndex(**s)
        except TypeError as e:
            raise DatasetIndexError(f"{path}: shard {i} has bad fields: {e}") from None
        for f in _LIST_FIELDS:
            if len(getattr(shard, f)) != shard.num_samples:
                raise DatasetIndexError(
                    f"{path}: shard {shard.name} has {len(getattr(shard, f))} {f} for {shard.num_samples} samples"
                )
        if check_files:
            sp = root / shard.name
            if not sp.is_file():
                raise DatasetIndexError(f"{path}: shard {shard.name} is missing")
            if sp.stat().st_size != shard.size_bytes:
                raise DatasetIndexError(
                    f"{path}: shard {shard.name} has {sp.stat().st_size} bytes, index says {shard.size_bytes} "
                    "(the shard changed after indexing: re-run prepare_data)"
                )
        shards.append(shard)
    return DatasetIndex(
        version=int(raw["version"]),
        root=root,
        tokenizer=str(raw.get("tokenizer", "")),
        image_token_count=int(raw.get("image_token_count", 0)),
        created_by=str(raw.get("created_by", "")),
        shards=shards,
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
