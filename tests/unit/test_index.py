"""The dataset index: ``load_index`` validates index.json against itself and the shard files it names, and
``scan_tar`` reports a damaged header instead of stopping silently.

Faults: a dataset directory with a missing, truncated, empty or zero-byte shard, or an index that is missing,
unparseable or disagrees with itself, is refused at setup with an error naming the file.
"""

import json
import tarfile

import pytest
from helpers.faults import empty_tar, read_index, truncate_mid_member, write_index

from nanovlm.data.index import DatasetIndexError, load_index, scan_tar


def test_load_index_validation(tmp_path, make_dataset):
    d = tmp_path / "ds"
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        load_index(d)
    make_dataset(d, 6, samples_per_shard=3)
    raw = json.loads((d / "index.json").read_text())
    shard = d / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes() + b"\0" * 512)
    with pytest.raises(DatasetIndexError, match="shard-000001.tar has"):
        load_index(d)
    shard.unlink()
    with pytest.raises(DatasetIndexError, match="shard-000001.tar is missing"):
        load_index(d)
    assert load_index(d, check_files=False).num_samples == 6
    raw["shards"][0]["keys"] = raw["shards"][0]["keys"][:2]
    (d / "index.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetIndexError, match="2 keys for 3 samples"):
        load_index(d, check_files=False)
    (d / "index.json").write_text("{oops")
    with pytest.raises(DatasetIndexError, match="not valid JSON"):
        load_index(d)
    (d / "index.json").write_text('{"version": 99}')
    with pytest.raises(DatasetIndexError, match="version"):
        load_index(d)


def test_scan_tar_reports_a_bad_header_instead_of_stopping_silently(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 4, samples_per_shard=4)
    path = idx.shard_path(0)
    shard = idx.shards[0]
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


def test_index_that_disagrees_with_itself_is_an_error(dataset):
    index = read_index(dataset)
    index["shards"][1]["num_samples"] += 1
    write_index(dataset, index)
    msg = _index_error(dataset)
    assert "shard-000001.tar" in msg


def test_missing_index_names_the_command_that_makes_one(dataset):
    (dataset / "index.json").unlink()
    msg = _index_error(dataset)
    assert "index.json" in msg and "prepare_data" in msg


def test_unparseable_index_names_the_file(dataset):
    (dataset / "index.json").write_text('{"version": 1, "shards": [')
    msg = _index_error(dataset)
    assert "index.json" in msg
