"""Image splitting end to end on CPU: packs planned from index metadata under a token and a tile budget, their
exact and elastic resumption, the over-budget skip, and packed == alone logits with mixed tile counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.data import all_keys, carried_keys, make_cfg, make_dm, take
from helpers.synthetic import synthetic_image

from nanovlm.data.collate import collate_packed
from nanovlm.data.datamodule import DataStateError
from nanovlm.data.format import Record
from nanovlm.data.prepare import write_dataset
from nanovlm.data.tokenizer import load_tokenizer
from nanovlm.model import build_model


@pytest.fixture(scope="module")
def split_tok(tiny_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("split_tok")
    tiny_tokenizer.save_pretrained(str(path))
    return load_tokenizer(path, image_splitting=True)


@pytest.fixture(scope="module")
def tiles_data(tmp_path_factory, split_tok):
    """Samples with 0-2 images from thumbnails to 4:1 strips and 3x3-tile pages (32 px tiles)."""
    rng = np.random.default_rng(5)
    sizes = [(20, 24), (40, 30), (128, 32), (32, 100), (96, 96), (60, 61)]
    records = []
    for i in range(70):
        picks = [sizes[int(k)] for k in rng.integers(0, len(sizes), i % 3)]
        images = [synthetic_image(rng, w, h, "PNG") for w, h in picks]
        user = "<image>" * len(images) + f"question {i}?"
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": f"answer {i} " + "x " * (i % 9)}]
        records.append(Record(f"t{i:03d}", msgs, images, {}))
    root = tmp_path_factory.mktemp("tiles")
    write_dataset(records, root / "a", split_tok, 16, samples_per_shard=12)
    return root, records


def split_cfg(data, **kw):
    cfg = make_cfg([data[0] / "a"], **kw)
    cfg.model.vision.image_splitting = True
    cfg.model.vision.max_tiles = 9
    return cfg


def test_packs_respect_the_tile_budget_and_carry_what_the_model_splices(tiles_data, split_tok):
    cfg = split_cfg(tiles_data, max_images=20, max_tokens=512)
    dm = make_dm(cfg, split_tok)
    assert dm.table.vision_unit == "tiles"
    assert dm.table.n_images.max() > 2  # some sample has more tiles than images
    batches = take(dm, dm.current_split().batches_per_rank())
    image_id = split_tok.convert_tokens_to_ids("<image>")
    for b in batches:
        assert b["pixel_values"].shape[0] <= 20
        assert int((b["input_ids"] == image_id).sum()) == b["pixel_values"].shape[0] * 16
    keys = [k for b in batches for k in b["sample_keys"]]
    carry = carried_keys(dm)
    assert sorted(keys + carry) == all_keys(tiles_data[0] / "a")  # one epoch: every sample once (none over budget)


def test_a_sample_over_the_tile_budget_is_a_counted_skip(tiles_data, split_tok):
    cfg = split_cfg(tiles_data, max_images=9, max_tokens=1024, max_skip_rate=1.0)
    dm = make_dm(cfg, split_tok)
    over = int((dm.table.n_images > 9).sum())
    assert over > 0
    take(dm, dm.current_split().batches_per_rank())
    assert dm.telemetry()["last_epoch_skips"] == {"too_many_tiles": over}


def same(x, y):
    assert x["sample_keys"] == y["sample_keys"]
    for k in ("input_ids", "labels", "cu_seqlens", "pixel_values"):
        assert torch.equal(x[k], y[k]), k


def test_exact_and_elastic_resume_with_splitting(tiles_data, split_tok):
    cfg = split_cfg(tiles_data, max_images=20, max_tokens=512, num_workers=2)
    ref = make_dm(cfg, split_tok)
    take(ref, 2)
    state = ref.state_dict()
    want = take(ref, 3, consume=False)
    again = make_dm(cfg, split_tok)
    again.load_state_dict(state)
    for got, w in zip(take(again, 3), want):
        same(got, w)

    # the same state on 2 ranks x 1 worker: the rest of the epoch, nothing lost or repeated
    seen = [k for b in take(make_dm(cfg, split_tok), 2) for k in b["sample_keys"]]
    dms = []
    two = split_cfg(tiles_data, max_images=20, max_tokens=512, num_workers=1)
    for rank in range(2):
        dm = make_dm(two, split_tok, rank, 2)
        dm.load_state_dict(state)
        seen += [
            k for b in take(dm, dm.current_split().batches_per_rank() - dm.position.consumed) for k in b["sample_keys"]
        ]
        dms.append(dm)
    carry = carried_keys(*dms)
    assert len(seen) == len(set(seen)) and sorted(seen + carry) == all_keys(tiles_data[0] / "a")


def test_resume_refuses_another_tile_budget(tiles_data, split_tok):
    a = make_dm(split_cfg(tiles_data, max_images=20, max_tokens=512), split_tok)
    take(a, 1)
    cfg = split_cfg(tiles_data, max_images=20, max_tokens=512)
    cfg.model.vision.max_tiles = 4
    b = make_dm(cfg, split_tok)
    with pytest.raises(DataStateError, match="max_tiles"):
        b.load_state_dict(a.state_dict())


def test_packed_equals_alone_with_mixed_tile_counts(tiles_data, split_tok):
    cfg = split_cfg(tiles_data, max_images=20, max_tokens=512)
    cfg.model.attn_backend = "sdpa"
    dm = make_dm(cfg, split_tok)
    torch.manual_seed(0)
    model = build_model(cfg.model, split_tok).eval()
    processed = [dm.processor.process(r) for r in tiles_data[1]]
    by_tiles = {}
    for p in processed:
        by_tiles.setdefault(p.pixel_values.shape[0], p)
    picks = [by_tiles[n] for n in sorted(by_tiles)[:5]]
    assert len(picks) >= 4 and max(p.pixel_values.shape[0] for p in picks) >= 5  # 0, 1, 2, 5+ tiles in one pack
    size = cfg.model.vision.image_size
    total = sum(len(p.input_ids) for p in picks) + 3
    with torch.no_grad():
        packed = model(collate_packed(picks, total, dm.pad_id, size))["logits"][0]
        start = 0
        for p in picks:
            n = len(p.input_ids)
            alone = model(collate_packed([p], n, dm.pad_id, size))["logits"][0]
            torch.testing.assert_close(packed[start : start + n], alone, atol=2e-5, rtol=1e-5)
            start += n
