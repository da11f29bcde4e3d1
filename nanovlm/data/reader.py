"""Random access to one sample of a shard by its index byte range.

The index records, per sample, the byte range of its tar members, so reading a sample is seek + one read +
parsing a few tar headers from memory (``tarfile`` on a BytesIO: headers and raw bytes only; nothing is
decoded here and nothing is ever unpickled). Shard files stay open per reader (one reader per DataLoader
worker), so a pack of samples costs no ``open`` calls.
"""

from __future__ import annotations

import io
import tarfile
from typing import BinaryIO

from nanovlm.data.format import Record, SampleError, members_to_record
from nanovlm.data.index import split_member_name

_END_OF_ARCHIVE = b"\0" * 1024  # two zero blocks: lets tarfile stop cleanly at the end of the byte range


def parse_members(blob: bytes, key: str) -> dict[str, bytes]:
    """Tar bytes of one sample -> {suffix: bytes}. Raises SampleError('corrupt_member') on any damage."""
    members: dict[str, bytes] = {}
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


class ShardReader:
    """Reads samples by (shard path, offset, nbytes), keeping shard files open."""

    def __init__(self, max_open: int = 64) -> None:
        self._files: dict[str, BinaryIO] = {}
        self._max_open = max_open

    def _file(self, path: str) -> BinaryIO:
        f = self._files.get(path)
        if f is None:
            if len(self._files) >= self._max_open:  # close the oldest handle
                self._files.pop(next(iter(self._files))).close()
            f = self._files[path] = open(path, "rb")  # noqa: SIM115 - kept open on purpose
        return f

    def read_members(self, path: str, offset: int, nbytes: int, key: str) -> dict[str, bytes]:
        f = self._file(path)
        f.seek(offset)
        blob = f.read(nbytes)
        if len(blob) != nbytes:
            raise SampleError("corrupt_member", key, f"{path}: short read at {offset} ({len(blob)} of {nbytes} bytes)")
        return parse_members(blob, key)

    def read(self, path: str, offset: int, nbytes: int, key: str) -> Record:
        """One sample as a Record (raises SampleError for corrupt bytes or a bad sample)."""
        return members_to_record(self.read_members(path, offset, nbytes, key), key)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __getstate__(self) -> dict:  # open files do not travel to DataLoader workers
        return {"_files": {}, "_max_open": self._max_open}

    def __del__(self) -> None:
        self.close()
