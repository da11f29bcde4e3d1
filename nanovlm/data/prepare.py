"""Writing datasets: Records -> validated samples -> deterministic tar shards + their index.

Every dataset of the project (``prepare_data``, the demo data, the tests' synthetic data) is written here, so
every index's token lengths come from ``SampleProcessor.token_counts`` and every shard has the same layout:

* one WebDataset key per sample: ``0.jpg``, ``1.png``, ... (the real format of the bytes, sniffed) + ``json``;
* deterministic tar metadata (mtime 0, uid/gid 0, fixed user/group names and mode), samples in input order,
  so the same input gives byte-identical shards; the mtime is an int because tarfile writes a float one as a pax
  extension header, 1 KB more per member;
* each shard is written to a hidden temp name and renamed when complete: a crash never leaves a half-written
  file that looks like a shard. The index is written last, also atomically.

``prepare_jsonl_line`` and ``index_tar_sample`` are the per-sample work of ``prepare_data`` (run in worker
processes); both return a PreparedSample or raise SampleError with a reason.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import webdataset as wds

from nanovlm.data.format import Record, SampleError, check_key, members_to_record, record_to_json, validate_messages
from nanovlm.data.index import (
    COLUMNS,
    INDEX_DIR,
    META_FILE,
    DatasetIndex,
    ShardEntry,
    ShardIndex,
    crc32_file,
    load_index,
    remove_index,
    scan_tar,
    shard_block,
)
from nanovlm.data.jpeg_header import jpeg_header
from nanovlm.data.processing import (
    ROTATED_ORIENTATIONS,
    SampleProcessor,
    check_pixels,
    load_image,
    open_upright,
    to_rgb,
)
from nanovlm.data.remote import RetryPolicy, filesystem, join, redact, with_retries
from nanovlm.data.tokenizer import tokenizer_fingerprint

SHARD_PATTERN = "shard-{:06d}.tar"
_SHARD_RE = re.compile(r"^shard-\d{6}\.tar$")
# PIL format -> member suffix. Other formats the decoder accepts (PPM) are re-encoded as PNG for every reader.
_FORMAT_EXT = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}


@dataclass
class PreparedSample:
    """A validated sample ready to write: tar members (suffix -> bytes) and its index fields."""

    key: str
    members: dict[str, bytes]
    text_tokens: int
    image_sizes: list[list[int]]  # per image [width, height], upright
    prompt_tokens: int = 0  # tokens before the first loss token (each <image> counted once)
    prompt_images: int = 0  # images before the first loss token


def inspect_image(
    data: bytes | memoryview, max_pixels: int = 0, key: str = "", decode: bool = True
) -> tuple[str, list[int], bytes]:
    """Check image bytes; return (member suffix, [width, height] upright, bytes).

    ``decode``: decode every byte (JPEG at 1/8 scale, which still reads the whole file) so truncated or corrupt
    files are caught here, at preparation time, not in the middle of training. Without it a JPEG is read up to
    its header only (format, size, orientation: ~20x faster) and a file damaged past its header is a counted
    ``unreadable_image`` skip when training reads it; other formats are decoded either way, since only the
    decoded image tells their orientation (``processing.open_upright``).
    """
    if not decode and (head := jpeg_header(data)) is not None:  # a plain JPEG header: no Pillow needed
        w, h, orientation = head
        check_pixels(w, h, max_pixels, key)
        return "jpg", ([h, w] if orientation in ROTATED_ORIENTATIONS else [w, h]), data
    img, upright = open_upright(data, max_pixels, key)
    w, h = img.size
    fmt = img.format
    if decode and fmt == "JPEG":
        img.draft(img.mode, (max(1, w // 8), max(1, h // 8)))
        load_image(img, key=key)
    ext = _FORMAT_EXT.get(fmt or "")
    if ext is None:  # PPM: store as PNG so any reader decodes it
        buf = io.BytesIO()
        to_rgb(img).save(buf, format="PNG")
        ext, data = "png", buf.getvalue()
    return ext, list(upright), data


def prepare_record(record: Record, processor: SampleProcessor, max_image_pixels: int = 0) -> PreparedSample:
    """Validate a Record (key, conversation, every image) and count its tokens. Raises SampleError."""
    check_key(record.key)
    messages = validate_messages(record.messages, len(record.images), record.key)
    members: dict[str, bytes] = {}
    sizes = []
    for i, data in enumerate(record.images):
        ext, size, data = inspect_image(data, max_image_pixels, record.key)
        members[f"{i}.{ext}"] = data
        sizes.append(size)
    clean = Record(record.key, messages, record.images, record.extra)
    members["json"] = record_to_json(clean)
    text_tokens, prompt_tokens, prompt_images = processor.token_counts(messages)
    return PreparedSample(record.key, members, text_tokens, sizes, prompt_tokens, prompt_images)


class ShardWriter:
    """Append PreparedSamples; writes ``shard-NNNNNN.tar`` files atomically and the index on ``close``."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        fingerprint: str,
        image_token_count: int,
        samples_per_shard: int = 1000,
        created_by: str = "write_dataset",
    ):
        if samples_per_shard <= 0:
            raise ValueError("samples_per_shard must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.image_token_count = image_token_count
        self.samples_per_shard = samples_per_shard
        self.created_by = created_by
        # finished shards as numpy column blocks: no Python object per sample outlives its shard
        self.shards: list[ShardEntry] = []
        self.blocks: list[dict] = []
        self._seen: set[str] = set()
        self._pending: list[PreparedSample] = []  # index fields of the open shard
        self._writer: wds.TarWriter | None = None
        self._tmp: Path | None = None

    def add(self, sample: PreparedSample) -> None:
        if sample.key in self._seen:
            raise SampleError("duplicate_key", sample.key, "keys must be unique within a dataset")
        self._seen.add(sample.key)
        if self._writer is None:
            name = SHARD_PATTERN.format(len(self.shards))
            self._tmp = self.out_dir / f".{name}.tmp"
            self._writer = wds.TarWriter(
                str(self._tmp), encoder=False, mtime=0, user="nanovlm", group="nanovlm", mode=0o644
            )
        self._writer.write({"__key__": sample.key, **sample.members})
        self._pending.append(replace(sample, members={}))  # drop the bytes, keep the index fields
        if len(self._pending) >= self.samples_per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._writer is not None and self._tmp is not None
        self._writer.close()
        name = SHARD_PATTERN.format(len(self.shards))
        scanned = list(scan_tar(self._tmp))
        keys = [s.key for s in self._pending]
        if [s.key for s in scanned] != keys:
            raise RuntimeError(f"{name}: written keys do not read back in order (a key with a dot?)")
        if not self.shards:
            # An earlier dataset's index must not survive a rerun that dies half-way: it would describe a mix of
            # new and old shards (same names) and training would read it without a word. Without an index the
            # directory is refused until a run completes.
            remove_index(self.out_dir)
        os.replace(self._tmp, self.out_dir / name)
        rows = ShardIndex(
            name=name,
            size_bytes=(self.out_dir / name).stat().st_size,
            num_samples=len(keys),
            keys=keys,
            offsets=[s.offset for s in scanned],
            nbytes=[s.nbytes for s in scanned],
            text_tokens=[s.text_tokens for s in self._pending],
            n_images=[len(s.image_sizes) for s in self._pending],
            image_sizes=[s.image_sizes for s in self._pending],
            prompt_tokens=[s.prompt_tokens for s in self._pending],
            prompt_images=[s.prompt_images for s in self._pending],
        )
        crc = crc32_file(self.out_dir / name)
        self.shards.append(ShardEntry(rows.name, rows.size_bytes, rows.num_samples, crc))
        self.blocks.append(shard_block(rows))
        self._writer, self._tmp, self._pending = None, None, []

    def close(self) -> DatasetIndex:
        """Finish the last shard, remove stale shards of an earlier run, write the index."""
        if self._writer is not None:
            self._finish_shard()
        keep = {s.name for s in self.shards}
        for f in self.out_dir.iterdir():
            if (_SHARD_RE.match(f.name) and f.name not in keep) or (
                f.name.startswith(".shard-") and f.suffix == ".tmp"
            ):
                f.unlink()
        index = DatasetIndex.from_blocks(
            self.out_dir, self.fingerprint, self.image_token_count, self.created_by, self.shards, self.blocks
        )
        index.save()
        return index

    def abort(self) -> None:
        """Drop the open shard's temp file (on error): nothing half-written remains."""
        if self._writer is not None:
            self._writer.close()
        if self._tmp is not None and self._tmp.exists():
            self._tmp.unlink()
        self._writer, self._tmp, self._pending = None, None, []


def write_dataset(
    records: Iterable[Record],
    out_dir: str | os.PathLike,
    tokenizer,
    image_token_count: int,
    samples_per_shard: int = 1000,
    max_image_pixels: int = 64_000_000,
    on_skip: Callable[[SampleError], None] | None = None,
    created_by: str = "write_dataset",
    chat_format: str = "chatml",
) -> DatasetIndex:
    """Validate and write ``records`` as shards + index in ``out_dir``; return the index.

    A bad record raises SampleError, unless ``on_skip`` is given: then it is called with the error and the
    record is left out (the caller counts and logs it).
    """
    processor = SampleProcessor(tokenizer, image_size=1, image_token_count=image_token_count, chat_format=chat_format)
    fingerprint = tokenizer_fingerprint(tokenizer, chat_format)
    writer = ShardWriter(out_dir, fingerprint, image_token_count, samples_per_shard, created_by)
    try:
        for record in records:
            try:
                writer.add(prepare_record(record, processor, max_image_pixels))
            except SampleError as e:
                if on_skip is None:
                    raise
                on_skip(e)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# ----------------------------------------------------------------------------------------------------------
# per-sample work of prepare_data (runs in worker processes)


def resolve_image_path(ref: str, image_root: Path, allow_absolute: bool = False, key: str = "") -> Path:
    """An image reference from a JSONL line -> a path inside ``image_root``.

    Refuses (reason ``unsafe_path``) references that escape the root (``../``, symlinks out) and absolute
    paths unless ``allow_absolute``; ``missing_image`` when the file does not exist.
    """
    shown = ref if len(ref) <= 200 else f"{ref[:200]}... ({len(ref)} characters)"
    try:
        ref_path = Path(ref)
        if ref_path.is_absolute():
            if not allow_absolute:
                raise SampleError("unsafe_path", key, f"absolute image path {shown!r} (use --allow-absolute-paths)")
            path = ref_path
        else:
            root = image_root.resolve()
            path = (root / ref_path).resolve()
            if not path.is_relative_to(root):
                raise SampleError(
                    "unsafe_path",
                    key,
                    f"image path {shown!r} escapes the image root {image_root} (a symlink pointing out of it counts: "
                    "give --image-root the folder the files really are in)",
                )
        if not path.is_file():
            raise SampleError("missing_image", key, f"{shown} (looked for {path})")
    except (OSError, ValueError, RuntimeError) as e:  # a name too long, a NUL byte, a lone surrogate, a symlink loop
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:200]  # OSError's str repeats the path
        raise SampleError(
            "bad_image_ref", key, f"{shown!r} is not a usable file path: {type(e).__name__}: {why}"
        ) from None
    return path


def prepare_jsonl_line(
    line: bytes,
    key: str,
    image_root: Path,
    processor: SampleProcessor,
    max_image_pixels: int,
    allow_absolute: bool = False,
) -> PreparedSample:
    """One JSONL line (any supported format) -> PreparedSample, reading its images from ``image_root``."""
    from nanovlm.data.format import parse_jsonl_line

    if not line.strip():
        raise SampleError("empty_line", key)
    messages, refs, extra = parse_jsonl_line(line, key)
    images = []
    for ref in refs:
        path = resolve_image_path(ref, image_root, allow_absolute, key)
        try:
            images.append(path.read_bytes())
        except OSError as e:
            raise SampleError("unreadable_image", key, f"{ref}: {e}") from None
    return prepare_record(Record(key, messages, images, extra), processor, max_image_pixels)


def index_tar_sample(
    members: dict[str, bytes | memoryview],
    key: str,
    processor: SampleProcessor,
    max_image_pixels: int,
    decode: bool = True,
) -> tuple[tuple[int, int, int], list[list[int]]]:
    """One sample of an existing shard -> ((text, prompt tokens, prompt images), image_sizes), validating it
    as training will read it."""
    record = members_to_record(members, key)
    sizes = [inspect_image(data, max_image_pixels, key, decode)[1] for data in record.images]
    return processor.token_counts(record.messages), sizes


def publish(local: Path, url: str, policy: RetryPolicy | None = None) -> int:
    """Upload a prepared dataset directory to ``url``: its shards first, then the index columns, ``meta.json``
    last, so a reader never finds an index whose shards are not there yet; then the remote shards the new index
    does not list are removed. A reader still holding the previous index meets a replaced shard that fails its
    size or CRC check: a named error, never a wrong sample. Returns the bytes uploaded."""
    policy = policy or RetryPolicy()
    index = load_index(local)
    fs, base = filesystem(url)
    files = [s.name for s in index.shards] + [f"{INDEX_DIR}/{c}.npy" for c in COLUMNS] + [f"{INDEX_DIR}/{META_FILE}"]
    sent = 0
    for name in files:
        target = join(base, name)
        with_retries(lambda n=name, t=target: fs.put_file(str(local / n), t), redact(join(url, name)), policy)
        sent += (local / name).stat().st_size
    listed = {join(base, s.name) for s in index.shards}
    for stale in fs.glob(join(base, "shard-*.tar")):
        if stale.split("://", 1)[-1] not in listed:
            with_retries(lambda p=stale: fs.rm(p), redact(stale), policy)
    return sent
