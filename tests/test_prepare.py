"""write_dataset + index: exact index contents, byte ranges, determinism, atomic writes, index validation."""

import hashlib
import json
import tarfile

import pytest
import webdataset as wds
from conftest import synthetic_image, synthetic_records

from nanovlm.data.format import Record, SampleError, members_to_record
from nanovlm.data.index import DatasetIndexError, load_index, read_sample, scan_tar
from nanovlm.data.prepare import write_dataset
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.tokenizer import tokenizer_fingerprint


def digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_index_contents_exact(tmp_path, make_dataset, tiny_tokenizer):
    idx = make_dataset(tmp_path / "ds", 37, samples_per_shard=10, image_token_count=16)
    assert [s.num_samples for s in idx.shards] == [10, 10, 10, 7]
    assert [s.name for s in idx.shards] == [f"shard-{i:06d}.tar" for i in range(4)]
    loaded = load_index(tmp_path / "ds")
    assert loaded.to_json() == idx.to_json()
    assert loaded.tokenizer == tokenizer_fingerprint(tiny_tokenizer) and loaded.image_token_count == 16
    records = list(synthetic_records(37))
    proc = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=16)
    keys = [k for s in loaded.shards for k in s.keys]
    assert keys == [r.key for r in records]
    assert [n for s in loaded.shards for n in s.n_images] == [i % 3 for i in range(37)]
    assert [t for s in loaded.shards for t in s.text_tokens] == [proc.text_tokens(r.messages) for r in records]
    sizes = [sz for s in loaded.shards for sz in s.image_sizes]
    import io

    from PIL import Image

    assert sizes == [[list(Image.open(io.BytesIO(b)).size) for b in r.images] for r in records]
    # total tokens = text + images * (count - 1) = the processed length
    tot = loaded.total_tokens(16)
    for r, t in zip(records, tot):
        assert len(proc.process(r).input_ids) == t
    assert all(s.size_bytes == (tmp_path / "ds" / s.name).stat().st_size for s in loaded.shards)


def test_byte_ranges_and_webdataset_reads_the_shards(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 12, samples_per_shard=5)
    records = {r.key: r for r in synthetic_records(12)}
    for shard in idx.shards:
        path = idx.shard_path(shard)
        streamed = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
        assert [s["__key__"] for s in streamed] == shard.keys
        for i, key in enumerate(shard.keys):
            members = read_sample(path, shard.offsets[i], shard.nbytes[i], expected_key=key)
            assert shard.offsets[i] % 512 == 0 and shard.nbytes[i] % 512 == 0
            rec = members_to_record(members, key)
            assert rec.messages == records[key].messages and rec.images == records[key].images
            assert rec.extra == records[key].extra
            assert {k: v for k, v in streamed[i].items() if not k.startswith("__")} == members
        with pytest.raises(ValueError, match="index says"):
            read_sample(path, shard.offsets[1], shard.nbytes[1], expected_key=shard.keys[0])


def test_tar_metadata_is_fixed(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 4)
    with tarfile.open(idx.shard_path(0)) as tf:
        infos = tf.getmembers()
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname) for i in infos} == {(0, 0, 0, "nanovlm", "nanovlm")}
    assert [i.name for i in infos[:3]] == ["s00000.json", "s00001.0.png", "s00001.json"]


def test_deterministic_bytes(tmp_path, make_dataset):
    make_dataset(tmp_path / "a", 20, samples_per_shard=8)
    make_dataset(tmp_path / "b", 20, samples_per_shard=8)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    # Re-running into the same directory with fewer samples removes the stale shards.
    make_dataset(tmp_path / "a", 5, samples_per_shard=8)
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == ["index.json", "shard-000000.tar"]


def test_crash_leaves_no_half_written_shard(tmp_path, tiny_tokenizer):
    def records():
        yield from synthetic_records(7)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_dataset(records(), tmp_path / "ds", tiny_tokenizer, 16, samples_per_shard=3)
    names = sorted(f.name for f in (tmp_path / "ds").iterdir())
    # Two complete shards were renamed into place; the open one was removed; no index was written.
    assert names == ["shard-000000.tar", "shard-000001.tar"]
    assert len(list(scan_tar(tmp_path / "ds" / "shard-000001.tar"))) == 3


def test_bad_records_raise_or_are_skipped(tmp_path, tiny_tokenizer):
    import numpy as np

    good = list(synthetic_records(3))
    jpeg = synthetic_image(np.random.default_rng(0), 32, 32, "JPEG")
    bad = [
        Record("trunc", [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}], [jpeg[:200]]),
        Record("no.dots", good[0].messages, []),
        Record("noans", [{"role": "user", "content": "hi"}], []),
        Record("s00001", good[0].messages, []),  # duplicate key
    ]
    with pytest.raises(SampleError) as e:
        write_dataset(good + bad, tmp_path / "x", tiny_tokenizer, 16)
    assert e.value.reason == "unreadable_image" and e.value.key == "trunc"
    skipped = []
    idx = write_dataset(good + bad, tmp_path / "y", tiny_tokenizer, 16, on_skip=skipped.append)
    assert [(s.reason, s.key) for s in skipped] == [
        ("unreadable_image", "trunc"),
        ("bad_key", "no.dots"),
        ("no_assistant_turn", "noans"),
        ("duplicate_key", "s00001"),
    ]
    assert idx.shards[0].keys == ["s00000", "s00001", "s00002"]


def test_image_format_is_sniffed_and_exotic_formats_become_png(tmp_path, tiny_tokenizer):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (1, 2, 3)).save(buf, format="PPM")
    jpeg = synthetic_image(__import__("numpy").random.default_rng(1), 9, 7, "JPEG")
    rec = Record(
        "k",
        [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}],
        [buf.getvalue(), jpeg],
    )
    idx = write_dataset([rec], tmp_path / "d", tiny_tokenizer, 16)
    members = read_sample(idx.shard_path(0), 0, idx.shards[0].nbytes[0])
    assert sorted(members) == ["0.png", "1.jpg", "json"]
    assert members["1.jpg"] == jpeg
    assert Image.open(io.BytesIO(members["0.png"])).getpixel((0, 0)) == (1, 2, 3)
    assert idx.shards[0].image_sizes == [[[5, 4], [9, 7]]]


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
