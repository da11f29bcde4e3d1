"""Image splitting: the grid rule, the markers, and the identity planning relies on (tokens and tiles of an
image follow from its size alone, exactly as processing lays them out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.faults import encode, exif_rotated_png, image, reason_of
from helpers.synthetic import synthetic_image, tiny_corpus
from PIL import Image

from nanovlm.config import DataConfig
from nanovlm.constants import IGNORE_INDEX
from nanovlm.data.format import Record
from nanovlm.data.index import DatasetIndexError, load_index
from nanovlm.data.prepare import inspect_image, write_dataset
from nanovlm.data.processing import SampleProcessor, split_idefics3, split_image
from nanovlm.data.shards import PackSpec, SampleTable
from nanovlm.data.state import fingerprint
from nanovlm.data.tiling import MAX_GRID_SIDE, SPLIT_TOKENS, ImageLayout, choose_grids, grid_tiles, idefics3_grids
from nanovlm.data.tokenizer import build_tokenizer, load_tokenizer, tokenizer_fingerprint

S = 16  # tile side of these tests: small, so a few hundred pixels already need many tiles
TOKENS = 4  # tokens per tile


@pytest.fixture(scope="module")
def split_tokenizer(tmp_path_factory):
    """A tokenizer with the grid markers whose BPE merged "\\n\\n" into one token, as SmolLM2's did: the last
    row's newline and the one before the global view are then one token, not two."""
    path = tmp_path_factory.mktemp("split_tok") / "tok"
    build_tokenizer(path, tiny_corpus() + ["a paragraph\n\n"] * 100, vocab_size=512)
    tok = load_tokenizer(path, image_splitting=True)
    assert len(tok("\n\n", add_special_tokens=False)["input_ids"]) == 1
    return tok


def processor(tok, max_tiles: int = 4, **kw) -> SampleProcessor:
    return SampleProcessor(tok, S, TOKENS, max_tiles=max_tiles, **kw)


def reference_grid(w: int, h: int, size: int, max_tiles: int) -> tuple[int, int]:
    """The rule as docs/tiling.py words it, written plainly: the grid keeping the most resolution (capped at the
    image's own), then the fewest tiles, then the fewest rows."""
    best = None
    for r in range(1, MAX_GRID_SIDE + 1):
        for c in range(1, MAX_GRID_SIDE + 1):
            if r * c > max_tiles:
                continue
            scale = min(c * size / w, r * size / h, 1.0)
            rank = (-round(scale * scale * w * h, 6), r * c, r)
            if best is None or rank < best[0]:
                best = (rank, (r, c))
    return best[1]


def test_grid_rule_on_named_shapes():
    sizes = [(10, 12), (16, 16), (64, 16), (16, 64), (32, 32), (1000, 1000), (48, 16), (17, 16), (500, 20)]
    got = [tuple(g) for g in choose_grids(np.array(sizes), S, 4).tolist()]
    # no larger than a tile: 1x1; a 4:1 strip: one row of 4; 2x2 pixels of tiles: 2x2; a huge square: the 2x2
    # budget; 3:1 fits 1x3; one pixel over a tile already needs a second column; a 25:1 strip: 1x4
    assert got == [(1, 1), (1, 1), (1, 4), (4, 1), (2, 2), (2, 2), (1, 3), (1, 2), (1, 4)]
    assert choose_grids(np.array([[64, 16]]), S, 2).tolist() == [[1, 2]]  # the budget caps the strip
    assert choose_grids(np.array([[1000, 10]]), S, 36).tolist() == [[1, MAX_GRID_SIDE]]  # the markers cap a side


def test_grid_rule_matches_the_plain_reference_on_random_sizes():
    rng = np.random.default_rng(0)
    w = np.exp(rng.uniform(np.log(1), np.log(400), 3000)).astype(np.int64) + 1
    aspect = np.exp(rng.uniform(np.log(1 / 8), np.log(8), 3000))
    h = np.maximum(1, (w * aspect).astype(np.int64))
    sizes = np.stack([w, h], 1)
    for max_tiles in (1, 4, 9, 36):
        got = choose_grids(sizes, S, max_tiles)
        want = np.array([reference_grid(int(a), int(b), S, max_tiles) for a, b in sizes])
        assert np.array_equal(got, want), max_tiles
        assert (got[:, 0] * got[:, 1] <= max_tiles).all()


def test_tokens_of_every_grid_equal_the_layout(split_tokenizer):
    """The count planning uses (ImageLayout.grid_tokens) against the ids processing emits, for every grid."""
    proc = processor(split_tokenizer, max_tiles=36)
    grids = np.array([(r, c) for r in range(1, 7) for c in range(1, 7)])
    counts = proc.layout.grid_tokens(grids)
    assert [len(proc.image_ids(tuple(g))) for g in grids.tolist()] == counts.tolist()
    image_id = split_tokenizer.convert_tokens_to_ids("<image>")
    for g, n_tiles in zip(grids.tolist(), grid_tiles(grids).tolist()):
        assert proc.image_ids(tuple(g)).count(image_id) == n_tiles * TOKENS


def test_markers_follow_the_idefics3_layout(split_tokenizer):
    """The ids of a 2x3 grid are what the tokenizer makes of the Idefics3 / SmolVLM prompt string."""
    proc = processor(split_tokenizer, max_tiles=6)
    img = "<image>" * TOKENS
    text = ""
    for r in (1, 2):
        text += "".join(f"<fake_token_around_image><row_{r}_col_{c}>{img}" for c in (1, 2, 3)) + "\n"
    text += f"\n<fake_token_around_image><global-img>{img}<fake_token_around_image>"
    assert list(proc.image_ids((2, 3))) == split_tokenizer(text, add_special_tokens=False)["input_ids"]
    single = f"<fake_token_around_image><global-img>{img}<fake_token_around_image>"
    assert list(proc.image_ids((1, 1))) == split_tokenizer(single, add_special_tokens=False)["input_ids"]


def test_split_image_views_are_tiles_then_the_global_view():
    arr = np.zeros((16, 64, 3), np.uint8)
    for i in range(4):
        arr[:, i * 16 : (i + 1) * 16] = 60 * i  # four bands: one per tile of a 1x4 grid
    views = split_image(Image.fromarray(arr), (1, 4), S)
    assert len(views) == 5 and all(v.size == (S, S) for v in views)
    assert [int(np.asarray(v).mean()) for v in views[:4]] == [0, 60, 120, 180]
    assert np.asarray(views[4]).shape == (S, S, 3)  # the whole strip, squashed


@pytest.mark.parametrize("edge", [7 * S, S])  # 112 is not a multiple of a tile; S: one view per image
def test_idefics3_rule_gives_transformers_grids_and_pixels(edge):
    """model.vision.longest_edge: on 200 random sizes (tiny to 300 px, strips of 1-19 px), the grid from the size
    alone and every view's pixels equal what transformers' Idefics3ImageProcessor makes of the same image."""
    from transformers import Idefics3ImageProcessorPil

    hf = Idefics3ImageProcessorPil(
        size={"longest_edge": edge}, max_image_size={"longest_edge": S}, do_rescale=False, do_normalize=False
    )
    rng = np.random.default_rng(edge)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 300, (200, 2))]
    sizes[::3] = [(int(rng.integers(1, 20)), h) for _, h in sizes[::3]]
    grids = idefics3_grids(np.asarray(sizes), S, edge)
    for (w, h), grid in zip(sizes, grids, strict=True):
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        out = hf.preprocess([img], return_row_col_info=True, do_pad=False)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        assert tuple(grid) == (max(rows, 1), max(cols, 1)), (w, h)  # transformers: (0, 0) for one tile
        theirs = np.stack(out["pixel_values"][0])
        ours = np.stack([np.asarray(v).transpose(2, 0, 1) for v in split_idefics3(img, tuple(grid), S, edge)])
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{w}x{h}")
    seen = {(int(r), int(c)) for r, c in grids}
    assert seen >= {(7, 7), (1, 7), (7, 1), (4, 7)} if edge > S else seen == {(1, 1)}


def test_planned_length_equals_processed_length_under_idefics3s_rule(tmp_path, split_tokenizer):
    """The same accounting as below with Idefics3's rule: planned lengths and tiles equal the processed ones."""
    rng = np.random.default_rng(2)
    records = []
    for i in range(60):
        sizes = [(int(rng.integers(1, 200)), int(rng.integers(1, 200))) for _ in range(int(rng.integers(0, 3)))]
        images = [synthetic_image(rng, w, h, "PNG" if j % 2 else "JPEG") for j, (w, h) in enumerate(sizes)]
        user = "look " + "<image> and ".join([""] * (len(sizes) + 1)) + f"question {i}?"
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": f"answer {i}"}]
        records.append(Record(f"k{i:04d}", msgs, images, {}))
    write_dataset(records, tmp_path / "ds", split_tokenizer, TOKENS, samples_per_shard=16)
    proc = processor(split_tokenizer, max_tiles=16, longest_edge=4 * S)
    table = SampleTable.from_indexes([("ds", load_index(tmp_path / "ds"))], proc.layout)
    for gid, rec in enumerate(records):
        out = proc.process(rec)
        assert (table.length[gid], table.n_images[gid]) == (len(out.input_ids), out.pixel_values.shape[0]), rec.key
    tiles, _ = proc.layout.costs(np.asarray([[1, 1], [150, 150], [199, 3]]))
    assert tiles.tolist() == [17, 17, 5]  # a square: 4 x 4 tiles + the global view whatever its size; a strip 1 x 4
    resumable = fingerprint(DataConfig(), PackSpec(), table, proc.layout)  # a resume under the other rule is refused
    assert resumable["image_splitting"] == {"image_size": S, "max_tiles": 16, "longest_edge": 4 * S}


def test_planned_length_equals_processed_length(tmp_path, split_tokenizer):
    """Thousands of images of random sizes and aspects, written as a dataset: the lengths and tile counts the
    planner derives from the index's sizes equal what processing produces, sample by sample."""
    rng = np.random.default_rng(1)
    records = []
    for i in range(400):
        n = int(rng.integers(0, 6))
        sizes = [(int(rng.integers(1, 120)), int(rng.integers(1, 120))) for _ in range(n)]
        if i % 4 == 0 and n:  # elongated strips and pages
            sizes[0] = (int(rng.integers(100, 300)), int(rng.integers(4, 20)))
        images = [synthetic_image(rng, w, h, "PNG" if j % 2 else "JPEG") for j, (w, h) in enumerate(sizes)]
        user = "look " + "<image> and ".join([""] * (n + 1)) + f"question {i}?"
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": f"answer {i}"}]
        records.append(Record(f"k{i:04d}", msgs, images, {}))
    assert sum(len(r.images) for r in records) > 900
    write_dataset(records, tmp_path / "ds", split_tokenizer, TOKENS, samples_per_shard=64)
    proc = processor(split_tokenizer, max_tiles=9)
    table = SampleTable.from_indexes([("ds", load_index(tmp_path / "ds"))], proc.layout)
    assert table.vision_unit == "tiles"
    for gid, rec in enumerate(records):
        out = proc.process(rec)
        assert table.length[gid] == len(out.input_ids), rec.key
        assert table.n_images[gid] == out.pixel_values.shape[0], rec.key
        image_tokens = int((out.input_ids == proc.image_token_id).sum())
        assert image_tokens == out.pixel_values.shape[0] * TOKENS  # what the model splices
    assert table.n_images.sum() > 2 * sum(len(r.images) for r in records)  # splitting really happened


def test_grid_uses_the_upright_size(split_tokenizer):
    rotated, upright = exif_rotated_png(6, size=(64, 16))  # stored 64x16, shown 16x64
    proc = processor(split_tokenizer)
    assert proc.grid(rotated) == proc.grid(upright) == (4, 1)
    assert torch.equal(proc.images([rotated]), proc.images([upright]))


def test_a_rotated_tiff_gets_the_grid_of_its_upright_size(split_tokenizer):
    """Pillow turns a TIFF upright while loading it (and drops its orientation tag), unlike JPEG / PNG / WebP: the
    size planning uses must be the one decoding gives, for every format."""
    raw = image((64, 16))
    exif = Image.Exif()
    exif[0x0112] = 6
    proc = processor(split_tokenizer)
    upright = encode(raw.transpose(Image.Transpose.ROTATE_270), "PNG")
    for fmt in ("TIFF", "PNG", "JPEG", "WEBP"):
        rotated = encode(raw, fmt, exif=exif.tobytes())
        assert proc.grid(rotated) == (4, 1), fmt
        assert inspect_image(rotated)[1] == [16, 64], fmt
        if fmt in ("TIFF", "PNG"):  # lossless: the same pixels as the upright file
            assert torch.equal(proc.images([rotated]), proc.images([upright])), fmt


def test_a_corrupt_png_is_refused_at_preparation(split_tokenizer):
    good = encode(image((64, 64)), "PNG")
    bad = good[:200] + bytes(b ^ 0x5A for b in good[200:260]) + good[260:]
    assert reason_of(inspect_image, bad, key="k") == "unreadable_image"
    assert (
        reason_of(processor(split_tokenizer).process, Record("k", conv_with_image(), [bad], {})) == "unreadable_image"
    )


def conv_with_image():
    return [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "x"}]


def test_truncation_removes_a_split_image_whole(split_tokenizer):
    proc = processor(split_tokenizer)
    big = encode(image((64, 64)))  # 2x2 grid: 5 views
    msgs = [
        {"role": "user", "content": "first <image> what?"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "then <image> what?"},
        {"role": "assistant", "content": "another answer"},
    ]
    rec = Record("k", msgs, [encode(image((8, 8))), big], {})
    full = proc.process(rec)
    assert full.pixel_values.shape[0] == 6
    second = full.input_ids.tolist().index(split_tokenizer.convert_tokens_to_ids("<row_1_col_1>")) - 1  # its start
    cut = proc.process(rec, max_tokens=second + 10, overlength="truncate")
    assert cut.pixel_values.shape[0] == 1  # the second image would be cut: it goes, markers and all
    assert len(cut.input_ids) == second
    assert reason_of(proc.process, rec, max_tokens=second + 10) == "overlength"  # the default drops it
    vision_ids = {proc.image_token_id, *(split_tokenizer.convert_tokens_to_ids(t) for t in SPLIT_TOKENS)}
    assert all(y == IGNORE_INDEX for x, y in zip(full.input_ids.tolist(), full.labels.tolist()) if x in vision_ids)


def test_marker_tokens_leave_the_fingerprint_alone(tiny_tokenizer, tmp_path):
    """Markers are appended special tokens: content counts do not change, so one prepared dataset serves both."""
    tiny_tokenizer.save_pretrained(str(tmp_path / "t"))
    plain, split = load_tokenizer(tmp_path / "t"), load_tokenizer(tmp_path / "t", image_splitting=True)
    assert all(t in split.get_vocab() for t in SPLIT_TOKENS)
    assert not any(t in plain.get_vocab() for t in SPLIT_TOKENS)
    assert tokenizer_fingerprint(split) == tokenizer_fingerprint(plain) == tokenizer_fingerprint(tiny_tokenizer)


def test_markers_keep_the_other_extra_special_tokens(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(str(tmp_path / "t"))
    base = load_tokenizer(tmp_path / "t")
    base.add_special_tokens({"additional_special_tokens": ["<foo>"]}, replace_extra_special_tokens=False)
    base.save_pretrained(str(tmp_path / "foo"))
    plain, split = load_tokenizer(tmp_path / "foo"), load_tokenizer(tmp_path / "foo", image_splitting=True)
    assert "<foo>" in split.all_special_tokens
    assert tokenizer_fingerprint(split) == tokenizer_fingerprint(plain)


def test_an_index_with_more_prompt_images_than_images_is_refused(tmp_path, split_tokenizer):
    rec = Record("k", conv_with_image(), [encode(image((40, 40)))], {})
    write_dataset([rec], tmp_path / "ds", split_tokenizer, TOKENS)
    idx = load_index(tmp_path / "ds")
    idx.columns["prompt_images"] = np.array([2], np.int32)
    with pytest.raises(DatasetIndexError, match="more prompt images than images"):
        idx.prompt_lengths(processor(split_tokenizer).layout)


def test_a_tokenizer_without_markers_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="fake_token_around_image.*image_splitting=True"):
        processor(tiny_tokenizer)


def test_unsplit_layout_is_one_image_one_tile():
    layout = ImageLayout(S, TOKENS)
    tiles, tokens = layout.costs(np.array([[500, 20], [3, 3]]))
    assert tiles.tolist() == [1, 1] and tokens.tolist() == [TOKENS, TOKENS]
