"""Demo data: deterministic, held out, answers determined by the images, ensure_demo_data builds once."""

import hashlib
import io
import time

import numpy as np
import pytest
from PIL import Image

from nanovlm.constants import IMAGE_TOKEN
from nanovlm.data.demo import (
    BACKGROUNDS,
    CHANCE_ACCURACY,
    COLOURS,
    DETAIL_LONG_SIDE,
    DETAIL_MARK,
    SHAPES,
    TASKS,
    TRAIN_SAMPLES,
    VAL_SAMPLES,
    ensure_demo_data,
    generate_records,
    make_demo_data,
)
from nanovlm.data.index import load_index
from nanovlm.data.reader import ShardReader
from nanovlm.data.tokenizer import load_tokenizer, tokenizer_fingerprint


def tree_digest(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def colour_fractions(data: bytes, table: dict) -> dict[str, float]:
    """Fraction of pixels within a small distance of each named colour."""
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).reshape(-1, 3).astype(int)
    return {name: float((np.abs(arr - np.array(rgb)).sum(1) < 60).mean()) for name, rgb in table.items()}


def shape_colour(data: bytes) -> str:
    fr = colour_fractions(data, COLOURS)
    name = max(fr, key=fr.get)
    assert fr[name] > 0.03 and sorted(fr.values())[-2] < 0.01, fr  # one clear shape colour
    return name


def shape_area(data: bytes) -> float:
    return max(colour_fractions(data, COLOURS).values())


def test_answers_are_determined_by_the_image():
    counts = {t: 0 for t in TASKS}
    for r in generate_records(300, "train", seed=3):
        task = r.extra["task"]
        counts[task] += 1
        assert sum(m["content"].count(IMAGE_TOKEN) for m in r.messages) == len(r.images)
        if "answer" in r.extra:
            assert r.extra["answer"] == r.messages[-1]["content"]
        if task in ("colour", "multi_turn"):
            assert shape_colour(r.images[0]) == r.messages[1]["content"]
        if task == "background":
            fr = colour_fractions(r.images[0], BACKGROUNDS)
            assert max(fr, key=fr.get) == r.extra["answer"] and fr[r.extra["answer"]] > 0.2
        if task == "same_colour":
            same = shape_colour(r.images[0]) == shape_colour(r.images[1])
            assert r.extra["answer"] == ("yes" if same else "no")
        if task == "compare_size":
            a, b = shape_area(r.images[0]), shape_area(r.images[1])
            assert r.extra["answer"] == ("first" if a > b else "second")
    assert all(counts[t] > 0 for t in TASKS), counts  # every task occurs
    assert 0.25 < CHANCE_ACCURACY < 0.40


def test_detail_mix_hides_a_small_mark_in_images_of_many_sizes():
    """The detail mix: one DETAIL_MARK-pixel mark whose colour is the answer, on images of several sizes and
    aspects; the val split is balanced over both tasks and their answers."""
    sizes = set()
    for r in generate_records(200, "train", seed=2, mix="detail"):
        img = Image.open(io.BytesIO(r.images[0]))
        sizes.add(img.size)
        assert max(img.size) >= DETAIL_LONG_SIDE[0] and min(img.size) > DETAIL_MARK
        fr = colour_fractions(r.images[0], COLOURS)
        mark = max(fr, key=fr.get)
        assert round(fr[mark] * img.size[0] * img.size[1]) <= (DETAIL_MARK + 1) ** 2  # small: the mark, edges included
        if r.extra["task"] == "detail_colour":
            assert r.extra["answer"] == mark
    aspects = {round(max(w, h) / min(w, h)) for w, h in sizes}
    assert len(sizes) > 50 and {1, 2, 3, 4} <= aspects and any(w > h for w, h in sizes) and any(h > w for w, h in sizes)
    val = [r.extra["answer"] for r in generate_records(48, "val", mix="detail")]
    assert sorted(val[0::2]) == sorted(list(SHAPES) * 6) and sorted(val[1::2]) == sorted(list(COLOURS) * 4)
    shape_only = [r.extra for r in generate_records(8, "val", mix="detail_shape")]
    assert [e["task"] for e in shape_only] == ["detail_shape"] * 8 and sorted(
        e["answer"] for e in shape_only
    ) == sorted(list(SHAPES) * 2)
    with pytest.raises(ValueError, match="unknown demo mix"):
        next(generate_records(1, mix="nope"))


def test_deterministic_and_held_out(tmp_path):
    make_demo_data(tmp_path / "a", train_samples=40, val_samples=12, samples_per_shard=16)
    make_demo_data(tmp_path / "b", train_samples=40, val_samples=12, samples_per_shard=16)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    tr, va = load_index(tmp_path / "a" / "train"), load_index(tmp_path / "a" / "val")
    assert tr.num_samples == 40 and va.num_samples == 12 and [s.num_samples for s in tr.shards] == [16, 16, 8]
    tok = load_tokenizer(tmp_path / "a" / "tokenizer")
    assert tr.tokenizer == va.tokenizer == tokenizer_fingerprint(tok)
    assert len(tok) <= 512
    train_imgs = {r.images[0] for r in generate_records(40, "train") if r.images}
    val_imgs = {r.images[0] for r in generate_records(12, "val") if r.images}
    assert not train_imgs & val_imgs
    # The answer is stored in the sample json.
    sh = tr.shard(0)
    members = ShardReader().read_members(str(tr.shard_path(0)), sh.offsets[0], sh.nbytes[0], sh.keys[0])
    first = next(generate_records(1, "train"))
    assert b'"task":"' + first.extra["task"].encode() in members["json"]


def test_ensure_demo_data_builds_once(tmp_path):
    root = tmp_path / "data" / "demo"
    kw = dict(train_samples=20, val_samples=5, samples_per_shard=50)
    assert ensure_demo_data(root, **kw) == root
    assert sorted(p.name for p in root.iterdir()) == ["tokenizer", "train", "val"]
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")]  # temp dir cleaned up
    stamp = (root / "train" / "index" / "meta.json").stat().st_mtime_ns
    ensure_demo_data(root, **kw)
    assert (root / "train" / "index" / "meta.json").stat().st_mtime_ns == stamp  # not rebuilt
    # A missing part is filled in, the rest is kept.
    import shutil

    shutil.rmtree(root / "val")
    ensure_demo_data(root, **kw)
    assert load_index(root / "val").num_samples == 5
    assert (root / "train" / "index" / "meta.json").stat().st_mtime_ns == stamp


def test_cli_rejects_empty_output():
    from nanovlm.cli.make_demo_data import main

    with pytest.raises(SystemExit, match="--output"):
        main(["--output", ""])


@pytest.mark.slow
def test_default_size_is_fast_and_long_tailed(tmp_path):
    t0 = time.perf_counter()
    info = make_demo_data(tmp_path / "demo")
    elapsed = time.perf_counter() - t0
    assert (info["train_samples"], info["val_samples"]) == (TRAIN_SAMPLES, VAL_SAMPLES)
    assert elapsed < 120, elapsed  # ~35 s measured on 2 shared cores; generous for loaded CI machines
    idx = load_index(tmp_path / "demo" / "train")
    tokens = np.array(idx.total_tokens(16))
    n_img = np.array(idx.columns["n_images"])
    assert set(n_img.tolist()) == {0, 1, 2}
    assert np.percentile(tokens, 50) < 60 and tokens.max() > 4 * np.percentile(tokens, 50)  # short median, long tail


def test_train_builds_only_the_demo_paths(tmp_path, monkeypatch):
    """A missing tokenizer or dataset of your own is never filled with demo data: the loaders name it instead."""
    import nanovlm.data.demo as demo
    from nanovlm.config import load_config
    from nanovlm.train.run import ensure_data

    built = []
    monkeypatch.setattr(demo, "ensure_demo_data", lambda root, **kw: built.append(root))
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    (mine / "train").mkdir(parents=True)
    cfg = load_config(
        ["tiny_cpu.yaml"], [f"data.train=[{mine}/train]", f"data.val=[{mine}/val]", f"data.tokenizer={mine}/tokenizer"]
    )
    ensure_data(cfg)
    assert built == [] and sorted(p.name for p in mine.iterdir()) == ["train"]
    ensure_data(load_config(["tiny_cpu.yaml"], ["data.tokenizer=HuggingFaceTB/SmolLM2-135M"]))  # a hub id
    assert built == []
    ensure_data(load_config(["tiny_cpu.yaml"]))  # the default demo paths, absent here: built into data/demo
    assert [str(p) for p in built] == ["data/demo"]
