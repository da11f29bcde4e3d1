"""draw_packs / pack_rows on hand-built packed and padded batches; inspect_batch end to end."""

import numpy as np
import pytest
import torch

from nanovlm.data.visualize import IMAGE, LOSS, PROMPT, UNUSED, draw_packs, pack_rows, row_rgb, rows_title

IMG = 7
X = -100


def packed_batch():
    # Two samples (8 and 7 tokens) and a 5-slot padding tail in T = 20.
    ids = [1, 5, IMG, IMG, 9, 9, 2, 3] + [1, 5, 9, 9, 2, 3, 3] + [0] * 5
    labels = [X, X, X, X, X, 9, 2, X] + [X, X, X, 9, 2, X, X] + [X] * 5
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "cu_seqlens": torch.tensor([0, 8, 15, 20], dtype=torch.int32),
        "sample_keys": ["a", "b"],
    }


def test_pack_rows_exact():
    (row,) = pack_rows([packed_batch()], image_token_id=IMG)
    P, L, M, U = PROMPT, LOSS, IMAGE, UNUSED
    assert row.category.tolist() == [P, P, M, M, P, L, L, P] + [P, P, P, L, L, P, P] + [U] * 5
    assert row.sample.tolist() == [0] * 8 + [1] * 7 + [-1] * 5
    assert row.fill == 15 / 20 and row.keys == ["a", "b"]
    # Without an image id, image tokens count as prompt tokens.
    (row,) = pack_rows([packed_batch()])
    assert IMAGE not in row.category.tolist()


def test_full_pack_without_padding_tail():
    b = packed_batch()
    b["cu_seqlens"] = torch.tensor([0, 8, 20], dtype=torch.int32)
    b["sample_keys"] = ["a", "b"]
    (row,) = pack_rows([b], IMG)
    assert row.fill == 1.0 and UNUSED not in row.category.tolist()


def test_padded_batches_one_row_per_sample():
    b = {
        "input_ids": torch.tensor([[1, IMG, 9, 2], [1, 9, 0, 0]]),
        "labels": torch.tensor([[X, X, 9, 2], [X, 9, X, X]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        "sample_keys": ["p", "q"],
    }
    rows = pack_rows([b], IMG)
    assert [r.fill for r in rows] == [1.0, 0.5] and [r.keys for r in rows] == [["p"], ["q"]]
    assert rows[1].category.tolist() == [PROMPT, LOSS, UNUSED, UNUSED]


def test_colours_distinguish_categories_and_samples():
    (row,) = pack_rows([packed_batch()], IMG)
    t = len(row.category)
    rgb = row_rgb(row, t + 4)
    assert rgb.shape == (t + 4, 3)
    assert np.allclose(rgb[15:t], 0.85)  # the unused tail is grey
    assert np.allclose(rgb[t:], 1.0)  # past the row's own slots (a wider row elsewhere): white, not "unused"
    loss_a, prompt_a, image_a, loss_b = rgb[5], rgb[0], rgb[2], rgb[11]
    assert prompt_a.sum() > loss_a.sum() > image_a.sum()  # prompt lighter, image darker than the sample colour
    assert not np.allclose(loss_a, loss_b)  # neighbouring samples differ


def test_draw_packs_writes_png(tmp_path):
    from PIL import Image

    out = tmp_path / "packs.png"
    fills = draw_packs([packed_batch(), packed_batch()], out, image_token_id=IMG)
    assert fills == [0.75, 0.75]
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size[0] > 600
    with pytest.raises(ValueError, match="no batch"):
        draw_packs([], tmp_path / "x.png")


def test_inspect_batch_cli(tmp_path, make_dataset, tiny_tokenizer, capsys):
    from nanovlm.cli.inspect_batch import main

    make_dataset(tmp_path / "ds", 60, samples_per_shard=20, image_token_count=16)
    out = tmp_path / "new" / "b.png"  # its folder is made (a traceback after the whole run before)
    rc = main([str(tmp_path / "ds"), "--out", str(out), "--batches", "3", "--samples", "1",
               f"data.tokenizer={tiny_tokenizer.name_or_path}", "data.max_tokens=256"])  # fmt: skip
    assert rc == 0 and out.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert f"dataset {tmp_path / 'ds'}: 60 samples in 3 shards" in printed
    assert "drew 3 rows from 3 batches" in printed and "max_tokens=256" in printed
    assert printed.count("batch ") >= 3 and "input_ids (1, 256) int64" in printed
    # Decoded samples mark the loss span and the image tokens.
    decoded = [line for line in printed.splitlines() if line.startswith("  - s")]
    assert len(decoded) == 3
    assert all("[[answer " in line and "<|im_end|>]]" in line for line in decoded)
    # --val shows the dataset given (it used to show the config's data.val, the demo set, under this header)
    make_dataset(tmp_path / "val", 8, samples_per_shard=8, image_token_count=16, key_prefix="v")
    rc = main([str(tmp_path / "val"), "--val", "--batches", "1", "--samples", "2",
               f"data.tokenizer={tiny_tokenizer.name_or_path}", "data.max_tokens=256"])  # fmt: skip
    printed = capsys.readouterr().out
    decoded = [line.split()[1] for line in printed.splitlines() if line.startswith("  - ")]
    assert rc == 0 and decoded and all(key.startswith("v0") for key in decoded), decoded
    # ... and describes that set, not the training plan of the same directory
    assert printed.startswith(f"validation: 8 samples from {tmp_path / 'val'}") and "epoch plan" not in printed
    # no directory: the first key=value is an override, not the dataset (it was taken as a directory)
    from nanovlm.cli.inspect_batch import parse_args

    args = parse_args(["data.max_tokens=512", "--val", "data.val_samples=5"])
    assert args.dataset is None and args.overrides == ["data.max_tokens=512", "data.val_samples=5"]
    # data that cannot be planned is a one-line error, not a traceback (every sample longer than the budget)
    with pytest.raises(SystemExit, match="cannot be packed.*raise data.max_tokens"):
        main([str(tmp_path / "ds"), f"data.tokenizer={tiny_tokenizer.name_or_path}", "data.max_tokens=16"])


def test_padded_rows_of_different_widths_are_titled_and_filled_by_slots(tmp_path):
    from PIL import Image

    short = {
        "input_ids": np.ones((1, 4), np.int64),
        "labels": np.ones((1, 4), np.int64),
        "attention_mask": np.array([[1, 1, 1, 1]]),
        "sample_keys": ["a"],
    }
    wide = {"input_ids": np.ones((1, 12), np.int64), "labels": np.ones((1, 12), np.int64),
            "attention_mask": np.array([[1] * 6 + [0] * 6]), "sample_keys": ["b"]}  # fmt: skip
    fills = draw_packs([short, wide], tmp_path / "p.png")
    assert fills == [1.0, 0.5] and Image.open(tmp_path / "p.png").size[0] > 0
    # not "2 packs of 12 slots, mean fill 75.0%": the rows differ in width, and 10 of 16 slots are real
    assert rows_title(pack_rows([short, wide])) == "2 rows of up to 12 slots, fill 62.5%"
    assert rows_title(pack_rows([wide, wide])) == "2 packs of 12 slots, fill 50.0%"


def test_decode_marked(tiny_tokenizer):
    from nanovlm.cli.inspect_batch import decode_marked

    tok = tiny_tokenizer
    img = tok.convert_tokens_to_ids("<image>")
    a = tok("hi", add_special_tokens=False)["input_ids"]
    b = tok("red", add_special_tokens=False)["input_ids"]
    ids = a + [img] * 3 + b
    labels = [X] * (len(a) + 3) + b
    assert decode_marked(tok, ids, labels, img) == "hi<image x3>[[red]]"
    two = a + [img] * 6 + b  # two adjacent images of 3 tokens each
    labels = [X] * (len(a) + 6) + b
    assert decode_marked(tok, two, labels, img, per_image=3) == "hi<image x3><image x3>[[red]]"


def test_inspect_batch_errors(tmp_path):
    from nanovlm.cli.inspect_batch import main

    with pytest.raises(SystemExit, match="no index/meta.json"):
        main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="unknown config key"):
        main([str(tmp_path), "--out", str(tmp_path / "new" / "x.png"), "data.max_tokenz=3"])
    assert not (tmp_path / "new").exists()  # nothing made for a call that fails


def test_batches_are_labelled_with_their_place_in_their_epoch(tiny_tokenizer):
    """A run of batches that crosses an epoch end said 'batch 1 of epoch 1' for the first batch of epoch 1."""
    from nanovlm.cli.inspect_batch import describe_batch

    batch = packed_batch() | {"pixel_values": torch.zeros(1, 3, 4, 4), "meta": {"epoch": 1, "index": 0}}
    assert describe_batch(batch, 7, tiny_tokenizer, IMG, 0)[0].startswith("batch 0 of epoch 1:")
