"""Fault generators for the fault tests: broken tars, bad images, bad JSON, hostile pickles.

Each generator builds one realistic fault in memory or on disk, small enough for a CPU test. They are plain
functions, so a fault can be reproduced by hand from a Python shell (in ``tests/``):

    >>> from helpers.faults import bomb_png, corrupt_header
    >>> open("bomb.png", "wb").write(bomb_png())

``reason_of`` and ``JSONL_REASON`` check the SampleError a fault must raise.

Dataset-level faults (``rewrite_shard``, ``truncate_mid_member``, ``corrupt_header``) act on a dataset directory
written by ``nanovlm.data.prepare.write_dataset`` and follow the index format of docs/internals.md: they change a
shard as bit rot or a careless tool would, and either keep the index consistent with the new bytes (so the
fault is only visible when the sample is read) or leave it stale on purpose (so setup must notice).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import struct
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from nanovlm.data.format import SampleError
from nanovlm.data.index import DatasetIndex, ShardIndex, load_index

BLOCK = 512  # tar block size

# ----------------------------------------------------------------------------------------------------------
# images


def image(size: tuple[int, int] = (32, 32), mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A deterministic, non-uniform test image (a gradient with a seed-dependent offset) in ``mode``."""
    w, h = size
    rgb = Image.new("RGB", size)
    rgb.putdata([((x * 255 // max(w - 1, 1) + seed * 37) % 256, (y * 255 // max(h - 1, 1)) % 256, (x ^ y) % 256)
                 for y in range(h) for x in range(w)])  # fmt: skip
    return rgb if mode == "RGB" else rgb.convert(mode)


def encode(img: Image.Image, fmt: str = "PNG", **save_kwargs) -> bytes:
    """``img`` encoded as ``fmt`` bytes."""
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def png(size: tuple[int, int] = (32, 32), mode: str = "RGB", seed: int = 0) -> bytes:
    return encode(image(size, mode, seed), "PNG")


def jpeg(size: tuple[int, int] = (32, 32), mode: str = "RGB", seed: int = 0) -> bytes:
    return encode(image(size, mode, seed), "JPEG", quality=90)


def not_an_image() -> bytes:
    """Bytes that no image decoder accepts (a text file saved as ``.jpg``)."""
    return b"this is a text file, not an image\n" * 8


def truncated_jpeg(size: tuple[int, int] = (64, 64)) -> bytes:
    """A JPEG cut after its headers and part of the scan: the header parses, decoding fails."""
    data = jpeg(size)
    return data[: len(data) // 2]


def png_named_jpg() -> bytes:
    """PNG bytes (the caller stores them under a ``.jpg`` member name): must decode by content."""
    return png((24, 16), seed=3)


def grayscale_png() -> bytes:
    return png((32, 32), "L", seed=1)


def palette_png() -> bytes:
    return png((32, 32), "P", seed=2)


def rgba_png() -> bytes:
    return png((32, 32), "RGBA", seed=4)


def cmyk_jpeg() -> bytes:
    return encode(image((32, 32), "CMYK", seed=5), "JPEG", quality=95)


def bomb_png(width: int = 12_000, height: int = 12_000, body: bool = True) -> bytes:
    """A valid 1-bit grayscale PNG of ``width x height`` pixels, about 20 KB on disk.

    Decoded it needs width*height bytes (144 MB by default, more after RGB conversion): the decompression bomb a
    pixel-count guard must refuse *before* decoding. PIL itself only warns below 2 x ``Image.MAX_IMAGE_PIXELS``.
    ``body=False`` leaves the pixel data out: only a guard that looks at the header first can tell it is too
    large (decoding it would fail as unreadable instead).
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte 0 + packed bits
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush() if body else b""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def exif_rotated_png(orientation: int = 6, size: tuple[int, int] = (32, 16)) -> tuple[bytes, bytes]:
    """(PNG whose EXIF says 'rotate for display', PNG of the same picture already upright, no EXIF).

    A camera stores the sensor image plus an orientation tag; a viewer shows it upright. Both returned files
    show the same upright picture, so a decoder that honours EXIF turns them into identical pixels.
    """
    raw = image(size, seed=6)
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    rotated = encode(raw, "PNG", exif=exif.tobytes())
    transpose = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}
    upright = encode(raw.transpose(transpose[orientation]), "PNG")
    return rotated, upright


# ----------------------------------------------------------------------------------------------------------
# JSON members of one sample


def conversation(n_images: int = 1, answer: str = "a red square", question: str = "What is this?") -> dict:
    """A valid native sample json: one user turn with ``n_images`` placeholders, one assistant turn."""
    return {
        "messages": [
            {"role": "user", "content": "<image>\n" * n_images + question},
            {"role": "assistant", "content": answer},
        ]
    }


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode("utf-8")


def bad_json_variants() -> dict[str, tuple[bytes, str]]:
    """name -> (json member bytes for a sample with ONE image, the SampleError reason it must be skipped with)."""
    ok = conversation(1)
    no_messages = {"caption_of_nothing": 1, "meta": "x"}
    return {
        "unparseable": (b'{"messages": [{"role": "user", "content": "<image>\\nhi"', "bad_json"),
        "not_an_object": (b'["<image>", "hi"]', "bad_json"),
        "missing_messages": (json_bytes({"meta": {"source": "x"}, "images": 1}), "missing_messages"),
        "messages_not_list": (json_bytes({"messages": "<image> hello"}), "missing_messages"),
        "content_not_str": (
            json_bytes({"messages": [{"role": "user", "content": ["<image>"]}, {"role": "assistant", "content": 1}]}),
            "missing_messages",
        ),
        "no_assistant_turn": (json_bytes({"messages": ok["messages"][:1]}), "no_assistant_turn"),
        "placeholder_mismatch": (json_bytes(conversation(2)), "image_count_mismatch"),
        "no_placeholder": (json_bytes(conversation(0)), "image_count_mismatch"),
        "invalid_utf8": (json_bytes(ok).replace(b"a red square", b"a red \xff\xfe square"), "bad_utf8"),
        "unknown_keys_only": (json_bytes(no_messages), "missing_messages"),
    }


# ----------------------------------------------------------------------------------------------------------
# the reason a fault must be rejected with


def reason_of(fn, *args, **kwargs) -> str:
    """The SampleError reason ``fn`` raises (fails the test if it raises nothing or something else)."""
    with pytest.raises(SampleError) as exc:
        fn(*args, **kwargs)
    return exc.value.reason


# A JSONL line may be native, LLaVA or caption: a line that is none of them is an unknown format.
JSONL_REASON = {
    "not_an_object": "unknown_format",
    "missing_messages": "unknown_format",
    "unknown_keys_only": "unknown_format",
}


# ----------------------------------------------------------------------------------------------------------
# hostile payloads


class _CreatesFile:
    """Pickles to 'call open(path, "w")': unpickling it creates ``path``. Nothing is created while pickling."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_payload(marker: Path) -> bytes:
    """Pickle bytes whose unpickling creates the file ``marker`` (and returns an open file object)."""
    return pickle.dumps(_CreatesFile(marker))


HOSTILE_SUFFIXES = ("pyd", "pickle", "pkl", "pth", "pt", "npy")


def hostile_members(marker: Path) -> dict[str, bytes]:
    return {suffix: pickle_payload(marker) for suffix in HOSTILE_SUFFIXES} | {"0.pyd": pickle_payload(marker)}


def malicious_checkpoint(path: Path, marker: Path, state_dict: dict | None = None) -> Path:
    """A ``torch.save`` file that looks like a checkpoint but creates ``marker`` when loaded with full unpickling."""
    import torch

    torch.save({"state_dict": state_dict or {"w": torch.zeros(2)}, "global_step": 1, "x": _CreatesFile(marker)}, path)
    return path


# ----------------------------------------------------------------------------------------------------------
# tars and shards


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """A deterministic ustar archive of (name, data) members, as WebDataset writes them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "", ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def empty_tar() -> bytes:
    """A valid tar with no member (the two zero end blocks plus padding)."""
    return tar_bytes([])


def read_index(dataset_dir: Path) -> dict:
    """The index as one editable dict: header fields and, per shard, its rows as lists."""
    idx = load_index(dataset_dir, check_files=False)
    shards = [dataclasses.asdict(idx.shard(i)) for i in range(len(idx.shards))]
    return {"tokenizer": idx.tokenizer, "image_token_count": idx.image_token_count, "shards": shards}


def write_index(dataset_dir: Path, index: dict) -> None:
    """Write an edited ``read_index`` dict back with the package's writer."""
    shards = [ShardIndex(**s) for s in index["shards"]]
    DatasetIndex.from_shards(dataset_dir, index["tokenizer"], index["image_token_count"], "test", shards).save()


def shard_members(path: Path) -> list[tuple[str, bytes]]:
    """All (name, data) members of a tar, in order."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def member_spans(path: Path) -> list[tuple[str, int, int]]:
    """(name, header offset, end of padded data) of every member of a tar."""
    with tarfile.open(path) as tar:
        return [(m.name, m.offset, m.offset_data + -(-m.size // BLOCK) * BLOCK) for m in tar.getmembers()]


def sample_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """key -> (offset, nbytes) of each sample's members, as the index records them (its offset and nbytes columns)."""
    ranges: dict[str, tuple[int, int]] = {}
    for name, start, end in member_spans(path):
        key = name.split(".", 1)[0]
        first = ranges.get(key, (start, 0))[0]
        ranges[key] = (first, end - first)
    return ranges


def rewrite_shard(
    dataset_dir: Path,
    shard: int,
    edit: Callable[[str, str, bytes], bytes | None],
    extra: list[tuple[str, bytes]] = (),
    fix_index: bool = True,
) -> None:
    """Rewrite shard number ``shard`` with ``edit(key, suffix, data) -> new data | None (drop member)``.

    ``extra`` members are appended to the sample they name (``key.suffix``), right after its last member, so
    the sample stays contiguous. With ``fix_index`` the shard's ``size_bytes``, ``offsets`` and ``nbytes`` in
    the index are recomputed from the new tar (keys, token counts and image counts are left as they were):
    the index is then consistent with the bytes and the fault shows only when the sample is decoded.
    """
    dataset_dir = Path(dataset_dir)
    index = read_index(dataset_dir)
    entry = index["shards"][shard]
    path = dataset_dir / entry["name"]
    by_key: dict[str, list[tuple[str, bytes]]] = {}
    for name, data in shard_members(path):
        key, suffix = name.split(".", 1)
        new = edit(key, suffix, data)
        by_key.setdefault(key, [])
        if new is not None:
            by_key[key].append((name, new))
    for name, data in extra:
        by_key.setdefault(name.split(".", 1)[0], []).append((name, data))
    path.write_bytes(tar_bytes([m for members in by_key.values() for m in members]))
    if fix_index:
        ranges = sample_ranges(path)
        entry["size_bytes"] = path.stat().st_size
        entry["offsets"] = [ranges[k][0] for k in entry["keys"]]
        entry["nbytes"] = [ranges[k][1] for k in entry["keys"]]
        write_index(dataset_dir, index)


def truncate_mid_member(path: Path, member: int = -1) -> int:
    """Cut the tar at ``path`` in the middle of the data of member number ``member``; returns the new size."""
    name, start, end = member_spans(path)[member]
    cut = start + BLOCK + (end - start - BLOCK) // 2
    with open(path, "r+b") as f:
        f.truncate(cut)
    return cut


def corrupt_header(path: Path, member: int) -> str:
    """Overwrite the name and checksum of member number ``member``'s header (same file size); returns its name.

    Python's tarfile treats a bad header after the first as the end of the archive, so a naive reader silently
    loses every sample from there on.
    """
    name, start, _ = member_spans(path)[member]
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\x9f" * 100)  # name field
        f.seek(start + 148)
        f.write(b"XXXXXXXX")  # chksum field
    return name
