"""PackedMultimodalDataModule on real (small, synthetic) shards: batch contract, partition over ranks and
workers, skips, error surfacing, shutdown, validation, telemetry.

Faults in the stream: bad samples are skipped and counted per reason (and per epoch) in ``telemetry()``, each skip
is logged with its key, shard and reason, every good sample is still delivered in the same order (no loss, no
duplicate), and ``data.max_skip_rate`` turns a mostly-broken dataset into an error naming it; a dataset that cannot
be used (a broken shard, another tokenizer's index) fails setup by name; an index whose token count is no longer
true stops the stream naming the sample.

Security: shard members are never unpickled, in the main process or a DataLoader worker (the payloads are checked
live in unit/test_format.py).
"""

from __future__ import annotations

import gc
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data import IMAGE_TOKENS, all_keys, carried_keys, make_cfg, make_dm, take
from helpers.faults import (
    HOSTILE_SUFFIXES,
    bad_json_variants,
    bomb_png,
    cmyk_jpeg,
    conversation,
    corrupt_header,
    empty_tar,
    grayscale_png,
    not_an_image,
    palette_png,
    pickle_payload,
    png,
    png_named_jpg,
    read_index,
    rewrite_shard,
    truncate_mid_member,
    truncated_jpeg,
    write_index,
)

from nanovlm.data.datamodule import DataMismatchError, SkipRateError
from nanovlm.data.format import Record
from nanovlm.data.index import DatasetIndexError, load_index
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.producer import ProducerError
from nanovlm.data.reader import ShardReader


@pytest.fixture(scope="module")
def data(tmp_path_factory, make_dataset):
    """Two training directories with uneven shards (16/16/16/16/6 and 7/7/7/4) and a validation one."""
    root = tmp_path_factory.mktemp("dm")
    make_dataset(root / "a", 70, samples_per_shard=16, seed=0, image_token_count=IMAGE_TOKENS)
    make_dataset(root / "b", 25, samples_per_shard=7, seed=1, image_token_count=IMAGE_TOKENS, key_prefix="b")
    make_dataset(root / "val", 30, samples_per_shard=8, seed=2, image_token_count=IMAGE_TOKENS, key_prefix="v")
    return root


@pytest.mark.parametrize("overlength,max_tokens", [("drop", 256), ("truncate", 96)])
def test_packed_batches_match_per_sample_processing(data, tiny_tokenizer, overlength, max_tokens):
    cfg = make_cfg([data / "a"], overlength=overlength, max_tokens=max_tokens)
    dm = make_dm(cfg, tiny_tokenizer)
    proc = SampleProcessor(tiny_tokenizer, 32, IMAGE_TOKENS)
    idx = load_index(data / "a")
    shards = [idx.shard(s) for s in range(len(idx.shards))]
    where = {k: (s, i) for s, sh in enumerate(shards) for i, k in enumerate(sh.keys)}
    n_checked = 0
    for batch in take(dm, 4):
        t = max_tokens
        assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, t)
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["pixel_values"].dtype == torch.uint8
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == t and batch["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        pixels = []
        for j, key in enumerate(batch["sample_keys"]):
            s, i = where[key]
            sh = shards[s]
            rec = ShardReader().read(str(idx.shard_path(s)), sh.offsets[i], sh.nbytes[i], key)
            ref = proc.process(rec, max_tokens, overlength)
            a, b = cu[j], cu[j + 1]
            assert torch.equal(batch["input_ids"][0, a:b], ref.input_ids)
            assert batch["labels"][0, a] == -100 and torch.equal(batch["labels"][0, a + 1 : b], ref.labels[1:])
            assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
            pixels.append(ref.pixel_values)
            n_checked += 1
        real = cu[len(batch["sample_keys"])]
        assert batch["meta"]["real_tokens"] == real
        assert (batch["labels"][0, real:] == -100).all()
        assert (batch["input_ids"][0, real:] == tiny_tokenizer.pad_token_id).all()
        assert torch.equal(batch["pixel_values"], torch.cat(pixels))
    assert n_checked >= 4


def _leaves(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


@pytest.mark.parametrize("world_size,workers", [(1, 2), (2, 1), (3, 2)])
def test_each_sample_once_per_epoch_across_ranks_and_workers(data, tiny_tokenizer, world_size, workers):
    cfg = make_cfg([data / "a", data / "b"], num_workers=workers)
    seen, steps, carry = [], set(), []
    for rank in range(world_size):
        dm = make_dm(cfg, tiny_tokenizer, rank, world_size)
        n = dm.current_split().batches_per_rank()
        batches = take(dm, n)
        assert [b["meta"]["index"] for b in batches] == list(range(n)) and {b["meta"]["epoch"] for b in batches} == {0}
        assert dm.telemetry()["epoch"] == 1  # the rank finished its epoch after exactly n batches
        steps.add(n)
        assert not any(isinstance(x, (np.ndarray, np.generic)) for x in _leaves(batches))  # loader._as_is: as is
        seen += [k for b in batches for k in b["sample_keys"]]
        carry += carried_keys(dm)  # what each slot left at the epoch end, opening its chunk of epoch 1
    assert len(steps) == 1  # every rank takes the same number of steps
    assert len(seen) == len(set(seen))  # disjoint
    assert sorted(seen + carry) == all_keys(data / "a", data / "b")  # complete (carry opens the next epoch)


def test_tokenizer_mismatch_is_refused(data, tmp_path):
    from nanovlm.data.tokenizer import build_tokenizer

    other = build_tokenizer(tmp_path / "tok", ["completely different words here"] * 50, vocab_size=300)
    with pytest.raises(DataMismatchError, match="prepare_data"):
        make_dm(make_cfg([data / "a"]), other)


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("workers", [0, 1])
def test_index_length_mismatch_surfaces_with_the_key(data, tiny_tokenizer, tmp_path, workers):
    d = copy_dataset(data / "a", tmp_path / "a")
    raw = read_index(d)
    raw["shards"][0]["text_tokens"] = [n + 1 for n in raw["shards"][0]["text_tokens"]]
    write_index(d, raw)
    dm = make_dm(make_cfg([d], num_workers=workers, shuffle_buffer=0), tiny_tokenizer)
    with pytest.raises(ProducerError) as err:
        take(dm, dm.current_split().batches_per_rank())
    msg = str(err.value)
    assert "s000" in msg and "prepare_data" in msg and "DataMismatchError" in msg


def corrupt(d: Path, which: list[int]) -> list[str]:
    """Overwrite the tar header of the last member of the given samples of shard 0 (sizes unchanged)."""
    idx = load_index(d)
    sh = idx.shard(0)
    blob = bytearray(idx.shard_path(0).read_bytes())
    for i in which:
        pos, end, headers = sh.offsets[i], sh.offsets[i] + sh.nbytes[i], []
        while pos < end:
            headers.append(pos)
            size = int(bytes(blob[pos + 124 : pos + 136]).strip(b"\0 ") or b"0", 8)
            pos += 512 + -(-size // 512) * 512
        blob[headers[-1] : headers[-1] + 100] = b"\xff" * 100
    idx.shard_path(0).write_bytes(bytes(blob))
    return [sh.keys[i] for i in which]


def test_corrupt_members_are_skipped_and_counted(data, tiny_tokenizer, tmp_path):
    d = copy_dataset(data / "a", tmp_path / "a")
    bad = corrupt(d, [0, 1, 5])  # 0, 1 and 2 images: the damaged header is the first, second and third
    dm = make_dm(make_cfg([d]), tiny_tokenizer)
    n = dm.current_split().batches_per_rank()
    batches = take(dm, n)
    seen = [k for b in batches for k in b["sample_keys"]]
    assert not set(bad) & set(seen)
    skipped = sorted(k for b in batches for k, reason, _ in b["meta"]["skips"] if reason == "corrupt_member")
    assert skipped == sorted(bad)
    tel = dm.telemetry()
    assert tel["skips_by_reason"] == {"corrupt_member": 3} and tel["last_epoch_skips"] == {"corrupt_member": 3}
    assert len(seen) + 3 + len(carried_keys(dm)) == 70


def test_skip_rate_limit_names_dataset_and_reason(data, tiny_tokenizer, tmp_path):
    d = copy_dataset(data / "a", tmp_path / "a")
    corrupt(d, list(range(10)))
    dm = make_dm(make_cfg([d], max_skip_rate=0.1), tiny_tokenizer)
    with pytest.raises(SkipRateError, match=r"corrupt_member x\d+") as err:
        take(dm, dm.current_split().batches_per_rank())
    assert str(d) in str(err.value)


def producer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pack-producer")]


def test_breaking_out_of_the_loop_leaves_no_thread(data, tiny_tokenizer):
    gc.collect()
    before = set(producer_threads())
    dm = make_dm(make_cfg([data / "a"]), tiny_tokenizer)
    it = iter(dm.train_dataloader())
    next(it)
    assert set(producer_threads()) - before
    del it  # breaking out of a for loop drops the iterator the same way
    time.sleep(0.1)
    assert not set(producer_threads()) - before

    def fail_in_step():
        for i, _batch in enumerate(dm.train_dataloader()):
            if i == 2:
                raise ValueError("loss is nan")

    with pytest.raises(ValueError, match="nan") as err:
        fail_in_step()
    del err  # the traceback holds the loop's frame (and so the iterator) until it is dropped
    gc.collect()
    time.sleep(0.1)
    assert not set(producer_threads()) - before


def test_validation_is_finite_deterministic_and_unshuffled(data, tiny_tokenizer):
    dm = make_dm(make_cfg([data / "a"], [data / "val"], num_workers=2), tiny_tokenizer)
    first = [b["sample_keys"] for b in dm.val_dataloader()]
    second = [b["sample_keys"] for b in dm.val_dataloader()]
    assert first == second and len(first) >= 2
    keys = [k for ks in first for k in ks]
    assert sorted(keys) == all_keys(data / "val")  # every validation sample exactly once
    assert dm.telemetry()["packs"] == 0  # validation never moves the training position


@pytest.mark.parametrize("world_size,workers", [(1, 2), (2, 0), (2, 2), (3, 1)])
def test_validation_covers_every_sample_once_whatever_the_topology(data, tiny_tokenizer, world_size, workers):
    """Slots of unequal length are topped up with empty packs, not cut: val/loss does not depend on the topology,
    and every rank runs the same number of validation steps (collectives under FSDP stay in step)."""
    cfg = make_cfg([data / "a"], [data / "val"], num_workers=workers, max_tokens=160)
    per_rank = [list(make_dm(cfg, tiny_tokenizer, r, world_size).val_dataloader()) for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    keys = [k for batches in per_rank for b in batches for k in b["sample_keys"]]
    assert sorted(keys) == all_keys(data / "val")
    empty = [b for batches in per_rank for b in batches if not b["sample_keys"]]
    assert all(b["meta"]["loss_tokens"] == 0 and b["pixel_values"].shape[0] == 0 for b in empty)


@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2), (3, 1)])
def test_val_samples_is_one_subset_whatever_the_topology(data, tiny_tokenizer, world_size, workers):
    """data.val_samples: the first N samples of the validation set, each once, on any number of ranks/workers
    (a per-rank cap on packs, trainer.val_batches, validates a topology-dependent subset)."""
    cfg = make_cfg([data / "a"], [data / "val"], num_workers=workers, max_tokens=160, val_samples=7)
    dms = [make_dm(cfg, tiny_tokenizer, r, world_size) for r in range(world_size)]
    keys = [k for dm in dms for b in dm.val_dataloader() for k in b["sample_keys"]]
    first = list(dms[0].val_table.keys)
    assert len(first) == 7 and sorted(keys) == sorted(first)
    assert first == load_index(data / "val").key_list(0, 7)  # stored order


def test_validation_set_smaller_than_the_slots(tmp_path, make_dataset, data, tiny_tokenizer):
    make_dataset(tmp_path / "val1", 1, seed=4, image_token_count=IMAGE_TOKENS, key_prefix="v")
    cfg = make_cfg([data / "a"], [tmp_path / "val1"], num_workers=2)
    per_rank = [list(make_dm(cfg, tiny_tokenizer, r, 2).val_dataloader()) for r in range(2)]
    assert [len(b) for b in per_rank] == [2, 2]  # 4 slots, one sample: one real pack, three empty ones
    assert sorted(k for batches in per_rank for b in batches for k in b["sample_keys"]) == all_keys(tmp_path / "val1")


def test_padded_baseline_batches(data, tiny_tokenizer):
    dm = make_dm(make_cfg([data / "a"], packing="pad_to_longest", batch_size=4), tiny_tokenizer)
    for b in take(dm, 3):
        n = len(b["sample_keys"])
        assert n == 4 and b["input_ids"].shape == b["attention_mask"].shape == (4, b["attention_mask"].sum(1).max())
        assert (b["labels"][:, 0] == -100).all()


def test_summary_and_telemetry(data, tiny_tokenizer):
    dm = make_dm(make_cfg([data / "a", data / "b"], train_weights=[1.0, 2.0]), tiny_tokenizer)
    s = dm.summary()
    assert [x["samples"] for x in s["datasets"]] == [70, 25] and s["samples_per_epoch"] == 70 + 50
    assert s["queue_memory_mb"] > 0 and 0.5 < s["planned_fill"] <= 1.0
    batches = take(dm, 5)
    tel = dm.telemetry()
    assert tel["packs"] == 5 and tel["samples"] == sum(len(b["sample_keys"]) for b in batches)
    assert tel["real_tokens"] == sum(b["meta"]["real_tokens"] for b in batches) and tel["slots"] == 5 * 256
    assert tel["images"] == sum(b["pixel_values"].shape[0] for b in batches) and tel["data_wait_s"] > 0
    assert dm.telemetry()["packs"] == 0  # counters reset on read


@pytest.mark.parametrize("workers", [0, 2])
def test_planned_overlength_skips_are_counted_once_per_epoch(data, tiny_tokenizer, workers):
    cfg = make_cfg([data / "a"], max_tokens=96, num_workers=workers)
    dm = make_dm(cfg, tiny_tokenizer)
    over = int((dm.table.length > 96).sum())
    assert over > 0
    # the plan's token count leaves the skipped samples out (it counted them clipped to max_tokens)
    assert dm.summary()["tokens_per_epoch"] == int(dm.table.length[dm.table.length <= 96].sum())
    seen = [k for b in take(dm, dm.current_split().batches_per_rank()) for k in b["sample_keys"]]
    tel = dm.telemetry()
    assert tel["skips_by_reason"] == {"overlength": over} and tel["last_epoch_skips"] == {"overlength": over}
    assert len(seen) + over + len(carried_keys(dm)) == 70


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory, tiny_tokenizer):
    """24 samples; every 6th has a user prompt longer than 96 tokens and a short answer."""
    from helpers.synthetic import synthetic_records

    from nanovlm.data.format import Record
    from nanovlm.data.prepare import write_dataset

    records = []
    for i, rec in enumerate(synthetic_records(24, seed=3)):
        if i % 6 == 5:
            rec = Record(rec.key, [{"role": "user", "content": "look " * 120}, rec.messages[1]], [], rec.extra)
        records.append(rec)
    path = tmp_path_factory.mktemp("prompts") / "d"
    write_dataset(records, path, tiny_tokenizer, IMAGE_TOKENS, samples_per_shard=8)
    return path, records


def test_index_records_the_prompt_before_the_first_loss_token(long_prompts, tiny_tokenizer):
    path, records = long_prompts
    proc = SampleProcessor(tiny_tokenizer, 32, IMAGE_TOKENS)
    prompts = load_index(path).prompt_lengths(IMAGE_TOKENS).tolist()
    for rec, prompt in zip(records, prompts, strict=True):
        labels = proc.process(rec).labels.tolist()
        assert prompt == next(i for i, label in enumerate(labels) if label != -100)  # image tokens expanded


@pytest.mark.parametrize("mode", ["packed", "constrained"])
def test_truncation_that_would_leave_no_answer_is_a_planned_skip(long_prompts, tiny_tokenizer, mode):
    """A sample whose prompt alone fills max_tokens is skipped when the epoch is planned, like drop would:
    planned as a truncated full pack instead, it was dropped at read time and left an empty batch (a
    zero-gradient optimizer step)."""
    path, records = long_prompts
    cfg = make_cfg([path], max_tokens=96, overlength="truncate", mode=mode, batch_size=2, max_skip_rate=0.5)
    dm = make_dm(cfg, tiny_tokenizer)
    no_answer = {r.key for i, r in enumerate(records) if i % 6 == 5}
    plan = dm.current_plan()
    assert {dm.table.keys[g] for g in plan.order[plan.skipped["overlength"]]} == no_answer
    batches = take(dm, dm.current_split().batches_per_rank())
    assert all(b["meta"]["real_tokens"] > 0 and (b["labels"] != -100).any() for b in batches)
    seen = [k for b in batches for k in b["sample_keys"]]
    assert not no_answer & set(seen)
    assert dm.telemetry()["skips_by_reason"] == {"overlength": len(no_answer)}
    assert len(seen) + len(no_answer) + len(carried_keys(dm)) == len(records)


def test_the_datamodule_is_importable_from_the_data_package():
    import nanovlm.data
    from nanovlm.data import PackedMultimodalDataModule
    from nanovlm.data.datamodule import PackedMultimodalDataModule as home

    assert PackedMultimodalDataModule is home
    with pytest.raises(AttributeError, match="no_such"):
        nanovlm.data.no_such  # noqa: B018


# ----------------------------------------------------------------------------------------------------------
# faults in the stream: skipped, counted per reason and epoch, logged; nothing else lost


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
    from helpers.faults import rewrite_shard

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
    shard = index.shard(2)
    i = shard.keys.index(CORRUPT_HEADER_KEY)
    from helpers.faults import member_spans

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
    from helpers.faults import member_spans

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
    from helpers.faults import rewrite_shard

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
    """Two samples' byte ranges swapped in the index: each range holds the other key, so neither is fed
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


def test_index_counted_in_another_chat_format_fails_setup(tmp_path, tiny_tokenizer):
    """Data prepared for ChatML, trained with data.chat_format=smolvlm: its lengths count other turn framing."""
    import copy

    from nanovlm.data.datamodule import DataMismatchError

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_utterance>"]}, replace_extra_special_tokens=False)
    path = tmp_path / "ds"
    make_fault_dataset(path, tok)
    with pytest.raises(DataMismatchError, match="data.chat_format=smolvlm.*--config"):
        data_module(path, tok, **{"data.chat_format": "smolvlm"})
    assert data_module(path, tok).table is not None


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
# security: shard members are never unpickled


def _dataset_with_hostile_members(path: Path, tokenizer, marker: Path) -> list[str]:
    """A written dataset whose every sample also carries pickle / torch members; returns the keys."""
    from nanovlm.data.format import Record
    from nanovlm.data.prepare import write_dataset

    records = [Record(f"s{i:03d}", conversation(1, answer=f"answer {i}")["messages"], [png(seed=i)]) for i in range(12)]
    write_dataset(records, path, tokenizer, image_token_count=16, samples_per_shard=6)
    evil = [(f"{r.key}.{suffix}", pickle_payload(marker)) for r in records for suffix in HOSTILE_SUFFIXES]
    for shard in range(2):
        keys = {r.key for r in records[shard * 6 : shard * 6 + 6]}
        rewrite_shard(path, shard, lambda k, s, d: d, extra=[(n, d) for n, d in evil if n.split(".")[0] in keys])
    return [r.key for r in records]


def test_datamodule_never_unpickles_shard_members(tmp_path, tiny_tokenizer):
    marker = tmp_path / "pwned"
    keys = _dataset_with_hostile_members(tmp_path / "ds", tiny_tokenizer, marker)
    dm = data_module(tmp_path / "ds", tiny_tokenizer)
    delivered = run_epochs(dm)[0]
    assert sorted(delivered) == keys  # the hostile members are ignored, the samples train
    assert dm.telemetry()["skips_by_reason"] == {}
    assert not marker.exists()


def test_datamodule_worker_processes_never_unpickle_shard_members(tmp_path, tiny_tokenizer):
    """Same with a DataLoader worker process (the decode path of real runs)."""
    marker = tmp_path / "pwned"
    keys = _dataset_with_hostile_members(tmp_path / "ds", tiny_tokenizer, marker)
    delivered = run_epochs(data_module(tmp_path / "ds", tiny_tokenizer, **{"data.num_workers": 1}))[0]
    assert sorted(delivered) == keys
    assert not marker.exists()
