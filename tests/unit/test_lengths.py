"""The sample table's length columns: a large table's are derived once per node into the cache and mapped by
every process (one copy, shared); a damaged cache entry is derived again, never trusted; a cache that cannot be
written costs memory, not correctness; a mapped table travels to spawned workers as file paths.
"""

import logging
import multiprocessing as mp
import pickle

import numpy as np
import pytest

from nanovlm.data import lengths
from nanovlm.data.index import DatasetIndex, ShardIndex, load_index
from nanovlm.data.shards import SampleTable
from nanovlm.data.tiling import ImageLayout, as_layout


def _rows(name, n, seed):
    rng = np.random.default_rng(seed)
    n_img = rng.integers(0, 3, n).tolist()
    sizes = [[[int(rng.integers(100, 2000)), int(rng.integers(100, 2000))] for _ in range(k)] for k in n_img]
    return ShardIndex(name, 512 * (n + 2), n, [f"{name}-{i}" for i in range(n)], [512 * i for i in range(n)],
                      [512] * n, rng.integers(5, 900, n).tolist(), n_img, sizes, [4] * n,
                      [min(1, k) for k in n_img])  # fmt: skip


@pytest.fixture
def indexes(tmp_path):
    out = []
    for d, n in (("a", 40), ("b", 25)):
        DatasetIndex.from_shards(tmp_path / d, "tok", 16, "test", [_rows(f"{d}0.tar", n, len(out))]).save()
        out.append(load_index(tmp_path / d, check_files=False))
    return out


@pytest.fixture
def cached(monkeypatch):
    monkeypatch.setattr(lengths, "CACHE_MIN_SAMPLES", 0)


TILES = ImageLayout(image_size=64, tokens_per_tile=16, max_tiles=4)


def _table(indexes, layout, cache):
    return SampleTable.from_indexes([(str(i.root), i) for i in indexes], layout, cache)


def _columns(table):
    return {name: np.asarray(getattr(table, name)).tolist() for name in lengths.COLUMNS}


def test_a_large_table_is_derived_once_then_mapped_from_the_cache(indexes, cached, tmp_path):
    cache = tmp_path / "cache"
    for layout in (16, TILES):
        expected = _columns(_table(indexes, layout, None))  # derived in memory
        first = _table(indexes, layout, cache)
        assert _columns(first) == expected
        assert all(isinstance(getattr(first, c), np.memmap) for c in lengths.COLUMNS)
        entry = cache / "tables" / lengths.cache_key(indexes, as_layout(layout))
        stamps = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
        again = _table(indexes, layout, cache)  # the next process of the node: maps, writes nothing
        assert _columns(again) == expected and {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == stamps
    assert len([p for p in (cache / "tables").iterdir() if p.is_dir()]) == 2  # one entry per layout


def test_a_column_the_index_already_maps_is_not_copied(indexes, cached, tmp_path):
    """One directory without image splitting: the table's encoder-input counts are the index's own mapped column."""
    table = _table(indexes[:1], 16, tmp_path / "cache")
    entry = tmp_path / "cache" / "tables" / lengths.cache_key(indexes[:1], as_layout(16))
    assert sorted(f.name for f in entry.iterdir()) == ["length.npy", "prompt.npy"]
    assert table.n_images.filename == indexes[0].columns["n_images"].filename
    assert (
        _columns(table)
        == _columns(_table(indexes[:1], 16, None))
        == _columns(_table(indexes[:1], 16, tmp_path / "cache"))
    )


def test_a_small_table_stays_in_memory_and_writes_nothing(indexes, tmp_path):
    table = _table(indexes, 16, tmp_path / "cache")
    assert not isinstance(table.length, np.memmap) and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("damage", ["truncate", "rows", "dtype", "garbage"])
def test_a_damaged_entry_is_derived_again(indexes, cached, tmp_path, caplog, damage):
    cache = tmp_path / "cache"
    expected = _columns(_table(indexes, TILES, cache))
    path = cache / "tables" / lengths.cache_key(indexes, TILES) / "prompt.npy"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-9])
    elif damage == "rows":
        np.save(path, np.zeros(3, np.int32))
    elif damage == "dtype":
        np.save(path, np.zeros(65, np.int64))
    else:
        path.write_bytes(b"not an npy file")
    with caplog.at_level(logging.WARNING, logger="nanovlm.data.lengths"):
        assert _columns(_table(indexes, TILES, cache)) == expected
    assert "prompt.npy" in caplog.text
    assert _columns(_table(indexes, TILES, cache)) == expected  # and the entry is whole again
    assert len(list((cache / "tables").iterdir())) == 2  # the entry and its lock: the replaced one is gone


def test_an_unwritable_cache_falls_back_to_memory(indexes, cached, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="nanovlm.data.lengths"):
        table = _table(indexes, 16, blocker)
    assert _columns(table) == _columns(_table(indexes, 16, None)) and "cannot be cached" in caplog.text


def test_a_mapped_table_pickles_as_paths(indexes, cached, tmp_path):
    table = _table(indexes, TILES, tmp_path / "cache")
    blob = pickle.dumps(table)
    back = pickle.loads(blob)
    assert _columns(back) == _columns(table) and isinstance(back.length, np.memmap)
    in_memory = pickle.dumps(_table(indexes, TILES, None))
    assert len(blob) < len(in_memory) - 3 * 4 * len(table) + 200  # the columns themselves did not travel
    assert _columns(pickle.loads(pickle.dumps(table.head(7)))) == {k: v[:7] for k, v in _columns(table).items()}


def _build(args):
    indexes, cache = args
    return _columns(_table(indexes, TILES, cache))


def test_processes_starting_together_derive_once_and_share_one_entry(indexes, cached, tmp_path, monkeypatch):
    cache, calls = tmp_path / "cache", tmp_path / "derive-calls"
    expected = _columns(_table(indexes, TILES, None))
    real = lengths.derive

    def counted(*args):
        with open(calls, "a") as f:  # appended by whichever forked process derives
            f.write("x")
        return real(*args)

    monkeypatch.setattr(lengths, "derive", counted)
    with mp.get_context("fork").Pool(4) as pool:
        results = pool.map(_build, [(indexes, cache)] * 4)
    assert calls.read_text() == "x"  # the first derived and saved; the other three mapped its entry
    assert all(r == expected for r in results)
    key = lengths.cache_key(indexes, TILES)
    assert sorted(p.name for p in (cache / "tables").iterdir()) == [key, f"{key}.lock"]  # no temporary left
