"""The dataset index: ``load_index`` maps the columns written by ``DatasetIndex.save`` and refuses, by file
name, a column that is missing, truncated, corrupt or disagrees with the rest, and shards that do not match;
``scan_tar`` reports a damaged header instead of stopping silently.

Faults: a dataset directory with a missing, truncated, empty or zero-byte shard, or an index that is missing,
unparseable or disagrees with itself, is refused at setup with an error naming the file.
"""

import dataclasses
import json
import tarfile

import numpy as np
import pytest
from helpers.faults import empty_tar, truncate_mid_member

from nanovlm.data import index as index_mod
from nanovlm.data.index import DatasetIndex, DatasetIndexError, ShardIndex, load_index, scan_tar


def _rows(name, n, first=0):
    keys = [f"k{first + i}é" for i in range(n)]  # non-ASCII keys survive the byte column
    return ShardIndex(name, 512 * (n + 2), n, keys, [512 * i for i in range(n)], [512] * n,
                      [10 + i for i in range(n)], [i % 3 for i in range(n)],
                      [[[30 + j, 40 + i] for j in range(i % 3)] for i in range(n)], [2] * n, [i % 2 for i in range(n)])  # fmt: skip


def test_round_trip_is_exact_and_deterministic(tmp_path):
    rows = [_rows("shard-000000.tar", 5), _rows("shard-000001.tar", 0), _rows("shard-000002.tar", 3, first=5)]
    written = DatasetIndex.from_shards(tmp_path, "tok-1", 16, "test", rows)
    written.save()
    before = {f.name: f.read_bytes() for f in (tmp_path / "index").iterdir()}
    idx = load_index(tmp_path, check_files=False, verify=True)
    assert [idx.shard(i) for i in range(3)] == rows
    assert (idx.tokenizer, idx.image_token_count, idx.num_samples, idx.content_hash) == (
        "tok-1",
        16,
        8,
        written.content_hash,
    )
    assert idx.shard_start.tolist() == [0, 5, 5, 8]
    assert idx.key_list() == [f"k{i}é" for i in range(8)] and idx.key(6) == "k6é"
    assert isinstance(idx.columns["offset"], np.memmap)  # mapped, not read
    assert idx.total_tokens(16).tolist() == [t + n * 15 for r in rows for t, n in zip(r.text_tokens, r.n_images)]
    DatasetIndex.from_shards(tmp_path, "tok-1", 16, "test", rows).save()
    assert {f.name: f.read_bytes() for f in (tmp_path / "index").iterdir()} == before
    other = dataclasses.replace(rows[0], text_tokens=[11] + rows[0].text_tokens[1:])
    assert DatasetIndex.from_shards(tmp_path, "tok-1", 16, "t", [other, *rows[1:]]).content_hash != idx.content_hash


@pytest.fixture
def written(tmp_path):
    DatasetIndex.from_shards(tmp_path, "tok", 4, "test", [_rows("shard-000000.tar", 6)]).save()
    return tmp_path


def _error(directory, **kw) -> str:
    with pytest.raises((DatasetIndexError, FileNotFoundError)) as exc:
        load_index(directory, check_files=False, **kw)
    return str(exc.value)


def test_truncated_column_is_an_error_naming_the_file(written):
    path = written / "index" / "text_tokens.npy"
    path.write_bytes(path.read_bytes()[:-3])
    msg = _error(written)
    assert "text_tokens.npy" in msg and "truncated" in msg


def test_corrupt_column_header_is_an_error_naming_the_file(written):
    path = written / "index" / "offset.npy"
    path.write_bytes(b"garbage" + path.read_bytes()[7:])
    assert "offset.npy" in _error(written)


def test_corrupt_column_content_is_found_by_verify_naming_the_file(written):
    path = written / "index" / "nbytes.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    load_index(written, check_files=False)  # same size and header: the cheap checks pass
    msg = _error(written, verify=True)
    assert "nbytes.npy" in msg and "hash" in msg


def test_column_of_another_type_or_length_is_an_error_naming_the_file(written):
    np.save(written / "index" / "n_images.npy", np.zeros(6, np.int64))
    assert "n_images.npy" in _error(written)
    np.save(written / "index" / "n_images.npy", np.zeros(5, np.int32))
    assert "n_images.npy" in _error(written)


def test_index_that_disagrees_with_itself_is_an_error(written):
    meta_path = written / "index" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["shards"][0]["num_samples"] += 1
    meta_path.write_text(json.dumps(meta))
    msg = _error(written)
    assert "hold 7 samples" in msg and ".npy" in msg


def test_version_mismatch_and_unparseable_meta_name_the_file(written):
    meta_path = written / "index" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"version": 2}))
    msg = _error(written)
    assert "meta.json" in msg and "version 2" in msg and "prepare_data" in msg
    meta_path.write_text('{"version": 3, "shards": [')
    assert "meta.json" in _error(written)


def test_missing_index_names_the_command_that_makes_one(tmp_path):
    msg = _error(tmp_path)
    assert "index/meta.json" in msg and "prepare_data" in msg
    (tmp_path / "index.json").write_text("{}")
    assert "older index format" in _error(tmp_path)


def test_a_save_that_dies_half_way_leaves_the_old_index(written, monkeypatch):
    old = load_index(written, check_files=False)
    saved = []

    def dying_save(path, arr):
        if saved:
            raise OSError("disk full")
        saved.append(path)
        with open(path, "wb") as f:
            np.lib.format.write_array(f, arr)

    monkeypatch.setattr(index_mod.np, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        DatasetIndex.from_shards(written, "tok", 4, "test", [_rows("shard-000000.tar", 2)]).save()
    monkeypatch.undo()
    again = load_index(written, check_files=False, verify=True)
    assert again.num_samples == 6 and again.content_hash == old.content_hash


def test_load_index_checks_the_shards(tmp_path, make_dataset):
    d = tmp_path / "ds"
    make_dataset(d, 6, samples_per_shard=3)
    shard = d / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes() + b"\0" * 512)
    with pytest.raises(DatasetIndexError, match="shard-000001.tar has"):
        load_index(d)
    shard.unlink()
    with pytest.raises(DatasetIndexError, match="shard-000001.tar is missing"):
        load_index(d)
    assert load_index(d, check_files=False).num_samples == 6


def test_scan_tar_reports_a_bad_header_instead_of_stopping_silently(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 4, samples_per_shard=4)
    path = idx.shard_path(0)
    shard = idx.shard(0)
    data = bytearray(path.read_bytes())
    data[shard.offsets[2] + 148 : shard.offsets[2] + 156] = b"XXXXXXXX"  # checksum of sample 2's first header
    path.write_bytes(bytes(data))
    seen = []
    with pytest.raises(tarfile.ReadError, match=f"unreadable tar header at byte {shard.offsets[2]}"):
        for s in scan_tar(path):
            seen.append(s.key)
    assert seen == shard.keys[:2]


# ----------------------------------------------------------------------------------------------------------
# dataset directory faults: refused at setup, by name


def _index_error(dataset) -> str:
    with pytest.raises((DatasetIndexError, FileNotFoundError)) as exc:
        load_index(dataset)
    return str(exc.value)


def test_intact_dataset_loads(dataset):
    index = load_index(dataset)
    assert index.num_samples == 24 and len(index.shards) == 3


def test_shard_missing_on_disk_is_an_error_naming_it(dataset):
    (dataset / "shard-000001.tar").unlink()
    msg = _index_error(dataset)
    assert "shard-000001.tar" in msg and "missing" in msg


def test_truncated_shard_is_an_error_naming_it(dataset):
    truncate_mid_member(dataset / "shard-000002.tar", member=-3)
    msg = _index_error(dataset)
    assert "shard-000002.tar" in msg and "bytes" in msg


def test_zero_byte_shard_is_an_error_naming_it(dataset):
    (dataset / "shard-000000.tar").write_bytes(b"")
    assert "shard-000000.tar" in _index_error(dataset)


def test_empty_tar_shard_is_an_error_naming_it(dataset):
    (dataset / "shard-000001.tar").write_bytes(empty_tar())
    assert "shard-000001.tar" in _index_error(dataset)


def test_a_loaded_index_pickles_as_its_path_and_is_mapped_again(written):
    """Spawned DataLoader workers get the index by pickling: the columns must not travel, and an index that
    changed meanwhile is refused."""
    import pickle

    idx = load_index(written, check_files=False)
    blob = pickle.dumps(idx)
    assert len(blob) < 1000  # the path and the hash, not the columns
    back = pickle.loads(blob)
    assert isinstance(back.columns["offset"], np.memmap) and back.key_list() == idx.key_list()
    DatasetIndex.from_shards(written, "tok", 4, "test", [_rows("shard-000000.tar", 3)]).save()
    with pytest.raises(DatasetIndexError, match="changed while the run was using it"):
        pickle.loads(blob)
    memory = DatasetIndex.from_shards(written, "tok", 4, "test", [_rows("shard-000000.tar", 3)])
    assert pickle.loads(pickle.dumps(memory)).key_list() == memory.key_list()  # not saved: travels whole


def test_meta_whose_content_hash_disagrees_with_its_columns_is_refused(written):
    meta_path = written / "index" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"content_hash": "0" * 40}))
    assert "content_hash does not match" in _error(written)


def test_a_save_during_a_load_gives_the_new_index_whole(written, monkeypatch):
    """A save swapping index/ while a reader maps the columns: the reader must not pair the old meta.json with the
    new columns (a hash naming other data than it holds)."""
    real, fired = index_mod._map_column, []

    def map_then_save(directory, name, col_meta):
        arr = real(directory, name, col_meta)
        if name == "offset" and not fired:
            fired.append(1)
            new = _rows("shard-000000.tar", 6)
            new.text_tokens = [99] * 6  # same shapes, other values
            DatasetIndex.from_shards(written, "tok", 4, "test", [new]).save()
        return arr

    monkeypatch.setattr(index_mod, "_map_column", map_then_save)
    idx = load_index(written, check_files=False)
    assert fired and idx.columns["text_tokens"].tolist() == [99] * 6
    assert idx.content_hash == load_index(written, check_files=False, verify=True).content_hash


def test_key_outside_the_index_is_an_index_error(written):
    idx = load_index(written, check_files=False)
    with pytest.raises(IndexError):
        idx.key(-1)  # would slice every key together
    with pytest.raises(IndexError):
        idx.key(6)


def test_the_shard_checksum_is_zlibs_crc32_in_pieces_and_views(tmp_path):
    """``index.crc32`` (zlib-ng's where installed) is the CRC-32 indexes record: equal to zlib's, whole, continued
    piece by piece, over a memoryview, and over a file."""
    import zlib

    from nanovlm.data.index import crc32, crc32_file

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    want = zlib.crc32(data)
    assert crc32(data) == want and crc32(memoryview(data)[5:]) == zlib.crc32(data[5:])
    assert crc32(data[1000:], crc32(data[:1000])) == want
    (tmp_path / "f").write_bytes(data * 2)  # more than crc32_file's 4 MB read
    assert crc32_file(tmp_path / "f") == f"{zlib.crc32(data * 2):08x}"
