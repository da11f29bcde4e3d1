"""PackedMultimodalDataModule on real (small, synthetic) shards: batch contract, partition over ranks and
workers, skips, error surfacing, shutdown, validation, telemetry."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from nanovlm.config import load_config
from nanovlm.data.datamodule import DataMismatchError, PackedMultimodalDataModule, SkipRateError
from nanovlm.data.index import load_index
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.producer import ProducerError
from nanovlm.data.reader import ShardReader

IMAGE_TOKENS = 16  # 32 px images, 4 px patches, pixel shuffle 2: the sample sizes these tests are built around


def make_cfg(train, val=(), **data):
    cfg = load_config(["tiny_cpu.yaml"], ["model.projector.pixel_shuffle_factor=2"])
    cfg.data.train = [str(d) for d in train]
    cfg.data.val = [str(d) for d in val]
    cfg.data.max_tokens = 256
    cfg.data.max_images = 8
    cfg.data.lookahead = 16
    cfg.data.max_carry = 4
    cfg.data.shuffle_buffer = 8
    cfg.data.queue_size = 2
    cfg.data.num_workers = 0
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def make_dm(cfg, tokenizer, rank=0, world_size=1):
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer, rank=rank, world_size=world_size)
    dm.setup("fit")
    return dm


def take(dm, n, consume=True):
    """The next n batches of a fresh train loader (advancing the position like a training loop)."""
    out = []
    it = iter(dm.train_dataloader())
    try:
        for batch in it:
            if consume:
                dm.on_batch_consumed(batch)
            out.append(batch)
            if len(out) == n:
                break
    finally:
        del it  # shut the loader down now, even when an exception keeps this frame alive in a traceback
    return out


def all_keys(*dirs):
    return sorted(k for d in dirs for sh in load_index(d).shards for k in sh.keys)


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
    where = {k: (sh, i) for sh in idx.shards for i, k in enumerate(sh.keys)}
    n_checked = 0
    for batch in take(dm, 4):
        t = max_tokens
        assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, t)
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["pixel_values"].dtype == torch.uint8
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == t and batch["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        pixels = []
        for j, key in enumerate(batch["sample_keys"]):
            sh, i = where[key]
            rec = ShardReader().read(str(idx.shard_path(sh)), sh.offsets[i], sh.nbytes[i], key)
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


@pytest.mark.parametrize("world_size,workers", [(1, 2), (2, 1), (3, 2)])
def test_each_sample_once_per_epoch_across_ranks_and_workers(data, tiny_tokenizer, world_size, workers):
    cfg = make_cfg([data / "a", data / "b"], num_workers=workers)
    seen, steps = [], set()
    for rank in range(world_size):
        dm = make_dm(cfg, tiny_tokenizer, rank, world_size)
        n = dm.current_plan().batches_per_rank()
        batches = take(dm, n)
        assert [b["meta"]["index"] for b in batches] == list(range(n)) and {b["meta"]["epoch"] for b in batches} == {0}
        assert dm.telemetry()["epoch"] == 1  # the rank finished its epoch after exactly n batches
        steps.add(n)
        seen += [k for b in batches for k in b["sample_keys"]]
        carry = [dm.table.keys[g] for g in dm.position.carry_in]  # cut at the epoch end, opening epoch 1
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
    raw = json.loads((d / "index.json").read_text())
    raw["shards"][0]["text_tokens"] = [n + 1 for n in raw["shards"][0]["text_tokens"]]
    (d / "index.json").write_text(json.dumps(raw))
    dm = make_dm(make_cfg([d], num_workers=workers, shuffle_buffer=0), tiny_tokenizer)
    with pytest.raises(ProducerError) as err:
        take(dm, dm.current_plan().batches_per_rank())
    msg = str(err.value)
    assert "s000" in msg and "prepare_data" in msg and "DataMismatchError" in msg


def corrupt(d: Path, which: list[int]) -> list[str]:
    """Overwrite the tar header of the last member of the given samples of shard 0 (sizes unchanged)."""
    idx = load_index(d)
    sh = idx.shards[0]
    blob = bytearray(idx.shard_path(sh).read_bytes())
    for i in which:
        pos, end, headers = sh.offsets[i], sh.offsets[i] + sh.nbytes[i], []
        while pos < end:
            headers.append(pos)
            size = int(bytes(blob[pos + 124 : pos + 136]).strip(b"\0 ") or b"0", 8)
            pos += 512 + -(-size // 512) * 512
        blob[headers[-1] : headers[-1] + 100] = b"\xff" * 100
    idx.shard_path(sh).write_bytes(bytes(blob))
    return [sh.keys[i] for i in which]


def test_corrupt_members_are_skipped_and_counted(data, tiny_tokenizer, tmp_path):
    d = copy_dataset(data / "a", tmp_path / "a")
    bad = corrupt(d, [0, 1, 5])  # 0, 1 and 2 images: the damaged header is the first, second and third
    dm = make_dm(make_cfg([d]), tiny_tokenizer)
    n = dm.current_plan().batches_per_rank()
    batches = take(dm, n)
    seen = [k for b in batches for k in b["sample_keys"]]
    assert not set(bad) & set(seen)
    skipped = sorted(k for b in batches for k, reason, _ in b["meta"]["skips"] if reason == "corrupt_member")
    assert skipped == sorted(bad)
    tel = dm.telemetry()
    assert tel["skips_by_reason"] == {"corrupt_member": 3} and tel["last_epoch_skips"] == {"corrupt_member": 3}
    assert len(seen) + 3 + len(dm.position.carry_in) == 70


def test_skip_rate_limit_names_dataset_and_reason(data, tiny_tokenizer, tmp_path):
    d = copy_dataset(data / "a", tmp_path / "a")
    corrupt(d, list(range(10)))
    dm = make_dm(make_cfg([d], max_skip_rate=0.1), tiny_tokenizer)
    with pytest.raises(SkipRateError, match=r"corrupt_member x\d+") as err:
        take(dm, dm.current_plan().batches_per_rank())
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
    first = dms[0].val_table.keys
    assert len(first) == 7 and sorted(keys) == sorted(first)
    assert first == [k for sh in load_index(data / "val").shards for k in sh.keys][:7]  # stored order


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
    seen = [k for b in take(dm, dm.current_plan().batches_per_rank()) for k in b["sample_keys"]]
    tel = dm.telemetry()
    assert tel["skips_by_reason"] == {"overlength": over} and tel["last_epoch_skips"] == {"overlength": over}
    assert len(seen) + over + len(dm.position.carry_in) == 70


class _Tokens:
    """A stand-in processed sample of n tokens with raw labels (no -100 of its own)."""

    def __init__(self, n):
        self.key, self.input_ids, self.labels = "s", torch.arange(n), torch.arange(n)
        self.pixel_values = torch.zeros(0, 3, 4, 4, dtype=torch.uint8)


def test_collate_max_seqlen_counts_the_padding_tail_and_each_first_label_is_ignored():
    """The varlen kernels need max_seqlen >= every segment, the padding tail included (on CPU/SDPA too short a
    value changes nothing, so only this catches it); no prediction crosses into the next sample."""
    from nanovlm.data.collate import collate_packed

    b = collate_packed([_Tokens(3), _Tokens(2)], max_tokens=16, pad_id=0, image_size=4)
    cu = b["cu_seqlens"]
    assert b["max_seqlen"] == int((cu[1:] - cu[:-1]).max()) == 11
    assert b["labels"][0, 0] == -100 and b["labels"][0, 3] == -100


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory, tiny_tokenizer):
    """24 samples; every 6th has a user prompt longer than 96 tokens and a short answer."""
    from conftest import synthetic_records

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
    shards = load_index(path).shards
    prompts = [p for sh in shards for p in sh.prompt_lengths(IMAGE_TOKENS)]
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
    assert {dm.table.keys[g] for g in dm.current_plan().order[dm.current_plan().skipped["overlength"]]} == no_answer
    batches = take(dm, dm.current_plan().batches_per_rank())
    assert all(b["meta"]["real_tokens"] > 0 and (b["labels"] != -100).any() for b in batches)
    seen = [k for b in batches for k in b["sample_keys"]]
    assert not no_answer & set(seen)
    assert dm.telemetry()["skips_by_reason"] == {"overlength": len(no_answer)}
    assert len(seen) + len(no_answer) + len(dm.position.carry_in) == len(records)
