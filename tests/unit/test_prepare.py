"""write_dataset and prepare_data: exact index contents, byte ranges, determinism, atomic writes, every input
format and skip reason.

Faults: every bad input line or shard is listed in rejected.jsonl with its reason (index-only runs over someone
else's shards included: a damaged shard keeps what is before the damage and is reported).

Security: nothing in the input is executed (pickle members of foreign shards are never loaded; the payloads are
checked live in unit/test_format.py), nothing is written outside the output directory whatever the tar member
names say, and image paths in JSONL stay inside ``--image-root`` (``..``, symlinks and absolute paths are
``unsafe_path`` unless ``--allow-absolute-paths``).
"""

import dataclasses
import hashlib
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from helpers.faults import (
    HOSTILE_SUFFIXES,
    JSONL_REASON,
    bad_json_variants,
    bomb_png,
    cmyk_jpeg,
    conversation,
    corrupt_header,
    empty_tar,
    exif_rotated_png,
    grayscale_png,
    json_bytes,
    not_an_image,
    pickle_payload,
    png,
    png_named_jpg,
    read_index,
    tar_bytes,
    truncate_mid_member,
    truncated_jpeg,
)
from helpers.synthetic import synthetic_image, synthetic_records

from nanovlm.data.format import Record, SampleError, members_to_record
from nanovlm.data.index import COLUMNS, load_index, scan_tar
from nanovlm.data.prepare import resolve_image_path, write_dataset
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.reader import ShardReader
from nanovlm.data.tokenizer import tokenizer_fingerprint


def digest(d):
    """Relative path -> sha256 of every file under ``d`` (the index is a directory of files)."""
    return {
        str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()
    }


def shards_of(idx):
    """Every shard's rows as lists (``ShardIndex``), in order."""
    return [idx.shard(i) for i in range(len(idx.shards))]


def assert_same_index(a, b):
    """Two DatasetIndex objects hold the same header, shard list and columns (dtype, shape and values)."""
    header = ("version", "tokenizer", "image_token_count", "created_by", "shards", "content_hash")
    assert [getattr(a, f) for f in header] == [getattr(b, f) for f in header]
    assert sorted(a.columns) == sorted(b.columns) == sorted(COLUMNS)
    for name in COLUMNS:
        x, y = a.columns[name], b.columns[name]
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


def test_index_contents_exact(tmp_path, make_dataset, tiny_tokenizer):
    idx = make_dataset(tmp_path / "ds", 37, samples_per_shard=10, image_token_count=16)
    assert [s.num_samples for s in idx.shards] == [10, 10, 10, 7]
    assert [s.name for s in idx.shards] == [f"shard-{i:06d}.tar" for i in range(4)]
    loaded = load_index(tmp_path / "ds")
    assert_same_index(loaded, idx)
    assert loaded.tokenizer == tokenizer_fingerprint(tiny_tokenizer) and loaded.image_token_count == 16
    records = list(synthetic_records(37))
    proc = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=16)
    rows = shards_of(loaded)
    keys = [k for s in rows for k in s.keys]
    assert keys == [r.key for r in records] == loaded.key_list()
    assert [n for s in rows for n in s.n_images] == [i % 3 for i in range(37)]
    assert [t for s in rows for t in s.text_tokens] == [proc.text_tokens(r.messages) for r in records]
    counts = [proc.token_counts(r.messages) for r in records]
    assert [(p, m) for s in rows for p, m in zip(s.prompt_tokens, s.prompt_images)] == [c[1:] for c in counts]
    sizes = [sz for s in rows for sz in s.image_sizes]
    import io

    from PIL import Image

    assert sizes == [[list(Image.open(io.BytesIO(b)).size) for b in r.images] for r in records]
    # total tokens = text + images * (count - 1) = the processed length
    tot = loaded.total_tokens(16).tolist()
    assert len(tot) == len(records)
    for r, t in zip(records, tot):
        assert len(proc.process(r).input_ids) == t
    assert all(s.size_bytes == (tmp_path / "ds" / s.name).stat().st_size for s in loaded.shards)


def test_byte_ranges_and_webdataset_reads_the_shards(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 12, samples_per_shard=5)
    records = {r.key: r for r in synthetic_records(12)}
    for n, shard in enumerate(shards_of(idx)):
        path = idx.shard_path(n)
        streamed = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))
        assert [s["__key__"] for s in streamed] == shard.keys
        for i, key in enumerate(shard.keys):
            members = ShardReader().read_members(str(path), shard.offsets[i], shard.nbytes[i], key)
            assert shard.offsets[i] % 512 == 0 and shard.nbytes[i] % 512 == 0
            rec = members_to_record(members, key)
            assert rec.messages == records[key].messages and rec.images == records[key].images
            assert rec.extra == records[key].extra
            assert {k: v for k, v in streamed[i].items() if not k.startswith("__")} == members
        with pytest.raises(SampleError, match="another key"):
            ShardReader().read_members(str(path), shard.offsets[1], shard.nbytes[1], shard.keys[0])


def test_tar_metadata_is_fixed(tmp_path, make_dataset):
    idx = make_dataset(tmp_path / "ds", 4)
    with tarfile.open(idx.shard_path(0)) as tf:
        infos = tf.getmembers()
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname) for i in infos} == {(0, 0, 0, "nanovlm", "nanovlm")}
    assert [i.name for i in infos[:3]] == ["s00000.json", "s00001.0.png", "s00001.json"]
    # plain ustar: one 512-byte header before each member, no pax extension header (a float mtime adds one,
    # 1 KB more per member, which doubles a shard of small members)
    assert all(i.pax_headers == {} and i.offset_data == i.offset + 512 for i in infos)
    assert all(b.offset == a.offset_data + -(-a.size // 512) * 512 for a, b in zip(infos, infos[1:]))


def test_deterministic_bytes(tmp_path, make_dataset):
    make_dataset(tmp_path / "a", 20, samples_per_shard=8)
    make_dataset(tmp_path / "b", 20, samples_per_shard=8)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    # Re-running into the same directory with fewer samples removes the stale shards.
    make_dataset(tmp_path / "a", 5, samples_per_shard=8)
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == ["index", "shard-000000.tar"]


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
    assert idx.shard(0).keys == ["s00000", "s00001", "s00002"]


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
    members = ShardReader().read_members(str(idx.shard_path(0)), 0, idx.shard(0).nbytes[0], "k")
    assert sorted(members) == ["0.png", "1.jpg", "json"]
    assert members["1.jpg"] == jpeg
    assert Image.open(io.BytesIO(members["0.png"])).getpixel((0, 0)) == (1, 2, 3)
    assert idx.shard(0).image_sizes == [[[5, 4], [9, 7]]]


# ---------------------------------------------------------------------------------------------------------
# scripts/prepare_data.py


def _img(path, size=(20, 12), colour=(255, 0, 0), fmt="PNG"):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format=fmt)
    return path


def _jsonl(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def _prepare(tok, *args):
    from nanovlm.cli.prepare_data import main

    return main([*args, "--tokenizer", tok.name_or_path])


@pytest.fixture()
def user_data(tmp_path):
    """A user folder: images/ (good, truncated, huge) and a JSONL mixing the three formats and every bad case."""
    imgs = tmp_path / "images"
    _img(imgs / "red.png")
    _img(imgs / "blue.jpg", (30, 40), (0, 0, 255), "JPEG")
    _img(imgs / "sub" / "green.webp", (16, 16), (0, 255, 0), "WEBP")
    _img(imgs / "actually_png.jpg", (8, 8))  # wrong extension: decoded by content
    full = (imgs / "blue.jpg").read_bytes()
    (imgs / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (imgs / "garbage.png").write_bytes(b"this is not an image")
    _img(imgs / "huge.png", (300, 300))
    (tmp_path / "outside.png").write_bytes((imgs / "red.png").read_bytes())
    ok_native = {
        "images": ["red.png", "sub/green.webp"],
        "messages": [
            {"role": "user", "content": "<image> vs <image>?"},
            {"role": "assistant", "content": "red, green"},
        ],
    }
    ok_llava = {
        "id": "L1",
        "image": "blue.jpg",
        "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Blue."}],
    }
    ok_caption = {"image": "actually_png.jpg", "caption": "a red square"}
    ok_text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

    def cap(image):
        return {"image": image, "caption": "x"}

    lines = [
        ok_native,                                                        # 1 ok
        ok_llava,                                                         # 2 ok
        "{broken json",                                                   # 3 bad_json
        ok_caption,                                                       # 4 ok
        cap("missing.png"),                                               # 5 missing_image
        cap("truncated.jpg"),                                             # 6 unreadable_image
        cap("garbage.png"),                                               # 7 unreadable_image
        cap("huge.png"),                                                  # 8 image_too_large
        cap("../outside.png"),                                            # 9 unsafe_path
        cap(str(tmp_path / "outside.png")),                               # 10 unsafe_path (absolute)
        {"messages": []},                                                 # 11 empty_conversation
        {"messages": [{"role": "user", "content": "hi"}]},                # 12 no_assistant_turn
        {"foo": 1},                                                       # 13 unknown_format
        {"images": ["red.png"], "messages": ok_text["messages"]},         # 14 image_count_mismatch
        ok_text,                                                          # 15 ok (text only)
        "",                                                               # 16 blank: not a sample
    ]  # fmt: skip
    return _jsonl(tmp_path / "mixed.jsonl", lines), imgs


EXPECTED_SKIPS = {
    "bad_json": 1,
    "missing_image": 1,
    "unreadable_image": 2,
    "image_too_large": 1,
    "unsafe_path": 2,
    "empty_conversation": 1,
    "no_assistant_turn": 1,
    "unknown_format": 1,
    "image_count_mismatch": 1,
}


def test_prepare_data_formats_and_every_skip_reason(tmp_path, user_data, tiny_tokenizer, capsys):
    jsonl, imgs = user_data
    out = tmp_path / "out"
    rc = _prepare(tiny_tokenizer, "--input", str(jsonl), "--output", str(out), "--max-image-pixels", "50000", "--image-root", str(imgs),
                  "--image-token-count", "16", "--samples-per-shard", "3")  # fmt: skip
    assert rc == 0
    idx = load_index(out)
    assert [k for s in shards_of(idx) for k in s.keys] == [
        "mixed-00000001",
        "mixed-00000002",
        "mixed-00000004",
        "mixed-00000015",
    ]
    assert [n for s in shards_of(idx) for n in s.n_images] == [2, 1, 1, 0]
    assert [sz for s in shards_of(idx) for sz in s.image_sizes] == [[[20, 12], [16, 16]], [[30, 40]], [[8, 8]], []]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["source"], r["reason"]) for r in rejected] == [
        ("mixed.jsonl:3", "bad_json"),
        ("mixed.jsonl:5", "missing_image"),
        ("mixed.jsonl:6", "unreadable_image"),
        ("mixed.jsonl:7", "unreadable_image"),
        ("mixed.jsonl:8", "image_too_large"),
        ("mixed.jsonl:9", "unsafe_path"),
        ("mixed.jsonl:10", "unsafe_path"),
        ("mixed.jsonl:11", "empty_conversation"),
        ("mixed.jsonl:12", "no_assistant_turn"),
        ("mixed.jsonl:13", "unknown_format"),
        ("mixed.jsonl:14", "image_count_mismatch"),
    ]
    printed = capsys.readouterr().out
    assert "wrote 4 of 15 samples" in printed
    assert "skipped 11: " + ", ".join(f"{r}={n}" for r, n in sorted(EXPECTED_SKIPS.items())) in printed
    assert f"index: {out / 'index'} " in printed
    # The written samples are what training reads: LLaVA turned into messages, caption into the caption prompt.
    proc = SampleProcessor(tiny_tokenizer, 8, 16)
    s = idx.shard(0)
    read = ShardReader().read
    rec = read(str(idx.shard_path(0)), s.offsets[1], s.nbytes[1], s.keys[1])
    assert rec.messages == [{"role": "user", "content": "<image>\nColour?"}, {"role": "assistant", "content": "Blue."}]
    assert rec.extra == {"id": "L1"} and rec.images == [(imgs / "blue.jpg").read_bytes()]
    assert s.text_tokens[1] == proc.text_tokens(rec.messages)
    rec = read(str(idx.shard_path(0)), s.offsets[2], s.nbytes[2], s.keys[2])
    assert rec.messages[-1]["content"] == "a red square"
    members = ShardReader().read_members(str(idx.shard_path(0)), s.offsets[2], s.nbytes[2], s.keys[2])
    assert sorted(members) == ["0.png", "json"]  # sniffed


def test_prepare_data_allow_absolute_and_image_root(tmp_path, user_data, tiny_tokenizer):
    jsonl, imgs = user_data
    lines = [{"image": str(imgs / "red.png"), "caption": "abs"}, {"image": "red.png", "caption": "rel"}]
    (tmp_path / "elsewhere").mkdir()
    src = _jsonl(tmp_path / "elsewhere" / "x.jsonl", lines)  # relative paths resolve in --image-root, not here
    out = tmp_path / "o"
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(out), "--image-root", str(imgs),
                    "--allow-absolute-paths") == 0  # fmt: skip
    assert load_index(out).num_samples == 2


def test_prepare_data_deterministic_across_workers_and_reruns(tmp_path, user_data, tiny_tokenizer):
    jsonl, imgs = user_data
    big = _jsonl(tmp_path / "big.jsonl", [json.loads(x) if x.startswith("{") and not x.startswith("{broken") else x
                                           for x in jsonl.read_text().splitlines()] * 5)  # fmt: skip
    args = [
        "--input",
        str(big),
        str(jsonl),
        "--samples-per-shard",
        "7",
        "--image-root",
        str(imgs),
        "--max-image-pixels",
        "50000",
    ]
    assert _prepare(tiny_tokenizer, *args, "--output", str(tmp_path / "w1")) == 0
    assert _prepare(tiny_tokenizer, *args, "--output", str(tmp_path / "w2"), "--workers", "2") == 0
    d1 = digest(tmp_path / "w1")
    assert d1 == digest(tmp_path / "w2")
    assert _prepare(tiny_tokenizer, *args, "--output", str(tmp_path / "w1")) == 0  # re-run in place
    assert digest(tmp_path / "w1") == d1
    assert load_index(tmp_path / "w1").num_samples == 4 * 5 + 4


def test_prepare_data_counts_in_the_configs_chat_format(tmp_path, user_data, tiny_tokenizer):
    """--config with data.chat_format=smolvlm: lengths counted in that framing, the index says so, and a run in
    that format reads it (its planned lengths equal the processed ones)."""
    import copy

    from nanovlm.config import load_config
    from nanovlm.data.datamodule import load_table
    from nanovlm.data.tokenizer import load_tokenizer

    jsonl, imgs = user_data
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_utterance>"]}, replace_extra_special_tokens=False)
    tok.save_pretrained(tmp_path / "tok")
    cfg_file = tmp_path / "smol.yaml"
    cfg_file.write_text(f"data: {{tokenizer: {tmp_path / 'tok'}, chat_format: smolvlm}}\n")
    args = ["--input", str(jsonl), "--image-root", str(imgs), "--output", str(tmp_path / "ds"), "--config"]
    from nanovlm.cli.prepare_data import main

    assert main([*args, str(cfg_file), "--max-image-pixels", "50000"]) == 0
    index = load_index(tmp_path / "ds")
    assert index.tokenizer.endswith("+smolvlm")
    cfg = load_config([str(cfg_file)])
    proc = SampleProcessor.from_config(load_tokenizer(tmp_path / "tok"), cfg.model, cfg.data)
    table = load_table([str(tmp_path / "ds")], proc.tokenizer, "tok", proc.layout, "smolvlm")
    reader = ShardReader()
    for gid in range(len(table)):
        sample = proc.process(reader.read(*table.locate(gid)))
        assert len(sample.input_ids) == table.length[gid]
        assert sample.input_ids[0] == proc.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_prepare_data_index_only_for_existing_webdataset(tmp_path, tiny_tokenizer, capsys):
    """img2dataset-style shards (jpg + txt + json metadata), with a corrupt image and a key without text."""
    src = tmp_path / "wds"
    src.mkdir()
    import io

    from PIL import Image

    def jpg(c):
        b = io.BytesIO()
        Image.new("RGB", (24, 18), c).save(b, format="JPEG")
        return b.getvalue()

    def tar(path, samples):
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for name, data in samples:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))

    tar(src / "00000.tar", [
        ("000000000.jpg", jpg((255, 0, 0))), ("000000000.txt", b"a red thing"), ("000000000.json", b'{"url": "u"}'),
        ("000000001.jpg", jpg((0, 255, 0))[:300]), ("000000001.txt", b"broken image"),
        ("000000002.jpg", jpg((0, 0, 255))), ("000000002.pyd", b"\x80\x04not unpickled"), ("000000002.txt", b"blue"),
    ])  # fmt: skip
    tar(
        src / "00001.tar",
        [("000000003.jpg", jpg((9, 9, 9))), ("000000004.jpg", jpg((1, 1, 1))), ("000000004.txt", b"dark")],
    )
    before = digest(src)
    out = tmp_path / "idx"
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(out), "--workers", "2") == 0
    assert digest(src) == before  # tars untouched
    idx = load_index(out)
    assert [s.name for s in idx.shards] == ["../wds/00000.tar", "../wds/00001.tar"]
    assert [s.keys for s in shards_of(idx)] == [["000000000", "000000002"], ["000000004"]]
    assert [s.image_sizes for s in shards_of(idx)] == [[[[24, 18]], [[24, 18]]], [[[24, 18]]]]
    proc = SampleProcessor(tiny_tokenizer, 8, 16)
    for n, shard in enumerate(shards_of(idx)):
        for i, key in enumerate(shard.keys):
            rec = ShardReader().read(str(idx.shard_path(n)), shard.offsets[i], shard.nbytes[i], key)
            assert shard.text_tokens[i] == proc.text_tokens(rec.messages)
            assert (shard.text_tokens[i], shard.prompt_tokens[i], shard.prompt_images[i]) == proc.token_counts(
                rec.messages
            )
            assert proc.process(rec).pixel_values.shape == (1, 3, 8, 8)
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["key"], r["reason"]) for r in rejected] == [
        ("000000001", "unreadable_image"),
        ("000000003", "missing_messages"),
    ]
    assert "wrote 3 of 5 samples" in capsys.readouterr().out
    # In place (--output = the shard directory): shard names are bare file names.
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(src)) == 0
    assert [s.name for s in load_index(src).shards] == ["00000.tar", "00001.tar"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--input", "{tmp}/nope.jsonl", "--output", "{tmp}/o"], "input not found"),
        (["--input", "{tmp}/a.jsonl", "--output", ""], "--output must not be empty"),
        (["--input", "{tmp}/a.jsonl", "--output", "{tmp}/o", "--workers", "0"], "must be positive"),
        (["--input", "{tmp}/a.jsonl", "{tmp}", "--output", "{tmp}/o"], "not both"),
        (["--input", "{tmp}", "--output", "{tmp}/o"], "no .tar shards"),
        (["--input", "{tmp}/a.jsonl", "--output", "{tmp}/o", "--image-root", "{tmp}/none"], "not a directory"),
        (["--input", "{tmp}/a.jsonl", "--output", "{tmp}/o", "--config", "{tmp}/none.yaml"], "config file not found"),
    ],
)
def test_prepare_data_bad_arguments(tmp_path, tiny_tokenizer, argv, message):
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match=message):
        _prepare(tiny_tokenizer, *[a.format(tmp=tmp_path) for a in argv])


def test_prepare_data_bad_tokenizer_and_nothing_written(tmp_path, tiny_tokenizer, capsys):
    from nanovlm.cli.prepare_data import main

    src = _jsonl(tmp_path / "a.jsonl", ["{bad", {"messages": []}])
    with pytest.raises(SystemExit, match="cannot load tokenizer"):
        main(["--input", str(src), "--output", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "no" / "tok")])
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(tmp_path / "o")) == 1
    assert "no sample could be written (bad_json=1, " in capsys.readouterr().err
    assert len((tmp_path / "o" / "rejected.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "o" / "index").exists()  # not an (empty) dataset that training would plan


def test_input_files_with_colliding_names_keep_all_their_samples(tmp_path, tiny_tokenizer):
    """a/x.jsonl, b/x.jsonl and c/x_1.jsonl: the renamed prefixes must not collide with a real stem (they gave
    x_0, x_1, x_1, and every line of the third file was rejected as a duplicate key)."""
    from nanovlm.cli.prepare_data import _key_stems

    files = [tmp_path / d / n for d, n in (("a", "x.jsonl"), ("b", "x.jsonl"), ("c", "x_1.jsonl"))]
    assert _key_stems(files) == ["x_0", "x_2", "x_1"]
    sample = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    for f in files:
        f.parent.mkdir()
        _jsonl(f, [sample, sample])
    args = ["--input", *map(str, files), "--output", str(tmp_path / "o")]
    assert _prepare(tiny_tokenizer, *args) == 0
    assert load_index(tmp_path / "o").num_samples == 6


@pytest.mark.parametrize(
    "orientation, upright", [(1, [12, 8]), (3, [12, 8]), (5, [8, 12]), (6, [8, 12]), (7, [8, 12]), (8, [8, 12])]
)
def test_image_sizes_are_upright_for_every_exif_orientation(orientation, upright):
    """The index records [width, height] as displayed: orientations 5-8 swap them (5 and 7 are the transposed ones)."""
    import io

    from PIL import Image

    from nanovlm.data.prepare import inspect_image

    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (12, 8), (200, 10, 10)).save(buf, format="JPEG", exif=exif.tobytes())
    assert inspect_image(buf.getvalue())[1] == upright


def test_a_rerun_that_dies_leaves_no_index_of_the_earlier_dataset(tmp_path, tiny_tokenizer):
    """The old index next to new shards of the same names described a silent mix of old and new samples."""
    out = tmp_path / "ds"
    write_dataset(synthetic_records(9), out, tiny_tokenizer, 16, samples_per_shard=3)
    load_index(out)

    def edited():
        for r in synthetic_records(9, seed=5):
            yield r
            if r.key == "s00004":
                raise KeyboardInterrupt  # Ctrl-C after the first new shard is in place

    with pytest.raises(KeyboardInterrupt):
        write_dataset(edited(), out, tiny_tokenizer, 16, samples_per_shard=3)
    with pytest.raises(FileNotFoundError, match="prepare the dataset"):
        load_index(out)


def test_lines_that_break_python_itself_are_rejected_not_fatal(tmp_path, tiny_tokenizer):
    """Scraped data: a lone surrogate escape, a NUL in a path, a file name over 255 bytes, deep nesting, a
    symlink loop: each is a counted rejection, and the good lines are written."""
    _img(tmp_path / "ok.png")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    good = {"image": "ok.png", "caption": "a red square"}
    lines = [
        json.dumps(good),
        '{"image": "ok.png", "caption": "broken emoji \\ud83d"}',
        json.dumps({"image": "a\x00b.png", "caption": "x"}),
        json.dumps({"image": "n" * 300 + ".png", "caption": "x"}),
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"image": "loop/x.png", "caption": "x"}),
        # native lines name their images "image" too: it used to be kept as an extra field, the image dropped
        json.dumps({"image": "ok.png", "messages": [{"role": "user", "content": "<image>Colour?"},
                                                    {"role": "assistant", "content": "red"}]}),
    ]  # fmt: skip
    src = tmp_path / "scraped.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(tmp_path / "o")) == 0
    rejected = [json.loads(line) for line in (tmp_path / "o" / "rejected.jsonl").read_text().splitlines()]
    reasons = [r["reason"] for r in rejected]
    assert reasons == ["bad_utf8", "bad_image_ref", "bad_image_ref", "bad_json", "bad_image_ref"]
    assert all(len(r["detail"]) < 600 for r in rejected)
    assert load_index(tmp_path / "o").shard(0).n_images == [1, 1]


def test_gzip_and_pipe_inputs_and_a_json_array_is_named(tmp_path, tiny_tokenizer):
    import gzip
    import os
    import threading

    _img(tmp_path / "ok.png")
    text = "".join(json.dumps({"image": "ok.png", "caption": f"square {i}"}) + "\n" for i in range(5))
    (tmp_path / "caps.jsonl").write_text(text)
    with gzip.open(tmp_path / "caps.jsonl.gz", "wt") as f:
        f.write(text)
    args = ("--image-root", str(tmp_path), "--samples-per-shard", "2")
    assert (
        _prepare(tiny_tokenizer, "--input", str(tmp_path / "caps.jsonl"), "--output", str(tmp_path / "a"), *args) == 0
    )
    assert (
        _prepare(tiny_tokenizer, "--input", str(tmp_path / "caps.jsonl.gz"), "--output", str(tmp_path / "b"), *args)
        == 0
    )
    fifo = tmp_path / "caps.pipe"  # a pipe can be read once: it used to be read to the end to count lines
    os.mkfifo(fifo)
    feeder = threading.Thread(target=lambda: fifo.write_text(text))
    feeder.start()
    assert _prepare(tiny_tokenizer, "--input", str(fifo), "--output", str(tmp_path / "c"), *args) == 0
    feeder.join(timeout=30)
    want = [(f.name, f.read_bytes()) for f in sorted((tmp_path / "a").glob("shard-*.tar"))]
    for out in ("b", "c"):
        assert [(f.name, f.read_bytes()) for f in sorted((tmp_path / out).glob("shard-*.tar"))] == want
    (tmp_path / "llava.json").write_text("\n[\n  " + json.dumps({"image": "ok.png", "caption": "x"}) + "\n]\n")
    with pytest.raises(SystemExit, match="holds a JSON array, not JSON Lines"):
        _prepare(tiny_tokenizer, "--input", str(tmp_path / "llava.json"), "--output", str(tmp_path / "d"))


def test_prepare_data_small_input_mistakes(tmp_path, tiny_tokenizer, capsys):
    _img(tmp_path / "ok.png")
    src = _jsonl(
        tmp_path / "a.jsonl",
        [
            {"image": "ok.png", "conversations": [{"from": "Human", "value": "<image>\nColour?"},
                                                  {"from": "GPT", "value": "red"}]},  # capitalised roles
            {"image": "ok.png", "conversations": [{"from": "human", "value": "<image>\nColour?"},
                                                  {"from": "gpt", "value": " "}]},  # blank answer
        ],
    )  # fmt: skip
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="is a file"):
        _prepare(tiny_tokenizer, "--input", str(src), "--output", str(tmp_path / "file"))
    with pytest.raises(SystemExit, match="same input file is given more than once"):
        _prepare(tiny_tokenizer, "--input", str(src), str(tmp_path / "." / "a.jsonl"), "--output", str(tmp_path / "o"))
    out = tmp_path / "o"
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(out), "--max-image-pixels", "100000000") == 0
    assert "training skips those over data.max_image_pixels=64000000" in capsys.readouterr().out
    rejected = [json.loads(line) for line in (tmp_path / "o" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["detail"]) for r in rejected] == [("no_assistant_turn", "every assistant turn is empty")]
    assert load_index(tmp_path / "o").num_samples == 1


def test_prepare_data_ctrl_c_is_a_message_not_a_traceback(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    import nanovlm.cli.prepare_data as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_jsonl", interrupted)
    src = _jsonl(tmp_path / "a.jsonl", [{"image": "x.png", "caption": "x"}])
    assert _prepare(tiny_tokenizer, "--input", str(src), "--output", str(tmp_path / "o")) == 130
    assert "interrupted: run the same command again" in capsys.readouterr().err


def test_prepare_data_unreadable_gzip_inputs_are_errors(tmp_path, tiny_tokenizer, capsys):
    import gzip

    (tmp_path / "fake.jsonl.gz").write_text('{"caption": "not gzip"}\n')
    with pytest.raises(SystemExit, match="cannot read .*fake.jsonl.gz"):
        _prepare(tiny_tokenizer, "--input", str(tmp_path / "fake.jsonl.gz"), "--output", str(tmp_path / "o"))
    _img(tmp_path / "ok.png")
    data = gzip.compress(b"".join(b'{"image": "ok.png", "caption": "c %d"}\n' % i for i in range(2000)))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])  # a download cut short
    assert _prepare(tiny_tokenizer, "--input", str(tmp_path / "cut.jsonl.gz"), "--output", str(tmp_path / "o")) == 1
    assert "error: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "o" / "index").exists()


# ----------------------------------------------------------------------------------------------------------
# faults: every bad input line or shard is listed in rejected.jsonl with its reason


TOKENS_PER_IMAGE = 4  # the image token count of the fault tests (as in unit/test_processing.py)


def test_exif_rotation_is_recorded_upright_in_the_index(tmp_path, tiny_tokenizer):
    from nanovlm.data.prepare import write_dataset

    rotated, _ = exif_rotated_png(6, size=(32, 16))
    record = Record("rot", conversation(1)["messages"], [rotated])
    index = write_dataset([record], tmp_path / "ds", tiny_tokenizer, TOKENS_PER_IMAGE)
    assert index.shard(0).image_sizes == [[[16, 32]]]


def test_prepare_data_lists_every_bad_line_with_its_reason(tmp_path, tiny_tokenizer):
    from nanovlm.cli.prepare_data import main

    root = tmp_path / "img"
    root.mkdir()
    files = {
        "ok.png": png(),
        "gray.png": grayscale_png(),
        "cmyk.jpg": cmyk_jpeg(),
        "named.jpg": png_named_jpg(),
        "text.jpg": not_an_image(),
        "cut.jpg": truncated_jpeg(),
        "bomb.png": bomb_png(),
        "rot.png": exif_rotated_png(6)[0],
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    lines: list[tuple[bytes, str]] = []  # (line, expected reason or "ok")

    def add(obj_or_bytes, reason):
        lines.append((obj_or_bytes if isinstance(obj_or_bytes, bytes) else json.dumps(obj_or_bytes).encode(), reason))

    for name in ("ok.png", "gray.png", "cmyk.jpg", "named.jpg", "rot.png"):
        add({"images": [name]} | conversation(1), "ok")
    add({"images": ["text.jpg"]} | conversation(1), "unreadable_image")
    add({"images": ["cut.jpg"]} | conversation(1), "unreadable_image")
    add({"images": ["bomb.png"]} | conversation(1), "image_too_large")
    add({"images": ["nope.png"]} | conversation(1), "missing_image")
    for name, (data, reason) in sorted(bad_json_variants().items()):
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            add(data, reason)
            continue
        if isinstance(obj, dict):
            obj["images"] = ["ok.png"]
        add(obj, JSONL_REASON.get(name, reason))
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(b"".join(line + b"\n" for line, _ in lines))
    out = tmp_path / "out"
    argv = ["--input", str(jsonl), "--output", str(out), "--image-root", str(root)]
    assert main([*argv, "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    want = [(f"in.jsonl:{i + 1}", reason) for i, (_, reason) in enumerate(lines) if reason != "ok"]
    assert [(r["source"], r["reason"]) for r in rejected] == want
    index = load_index(out)
    assert index.num_samples == 5
    assert index.shard(0).image_sizes[4] == [[16, 32]]  # EXIF rotation recorded upright


def _foreign_shards(directory, n_shards: int = 2, per_shard: int = 6):
    """Un-indexed WebDataset shards (as img2dataset writes them): x<shard>_<i>.png + .json."""
    directory.mkdir(parents=True)
    for s in range(n_shards):
        members = []
        for i in range(per_shard):
            members += [(f"x{s}_{i}.png", png(seed=i)), (f"x{s}_{i}.json", json_bytes(conversation(1)))]
        (directory / f"part-{s}.tar").write_bytes(tar_bytes(members))
    return directory


def _index_only(directory, tokenizer) -> tuple[int, dict[str, list[str]], list[dict]]:
    from nanovlm.cli.prepare_data import main

    rc = main(["--input", str(directory), "--output", str(directory), "--tokenizer", tokenizer.name_or_path])
    keys = (
        {s["name"]: s["keys"] for s in read_index(directory)["shards"]}
        if (directory / "index" / "meta.json").exists()
        else {}
    )
    rejected = directory / "rejected.jsonl"
    return rc, keys, [json.loads(x) for x in rejected.read_text().splitlines()] if rejected.exists() else []


def test_index_only_truncated_shard_keeps_what_is_before_the_cut_and_reports_the_rest(tmp_path, tiny_tokenizer):
    shards = _foreign_shards(tmp_path / "foreign")
    truncate_mid_member(shards / "part-1.tar", 7)  # the png of x1_3
    rc, keys, rejected = _index_only(shards, tiny_tokenizer)
    assert rc == 0
    assert keys == {"part-0.tar": [f"x0_{i}" for i in range(6)], "part-1.tar": ["x1_0", "x1_1", "x1_2"]}
    assert [(r["source"], r["reason"]) for r in rejected] == [("part-1.tar", "corrupt_shard")]


def test_index_only_corrupt_header_is_reported_not_silently_dropped(tmp_path, tiny_tokenizer):
    shards = _foreign_shards(tmp_path / "foreign")
    corrupt_header(shards / "part-1.tar", 6)  # header of x1_3.png: x1_3..x1_5 are unreachable
    rc, keys, rejected = _index_only(shards, tiny_tokenizer)
    assert rc == 0
    assert keys == {"part-0.tar": [f"x0_{i}" for i in range(6)], "part-1.tar": ["x1_0", "x1_1", "x1_2"]}
    assert [(r["source"], r["reason"]) for r in rejected] == [("part-1.tar", "corrupt_shard")]
    # one skip stands for an unknown number of lost samples: the detail says so
    assert "The 3 sample(s) before the damage are indexed; everything after it" in rejected[0]["detail"]


def test_index_only_zero_byte_shard_is_reported(tmp_path, tiny_tokenizer):
    shards = _foreign_shards(tmp_path / "foreign")
    (shards / "part-1.tar").write_bytes(b"")
    rc, keys, rejected = _index_only(shards, tiny_tokenizer)
    assert rc == 0 and list(keys) == ["part-0.tar"]
    assert [(r["source"], r["reason"]) for r in rejected] == [("part-1.tar", "corrupt_shard")]


def test_index_only_empty_tar_contributes_nothing_and_all_empty_is_an_error(tmp_path, tiny_tokenizer, capsys):
    shards = _foreign_shards(tmp_path / "foreign")
    (shards / "part-1.tar").write_bytes(empty_tar())
    rc, keys, _ = _index_only(shards, tiny_tokenizer)
    assert rc == 0 and keys == {"part-0.tar": [f"x0_{i}" for i in range(6)]}
    (shards / "part-0.tar").write_bytes(empty_tar())
    rc, _, _ = _index_only(shards, tiny_tokenizer)
    assert rc == 1
    assert "no sample could be written" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# security: shard members are never unpickled, tar member names write nothing


def test_prepare_data_index_only_never_unpickles_shard_members(tmp_path, tiny_tokenizer):
    """Indexing someone else's shards (``--input DIR``) reads them but never loads pickles."""
    from nanovlm.cli.prepare_data import main

    marker = tmp_path / "pwned"
    shards = tmp_path / "foreign"
    shards.mkdir()
    members = []
    for i in range(4):
        members += [(f"x{i}.jpg", png(seed=i)), (f"x{i}.json", json_bytes(conversation(1)))]
        members += [(f"x{i}.{suffix}", pickle_payload(marker)) for suffix in HOSTILE_SUFFIXES]
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    assert main(["--input", str(shards), "--output", str(shards), "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    index = read_index(shards)
    assert index["shards"][0]["keys"] == ["x0", "x1", "x2", "x3"]
    assert not marker.exists()


def test_tar_member_names_cannot_write_outside(tmp_path, tiny_tokenizer):
    """Members named ``../../x`` or ``/abs/x`` (tar slip): nothing extracts shards to disk, so nothing is
    written anywhere, whatever the names say; such members are just not part of any sample."""
    from nanovlm.cli.prepare_data import main

    shards = tmp_path / "a" / "b" / "foreign"
    shards.mkdir(parents=True)
    escaped = tmp_path / "a" / "escaped.txt"
    absolute = tmp_path / "absolute.txt"
    members = [("x0.jpg", png()), ("x0.json", json_bytes(conversation(1)))]
    members += [("../../escaped.txt", b"owned"), (str(absolute), b"owned")]
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    main(["--input", str(shards), "--output", str(shards), "--tokenizer", tiny_tokenizer.name_or_path])
    index = read_index(shards)
    assert index["shards"][0]["keys"][0] == "x0"
    assert not escaped.exists() and not absolute.exists()
    assert sorted(p.name for p in shards.iterdir()) == ["index", "part-0.tar", "rejected.jsonl"]


# ----------------------------------------------------------------------------------------------------------
# security: image paths in JSONL stay inside --image-root


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (root / "ok.png").write_bytes(png())
    (root / "sub" / "ok2.png").write_bytes(png(seed=1))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png(seed=2))
    (root / "link.png").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path)
    return root


@pytest.mark.parametrize(
    "ref",
    ["../secret.png", "../../etc/passwd", "sub/../../secret.png", "link.png", "linkdir/secret.png", "/etc/passwd"],
)
def test_image_path_escaping_the_root_is_unsafe_path(image_root, ref):
    with pytest.raises(SampleError) as exc:
        resolve_image_path(ref, image_root, key="k")
    assert exc.value.reason == "unsafe_path"


def test_image_paths_inside_the_root_resolve(image_root):
    assert resolve_image_path("ok.png", image_root) == (image_root / "ok.png").resolve()
    assert resolve_image_path("sub/../sub/ok2.png", image_root) == (image_root / "sub" / "ok2.png").resolve()
    assert resolve_image_path(str(image_root.parent / "secret.png"), image_root, allow_absolute=True).is_file()


def test_prepare_data_rejects_escaping_paths_and_lists_them(tmp_path, image_root, tiny_tokenizer, capsys):
    """End to end: unsafe lines are counted, listed in rejected.jsonl with reason unsafe_path, never read
    (no content of the outside file reaches the shards), and the safe lines are written."""
    from nanovlm.cli.prepare_data import main

    lines = {
        "ok.png": "ok",
        "sub/ok2.png": "ok",
        "../secret.png": "unsafe_path",
        "../../../../../../etc/passwd": "unsafe_path",
        "link.png": "unsafe_path",
        "linkdir/secret.png": "unsafe_path",
        str(image_root.parent / "secret.png"): "unsafe_path",  # absolute, not allowed by default
        "/etc/passwd": "unsafe_path",
        "missing.png": "missing_image",
    }
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"images": [ref]} | conversation(1)) + "\n" for ref in lines))
    out = tmp_path / "out"
    args = ["--input", str(jsonl), "--output", str(out), "--image-root", str(image_root)]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    expected = [(f"data.jsonl:{i + 1}", reason) for i, reason in enumerate(lines.values()) if reason != "ok"]
    assert [(r["source"], r["reason"]) for r in rejected] == expected
    index = read_index(out)
    assert sum(s["num_samples"] for s in index["shards"]) == 2
    secret = (image_root.parent / "secret.png").read_bytes()
    for shard in out.glob("shard-*.tar"):
        assert secret not in shard.read_bytes()
    assert "unsafe_path=6" in capsys.readouterr().out


def test_absolute_paths_are_accepted_only_when_allowed(tmp_path, image_root, tiny_tokenizer):
    from nanovlm.cli.prepare_data import main

    jsonl = tmp_path / "abs.jsonl"
    jsonl.write_text(json.dumps({"images": [str(image_root.parent / "secret.png")]} | conversation(1)) + "\n")
    out = tmp_path / "out"
    args = ["--input", str(jsonl), "--output", str(out), "--image-root", str(image_root)]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 1  # nothing written: an error
    assert json.loads((out / "rejected.jsonl").read_text())["reason"] == "unsafe_path"
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path, "--allow-absolute-paths"]) == 0
    assert read_index(out)["shards"][0]["num_samples"] == 1


@pytest.mark.skipif(sys.platform != "linux", reason="symlink semantics")
def test_prepare_data_never_follows_symlinked_jsonl_images_out_of_root_even_via_dotdot(tmp_path, image_root):
    """A symlink inside the root pointing to a directory outside, then ``..`` out of it: still outside."""
    ref = "linkdir/images/../secret.png"
    with pytest.raises(SampleError) as exc:
        resolve_image_path(ref, image_root)
    assert exc.value.reason == "unsafe_path"
    assert os.path.exists(image_root / "linkdir" / "secret.png")


def test_index_only_resumes_after_a_kill(tmp_path, tiny_tokenizer, monkeypatch):
    """A killed index-only run keeps each finished shard's rows; the same command then indexes only the shards
    not done (and any whose bytes changed since) and writes the index a clean run writes."""
    from nanovlm.cli import prepare_data

    clean = _foreign_shards(tmp_path / "clean", n_shards=3)
    shards = _foreign_shards(tmp_path / "killed", n_shards=3)
    args = ["--workers", "1", "--tokenizer", tiny_tokenizer.name_or_path]
    assert prepare_data.main(["--input", str(clean), "--output", str(clean), *args]) == 0
    real, seen = prepare_data._shard_work, []

    def work(path):
        seen.append(Path(path).name)
        if Path(path).name == "part-2.tar" and len(seen) == 3:
            raise KeyboardInterrupt  # the kill, after two shards are done
        return real(path)

    monkeypatch.setattr(prepare_data, "_shard_work", work)
    assert prepare_data.main(["--input", str(shards), "--output", str(shards), *args]) == 130
    assert not (shards / "index").exists()
    assert sorted(p.name for p in (shards / ".index-parts").iterdir()) == ["part-0.tar.npz", "part-1.tar.npz"]
    (shards / "part-1.tar").write_bytes((clean / "part-1.tar").read_bytes() + b"\0" * 512)  # changed: not trusted
    seen.clear()
    assert prepare_data.main(["--input", str(shards), "--output", str(shards), *args]) == 0
    assert seen == ["part-1.tar", "part-2.tar"]
    assert not (shards / ".index-parts").exists()
    got, want = load_index(shards), load_index(clean)
    assert [got.shard(i) for i in range(3)] == [
        dataclasses.replace(want.shard(i), size_bytes=(shards / want.shards[i].name).stat().st_size) for i in range(3)
    ]


def test_index_only_header_check_reads_sizes_without_decoding(tmp_path, tiny_tokenizer):
    """--image-check header records the same index as a full decode for intact images; a JPEG damaged after
    its header then passes (training skips it when it reads it), where decode rejects it."""
    from nanovlm.cli.prepare_data import main

    shards = _foreign_shards(tmp_path / "foreign")
    args = ["--input", str(shards), "--workers", "1", "--tokenizer", tiny_tokenizer.name_or_path]
    assert main([*args, "--output", str(tmp_path / "decode")]) == 0
    assert main([*args, "--output", str(tmp_path / "header"), "--image-check", "header"]) == 0
    dec, head = load_index(tmp_path / "decode"), load_index(tmp_path / "header")
    assert [dec.shard(i) for i in range(2)] == [head.shard(i) for i in range(2)]
    members = [("y_0.jpg", truncated_jpeg((256, 256))), ("y_0.json", json_bytes(conversation(1)))]  # past its header
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    (shards / "part-1.tar").unlink()
    assert main([*args, "--output", str(tmp_path / "decode2")]) == 1  # nothing indexable
    assert main([*args, "--output", str(tmp_path / "header2"), "--image-check", "header"]) == 0
    assert load_index(tmp_path / "header2").key_list() == ["y_0"]
    broken = png(seed=0)  # a PNG is decoded either way: only the decoded image tells its orientation
    members = [("y_0.png", broken[: len(broken) // 2]), ("y_0.json", json_bytes(conversation(1)))]
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    assert main([*args, "--output", str(tmp_path / "header3"), "--image-check", "header"]) == 1
