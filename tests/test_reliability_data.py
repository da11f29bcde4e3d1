"""Reliability of the data path under bad input: every fault is either a counted skip with its reason or a clear
error naming the file, never a crash mid-run, a hang or a silent drop.

Levels, from the smallest unit to the whole stream:

* one sample's members -> ``members_to_record`` / ``SampleProcessor`` raise ``SampleError`` with the exact reason;
* one image -> decoded upright and RGB whatever its mode, or refused (unreadable / too large) before decoding;
* a dataset directory -> ``load_index`` refuses missing, truncated, empty or zero-byte shards by name;
  ``ShardReader`` refuses a byte range that does not hold the indexed key;
* the DataModule stream -> bad samples are skipped and counted per reason in ``telemetry()``, every good sample
  is still delivered, and ``data.max_skip_rate`` turns a mostly-broken dataset into an error.
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from faults import (
    bad_json_variants,
    bomb_png,
    cmyk_jpeg,
    conversation,
    corrupt_header,
    empty_tar,
    encode,
    exif_rotated_png,
    grayscale_png,
    json_bytes,
    not_an_image,
    palette_png,
    png,
    png_named_jpg,
    read_index,
    rgba_png,
    tar_bytes,
    truncate_mid_member,
    truncated_jpeg,
    write_index,
)
from PIL import Image

from nanovlm.data.format import Record, SampleError, members_to_record, parse_jsonl_line
from nanovlm.data.index import DatasetIndexError, load_index
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.reader import ShardReader

IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def processor(tiny_tokenizer):
    return SampleProcessor(tiny_tokenizer, image_size=IMAGE_SIZE, image_token_count=TOKENS_PER_IMAGE)


def reason_of(fn, *args, **kwargs) -> str:
    """The SampleError reason ``fn`` raises (fails the test if it raises nothing or something else)."""
    with pytest.raises(SampleError) as exc:
        fn(*args, **kwargs)
    return exc.value.reason


# ----------------------------------------------------------------------------------------------------------
# JSON / text faults in one sample


@pytest.mark.parametrize("name", sorted(bad_json_variants()))
def test_bad_json_member_is_rejected_with_its_reason(name):
    data, reason = bad_json_variants()[name]
    with pytest.raises(SampleError) as exc:
        members_to_record({"0.png": png(), "json": data}, "k1")
    assert exc.value.reason == reason
    assert exc.value.key == "k1"  # the skip log can name the sample


# A JSONL line may be native, LLaVA or caption: a line that is none of them is an unknown format.
JSONL_REASON = {
    "not_an_object": "unknown_format",
    "missing_messages": "unknown_format",
    "unknown_keys_only": "unknown_format",
}


@pytest.mark.parametrize("name", sorted(bad_json_variants()))
def test_bad_jsonl_line_is_rejected_with_its_reason(name):
    """The same faults as JSONL lines for prepare_data (images given as a one-element path list)."""
    data, reason = bad_json_variants()[name]
    reason = JSONL_REASON.get(name, reason)
    try:
        obj = json.loads(data.decode("utf-8"))
        if isinstance(obj, dict):
            obj["images"] = ["a.png"]
            data = json.dumps(obj).encode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass  # the fault is in the bytes themselves
    assert reason_of(parse_jsonl_line, data, "k2") == reason


def test_invalid_utf8_caption_txt_is_bad_utf8():
    assert reason_of(members_to_record, {"jpg": png(), "txt": b"a \xc3\x28 caption"}, "k") == "bad_utf8"


def test_members_without_conversation_or_caption_are_missing_messages():
    assert reason_of(members_to_record, {"0.png": png(), "cls": b"3"}, "k") == "missing_messages"


def test_overlength_sample_is_dropped_or_truncated_as_configured(processor):
    record = Record("long", conversation(1, answer="red " * 400)["messages"], [png()])
    full = processor.process(record)
    assert len(full.input_ids) > 64
    assert reason_of(processor.process, record, max_tokens=64, overlength="drop") == "overlength"
    cut = processor.process(record, max_tokens=64, overlength="truncate")
    assert cut.truncated and len(cut.input_ids) == 64
    assert torch.equal(cut.input_ids, full.input_ids[:64])
    assert (cut.labels != -100).any()  # something is left to learn


def test_overlength_truncation_that_leaves_no_answer_is_dropped(processor):
    record = Record("long_q", conversation(1, question="why " * 300)["messages"], [png()])
    assert reason_of(processor.process, record, max_tokens=64, overlength="truncate") == "overlength"


def test_placeholder_mismatch_is_caught_at_processing_too(processor):
    """A Record built in code (not parsed) with 2 placeholders and 1 image never reaches the model."""
    record = Record("mm", conversation(2)["messages"], [png()])
    assert reason_of(processor.process, record) == "image_count_mismatch"


# ----------------------------------------------------------------------------------------------------------
# image faults


@pytest.mark.parametrize(
    "data",
    [not_an_image(), truncated_jpeg(), b"", b"\x89PNG\r\n\x1a\n" + b"\0" * 40],
    ids=["text_file", "truncated_jpeg", "empty", "png_signature_only"],
)
def test_unreadable_image_is_unreadable_image(processor, data):
    assert reason_of(processor.image, data, key="k") == "unreadable_image"


def test_decompression_bomb_is_refused_before_decoding(processor):
    """144 Mpx in 18 KB: refused by the pixel-count guard; the header-only variant proves the guard runs before
    any pixel is decoded (decoding it would fail as unreadable, not as too large)."""
    assert processor.max_image_pixels == 64_000_000
    assert reason_of(processor.image, bomb_png(), key="k") == "image_too_large"
    assert reason_of(processor.image, bomb_png(body=False), key="k") == "image_too_large"


def test_bomb_beyond_pils_own_limit_is_image_too_large_even_without_our_guard(tiny_tokenizer):
    """With the guard disabled (max_image_pixels=0), PIL's DecompressionBombError must still map to a skip."""
    p = SampleProcessor(tiny_tokenizer, IMAGE_SIZE, TOKENS_PER_IMAGE, max_image_pixels=0)
    huge = bomb_png(20_000, 20_000, body=False)  # 400 Mpx > 2 x PIL's MAX_IMAGE_PIXELS
    assert reason_of(p.image, huge, key="k") == "image_too_large"


def test_max_image_pixels_is_configurable(tiny_tokenizer):
    p = SampleProcessor(tiny_tokenizer, IMAGE_SIZE, TOKENS_PER_IMAGE, max_image_pixels=32 * 32 - 1)
    assert reason_of(p.image, png((32, 32)), key="k") == "image_too_large"
    assert p.image(png((31, 32))).shape == (3, IMAGE_SIZE, IMAGE_SIZE)


def test_png_named_jpg_decodes_by_content(processor):
    data = png_named_jpg()
    record = members_to_record({"0.jpg": data, "json": json_bytes(conversation(1))}, "k")
    out = processor.process(record)
    expected = Image.open(io.BytesIO(data)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    assert torch.equal(out.pixel_values[0], _pixels(expected))


def _pixels(img: Image.Image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("make", [grayscale_png, palette_png, cmyk_jpeg], ids=["L", "P", "CMYK"])
def test_non_rgb_modes_become_exact_rgb(processor, make):
    data = make()
    out = processor.image(data)
    assert out.dtype == torch.uint8 and out.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert torch.equal(out, _pixels(Image.open(io.BytesIO(data))))  # 32x32 in: no resize, exact conversion
    if make is grayscale_png:
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_transparent_image_is_composited_on_white(processor):
    rgba = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 16, 32))  # left half opaque blue, right half fully transparent
    out = processor.image(encode(rgba, "PNG"))
    assert out[:, :, :16].eq(torch.tensor([0, 0, 255], dtype=torch.uint8)[:, None, None]).all()
    assert out[:, :, 16:].eq(255).all()
    assert processor.image(rgba_png()).shape == (3, IMAGE_SIZE, IMAGE_SIZE)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotation_is_applied(processor, orientation):
    rotated, upright = exif_rotated_png(orientation)
    assert torch.equal(processor.image(rotated), processor.image(upright))
    # and the test can fail: ignoring EXIF gives other pixels
    raw = Image.open(io.BytesIO(rotated)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    assert not torch.equal(processor.image(rotated), _pixels(raw))


def test_exif_rotation_is_recorded_upright_in_the_index(tmp_path, tiny_tokenizer):
    from nanovlm.data.prepare import write_dataset

    rotated, _ = exif_rotated_png(6, size=(32, 16))
    record = Record("rot", conversation(1)["messages"], [rotated])
    index = write_dataset([record], tmp_path / "ds", tiny_tokenizer, TOKENS_PER_IMAGE)
    assert index.shards[0].image_sizes == [[[16, 32]]]


# ----------------------------------------------------------------------------------------------------------
# dataset directory faults: refused at setup, by name


@pytest.fixture
def dataset(tmp_path, make_dataset):
    """A 3-shard dataset (8 samples per shard) in a fresh directory."""
    path = tmp_path / "ds"
    make_dataset(path, 24, samples_per_shard=8)
    return path


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


def test_index_offsets_pointing_at_another_sample_are_detected(dataset):
    """A stale index (same shard size, other sample order) must not silently feed the wrong sample."""
    index = load_index(dataset)
    shard = index.shards[0]
    path, read = str(index.shard_path(0)), ShardReader().read_members
    with pytest.raises(SampleError, match="s00001"):
        read(path, shard.offsets[1], shard.nbytes[1], shard.keys[0])
    with pytest.raises(SampleError, match="another key"):
        read(path, shard.offsets[0], shard.nbytes[0] + shard.nbytes[1], shard.keys[0])


def test_corrupt_header_is_detected_when_the_sample_is_read(dataset):
    """Same size, so setup passes; Python's tarfile would silently stop at the bad header: the reader must not."""
    index = load_index(dataset)
    shard = index.shards[1]
    path = index.shard_path(1)
    # member 0 of sample 3 in shard 1 (samples have 1..3 members: find the first member at its offset)
    from faults import member_spans

    member = [start for _, start, _ in member_spans(path)].index(shard.offsets[3])
    corrupt_header(path, member)
    load_index(dataset)  # size unchanged: not visible at setup
    read = ShardReader().read_members
    with pytest.raises(SampleError, match="corrupt_member"):
        read(str(path), shard.offsets[3], shard.nbytes[3], shard.keys[3])
    for i in (0, 1, 2, 4, 5, 6, 7):  # every other sample of the shard still reads
        assert read(str(path), shard.offsets[i], shard.nbytes[i], shard.keys[i])


# ----------------------------------------------------------------------------------------------------------
# the DataModule stream: skipped, counted per reason and epoch, logged; nothing else lost

N_SAMPLES = 24
MAX_TOKENS = 256


def fault_records(n: int = N_SAMPLES, long_key: str | None = "s00023"):
    """``n`` one-image samples ``s00000``..; ``long_key`` gets an answer longer than MAX_TOKENS."""
    for i in range(n):
        key = f"s{i:05d}"
        answer = "red " * 400 if key == long_key else f"answer {i} is a red square"
        # 48x48 noise-like gradient PNG: ~7 KB, so replacing it changes the member size
        yield Record(key, conversation(1, answer=answer)["messages"], [png((48, 48), seed=i)])


def make_fault_dataset(path, tokenizer, n: int = N_SAMPLES, long_key: str | None = "s00023"):
    from nanovlm.data.prepare import write_dataset

    return write_dataset(fault_records(n, long_key), path, tokenizer, image_token_count=16, samples_per_shard=8)


def data_module(path, tokenizer, **overrides):
    from nanovlm.config import load_config
    from nanovlm.data.datamodule import PackedMultimodalDataModule

    base = {
        "data.train": f"[{path}]",
        "data.val": "[]",
        "data.make_demo_if_missing": "false",
        "data.max_tokens": str(MAX_TOKENS),
        "data.num_workers": "0",
        "data.max_skip_rate": "1.0",
    }
    base.update({k: str(v) for k, v in overrides.items()})
    cfg = load_config(["tiny_cpu.yaml"], [f"{k}={v}" for k, v in base.items()])
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer=tokenizer)
    dm.setup("fit")
    return dm


def run_epochs(dm, epochs: int = 1) -> list[list[str]]:
    """Train-loop-like consumption of ``epochs`` data epochs; per epoch the delivered keys, in order."""
    out: list[list[str]] = [[] for _ in range(epochs)]
    for batch in dm.train_dataloader():
        epoch = batch["meta"]["epoch"]
        if epoch >= epochs:
            break
        out[epoch] += batch["sample_keys"]
        dm.on_batch_consumed(batch)
    return out


# key -> (member suffix to replace, new bytes, reason the sample must be skipped with)
def injected_faults() -> dict[str, tuple[str, bytes, str]]:
    bad = bad_json_variants()
    return {
        "s00001": ("0.png", not_an_image(), "unreadable_image"),
        "s00003": ("0.png", truncated_jpeg(), "unreadable_image"),
        "s00005": ("0.png", bomb_png(), "image_too_large"),
        "s00008": ("json", bad["unparseable"][0], "bad_json"),
        "s00010": ("json", bad["missing_messages"][0], "missing_messages"),
        "s00012": ("json", bad["content_not_str"][0], "missing_messages"),
        "s00014": ("json", bad["no_assistant_turn"][0], "no_assistant_turn"),
        "s00017": ("json", bad["placeholder_mismatch"][0], "image_count_mismatch"),
        "s00019": ("json", bad["invalid_utf8"][0], "bad_utf8"),
    }


# good samples whose images are unusual but valid: they must be delivered
UNUSUAL_BUT_VALID = {
    "s00002": png_named_jpg(),
    "s00004": grayscale_png(),
    "s00006": cmyk_jpeg(),
    "s00009": palette_png(),
}
CORRUPT_HEADER_KEY = "s00020"


@pytest.fixture
def faulty(tmp_path, tiny_tokenizer):
    """(clean dataset dir, faulty copy, {bad key: reason}): same index plan, faults visible only when read."""
    from faults import rewrite_shard

    clean, bad = tmp_path / "clean", tmp_path / "bad"
    make_fault_dataset(clean, tiny_tokenizer)
    make_fault_dataset(bad, tiny_tokenizer)
    faults_by_key = injected_faults()

    def edit(key, suffix, data):
        if key in faults_by_key and faults_by_key[key][0] == suffix:
            return faults_by_key[key][1]
        if key in UNUSUAL_BUT_VALID and suffix == "0.png":
            return UNUSUAL_BUT_VALID[key]
        return data

    for shard in range(3):
        rewrite_shard(bad, shard, edit)
    index = load_index(bad)
    shard = index.shards[2]
    i = shard.keys.index(CORRUPT_HEADER_KEY)
    from faults import member_spans

    starts = [start for _, start, _ in member_spans(index.shard_path(2))]
    corrupt_header(index.shard_path(2), starts.index(shard.offsets[i]))
    expected = {k: v[2] for k, v in faults_by_key.items()}
    expected[CORRUPT_HEADER_KEY] = "corrupt_member"
    return clean, bad, expected


def test_every_bad_sample_is_skipped_and_counted_by_reason_and_nothing_else_is_lost(faulty, tiny_tokenizer, caplog):
    from collections import Counter

    clean, bad, expected = faulty
    clean_keys = run_epochs(data_module(clean, tiny_tokenizer))[0]
    assert "s00023" not in clean_keys  # over-length: a planned skip in both runs
    assert sorted(clean_keys) == [f"s{i:05d}" for i in range(N_SAMPLES - 1)]

    dm = data_module(bad, tiny_tokenizer)
    with caplog.at_level("WARNING"):
        keys = run_epochs(dm)[0]
    # exactly the clean stream minus the bad samples, in the same order: no loss, no duplicate, no reorder
    assert keys == [k for k in clean_keys if k not in expected]
    for k in UNUSUAL_BUT_VALID:
        assert k in keys
    want = Counter(expected.values())
    tel = dm.telemetry()
    want["overlength"] += 1  # s00023: planned by the packer from the index, counted the same way
    assert tel["skips_by_reason"] == dict(want)
    assert tel["last_epoch_skips"] == dict(want)  # per epoch
    assert tel["samples"] == len(keys)
    logged = caplog.text
    for key, reason in expected.items():  # each skip is logged with its key, shard and reason
        assert re.search(rf"skipped sample {key} \(\S+/bad/shard-\d{{6}}\.tar\) \({reason}\)", logged), key


def test_planned_overlength_skip_is_counted_once(tmp_path, tiny_tokenizer):
    """One over-length sample in the index -> exactly one 'overlength' skip per epoch (planned by the packer)."""
    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer)
    dm = data_module(path, tiny_tokenizer)
    keys = run_epochs(dm)[0]
    assert len(keys) == N_SAMPLES - 1
    tel = dm.telemetry()
    assert tel["skips_by_reason"] == {"overlength": 1}
    assert tel["last_epoch_skips"] == {"overlength": 1}


def test_skips_are_counted_again_in_every_epoch(faulty, tiny_tokenizer):
    from collections import Counter

    _, bad, expected = faulty
    dm = data_module(bad, tiny_tokenizer)
    per_epoch = []
    for batch in dm.train_dataloader():
        if batch["meta"]["epoch"] >= 2:
            break
        dm.on_batch_consumed(batch)
        if dm.telemetry()["epoch"] == len(per_epoch) + 1:  # an epoch just ended
            per_epoch.append(dm.telemetry()["last_epoch_skips"])
    want = Counter(expected.values())
    want["overlength"] += 1
    assert per_epoch == [dict(want), dict(want)]


def test_corrupt_header_inside_a_sample_is_a_counted_skip_not_a_partial_sample(tmp_path, tiny_tokenizer):
    """A bad header on a sample's *last* member: Python's tarfile stops there without an error, so a reader that
    trusts it would see the sample without its json (a wrong reason) or without one image. The recorded byte
    range says more data is there: the sample is skipped as corrupt_member."""
    from faults import member_spans

    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer, long_key=None)
    shard = path / "shard-000001.tar"
    names = [name for name, _, _ in member_spans(shard)]
    corrupt_header(shard, names.index("s00012.json"))
    dm = data_module(path, tiny_tokenizer)
    keys = run_epochs(dm)[0]
    assert sorted(keys) == [f"s{i:05d}" for i in range(N_SAMPLES) if i != 12]
    assert dm.telemetry()["skips_by_reason"] == {"corrupt_member": 1}


def test_each_epoch_ends_with_a_logged_skip_summary(faulty, tiny_tokenizer, caplog):
    """Per-sample warnings scroll by; the end of each data epoch logs its skips by reason in one line."""
    from collections import Counter

    _, bad, expected = faulty
    want = Counter(expected.values())
    want["overlength"] += 1
    with caplog.at_level("INFO"):
        run_epochs(data_module(bad, tiny_tokenizer), epochs=2)
    for epoch in (0, 1):
        line = next(
            (r.getMessage() for r in caplog.records if re.search(rf"epoch {epoch}\b.*skipped", r.getMessage())), ""
        )
        assert line, f"no skip summary for epoch {epoch}"
        for reason, n in want.items():
            assert f"{reason}={n}" in line, line


def test_skip_rate_above_threshold_is_an_error_naming_the_dataset_and_reasons(faulty, tiny_tokenizer):
    from nanovlm.data.datamodule import SkipRateError

    _, bad, _ = faulty
    dm = data_module(bad, tiny_tokenizer, **{"data.max_skip_rate": 0.1})  # 11 of 24 skipped
    with pytest.raises(SkipRateError) as exc:
        run_epochs(dm)
    msg = str(exc.value)
    assert str(bad) in msg and "data.max_skip_rate=0.1" in msg
    assert "unreadable_image" in msg or "missing_messages" in msg


def test_skip_rate_below_threshold_trains_on(tmp_path, tiny_tokenizer):
    """2 bad samples of 24 (8%) under max_skip_rate=0.1: counted, no error; a third one (12.5%) fails."""
    from faults import rewrite_shard

    from nanovlm.data.datamodule import SkipRateError

    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer, long_key=None)
    broken = {"s00001"}
    rewrite_shard(path, 0, lambda k, s, d: not_an_image() if k in broken and s == "0.png" else d)
    broken.add("s00010")
    rewrite_shard(path, 1, lambda k, s, d: not_an_image() if k in broken and s == "0.png" else d)
    dm = data_module(path, tiny_tokenizer, **{"data.max_skip_rate": 0.1})
    keys = run_epochs(dm)[0]
    assert len(keys) == 22 and not broken & set(keys)
    assert dm.telemetry()["skips_by_reason"] == {"unreadable_image": 2}
    assert len(run_epochs(data_module(path, tiny_tokenizer, **{"data.max_skip_rate": 2 / 24}))[0]) == 22  # at the limit
    broken.add("s00020")
    rewrite_shard(path, 2, lambda k, s, d: not_an_image() if k in broken and s == "0.png" else d)
    with pytest.raises(SkipRateError):
        run_epochs(data_module(path, tiny_tokenizer, **{"data.max_skip_rate": 0.1}))


def test_index_pointing_at_the_wrong_samples_is_skipped_not_misread(tmp_path, tiny_tokenizer):
    """Two samples' byte ranges swapped in index.json: each range holds the other key, so neither is fed
    under the wrong key (its token count and loss mask would be wrong); both are counted corrupt_member."""
    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer, long_key=None)
    index = read_index(path)
    sh = index["shards"][1]
    for f in ("offsets", "nbytes"):
        sh[f][2], sh[f][5] = sh[f][5], sh[f][2]
    write_index(path, index)
    dm = data_module(path, tiny_tokenizer)
    keys = run_epochs(dm)[0]
    assert sorted(keys) == sorted({f"s{i:05d}" for i in range(N_SAMPLES)} - {sh["keys"][2], sh["keys"][5]})
    assert dm.telemetry()["skips_by_reason"] == {"corrupt_member": 2}


@pytest.mark.parametrize("fault", ["missing", "zero_byte", "truncated", "empty_tar"])
def test_unusable_shard_fails_setup_naming_the_file(tmp_path, tiny_tokenizer, fault):
    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer)
    shard = path / "shard-000001.tar"
    if fault == "missing":
        shard.unlink()
    elif fault == "zero_byte":
        shard.write_bytes(b"")
    elif fault == "truncated":
        truncate_mid_member(shard, 5)
    else:
        shard.write_bytes(empty_tar())
    with pytest.raises(DatasetIndexError, match="shard-000001.tar"):
        data_module(path, tiny_tokenizer)


def test_index_made_with_another_tokenizer_fails_setup(tmp_path, tiny_tokenizer):
    from nanovlm.data.datamodule import DataMismatchError

    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer)
    index = read_index(path)
    index["tokenizer"] = "0123456789abcdef"
    write_index(path, index)
    with pytest.raises(DataMismatchError, match="tokenizer"):
        data_module(path, tiny_tokenizer)


def test_wrong_token_count_in_index_is_an_error_naming_the_sample(tmp_path, tiny_tokenizer):
    """An index whose token count disagrees with the sample (not a bad sample: a bad index) stops the stream
    with the sample key and shard, instead of training on a plan that is no longer true."""
    from nanovlm.data.producer import ProducerError

    path = tmp_path / "ds"
    make_fault_dataset(path, tiny_tokenizer, long_key=None)
    index = read_index(path)
    index["shards"][0]["text_tokens"][3] -= 2
    write_index(path, index)
    with pytest.raises(ProducerError) as exc:
        run_epochs(data_module(path, tiny_tokenizer))
    assert "s00003" in str(exc.value) and "shard-000000.tar" in str(exc.value)


# ----------------------------------------------------------------------------------------------------------
# prepare_data: every bad input line or shard is listed in rejected.jsonl with its reason


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
    assert index.shards[0].image_sizes[4] == [[16, 32]]  # EXIF rotation recorded upright


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
        {s["name"]: s["keys"] for s in read_index(directory)["shards"]} if (directory / "index.json").exists() else {}
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
