"""``ShardReader`` / ``parse_members``: a byte range must hold exactly the indexed sample's members, and a
damaged member header is a counted ``corrupt_member``, never a silently shorter sample.

The direct ustar/pax parser (the fast path) returns what the tarfile path returns and hands any damaged header
to it.
"""

import io

import pytest
from helpers.faults import corrupt_header

from nanovlm.data.format import SampleError
from nanovlm.data.index import load_index
from nanovlm.data.reader import ShardReader


def test_index_offsets_pointing_at_another_sample_are_detected(dataset):
    """A stale index (same shard size, other sample order) must not silently feed the wrong sample."""
    index = load_index(dataset)
    shard = index.shard(0)
    path, read = str(index.shard_path(0)), ShardReader().read_members
    with pytest.raises(SampleError, match="s00001"):
        read(path, shard.offsets[1], shard.nbytes[1], shard.keys[0])
    with pytest.raises(SampleError, match="another key"):
        read(path, shard.offsets[0], shard.nbytes[0] + shard.nbytes[1], shard.keys[0])


def test_corrupt_header_is_detected_when_the_sample_is_read(dataset):
    """Same size, so setup passes; Python's tarfile would silently stop at the bad header: the reader must not."""
    index = load_index(dataset)
    shard = index.shard(1)
    path = index.shard_path(1)
    # member 0 of sample 3 in shard 1 (samples have 1..3 members: find the first member at its offset)
    from helpers.faults import member_spans

    member = [start for _, start, _ in member_spans(path)].index(shard.offsets[3])
    corrupt_header(path, member)
    load_index(dataset)  # size unchanged: not visible at setup
    read = ShardReader().read_members
    with pytest.raises(SampleError, match="corrupt_member"):
        read(str(path), shard.offsets[3], shard.nbytes[3], shard.keys[3])
    for i in (0, 1, 2, 4, 5, 6, 7):  # every other sample of the shard still reads
        assert read(str(path), shard.offsets[i], shard.nbytes[i], shard.keys[i])


def test_a_byte_range_longer_than_the_samples_members_is_corrupt():
    import tarfile

    from nanovlm.data.reader import parse_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        payload = b'{"a":1}'
        info = tarfile.TarInfo("k.json")
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    blob = buf.getvalue()[:1024]  # header + one data block
    assert parse_members(blob, "k") == {"json": payload}
    for extra in (b"\0" * 512, b"x" * 100):
        with pytest.raises(SampleError):
            parse_members(blob + extra, "k")


# ----------------------------------------------------------------------------------------------------------
# the fast path


def test_reader_fast_path_matches_tarfile(tmp_path, make_dataset):
    """The reader's direct ustar/pax parser (a speed fix found by this benchmark) is used for well-formed
    shards and returns exactly what the tarfile path returns."""
    import nanovlm.data.reader as reader

    idx = make_dataset(tmp_path / "ds", 12, samples_per_shard=12)
    sh = idx.shard(0)
    blob = idx.shard_path(0).read_bytes()
    for key, off, nb in zip(sh.keys, sh.offsets, sh.nbytes):
        part = blob[off : off + nb]
        assert reader._fast_members(part) is not None
        fast = reader.parse_members(part, key)
        orig, reader._fast_members = reader._fast_members, lambda b: None
        try:
            assert reader.parse_members(part, key) == fast
        finally:
            reader._fast_members = orig
        assert reader._fast_members(part[:-512]) is None  # truncated: left to the tarfile path and its checks


def test_reader_fast_path_rejects_every_single_byte_header_corruption(tmp_path, make_dataset):
    """The fast parser's checksum (a C-speed byte sum modulo 65521) catches a change of any header byte, as the
    plain byte sum does: the damaged sample goes to the tarfile path, which reports it."""
    import nanovlm.data.reader as reader

    idx = make_dataset(tmp_path / "ds", 2, samples_per_shard=2)
    sh = idx.shard(0)
    part = idx.shard_path(0).read_bytes()[sh.offsets[0] : sh.offsets[0] + sh.nbytes[0]]
    good = reader._fast_members(part)
    assert good is not None
    for pos in range(512):
        for delta in (1, 0x80, 0xFF):
            bad = bytearray(part)
            bad[pos] = (bad[pos] + delta) % 256
            if 148 <= pos < 156:  # the stored checksum itself: the value changes, or stops parsing
                assert reader._fast_members(bytes(bad)) in (None, good), pos
            else:
                assert reader._fast_members(bytes(bad)) is None, (pos, delta)


def test_scan_bytes_matches_scan_tar_and_refuses_damage(tmp_path, make_dataset):
    """The in-memory scan (prepare_data's fast path) gives scan_tar's samples and ranges, pax members included,
    and hands any damage back to scan_tar (None) instead of stopping at it."""
    import tarfile

    from helpers.faults import tar_bytes, truncate_mid_member

    from nanovlm.data.index import scan_tar
    from nanovlm.data.reader import scan_bytes

    idx = make_dataset(tmp_path / "ds", 12, samples_per_shard=12)
    path = idx.shard_path(0)
    assert scan_bytes(path.read_bytes()) == list(scan_tar(path))
    assert scan_bytes(memoryview(bytearray(path.read_bytes()))) == list(scan_tar(path))  # indexing's reused buffer
    long_key = "k" * 120  # over ustar's 100-character name: written with a pax header
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in [(f"{long_key}.txt", b"a"), (f"{long_key}.json", b"{}"), ("b.txt", b"bb")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    pax = tmp_path / "pax.tar"
    pax.write_bytes(buf.getvalue())
    assert scan_bytes(pax.read_bytes()) == list(scan_tar(pax)) and [s.key for s in scan_tar(pax)] == [long_key, "b"]
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(path.read_bytes())
    corrupt_header(damaged, 5)
    assert scan_bytes(damaged.read_bytes()) is None
    damaged.write_bytes(path.read_bytes())
    truncate_mid_member(damaged, 5)
    assert scan_bytes(damaged.read_bytes()) is None
    assert scan_bytes(tar_bytes([("x.txt", b"1")]) + b"junk") is None  # bytes after the end blocks


def test_a_read_answered_in_parts_is_read_whole(dataset, monkeypatch):
    """A network or FUSE mount may answer a positioned read with fewer bytes than asked before the end of the file:
    the reader asks again for the rest, rather than calling a whole sample short (a corrupt_member skip); at the
    real end of the file a short range stays an error naming the short read."""
    import os

    from nanovlm.data import reader

    index = load_index(dataset)
    shard = index.shard(0)
    path = str(index.shard_path(0))
    want = ShardReader().read_members(path, shard.offsets[2], shard.nbytes[2], shard.keys[2])
    pread = os.pread
    monkeypatch.setattr(reader.os, "pread", lambda fd, n, off: pread(fd, min(n, 700), off))
    assert ShardReader().read_members(path, shard.offsets[2], shard.nbytes[2], shard.keys[2]) == want
    size = os.path.getsize(path)
    with pytest.raises(SampleError, match="short read"):
        ShardReader().read_members(path, size - 512, 1024, shard.keys[2])
