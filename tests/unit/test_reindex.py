"""Indexing existing shards (``data/reindex.py``): duplicates found by hash and confirmed by key, whatever shard
they are in, with their images dropped alongside; skips listed in input order; kept parts trusted only with the
same stamp and layout version."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.faults import conversation, json_bytes, png, tar_bytes

from nanovlm.cli.prepare_data import main
from nanovlm.data import reindex
from nanovlm.data.index import load_index
from nanovlm.data.processing import SampleProcessor


def _shard(path, keys, n_images=1):
    members = []
    for i, k in enumerate(keys):
        members += [(f"{k}.{j}.png", png(seed=i + j)) for j in range(n_images)]
        members.append((f"{k}.json", json_bytes(conversation(n_images))))
    path.write_bytes(tar_bytes(members))


def test_duplicates_across_and_within_shards_are_dropped_with_their_images(tmp_path, tiny_tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    _shard(src / "a.tar", ["k0", "k1", "k0", "k2"], n_images=2)  # k0 twice in one shard
    _shard(src / "b.tar", ["k3", "k1", "k4"], n_images=2)  # k1 again in another
    args = ["--input", str(src), "--output", str(tmp_path / "out"), "--workers", "1"]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    idx = load_index(tmp_path / "out")
    assert idx.key_list() == ["k0", "k1", "k2", "k3", "k4"]
    assert idx.columns["n_images"].tolist() == [2] * 5 and idx.columns["image_sizes"].shape == (10, 2)
    assert [idx.shard(i).num_samples for i in range(2)] == [3, 2]
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["key"], r["reason"], r["source"].split("@")[0]) for r in rejected] == [
        ("k0", "duplicate_key", "a.tar"),
        ("k1", "duplicate_key", "b.tar"),
    ]


def test_filter_and_hash_collisions_keep_the_right_rows():
    """Equal hashes of different keys are not duplicates (confirmed on the key); a filtered block keeps each
    remaining sample's own images and key."""
    block = {
        "offset": np.array([0, 512, 1024]), "nbytes": np.array([512] * 3), "text_tokens": np.array([5, 6, 7]),
        "n_images": np.array([1, 0, 2]), "prompt_tokens": np.array([1, 1, 1]), "prompt_images": np.array([0] * 3),
        "image_sizes": np.array([[1, 1], [2, 2], [3, 3]]), "key_ends": np.array([2, 5, 6]),
        "keys": np.frombuffer(b"aabbbc", np.uint8),
    }  # fmt: skip
    kept = reindex._filter(block, np.array([True, False, True]))
    assert kept["image_sizes"].tolist() == [[1, 1], [2, 2], [3, 3]]
    assert bytes(kept["keys"]) == b"aac" and kept["key_ends"].tolist() == [2, 3]
    kept = reindex._filter(block, np.array([False, True, True]))
    assert kept["image_sizes"].tolist() == [[2, 2], [3, 3]] and bytes(kept["keys"]) == b"bbbc"
    collide = reindex.ShardResult(block, [], np.array([7, 7, 7], np.uint64))  # three keys, one hash
    assert reindex._later_duplicates([collide]).tolist() == []
    twice = reindex.ShardResult(block, [], np.array([7, 8, 9], np.uint64))
    assert reindex._later_duplicates([twice, twice]).tolist() == [3, 4, 5]


def test_parts_are_trusted_only_with_the_same_stamp_and_version(tmp_path, tiny_tokenizer, monkeypatch):
    src = tmp_path / "a.tar"
    _shard(src, ["x", "y"])
    res = reindex.index_shard(str(src), SampleProcessor(tiny_tokenizer, 1, 1), 0)
    parts = tmp_path / "parts"
    parts.mkdir()
    reindex.save_part(parts, src, res, [1, 2, "tok"])
    back = reindex.load_part(parts, src, [1, 2, "tok"])
    assert back is not None and back.skips == res.skips and np.array_equal(back.hashes, res.hashes)
    assert all(np.array_equal(back.block[c], res.block[c]) for c in res.block)
    assert reindex.load_part(parts, src, [1, 3, "tok"]) is None  # the shard changed since
    monkeypatch.setattr(reindex, "PART_VERSION", reindex.PART_VERSION + 1)
    assert reindex.load_part(parts, src, [1, 2, "tok"]) is None  # made by another layout
    (parts / "a.tar.npz").write_bytes(b"PK\x03\x04 cut short")
    assert reindex.load_part(parts, src, [1, 2, "tok"]) is None


@pytest.mark.parametrize("whole", [True, False])
def test_the_shard_crc_is_the_files_whether_read_whole_or_streamed(tmp_path, tiny_tokenizer, monkeypatch, whole):
    """Read whole, the CRC comes from the bytes just indexed (no second read); streamed, from the file."""
    from nanovlm.data.index import crc32_file

    if not whole:
        monkeypatch.setattr(reindex, "IN_MEMORY_MAX", 0)
    src = tmp_path / "a.tar"
    _shard(src, ["x", "y", "z"])
    res = reindex.index_shard(str(src), SampleProcessor(tiny_tokenizer, 1, 1), 0)
    assert res.crc32 == crc32_file(src) and len(res.hashes) == 3


def test_a_key_that_is_not_utf8_is_a_counted_skip(tmp_path, tiny_tokenizer):
    """A member name in latin-1 (a foreign tool): the sample is skipped as bad_key, the rest is indexed."""
    import io
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tf:
        for name, data in [("caf\u00e9.png", png()), ("caf\u00e9.json", json_bytes(conversation(1))),
                           ("ok.png", png()), ("ok.json", json_bytes(conversation(1)))]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    (src / "a.tar").write_bytes(buf.getvalue())
    args = ["--input", str(src), "--output", str(tmp_path / "out"), "--workers", "1"]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    assert load_index(tmp_path / "out").key_list() == ["ok"]
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejected] == ["bad_key"] and "caf" in rejected[0]["key"]


def test_bad_text_members_of_a_shard_read_whole_are_named_skips(tmp_path, tiny_tokenizer):
    """A shard read whole hands its members on as views into one buffer: a json that is not UTF-8, or not JSON,
    or a txt caption that is not UTF-8, is each a counted skip with its reason; the good sample is indexed."""
    from helpers.faults import bad_json_variants

    members = [("ok.png", png()), ("ok.json", json_bytes(conversation(1)))]
    members += [("u.png", png()), ("u.json", bad_json_variants()["invalid_utf8"][0])]
    members += [("j.png", png()), ("j.json", b"{broken json")]
    members += [("t.png", png()), ("t.txt", b"caf\xe9")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    res = reindex.index_shard(str(tmp_path / "a.tar"), SampleProcessor(tiny_tokenizer, 8, 16), 0, decode=False)
    assert res.block["text_tokens"].shape == (1,)
    assert [(sk[0], sk[2]) for sk in res.skips] == [("u", "bad_utf8"), ("j", "bad_json"), ("t", "bad_utf8")]


def test_header_only_image_check_is_refused_for_jsonl(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="--image-check header is for --input DIR"):
        main(["--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--image-check", "header"])
