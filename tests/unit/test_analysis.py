"""analyze_data: exact waste numbers on hand-made indexes, recommendations, plots, reads only the index."""

import json

import numpy as np
import pytest

from nanovlm.data.analysis import LengthStats, collect, recommend, waste
from nanovlm.data.index import DatasetIndex, ShardIndex, load_index
from nanovlm.data.tiling import ImageLayout


def write_index(path, text_tokens, n_images, image_token_count=16, prompts=None):
    """An index with the given columns and no shard files (analysis must not need them)."""
    n = len(text_tokens)
    prompts = prompts or ([1] * n, [0] * n)
    keys = [f"k{i}" for i in range(n)]
    shard = ShardIndex("shard-000000.tar", 0, n, keys, [0] * n, [512] * n, list(text_tokens), list(n_images),
                       [[[32, 32]] * m for m in n_images], *map(list, prompts))  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    DatasetIndex.from_shards(path, "fp", image_token_count, "test", [shard]).save()
    return load_index(path, check_files=False)


def stats_of(lengths, n_images=None):
    n_images = np.zeros(len(lengths), dtype=np.int64) if n_images is None else np.asarray(n_images)
    return LengthStats(np.asarray(lengths), np.asarray(lengths), n_images, 1)


def test_collect_expands_images(tmp_path):
    idx = write_index(tmp_path / "d", [10, 20, 30], [0, 1, 2], image_token_count=16)
    s = collect([idx, idx], 16)
    assert s.total_tokens.tolist() == [10, 35, 60] * 2
    assert s.text_tokens.tolist() == [10, 20, 30] * 2 and s.n_images.tolist() == [0, 1, 2] * 2
    assert s.prompt_tokens.tolist() == [1, 1, 1] * 2
    idx = write_index(tmp_path / "p", [10, 20, 30], [0, 1, 2], 16, prompts=([5, 6, 7], [0, 1, 2]))
    assert collect([idx], 16).prompt_tokens.tolist() == [5, 21, 37]


def test_collect_with_splitting_counts_tiles_from_sizes(tmp_path):
    """32x32 images at 16-px tiles and <= 4 tiles: a 2x2 grid plus the global view, 5 tiles; each tile 4 tokens +
    2 markers, one newline between the rows, "\\n\\n" before the global view (4 tokens + 3 markers): 33 tokens."""
    idx = write_index(tmp_path / "d", [10, 20, 30], [0, 1, 2])
    s = collect([idx], ImageLayout(16, 4, max_tiles=4))
    assert s.unit == "tiles" and s.n_images.tolist() == [0, 5, 10]
    assert s.total_tokens.tolist() == [10, 20 + 32, 30 + 64]
    rec = recommend(s, max_images=8)
    assert rec.max_images >= 10 and any("too_many_tiles" in r for r in rec.reasons)


def test_waste_exact():
    # 6 samples of 100 tokens and 2 of 300; budget 256; batches of 1 (no padding) -> only truncation/drop count.
    w = waste(stats_of([100] * 6 + [300] * 2), budget=256, batch_size=1)
    assert w.pad_to_longest == 0.0 and w.constrained == 0.0
    assert w.constrained_truncated_samples == 2
    assert w.constrained_lost_tokens == pytest.approx(88 / 1200)
    assert w.over_budget == 2 and w.over_budget_tokens == pytest.approx(0.5)
    assert w.packing == pytest.approx(1 - 600 / 768)  # the 6 short ones in 3 packs of 2
    assert w.packing_ffd == pytest.approx(1 - 600 / 768)
    # Equal lengths never pad; alternating 10/30 in pairs of 2 waste exactly 1 - 40/60 whatever the order...
    assert waste(stats_of([50] * 8), 1024, batch_size=4).pad_to_longest == 0.0
    w = waste(stats_of([10, 30] * 50 + [30] * 0), 1024, batch_size=100)
    assert w.pad_to_longest == pytest.approx(1 - 2000 / 3000)
    assert w.packing == pytest.approx(1 - 2000 / 2048)  # 2000 tokens fit in 2 packs of 1024


def test_image_budget_binding_is_reported():
    w = waste(stats_of([10] * 100, [1] * 100), 1024, max_images=4)
    assert w.image_bound_packs == 1.0 and w.packing == pytest.approx(1 - 1000 / (25 * 1024))


def test_samples_the_packer_cannot_place_are_counted_as_lost():
    """Over the image budget or over the token budget: both are lost to packing (the table said 0 for images)."""
    w = waste(stats_of([10] * 6 + [50] * 2 + [2000], [1] * 6 + [9, 0, 0]), 1024, max_images=4)
    assert (w.packing_lost, w.over_budget, w.over_images) == (2, 1, 1)
    assert w.packing_lost_tokens == pytest.approx((50 + 2000) / 2160)


def test_recommendation_rules():
    r = recommend(stats_of([30] * 1000))
    assert (r.max_tokens, r.overlength) == (256, "drop")  # 8 x 30 = 240 -> 256, nothing over
    r = recommend(stats_of([100] * 1000 + [10000]))
    assert (r.max_tokens, r.overlength) == (1024, "drop")  # one outlier (0.1%) is dropped, not the budget raised
    r = recommend(stats_of([1000] * 900 + [40000] * 100), cap=16384)
    assert (r.max_tokens, r.overlength) == (16384, "truncate")  # 10% over the memory cap: truncate
    assert any("capped at 16384" in x for x in r.reasons)
    r = recommend(stats_of([100] * 100, [1] * 100), max_images=4)
    assert any("data.max_images=4" in x for x in r.reasons)
    # a small dataset: keeping 99.9% whole means keeping the longest too (an interpolated p99.9 fell below it)
    r = recommend(stats_of([100] * 288 + [1663]))
    assert r.max_tokens >= 1663 and any("0 samples are longer" in x for x in r.reasons)
    r = recommend(stats_of([100] * 3000 + [10000]), cap=1024)
    assert any(": 1 sample is longer" in x for x in r.reasons)


def test_truncate_recommendation_counts_samples_whose_prompt_fills_the_budget(tmp_path):
    stats = collect([write_index(tmp_path / "old", [1000] * 900 + [40000] * 100, [0] * 1000)], 16)
    assert not any("a prompt of" in x for x in recommend(stats, cap=16384).reasons)  # every prompt is 1 token
    stats.prompt_tokens = np.asarray([10] * 900 + [20000] * 3 + [500] * 97)
    r = recommend(stats, cap=16384)
    assert r.overlength == "truncate" and any("3 of them have a prompt of 16384 tokens" in x for x in r.reasons)
    stats.prompt_tokens = np.asarray([10] * 1000)
    assert not any("a prompt of" in x for x in recommend(stats, cap=16384).reasons)


def test_analyze_cli_writes_plots_and_summary(tmp_path, make_dataset, capsys):
    from nanovlm.cli.analyze_data import main

    idx = make_dataset(tmp_path / "ds", 40, samples_per_shard=16, image_token_count=16)
    for s in idx.shards:  # the report reads only the index
        (tmp_path / "ds" / s.name).unlink()
    out = tmp_path / "report"
    assert main([str(tmp_path / "ds"), "--out", str(out), "--max-tokens", "256", "--image-token-count", "16"]) == 0
    for name in ("text_tokens.png", "total_tokens.png", "images_per_sample.png", "waste.png", "waste_vs_budget.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    summary = (out / "summary.md").read_text()
    report = json.loads((out / "report.json").read_text())
    totals = np.array(idx.total_tokens(16))
    assert report["num_samples"] == 40 and "Samples: 40;" in summary
    assert report["total_tokens"]["max"] == totals.max()
    assert report["waste"]["over_budget"] == int((totals > 256).sum())
    assert (
        f"`data.max_tokens={report['recommended_max_tokens']} data.overlength={report['recommended_overlength']} "
        f"data.max_images={report['recommended_max_images']}`" in summary
    )
    assert "pad to longest" in summary and "packing, online packer" in summary
    printed = capsys.readouterr().out
    assert "recommended: data.max_tokens=" in printed and "note:" not in printed
    # an index prepared for another image-token count is analysed with the one asked for, and that is said
    assert main([str(tmp_path / "ds"), "--out", str(out), "--max-tokens", "256", "--image-token-count", "64"]) == 0
    assert (
        f"note: {tmp_path / 'ds'} was prepared for 16 tokens per image; this analysis uses 64"
        in capsys.readouterr().out
    )
    assert json.loads((out / "report.json").read_text())["index_image_token_counts"] == {str(tmp_path / "ds"): 16}


def test_analyze_cli_errors(tmp_path):
    from nanovlm.cli.analyze_data import main

    with pytest.raises(SystemExit, match="no index/meta.json"):
        main([str(tmp_path), "--out", str(tmp_path / "r")])
    write_index(tmp_path / "d", [1], [0])
    with pytest.raises(SystemExit, match="must be positive"):
        main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--max-tokens", "0"])
    with pytest.raises(SystemExit, match="must be positive"):
        main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--max-budget", "-5"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="is a file"):
        main([str(tmp_path / "d"), "--out", str(tmp_path / "file")])
    write_index(tmp_path / "empty", [], [])
    with pytest.raises(SystemExit, match="lists no samples"):  # was a report of "waste 0.0%, recommended 1024"
        main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    split = tmp_path / "split.yaml"  # splitting needs the run's tokenizer (newline counts of split grids)
    split.write_text(f"model:\n  vision:\n    image_splitting: true\ndata:\n  tokenizer: {tmp_path / 'no_tok'}\n")
    with pytest.raises(SystemExit, match="image splitting needs the run's tokenizer"):
        main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--config", str(split)])


def test_recommended_budget_fits_the_models_context(tmp_path, capsys):
    """tiny_cpu.yaml's decoder has 2048 positions: recommending 5120 gave a budget train.py then refused."""
    from nanovlm.cli.analyze_data import main

    write_index(tmp_path / "d", [4000] * 50 + [600] * 50, [0] * 100)
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--max-tokens", "4096"]) == 0
    printed = capsys.readouterr().out
    assert "recommended: data.max_tokens=2048 data.overlength=truncate" in printed
    assert "max_position_embeddings=2048" in printed and "training refuses it" in printed


def test_verify_finds_a_flipped_byte_the_cheap_checks_pass(tmp_path):
    """analyze_data --verify re-hashes the columns: a corrupt byte that keeps size and header is named."""
    from nanovlm.cli.analyze_data import main

    write_index(tmp_path / "d", [10, 20, 30], [0, 1, 2])
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--verify"]) == 0
    column = tmp_path / "d" / "index" / "text_tokens.npy"
    data = bytearray(column.read_bytes())
    data[-2] ^= 0x01
    column.write_bytes(bytes(data))
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "r")]) == 0  # without --verify: not noticed
    with pytest.raises(SystemExit, match="text_tokens.npy: content does not match its hash"):
        main([str(tmp_path / "d"), "--out", str(tmp_path / "r"), "--verify"])
