"""Random access to one sample of a shard by its index byte range.

The index records, per sample, the byte range of its tar members, so reading a sample is one positioned read +
parsing a few tar headers from memory (a direct ustar/pax header parser, with ``tarfile`` on a BytesIO for
anything unusual: headers and raw bytes only; nothing is decoded here and nothing is ever unpickled). Shard files
stay open per reader (one reader per DataLoader worker), so a pack of samples costs no ``open`` calls.
"""

from __future__ import annotations

import io
import os
import tarfile
import zlib
from typing import BinaryIO

from nanovlm.data.format import Record, SampleError, members_to_record
from nanovlm.data.index import TarSample, split_member_name
from nanovlm.data.remote import is_remote

_END_OF_ARCHIVE = b"\0" * 1024  # two zero blocks: lets tarfile stop cleanly at the end of the byte range
MAX_OPEN_STAGED = 4  # staged remote shards a reader keeps open: a few more than it reads from at once
_NON_FILE_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, dirs, fifos: skipped like tarfile does


def _octal(field: bytes) -> int:
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits, 8) if digits else 0


def _checksum_ok(h: bytes) -> bool:
    """The ustar header checksum: the byte sum of the header with its checksum field read as 8 spaces.

    ``sum(h)`` walks 512 Python ints (~4 us a header, most of this parser's time); ``zlib.adler32`` sums in C,
    and its low 16 bits are 1 + the byte sum mod 65521. A corruption fools the modulus only by moving the sum
    (or the stored value) by a multiple of 65521: more than 256 changed bytes, or at least three changed digits
    of the stored value. (Signed-sum headers of old tars fail here and go to ``tarfile``, which accepts them.)
    """
    stored = _octal(h[148:156])
    return ((zlib.adler32(h) & 0xFFFF) - 1 - sum(h[148:156]) + 256 - stored) % 65521 == 0


def _fast_headers(blob: bytes | memoryview, archive: bool = False) -> list[tuple[str, int, int, int]] | None:
    """(name, first header offset, data offset, size) of the regular files in ``blob``, parsing ustar/pax headers
    directly; None when anything is unusual (bad checksum, truncation, GNU long names, global pax headers,
    base-256 sizes), so that the ``tarfile`` path decides. Opening a TarFile per sample costs more than the read
    itself; this does not. ``archive``: ``blob`` is a whole tar, which ends in zero blocks.
    """
    out: list[tuple[str, int, int, int]] = []
    pos, n, end, first, in_pax = 0, len(blob), 0, 0, False
    pax: dict[bytes, bytes] = {}
    try:
        while pos + 512 <= n:
            h = bytes(blob[pos : pos + 512])  # (a memoryview's slice is one too: bytes has the methods used here)
            if h[0] == 0 and h.count(0) == 512:
                break
            if h[124] & 0x80 or not _checksum_ok(h):
                return None
            size = _octal(h[124:136])
            kind = h[156:157]
            start = pos + 512
            if not in_pax:
                first = pos  # a member starts at its pax header, if it has one
            if kind == b"x":  # pax extended header for the next member: "<len> <key>=<value>\n" records
                data, i = bytes(blob[start : start + size]), 0
                if start + size > n:
                    return None
                while i < len(data):
                    sp = data.index(b" ", i)
                    length = int(data[i:sp])
                    k, eq, v = data[sp + 1 : i + length - 1].partition(b"=")
                    if not eq or length <= 0 or data[i + length - 1 : i + length] != b"\n":
                        return None
                    pax[k] = v
                    i += length
                pos, in_pax = start + -(-size // 512) * 512, True
                continue
            if kind in _NON_FILE_TYPES:
                if size:  # a link or directory with data: unusual, tarfile decides
                    return None
                pax, in_pax = {}, False
                pos = start
                continue
            if kind not in (b"0", b"\0", b"7"):
                return None
            if b"path" in pax:
                name = pax[b"path"].decode("utf-8")
            else:
                name = h[:100].split(b"\0", 1)[0].decode("utf-8")
                prefix = h[345:500].split(b"\0", 1)[0].decode("utf-8") if h[257:263] == b"ustar\x00" else ""
                name = f"{prefix}/{name}" if prefix else name
            if b"size" in pax:
                size = int(pax[b"size"])
            if start + size > n:
                return None
            out.append((name, first, start, size))
            pax, in_pax = {}, False
            pos = end = start + -(-size // 512) * 512
    except (ValueError, UnicodeDecodeError):
        return None
    if archive:  # an archive without members (or no bytes at all): scan_tar decides
        return out if out and bytes(blob[end:]).count(0) == n - end else None
    return out if out and end == n else None  # anything left over: let tarfile and the checks below decide


def _fast_members(blob: bytes) -> list[tuple[str, bytes]] | None:
    """(name, data) of the regular files of one sample's bytes, or None (see ``_fast_headers``)."""
    heads = _fast_headers(blob)
    return None if heads is None else [(name, blob[s : s + size]) for name, _, s, size in heads]


def scan_bytes(blob: bytes | memoryview) -> list[TarSample] | None:
    """``index.scan_tar`` for a whole tar held in memory, several times faster; None when the tar is unusual
    or damaged anywhere (``scan_tar`` then decides, keeping what comes before the damage)."""
    heads = _fast_headers(blob, archive=True)
    if heads is None:
        return None
    out: list[TarSample] = []
    for name, first, start, size in heads:
        key, suffix = split_member_name(name)
        end = start + -(-size // 512) * 512
        if out and out[-1].key == key:
            out[-1].members.append((suffix, start, size))
            out[-1].nbytes = end - out[-1].offset
        else:
            out.append(TarSample(key, first, end - first, [(suffix, start, size)]))
    return out


def parse_members(blob: bytes, key: str) -> dict[str, bytes]:
    """Tar bytes of one sample -> {suffix: bytes}. Raises SampleError('corrupt_member') on any damage."""
    members: dict[str, bytes] = {}
    fast = _fast_members(blob)
    if fast is not None:  # well-formed ustar/pax: same result as the tarfile path below, several times faster
        for name, payload in fast:
            k, suffix = split_member_name(name)
            if k != key:
                raise SampleError("corrupt_member", key, f"byte range holds member {name!r} of another key")
            members[suffix] = payload
        return members
    end = 0  # end of the last member's data blocks: must reach the end of the byte range
    try:
        with tarfile.open(fileobj=io.BytesIO(blob + _END_OF_ARCHIVE), mode="r:") as tf:
            for info in tf:
                if not info.isfile():
                    continue
                k, suffix = split_member_name(info.name)
                if k != key:
                    raise SampleError("corrupt_member", key, f"byte range holds member {info.name!r} of another key")
                data = tf.extractfile(info)
                payload = data.read() if data is not None else b""
                if len(payload) != info.size:
                    raise SampleError("corrupt_member", key, f"member {info.name!r} is truncated")
                members[suffix] = payload
                end = max(end, info.offset_data + -(-info.size // 512) * 512)
    except SampleError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise SampleError("corrupt_member", key, f"{type(e).__name__}: {e}") from None
    if not members:
        raise SampleError("corrupt_member", key, "no tar member in the recorded byte range")
    if end != len(blob):  # tarfile stops quietly at a damaged header after the first member
        raise SampleError("corrupt_member", key, f"tar members end at byte {end} of the sample's {len(blob)}")
    return members


def _pread(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset`` (fewer only at the end of the file): positioned reads, no seek and no buffer in
    between; a local file answers in one, a network or FUSE mount may answer in parts."""
    blob = os.pread(fd, n, offset)
    while len(blob) < n:
        more = os.pread(fd, n - len(blob), offset + len(blob))
        if not more:
            break
        blob += more
    return blob


class ShardReader:
    """Reads samples by (shard path, offset, nbytes), keeping shard files open, the least recently used closed
    first. A remote shard (a URL) is read from its staged copy in ``cache`` (``shard_cache.ShardCache``), of which at
    most ``max_open_staged`` stay open: a copy the cache evicts keeps its disk space while a reader holds it, so
    the handles bound what readers hold beyond ``data.cache_max_bytes``, and a shard read again after its copy
    was evicted is fetched again instead of read from a deleted file."""

    def __init__(self, max_open: int = 64, cache=None, max_open_staged: int = MAX_OPEN_STAGED) -> None:
        self._files: dict[str, BinaryIO] = {}  # local shard files, least recently used first
        self._staged: dict[str, BinaryIO] = {}  # staged copies of remote shards, least recently used first
        self._max_open, self._max_open_staged = max_open, max_open_staged
        self.cache = cache

    def _file(self, path: str) -> BinaryIO:
        for files in (self._files, self._staged):
            f = files.pop(path, None)
            if f is not None:
                files[path] = f  # now the most recently used
                return f
        if self.cache is not None and is_remote(path):
            files, limit = self._staged, self._max_open_staged
            f = self.cache.open(path)  # stays readable while open, even if the cache evicts it
        else:
            files, limit = self._files, self._max_open
            f = open(path, "rb")  # noqa: SIM115 - kept open on purpose
        while len(files) >= limit:
            files.pop(next(iter(files))).close()
        files[path] = f
        return f

    def holds(self, path: str) -> bool:
        """Whether the staged copy of ``path`` is open here: it needs no room in the cache while it is read."""
        return path in self._staged

    def read_members(self, path: str, offset: int, nbytes: int, key: str) -> dict[str, bytes]:
        blob = _pread(self._file(path).fileno(), nbytes, offset)
        if len(blob) != nbytes:
            raise SampleError("corrupt_member", key, f"{path}: short read at {offset} ({len(blob)} of {nbytes} bytes)")
        return parse_members(blob, key)

    def read(self, path: str, offset: int, nbytes: int, key: str) -> Record:
        """One sample as a Record (raises SampleError for corrupt bytes or a bad sample)."""
        return members_to_record(self.read_members(path, offset, nbytes, key), key)

    def close(self) -> None:
        for files in (self._files, self._staged):
            for f in files.values():
                f.close()
            files.clear()

    def __getstate__(self) -> dict:  # open files do not travel to DataLoader workers
        return {**self.__dict__, "_files": {}, "_staged": {}}

    def __del__(self) -> None:
        self.close()
