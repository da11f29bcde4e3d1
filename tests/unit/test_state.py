"""Exact resumption of the packed data stream: same keys and same tensors after restore, with workers, across
epoch boundaries, on a different world size / worker count, and through a Lightning checkpoint."""

from __future__ import annotations

import pytest
import torch
from helpers.data import IMAGE_TOKENS, all_keys, carried_keys, make_cfg, make_dm, take
from helpers.processes import run_forked_ranks

from nanovlm.data.datamodule import DataStateError, PackedMultimodalDataModule
from nanovlm.data.reader import ShardReader
from nanovlm.train.callbacks import DataPositionCallback


@pytest.fixture(scope="module")
def data(tmp_path_factory, make_dataset):
    root = tmp_path_factory.mktemp("resume")
    make_dataset(root / "a", 60, samples_per_shard=16, seed=3, image_token_count=IMAGE_TOKENS)
    make_dataset(root / "b", 20, samples_per_shard=6, seed=4, image_token_count=IMAGE_TOKENS, key_prefix="b")
    return root


def same_batch(x: dict, y: dict) -> None:
    assert x["sample_keys"] == y["sample_keys"]
    assert (x["meta"]["epoch"], x["meta"]["index"]) == (y["meta"]["epoch"], y["meta"]["index"])
    for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values"):
        assert torch.equal(x[k], y[k]), k


def test_exact_resume_with_workers_at_several_points(data, tiny_tokenizer):
    cfg = make_cfg([data / "a", data / "b"], num_workers=2)
    ref_dm = make_dm(cfg, tiny_tokenizer)
    per_epoch = ref_dm.current_split().batches_per_rank()
    points = [1, 2, per_epoch - 1, per_epoch, per_epoch + 1]  # incl. the last batch and right after the boundary
    states, ref = {}, []
    it = iter(ref_dm.train_dataloader())
    for i in range(per_epoch + 4):
        if i in points:
            states[i] = ref_dm.state_dict()
        batch = next(it)
        ref_dm.on_batch_consumed(batch)
        ref.append(batch)
    del it
    assert ref[per_epoch]["meta"]["epoch"] == 1 and ref[per_epoch]["meta"]["index"] == 0
    for c in points:
        dm = make_dm(cfg, tiny_tokenizer)
        dm.load_state_dict(states[c])
        for got, want in zip(take(dm, 3), ref[c : c + 3]):
            same_batch(got, want)


@pytest.mark.parametrize("before_end", [1, 2])
def test_a_resume_in_the_last_round_of_an_epoch_keeps_the_carries_of_slots_already_done(
    data, tiny_tokenizer, before_end
):
    """With 3 workers the slots' last packs of an epoch arrive one batch apart, each with the carry that opens its
    next chunk; a state saved between them must hold those already seen, or the next epoch's state lacks them."""
    cfg = make_cfg([data / "a", data / "b"], num_workers=3, max_tokens=128)
    ref = make_dm(cfg, tiny_tokenizer)
    n = ref.current_split().batches_per_rank()
    take(ref, n - before_end)
    state = ref.state_dict()
    want = take(ref, before_end + 2, consume=True)
    want_state = ref.state_dict()
    assert any(want_state["ranks"][0]["carry_in"][:2])  # the slots done before the save carried something
    dm = make_dm(cfg, tiny_tokenizer)
    dm.load_state_dict(state)
    for got, w in zip(take(dm, before_end + 2), want):
        same_batch(got, w)
    assert dm.state_dict() == want_state


def test_state_restored_before_setup_and_in_a_new_process_order(data, tiny_tokenizer):
    """Lightning may call load_state_dict before setup; the state applies at setup."""
    cfg = make_cfg([data / "a"])
    a = make_dm(cfg, tiny_tokenizer)
    take(a, 3)
    state = a.state_dict()
    want = take(a, 2, consume=False)
    b = PackedMultimodalDataModule(cfg.data, cfg.model, tiny_tokenizer, rank=0, world_size=1)
    b.load_state_dict(state)
    b.setup("fit")
    for got, w in zip(take(b, 2), want):
        same_batch(got, w)


def run_ranks(cfg, tokenizer, world_size, n_batches, state=None):
    """Simulate ``world_size`` ranks in-process: each consumes ``n_batches`` (None = to the epoch's end).

    Returns the keys each rank consumed, the merged (as if all-gathered) state and the plan's carry."""
    keys, states, dms = [], [], []
    for rank in range(world_size):
        dm = make_dm(cfg, tokenizer, rank, world_size)
        if state is not None:
            dm.load_state_dict(state)
        n = n_batches if n_batches is not None else dm.current_split().batches_per_rank() - dm.position.consumed
        keys += [k for b in take(dm, n) for k in b["sample_keys"]]
        states.append(dm.state_dict())
        dms.append(dm)
    return keys, PackedMultimodalDataModule.merge_rank_states(states), dms


@pytest.mark.parametrize("old,new", [((2, 1), (1, 1)), ((1, 2), (3, 1))])
def test_elastic_resume_loses_and_repeats_nothing(data, tiny_tokenizer, old, new):
    old_cfg = make_cfg([data / "a", data / "b"], num_workers=old[1])
    new_cfg = make_cfg([data / "a", data / "b"], num_workers=new[1])
    first, state, _ = run_ranks(old_cfg, tiny_tokenizer, old[0], 3)
    assert state["world_size"] == old[0] and len(state["ranks"]) == old[0]
    rest, _, dms = run_ranks(new_cfg, tiny_tokenizer, new[0], None, state)
    assert all(dm.position.epoch == 1 for dm in dms)  # every new rank finished the epoch after the same number of steps
    carry = carried_keys(*dms)
    seen = first + rest
    assert len(seen) == len(set(seen))  # nothing repeated
    assert sorted(seen + carry) == all_keys(data / "a", data / "b")  # nothing lost (carry opens epoch 1)


def test_two_elastic_resumes_in_an_epoch_that_opened_with_per_slot_carries(data, tiny_tokenizer):
    """2 ranks x 2 workers cross into epoch 1 (each slot carrying its own leftovers, each rank knowing only its
    slots'), resume on 3 x 1 mid-epoch, then on 1 x 2: epoch 1's samples are each trained once, or carried on."""
    cfgs = {w: make_cfg([data / "a", data / "b"], num_workers=w, max_tokens=160) for w in (1, 2)}

    def run(world, workers, n, state=None):
        keys, states, dms = [], [], []
        for rank in range(world):
            dm = make_dm(cfgs[workers], tiny_tokenizer, rank, world)
            if state is not None:
                dm.load_state_dict(state)
            left = dm.current_split().batches_per_rank() - dm.position.consumed
            keys += [(b["meta"]["epoch"], k) for b in take(dm, left if n is None else n) for k in b["sample_keys"]]
            states.append(dm.state_dict())
            dms.append(dm)
        return keys, PackedMultimodalDataModule.merge_rank_states(states), dms

    per_epoch = make_dm(cfgs[2], tiny_tokenizer, 0, 2).current_split().batches_per_rank()
    first, s1, _ = run(2, 2, per_epoch + 2)
    assert s1["ranks"][0]["epoch"] == 1 and any(any(r["carry_in"]) for r in s1["ranks"])  # per-slot carries
    opened = make_dm(cfgs[2], tiny_tokenizer)
    opened.load_state_dict(s1)
    carried_in = carried_keys(opened)
    second, s2, _ = run(3, 1, 2, s1)
    assert len(s2["history"]) == 1
    third, _, dms = run(1, 2, None, s2)
    assert dms[0].position.epoch == 2
    epoch1 = [k for e, k in first + second + third if e == 1]
    # each sample once, except those epoch 0 carried in (they also come fresh): nothing lost, nothing repeated
    assert sorted(epoch1 + carried_keys(*dms)) == sorted(all_keys(data / "a", data / "b") + carried_in)


def test_elastic_resume_at_the_end_of_an_epoch_onto_more_slots(data, tiny_tokenizer):
    """One pack left in the epoch, resumed on 4 ranks x 2 workers: the rest cannot give 8 slots a batch each,
    so it opens the next epoch (it used to be a PlanError that made the checkpoint unusable on that topology)."""
    old_cfg = make_cfg([data / "b"], num_workers=0, max_tokens=160)
    new_cfg = make_cfg([data / "b"], num_workers=2, max_tokens=160)
    dm = make_dm(old_cfg, tiny_tokenizer)
    n = dm.current_split().batches_per_rank()
    first = [k for b in take(dm, n - 1) for k in b["sample_keys"]]
    left = sorted(set(all_keys(data / "b")) - set(first))
    assert 0 < len(left) < 8
    state = dm.state_dict()
    dms = [make_dm(new_cfg, tiny_tokenizer, r, 4) for r in range(4)]
    for d in dms:
        d.load_state_dict(state)
        assert (d.position.epoch, d.position.consumed) == (1, 0)
        assert sorted(carried_keys(d)) == left  # nothing lost, nothing repeated
    batch = take(dms[0], 1)[0]  # the stream starts at epoch 1, batch 0, and the position accepts it
    assert (batch["meta"]["epoch"], batch["meta"]["index"]) == (1, 0) and dms[0].position.consumed == 1


def test_changed_seed_or_data_is_refused(data, tiny_tokenizer):
    cfg = make_cfg([data / "a"])
    dm = make_dm(cfg, tiny_tokenizer)
    take(dm, 2)
    state = dm.state_dict()
    other = make_cfg([data / "a"], seed=99)
    with pytest.raises(DataStateError, match=r"seed: 1234 -> 99"):
        make_dm(other, tiny_tokenizer).load_state_dict(state)
    with pytest.raises(DataStateError, match="datasets") as e:  # named by directory, not only by content hash
        make_dm(make_cfg([data / "b"]), tiny_tokenizer).load_state_dict(state)
    assert f"data.train: ['{data / 'a'}'] -> ['{data / 'b'}']" in str(e.value) and "checkpoint.init_from" in str(
        e.value
    )
    with pytest.raises(DataStateError, match="max_tokens"):
        make_dm(make_cfg([data / "a"], max_tokens=300), tiny_tokenizer).load_state_dict(state)


def test_a_malformed_state_or_an_unrecorded_setting_is_a_data_state_error(data, tiny_tokenizer):
    """A state missing a field is a DataStateError (not a TypeError); a fingerprint key the saved state lacks is
    named as not recorded."""
    cfg = make_cfg([data / "a"], overlength="truncate")
    dm = make_dm(cfg, tiny_tokenizer)
    take(dm, 2)
    state = dm.state_dict()
    broken = {k: v for k, v in state.items() if k != "carry_bound"}
    with pytest.raises(DataStateError, match="malformed"):
        make_dm(cfg, tiny_tokenizer).load_state_dict(broken)
    older = dict(state, config={k: v for k, v in state["config"].items() if k != "prompt_only_skips"})
    with pytest.raises(DataStateError, match=r"prompt_only_skips: \(not recorded\) -> '"):
        make_dm(cfg, tiny_tokenizer).load_state_dict(older)
    make_dm(cfg, tiny_tokenizer).load_state_dict(state)  # the state itself restores
    # a state of the plan where odd slots reversed their runs of one shard: its positions name other samples now
    with pytest.raises(DataStateError, match="data state version 3 is not 4: it was saved by another version"):
        make_dm(cfg, tiny_tokenizer).load_state_dict(dict(state, version=3))


def test_a_state_missing_slot_carries_is_a_data_state_error():
    """The common bound counts every slot; a state that lists fewer slots' carries (a rank's part lost in the
    gather) is refused rather than opening the epoch without those samples."""
    from nanovlm.data.state import DataState, RankState, saved_carry

    ranks = [RankState(rank=r, epoch=1, consumed=0, carry_in=[[r * 10 + j] for j in range(2)]) for r in range(2)]
    state = DataState(2, 2, [], [[0, 0, 0]] * 4, [], [], {}, [], ranks)
    assert sorted(saved_carry(state).slots) == [0, 1, 2, 3]
    state.ranks = ranks[:1]
    with pytest.raises(DataStateError, match="lists the carries of 2 of its 4 slots"):
        saved_carry(state)


def test_resume_seeks_instead_of_replaying(data, tiny_tokenizer, monkeypatch):
    """Samples read before the first batch after a resume do not grow with the position in the epoch."""
    cfg = make_cfg([data / "a", data / "b"])
    reads = []
    real_read = ShardReader.read

    def counting_read(self, path, offset, nbytes, key):
        reads.append(key)
        return real_read(self, path, offset, nbytes, key)

    monkeypatch.setattr(ShardReader, "read", counting_read)
    counts = {}
    for c in (0, 10):
        dm = make_dm(cfg, tiny_tokenizer)
        dm.position.consumed = c  # a saved position, as load_state_dict would set it
        reads.clear()
        batch = next(iter(dm.train_dataloader()))
        assert batch["meta"]["index"] == c
        counts[c] = len(reads)
    assert counts[10] <= cfg.data.lookahead + 2 * max(counts[0], 8)


def test_lightning_checkpoint_resume_continues_exactly(data, tiny_tokenizer, tmp_path):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.keys: list[list[str]] = []

        def training_step(self, batch, batch_idx):
            self.keys.append(batch["sample_keys"])
            return (self.w * batch["input_ids"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, ckpt=None):
        cfg = make_cfg([data / "a"], num_workers=1)
        dm = PackedMultimodalDataModule(cfg.data, cfg.model, tiny_tokenizer)
        model = Tiny()
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
            callbacks=[
                DataPositionCallback(),
                L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1),
            ],
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return model.keys

    full = fit(10)
    ckpts = sorted((tmp_path / "ckpt").glob("*step=4*.ckpt"))
    assert ckpts, list((tmp_path / "ckpt").iterdir())
    resumed = fit(10, str(ckpts[0]))
    assert resumed == full[4:]


def _dist_rank(rank, port, world_size, cfg, tokenizer, out_dir):
    """One rank of a 2-process gloo group: consume 3 batches, save the gathered state and the next keys."""
    import json
    import os
    import traceback

    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        dm = PackedMultimodalDataModule(cfg.data, cfg.model, tokenizer)  # rank and world size from the group
        dm.setup("fit")
        take(dm, 3)
        state = dm.state_dict()  # a collective: every rank calls it
        nxt = [b["sample_keys"] for b in take(dm, 2, consume=False)]
        (out_dir / f"next{rank}.json").write_text(json.dumps(nxt))
        if rank == 0:
            torch.save(state, out_dir / "state.pt")
        torch.distributed.destroy_process_group()
    except BaseException:
        (out_dir / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


@pytest.mark.distributed
def test_state_dict_gathers_every_rank_under_torch_distributed(data, tiny_tokenizer, tmp_path):
    import json

    cfg = make_cfg([data / "a", data / "b"])
    run_forked_ranks(_dist_rank, 2, tmp_path, 2, cfg, tiny_tokenizer, tmp_path)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert [r["rank"] for r in state["ranks"]] == [0, 1] and state["world_size"] == 2  # rank 1 was not lost
    for rank in range(2):
        dm = make_dm(cfg, tiny_tokenizer, rank, 2)
        dm.load_state_dict(state)
        got = [b["sample_keys"] for b in take(dm, 2, consume=False)]
        assert got == json.loads((tmp_path / f"next{rank}.json").read_text())


def test_resume_in_an_epoch_that_opened_with_carried_samples(data, tiny_tokenizer):
    """The other resume tests' epochs open with nothing carried over; here three samples are."""
    cfg = make_cfg([data / "a", data / "b"], num_workers=3, max_tokens=200)
    ref = make_dm(cfg, tiny_tokenizer)
    per_epoch = ref.current_split().batches_per_rank()
    assert ref.current_plan().carry_out.size > 0
    take(ref, per_epoch + 1)
    state = ref.state_dict()
    assert any(r["carry_in"] and any(r["carry_in"]) for r in state["ranks"])
    want = take(ref, 3, consume=False)
    dm = make_dm(cfg, tiny_tokenizer)
    dm.load_state_dict(state)
    for got, w in zip(take(dm, 3), want):
        same_batch(got, w)


def test_planned_skips_are_counted_once_after_a_mid_epoch_resume(data, tiny_tokenizer):
    cfg = make_cfg([data / "a"], max_tokens=96)
    first = make_dm(cfg, tiny_tokenizer)
    over = int((first.table.length > 96).sum())
    n = first.current_split().batches_per_rank()
    take(first, 2)
    resumed = make_dm(cfg, tiny_tokenizer)
    resumed.load_state_dict(first.state_dict())
    take(resumed, n - 2)
    assert resumed.telemetry()["last_epoch_skips"] == {"overlength": over}


def test_total_skips_survive_a_state_round_trip(data, tiny_tokenizer):
    cfg = make_cfg([data / "a"], max_tokens=96)
    first = make_dm(cfg, tiny_tokenizer)
    take(first, first.current_split().batches_per_rank() + 1)
    state = first.state_dict()
    assert state["ranks"][0]["total_skips"]
    restored = make_dm(cfg, tiny_tokenizer)
    restored.load_state_dict(state)
    assert restored.state_dict()["ranks"][0]["total_skips"] == state["ranks"][0]["total_skips"]
