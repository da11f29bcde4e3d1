"""The benchmark suite: its baselines behave as described, and ``--quick`` writes well-formed JSON and markdown.

No timing is asserted anywhere: timings depend on the machine. What is asserted is structure (every section,
every strategy, every figure present and in range) and the exact behaviour of the re-implemented baselines.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO

from benchmarks.baselines import balanced_greedy_knapsack, flattening_steps
from benchmarks.cli import main
from benchmarks.common import Stats, percentile
from benchmarks.distributions import LengthSet, from_index, lognormal, mixture
from benchmarks.packing import plan_metrics, run_cell
from benchmarks.train import HEAD_EVERYWHERE, STATIC_COMPILED, STATIC_EAGER
from nanovlm.config import load_config
from nanovlm.data.index import load_index
from nanovlm.data.tokenizer import load_tokenizer
from nanovlm.model import build_model, num_parameters


def _groups(plan) -> list[list[int]]:
    return sorted(sorted(g) for g in plan.steps)


def test_knapsack_is_worst_fit_decreasing_over_a_presized_pool():
    lengths, images = [5, 4, 3, 3, 2, 1], [0] * 6
    # delta 0: ceil(18 / 8) = 3 bins; each item goes to the least-loaded bin that fits.
    plan = balanced_greedy_knapsack(lengths, images, 8, num_sequences=100, delta=0, separator_tokens=0)
    assert _groups(plan) == [[0, 5], [1, 4], [2, 3]]
    assert plan.slots == [8, 8, 8] and sorted(plan.tokens) == [6, 6, 6]
    # delta 2: 5 bins up front, so the items spread out (the balancing that costs fill).
    plan = balanced_greedy_knapsack(lengths, images, 8, num_sequences=100, delta=2, separator_tokens=0)
    assert _groups(plan) == [[0], [1], [2], [3], [4, 5]]


def test_knapsack_image_cap_filters_and_separator():
    # Item 2 would go to the least-loaded bin, but that bin's image budget is full: it goes to the other one.
    lengths, images = [4, 3, 2], [1, 2, 1]
    plan = balanced_greedy_knapsack(
        lengths, images, 8, num_sequences=100, delta=0, max_images_per_knapsack=2, separator_tokens=0
    )
    assert _groups(plan) == [[0, 2], [1]]
    assert max(plan.images) <= 2
    # Filters: length >= max_sample_length, more than max_images_per_example images; separator takes a slot.
    plan = balanced_greedy_knapsack([8, 7, 3, 2], [0, 0, 5, 1], 8, num_sequences=100, delta=0, separator_tokens=1)
    assert plan.dropped == [0, 2]
    assert _groups(plan) == [[1], [3]]  # 7 + 1 separator fills a pack; 2 + 1 cannot join it
    assert sorted(plan.tokens) == [2, 7]  # real tokens exclude separators


def test_knapsack_buffers_the_stream():
    # A buffer of one pack's worth: packing decisions never cross buffer boundaries.
    plan = balanced_greedy_knapsack([3, 3, 3, 3], [0] * 4, 6, num_sequences=1, delta=0, separator_tokens=0)
    assert _groups(plan) == [[0, 1], [2, 3]]


def test_flattening_runs_the_real_collator():
    plan = flattening_steps([3, 5, 2, 7, 1], [1, 0, 0, 2, 1], batch_size=2, max_len=6)
    assert plan.steps == [[0, 1], [2, 4]]  # sample 3 (7 > 6) is dropped before batching
    assert plan.dropped == [3]
    assert plan.slots == [8, 3] and plan.tokens == [8, 3] and plan.images == [1, 1]
    assert not plan.fixed_budget


def test_plan_metrics_exact():
    ls = LengthSet("t", [4, 4, 2, 6], [1, 0, 0, 1])
    plan = flattening_steps(ls.lengths, ls.n_images, batch_size=2)
    m = plan_metrics(plan, ls, L=8, bound_fill=1.0, ffd_fill=1.0)
    assert m["fill"] == 1.0 and m["fill_at_peak"] == 1.0 and m["steps"] == 2
    assert m["slots_per_step_mean"] == 8 and m["dropped_samples"] == 0 and m["gap_to_bound_pp"] == 0.0


def test_stats_and_percentile():
    s = Stats.of([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (s.median, s.min, s.max, s.q1, s.q3, s.n) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 100) == 4
    with pytest.raises(ValueError):
        Stats.of([])


def test_distributions_deterministic_and_index_lengths(tmp_path, make_dataset):
    assert lognormal(50, seed=3).lengths == lognormal(50, seed=3).lengths
    assert mixture(50, seed=3).lengths != mixture(50, seed=4).lengths
    idx = make_dataset(tmp_path / "ds", 20, samples_per_shard=8)
    ls = from_index(tmp_path / "ds", image_token_count=16)
    assert ls.lengths == idx.total_tokens(16).tolist()
    with pytest.raises(FileNotFoundError, match="index/meta.json"):
        from_index(tmp_path / "nothing")


def test_run_cell_ranks_every_strategy():
    cell = run_cell(lognormal(400, seed=0), 2048, max_images=64, reps=1)
    names = [r["strategy"] for r in cell["rows"]]
    assert names[0].startswith("ours") and names[-1].startswith("FFD")
    assert any(n.startswith("mmdp knapsack") for n in names)
    assert any(n.startswith("DataCollatorWithFlattening") for n in names)
    assert cell["lower_bound_packs"] == math.ceil(sum(n for n in lognormal(400, seed=0).lengths if n <= 2048) / 2048)
    for r in cell["rows"]:
        assert 0.0 < r["fill"] <= 1.0
        if r["strategy"].startswith(("ours", "mmdp", "FFD")):  # packs of L slots: never fewer than the bound
            assert r["steps"] >= cell["lower_bound_packs"] and r["slots_per_step_max"] == 2048


def test_lower_bound_counts_the_image_cap():
    """Short samples with many images: the image cap, not the token budget, sets the fewest possible packs."""
    ls = LengthSet("imagey", [10] * 100, [2] * 100)
    cell = run_cell(ls, 1024, max_images=8, reps=1)
    assert cell["lower_bound_packs"] == 25 and cell["bound_binding"] == "images"  # 200 images / 8 (tokens: 1)
    ours = cell["rows"][0]
    assert ours["steps"] == 25 and abs(ours["gap_to_bound_pp"]) < 1e-9
    from benchmarks.report import cell_table

    assert "(25 packs, the image cap binds)" in cell_table(cell)


def _check_doc(doc: dict, sections: list[str]) -> None:
    assert set(doc["sections"]) == set(sections)
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["torch"]
    json.dumps(doc)  # plain JSON all the way down


def test_quick_packing_section_writes_json_markdown_plot(tmp_path, make_dataset, capsys):
    make_dataset(tmp_path / "ds", 60, samples_per_shard=20)
    out = tmp_path / "b.json"
    md = tmp_path / "b.md"
    png = tmp_path / "fill.png"
    rc = main(
        [
            "--quick",
            "--sections",
            "packing",
            "--index",
            str(tmp_path / "ds"),
            "--reps",
            "1",
            "--synthetic-samples",
            "400",
        ]
        + ["--json", str(out), "--markdown", str(md), "--plot", str(png)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    _check_doc(doc, ["packing"])
    cells = doc["sections"]["packing"]["cells"]
    assert cells[0]["distribution"]["samples"] == 60  # the --index dataset comes first
    assert {c["regime"] for c in cells} == {"dataset", "token-bound", "image-cap"}
    assert doc["sections"]["packing"]["targets"]["checks"]
    text = md.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert text.count("| strategy |") == len(cells)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["--sections", "nope"]) == 2
    assert "unknown section" in capsys.readouterr().err
    assert main(["--quick", "--sections", "packing", "--index", str(tmp_path)]) == 2
    assert "no index/meta.json" in capsys.readouterr().err
    # checked before any section runs (packing would otherwise take minutes first)
    assert main(["--quick", "--set", "model.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'model.bogus'" in err and "benchmark section" not in err  # no section started
    assert main(["--quick", "--set", "novalue"]) == 2
    assert "must look like key=value" in capsys.readouterr().err
    assert main(["--quick", "--sections", "train", "--train-samples", "-5"]) == 2
    assert "--train-samples must be >= 1" in capsys.readouterr().err
    assert main(["--quick", "--sections", "train", "--train-modes", "packed,padded"]) == 2
    assert "unknown --train-modes ['padded']" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_all_sections(tmp_path, make_dataset, tiny_tokenizer):
    """The whole --quick suite on a small dataset: every section present with its figures."""
    make_dataset(tmp_path / "ds", 240, samples_per_shard=60)
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "q.json"
    args = [
        "--quick",
        "--data",
        str(tmp_path / "ds"),
        "--index",
        str(tmp_path / "ds"),
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    args += ["--train-samples", "48", "--set", "model.language.num_layers=2"]  # both reach the train section
    assert main([*args, "--reps", "2", "--json", str(out), "--workdir", str(tmp_path / "wd")]) == 0
    doc = json.loads(out.read_text())
    _check_doc(doc, ["packing", "pipeline", "train", "resume"])
    assert doc["sections"]["train"]["layout"]["samples"] == 48
    cfg = load_config(["tiny_cpu.yaml"], ["model.language.num_layers=2"])
    two_layers = num_parameters(build_model(cfg.model, load_tokenizer(str(tmp_path / "tok"))))["total"]
    assert doc["sections"]["train"]["parameters"] == two_layers
    pipe = doc["sections"]["pipeline"]
    assert [b["workers"] for b in pipe["by_workers"]] == [0, 1, 2]
    assert set(pipe["stage_breakdown"]["us_per_sample"]) == {"read", "decode", "tokenize", "pack"}
    train = doc["sections"]["train"]
    layouts = {"packed", "pad_to_longest", "constrained"}
    only = {"packed (decoder only)", "pad_to_longest (decoder only)"}
    assert set(train["modes"]) == layouts | only | {HEAD_EVERYWHERE}
    saving = train["loss_position_head"]
    assert saving["speedup"] > 0 and saving["paired_speedup"]["n"] == 2
    assert train["modes"]["packed"]["fill"] > train["modes"]["pad_to_longest"]["fill"]
    assert train["modes"]["packed (decoder only)"]["fill"] == train["modes"]["packed"]["fill"]  # same batches
    assert train["modes"]["packed"]["launches_per_step"] > 0
    check = train["ratio_check"]
    assert set(check["decoder_only"]) == {"actual_ratio", "fraction_of_ideal", "paired_fraction_of_ideal"}
    for paired in (check["paired_fraction_of_ideal"], check["decoder_only"]["paired_fraction_of_ideal"]):
        assert paired["n"] == 2 and paired["min"] <= paired["median"] <= paired["max"]  # one ratio per pass
    resume = doc["sections"]["resume"]["results"]
    assert [resume[k]["position"] for k in ("fresh", "early", "mid", "late")][0] == 0


def test_scale_section_measures_a_synthetic_index(tmp_path, make_dataset, tiny_tokenizer):
    """The scale section writes its synthetic index once, plans it in a child process, measures PSS, and times
    prepare_data on the given shards."""
    make_dataset(tmp_path / "ds", 40, samples_per_shard=20)
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "s.json"
    args = ["--quick", "--sections", "scale", "--scale-sizes", "20k", "--real-shards", str(tmp_path / "ds")]
    args += ["--tokenizer", str(tmp_path / "tok"), "--workdir", str(tmp_path / "wd"), "--json", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())["sections"]["scale"]
    (row,) = doc["rows"]
    assert row["n"] == 20_000 and row["packs_per_slot"] >= 1 and row["index_bytes"] > 20_000 * 40
    assert row["pss_mb"]["Pss"] > 0 and row["worker_pss_mb"]["Pss"] > 0
    assert doc["prepare"]["n_shards"] == 2 and doc["prepare"]["header_samples_per_s"] > 0
    idx = load_index(tmp_path / "wd" / "scale" / "20000")
    assert idx.num_samples == 20_000 and idx.key(19_999) == "s00000019999"


def test_tiles_section_packs_real_sizes_and_documents_under_a_tile_budget(tmp_path, make_dataset):
    make_dataset(tmp_path / "ds", 60, samples_per_shard=30)
    out = tmp_path / "t.json"
    args = ["--quick", "--sections", "tiles", "--index", str(tmp_path / "ds"), "--tiles-samples", "400"]
    assert main([*args, "--json", str(out), "--workdir", str(tmp_path / "wd")]) == 0
    doc = json.loads(out.read_text())["sections"]["tiles"]
    assert [(c["distribution"]["name"], c["max_images"]) for c in doc["cells"]] == [
        ("photos", 64), ("photos", 128), ("documents", 64), ("documents", 128)
    ]  # fmt: skip
    for cell in doc["cells"]:
        assert cell["distribution"]["samples"] == 400
        rows = {r["strategy"]: r for r in cell["rows"]}
        ours = rows["ours (online exact fill)"]
        assert (
            ours["images_per_step_max"] <= cell["max_images"]
            and ours["fill"] >= rows["FFD (offline reference)"]["fill"] - 0.05
        )
    assert doc["cells"][2]["distribution"]["tiles_mean"] > 5  # documents really are split


def _quick_s3_section(section: str, tmp_path, make_dataset, tiny_tokenizer, *extra: str) -> dict:
    """The JSON of a ``--quick`` run of ``section`` (remote, stream or ranges) on 6 shards of 10 samples, with
    ``extra`` arguments; its ``cpus`` beside the section's keys."""
    pytest.importorskip("s3fs")
    make_dataset(tmp_path / "ds", 60, samples_per_shard=10)
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / f"{section}.json"
    args = ["--quick", "--sections", section, "--data", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "tok")]
    assert main([*args, "--workdir", str(tmp_path / "wd"), "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    return doc["sections"][section] | {"cpus": doc.get("cpus")}


def test_remote_section_reads_from_a_slow_s3_server(tmp_path, make_dataset, tiny_tokenizer):
    """One epoch from moto's S3 server behind 20 ms of latency, cold and warm, prefetch on and off, each against a
    local pass; a cold epoch fetches the dataset about once; the transfer's CPU is measured both ways."""
    doc = _quick_s3_section("remote", tmp_path, make_dataset, tiny_tokenizer)
    rows = {(r["latency_ms"], r["prefetch"], r["cold"]): r for r in doc["rows"]}
    assert set(rows) == {(20, p, c) for p in (True, False) for c in (True, False)} | {(None, None, None)}
    # the one round between two local passes, each remote pass against the local rate at its moment
    assert [len(r["runs"]) for r in rows.values()] == [1, 1, 1, 1, 2] and rows[(None, None, None)] == doc["rows"][-1]
    for key, row in rows.items():
        assert row["samples_per_s"]["median"] > 0 and row["of_local"]["median"] > 0
        # the whole epoch, its first batch included, is slower than the epoch after its first batch
        assert row["samples_per_s"]["median"] < row["steady_samples_per_s"]["median"]
        assert row["steady_of_local"]["median"] > 0  # after the first batch, against local disk's alike
        if key[2]:  # cold: every shard fetched once, plus the index, by the store's process, whose CPU it costs
            assert 1.0 <= row["bytes_per_epoch"] / doc["dataset_bytes"] <= 1.1 and row["store_cpu_s"]["min"] > 0
            assert 0 < row["by_first_batch"]["median"] <= 1  # a share of what the epoch fetched
        else:
            assert row["bytes_per_epoch"] is None and row["store_cpu_s"]["min"] >= 0
    from benchmarks.remote import GET_FILE, PRESIGNED

    transfer = doc["transfer"]  # each way of receiving, in a fresh process: 6 shards, then the first 3 end to end
    assert set(transfer["rows"]) == {GET_FILE, PRESIGNED} and 0 < transfer["big_bytes"] < doc["dataset_bytes"]
    for row in transfer["rows"].values():
        assert row["shard_ms"]["n"] == 5 and min(s["min"] for s in row.values()) > 0


def test_stream_section_fetches_what_a_small_cache_let_go_without_thrashing(tmp_path, make_dataset, tiny_tokenizer):
    """Three epochs from one loader behind 20 ms, through a cache of 2 shards per worker (4 of the 6 shards) and one
    that holds the dataset: the timed epochs (the second and third; prefetch runs into each next epoch, and on
    epochs this short the workers run a whole epoch ahead) fetch again the shards the small cache let go, without
    thrashing, and nothing through the large one; the control stages every shard by a local copy, fetching none;
    each rate is set against local disk's, and every row says what CPU a sample took (too few samples here to
    compare the loader's with the machine's: /proc counts in 10 ms ticks)."""
    doc = _quick_s3_section("stream", tmp_path, make_dataset, tiny_tokenizer)
    assert doc["cache_bytes"]["small"] < doc["dataset_bytes"] < doc["cache_bytes"]["whole"]
    small, whole, copied, local = doc["rows"]
    assert [r["latency_ms"] for r in doc["rows"]] == [20, 20, 20, None] and local["samples_per_s"]["n"] == 4
    assert copied["name"].startswith("control") and copied["bytes_per_epoch"]["max"] == 0  # copies, no fetch
    for r in (small, whole, copied):
        assert r["samples_per_s"]["median"] > 0 and r["of_local"]["median"] > 0 and r["wait_s"]["min"] >= 0
    # a shard or two of the 6 fetched twice over the two epochs is the plan's (docs/remote.md); workers evicting
    # each other's prefetched shards fetched 1.9 x per epoch
    assert 0.1 < small["bytes_per_epoch"]["median"] <= 1.2 and whole["bytes_per_epoch"]["max"] < 0.1, doc["rows"]
    # what serving the epochs cost the store: warm epochs fetch nothing
    assert 0 <= whole["store_cpu_s"]["median"] < small["store_cpu_s"]["median"], doc["rows"]
    for r in doc["rows"]:  # CPU per sample read, the loader's and the whole machine's, in every row
        assert r["loader_cpu_ms"]["min"] > 0 and r["machine_cpu_ms"]["min"] > 0, r


def test_ranges_section_reads_a_shards_samples_whole_and_by_ranges(tmp_path, make_dataset, tiny_tokenizer):
    """All 10 samples of a shard, then 1 and 4 at random places, behind 20 ms: one GET of the whole shard against
    one ranged GET per sample, 8 in flight; a ranged read sends exactly the samples' bytes, a whole one the shard,
    and every request waits out the latency. Where this process may use 2+ CPUs, the store runs on one of them
    (--store-cpus) and the reader on the others, which this process is back on all of its own after."""
    mine = sorted(getattr(os, "sched_getaffinity", lambda _: ())(0))
    pin = ["--store-cpus", str(mine[-1])] if len(mine) > 1 else []
    doc = _quick_s3_section("ranges", tmp_path, make_dataset, tiny_tokenizer, *pin)
    if pin:
        assert doc["cpus"] == {"store": mine[-1:], "loader": mine[:-1]} and sorted(os.sched_getaffinity(0)) == mine
    rows = {(r["read"], r["how"]): r for r in doc["rows"]}
    assert set(rows) == {(k, how) for k in ("all", "1", "4") for how in ("whole", "ranges")}
    assert doc["samples_per_shard"] == 10 and {r["latency_ms"] for r in doc["rows"]} == {20}
    for (read, how), r in rows.items():
        k = 10 if read == "all" else int(read)
        assert r["samples"] == k and r["requests"] == (1 if how == "whole" else k)
        assert r["store_cpu_ms_per_sample"]["min"] > 0 and r["client_cpu_ms_per_sample"]["min"] > 0
        if how == "ranges":
            assert r["bytes_over_samples"]["median"] == 1.0  # each answer is its sample's bytes, no more
            assert r["wall_s"]["min"] >= 0.02 * -(-k // 8)  # rounds of 8 requests, each after its 20 ms
        else:  # the whole shard (tar headers and the samples not asked for included), after one 20 ms
            assert r["bytes_over_samples"]["median"] > (1.0 if read == "all" else 2.0) and r["wall_s"]["min"] >= 0.02


def test_the_slow_store_adds_its_latency_and_caps_its_bandwidth(tmp_path):
    """Each slow port answers after its latency, sends no faster than the cap, and counts the body bytes it sent;
    the plain port serves the same bucket and counts nothing."""
    pytest.importorskip("moto")
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    from benchmarks.remote import aws_env, s3_servers

    (tmp_path / "src").mkdir()
    data = os.urandom(1_000_000)
    (tmp_path / "src" / "blob.bin").write_bytes(data)
    with s3_servers({"blobs": tmp_path / "src"}, {}, (0, 200), 10.0) as ((host, port), slow):
        ports = {None: f"http://{host}:{port}"} | {ms: url for ms, (url, _) in slow.items()}
        with aws_env(ports[None]):
            for ms, url in ports.items():
                fs = fsspec.filesystem("s3", endpoint_url=url, skip_instance_cache=True)
                for _ in range(2):  # the second GET without the client's set-up
                    t0 = time.monotonic()
                    assert fs.cat_file("blobs/ds/blob.bin") == data
                    took = time.monotonic() - t0
                if ms is None:
                    assert [s.bytes_out for _, s in slow.values()] == [0, 0]
                    continue
                assert took >= ms / 1000 + 0.07  # 1 MB at 10 MB/s: 0.1 s (less a margin)
                assert slow[ms][1].bytes_out == 2 * len(data)


def test_a_store_that_fails_is_an_error_at_once(tmp_path):
    """The benchmark's store (the S3 server in a child process) that dies while starting, or later, is a
    named error within seconds, never a wait on its pipe."""
    pytest.importorskip("moto")
    from benchmarks.remote import store

    t0 = time.monotonic()
    missing = {"b/missing": tmp_path / "missing.bin"}  # its upload fails
    with pytest.raises(RuntimeError, match="process failed"), store({}, missing, (0,), 100.0):
        pass
    with pytest.raises(RuntimeError, match="stopped answering"), store({}, {}, (0,), 100.0) as s3:
        assert s3.stats()[0] == {0: 0}
        s3.proc.kill()
        s3.stats()
    assert time.monotonic() - t0 < 120


@pytest.mark.skipif(
    len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="pins a process to some of 2+ CPUs: Linux"
)
def test_the_store_runs_on_the_cpus_it_is_given(tmp_path):
    """--store-cpus: every thread of the store's process (its interpreter's, its servers', those answering) runs on
    the CPUs given, a GET through it still answers, and the thread that started it is back on all of its own."""
    pytest.importorskip("moto")
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    from benchmarks.remote import store

    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blob.bin").write_bytes(b"x" * 1000)
    with store({"blobs": tmp_path / "src"}, {}, (0,), 100.0, frozenset({cpu})) as s3:
        assert os.sched_getaffinity(0) == mine
        fs = fsspec.filesystem("s3", endpoint_url=s3.urls[0], skip_instance_cache=True)
        assert fs.cat_file("blobs/ds/blob.bin") == b"x" * 1000
        allowed = set()
        tids = os.listdir(f"/proc/{s3.proc.pid}/task")
        for tid in tids:
            with contextlib.suppress(OSError):  # a thread that answered a request, ended since
                status = Path(f"/proc/{s3.proc.pid}/task/{tid}/status").read_text()
                allowed |= {ln.split(":")[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_l")}
        assert allowed == {str(cpu)} and len(tids) > 2  # its server threads among them


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="pins processes to CPUs: Linux")
def test_cpu_lists_are_checked_before_anything_runs(monkeypatch):
    """--store-cpus and --loader-cpus: a malformed list, a CPU this process may not use, a CPU in both, none left
    for the other, or a pinning the system refuses is an error naming the option; one given, the other takes the
    remaining CPUs; neither given pins nothing."""
    from benchmarks.cli import build_parser, check_args
    from benchmarks.common import parse_cpus

    assert parse_cpus(" 0 , 2-4,3") == {0, 2, 3, 4}
    for bad in ("", "1-", "3-1", "0,,1", "+1", "1_0", "0-99999999"):
        with pytest.raises(ValueError, match="not a CPU"):
            parse_cpus(bad)

    def checked(*argv: str):
        args = build_parser().parse_args(["--sections", "ranges", *argv])
        return check_args(args), args

    err, args = checked()
    assert err is None and args.store_cpus is None and args.loader_cpus is None
    assert checked("--store-cpus", "a-b")[0].startswith("--store-cpus: 'a-b'")
    assert "are not among" in checked("--loader-cpus", "0,4096")[0]
    usable = frozenset(os.sched_getaffinity(0))
    assert "leaves no CPU for the store" in checked("--loader-cpus", ",".join(map(str, usable)))[0]
    cpu = min(usable)
    assert "share CPUs" in checked("--store-cpus", str(cpu), "--loader-cpus", str(cpu))[0]
    if len(usable) > 1:
        err, args = checked("--store-cpus", str(cpu))
        assert err is None and args.store_cpus == {cpu} and args.loader_cpus == usable - {cpu}

        def refused(pid: int, cpus) -> None:  # as a container without CAP_SYS_NICE may answer
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "sched_setaffinity", refused)
        err, _ = checked("--store-cpus", str(cpu))
        assert err.startswith("--store-cpus: this process may not pin itself") and "not permitted" in err, err


def test_wait_is_counted_per_worker_from_its_first_batch():
    from benchmarks.remote import _wait_after_first_batch

    metas = [
        {"worker_slot": 0, "remote": {"wait_ms": 300}},  # its first shard, before the timed part
        {"worker_slot": 1, "remote": {"wait_ms": 250}},
        {"worker_slot": 0, "remote": {"wait_ms": 340}},
        {"worker_slot": 1, "remote": {"wait_ms": 250}},
        {"worker_slot": 0, "remote": {"wait_ms": 400}},
    ]
    assert _wait_after_first_batch(metas) == pytest.approx(0.1)
    assert _wait_after_first_batch([{"n_samples": 3}]) == 0  # a local dataset: no remote counters


def test_a_remote_pass_is_compared_with_local_disk_at_its_own_moment():
    """``bracketed``: each remote pass's local rate is its reader's local rate interpolated, by time, between the
    local passes that open and close its round (prefetch off against ours), so a machine speeding up or slowing
    down between them moves both sides of the ratio."""
    from benchmarks.remote import OURS, OURS_NO_PREFETCH, bracketed

    def rates(whole: float) -> dict[str, float]:  # the rate after the first batch: 10% higher
        return {"samples_per_s": whole, "steady_samples_per_s": 1.1 * whole}

    brackets = [
        {OURS: (0.0, rates(100.0)), "litdata": (1.0, rates(90.0))},
        {OURS: (10.0, rates(200.0)), "litdata": (11.0, rates(90.0))},
        {OURS: (20.0, rates(100.0)), "litdata": (21.0, rates(80.0))},
    ]
    runs = {
        (OURS, None, None): [{"t": 0.0, "local": 100.0}],  # local passes keep their own rate
        (OURS, 20, True): [{"t": 5.0, "after": 0}, {"t": 12.5, "after": 1}],
        (OURS_NO_PREFETCH, 20, False): [{"t": 2.5, "after": 0}],
        ("litdata", 20, True): [{"t": 16.0, "after": 1}],
    }
    bracketed(runs, brackets)
    assert [r["local"] for r in runs[(OURS, 20, True)]] == [150.0, 175.0]
    assert [r["local_steady"] for r in runs[(OURS, 20, True)]] == pytest.approx([165.0, 192.5])
    assert runs[(OURS_NO_PREFETCH, 20, False)][0]["local"] == 125.0
    assert runs[("litdata", 20, True)][0]["local"] == 85.0
    assert runs[(OURS, None, None)][0]["local"] == 100.0
    with pytest.raises(AssertionError, match="outside its round"):  # a pass after the local passes closing it
        bracketed({(OURS, 20, True): [{"t": 25.0, "after": 1}]}, brackets)


def test_peer_table_pairs_passes_of_the_same_round():
    """*ours / peer* divides each round's passes pairwise (not the medians), and every row keeps its runs."""
    from benchmarks.remote import Rows
    from benchmarks.report import render_peers

    def run(rate: float, local: float, sent: int | None = None) -> dict:
        r = {"samples_per_s": rate, "steady_samples_per_s": rate, "local": local, "local_steady": local}
        r |= {"first_batch_s": 0.1}
        r |= {"store_cpu_s": 0.1}
        return r if sent is None else r | {"sent": sent, "sent_by_first": sent // 2}

    ours, theirs = Rows(lambda _: None), Rows(lambda _: None)
    ours.record("S3 +20 ms, cold", 20, True, True, [run(90, 100, 10), run(300, 300, 10), run(150, 200, 10)])
    ours.record("local disk", None, None, None, [run(100, 100), run(300, 300), run(200, 200)])
    theirs.record("litdata: S3 +20 ms, cold", 20, None, True, [run(60, 50, 8), run(200, 400, 8), run(300, 300, 8)])
    theirs.record("litdata: local disk", None, None, None, [run(50, 50), run(400, 400), run(300, 300)])
    result = {
        "dataset_bytes": 10,
        "plan": {"reps": 3},
        "rows": list(ours),
        "peers": {"prepared": {"litdata": {"seconds": 1.0, "bytes": 8}}, "missing": [], "rows": list(theirs)},
    }
    text = render_peers(result)
    lines: dict[str, str] = {}  # each row's first line: the main table's, not the first-batch table's
    for line in text.splitlines():
        if line.startswith("| "):
            lines.setdefault(line.split(" | ")[0], line)
    # ratios 1.5, 1.5, 0.5 -> median 1.5; medians alone would give 150 / 200 = 0.75
    assert lines["| S3 +20 ms, cold"].endswith("| 200 (100%, 1.00x, 0.10 s) | 1.50 [0.50-1.50] |")
    assert lines["| local disk"].endswith("| 300 (100%) | 0.75 [0.67-2.00] |")
    assert lines["| S3 +20 ms, cold"].startswith("| S3 +20 ms, cold | 150 (90%, 1.00x, 0.10 s) |")
    # the cold rows' first batches: 5 of 10 bytes by then (ours), 4 of 8 (LitData)
    assert "| S3 +20 ms, cold | 0.10 s / 50% / 150 | 0.10 s / 50% / 200 |" in text


def test_the_peers_read_every_sample_once(tmp_path, make_dataset, tiny_tokenizer):
    """Where megatron-energon and LitData are installed (``benchmarks.peers.PEERS_INSTALL``): each, after its own
    preparation step, reads every sample of the shards exactly once per epoch, with our per-sample work done on
    every one (the tokens they deliver are the tokens our processor makes)."""
    pytest.importorskip("megatron.energon")
    pytest.importorskip("litdata")
    from helpers.data import IMAGE_TOKENS, make_cfg

    from benchmarks import peers
    from nanovlm.data.index import load_index
    from nanovlm.data.processing import SampleProcessor

    make_dataset(tmp_path / "ds", 60, samples_per_shard=10, image_token_count=IMAGE_TOKENS)
    cfg = make_cfg([tmp_path / "ds"])
    processor = SampleProcessor.from_config(tiny_tokenizer, cfg.model, cfg.data)
    index = load_index(tmp_path / "ds")
    tokens = int(index.columns["text_tokens"].sum()) + (IMAGE_TOKENS - 1) * int(index.columns["n_images"].sum())
    energon_dir, _ = peers.prepare_energon(tmp_path / "ds", tmp_path / "wd")
    assert peers.energon_epoch(str(energon_dir), processor, 60)["tokens"] == tokens  # raises unless 60 keys, once
    litdata_dir, _ = peers.prepare_litdata(tmp_path / "ds", tmp_path / "wd")
    assert peers.litdata_epoch(str(litdata_dir), processor, 60, cache_dir=str(tmp_path / "c"))["tokens"] == tokens


def test_compiled_step_rows_train_the_static_packs_like_eager(tmp_path, make_dataset, tiny_tokenizer):
    """``--compile-step`` on CPU: the packed plan as static packs, eager and with the whole step compiled, gives the
    packed row's losses, compiles one graph for every pack with no break, and reports tokens/s and the host time of
    a profiled step. The aot_eager backend captures the graph (forward + backward) as inductor would, without its
    code generation, which takes most of a minute here; inductor's compiled step is checked against eager by
    test_cli_train.py, and the dry run of scripts/gpu_check.sh below runs these rows with inductor."""
    make_dataset(tmp_path / "ds", 80, samples_per_shard=40)
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "c.json"
    args = ["--quick", "--sections", "train", "--data", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "tok")]
    args += ["--train-samples", "60", "--reps", "1", "--train-modes", "packed", "--compile-step", "--json", str(out)]
    args += ["--compile-backend", "aot_eager"]
    args += ["--set", "model.language.num_layers=1", "--set", "model.vision.num_layers=1"]
    assert main(args) == 0
    train = json.loads(out.read_text())["sections"]["train"]
    assert list(train["modes"]) == ["packed", STATIC_EAGER, STATIC_COMPILED] and train["backends"] == []
    packed, eager, compiled = train["modes"].values()
    assert packed["steps_per_pass"] >= 2  # several packs, all through the one compiled graph
    for row in (packed, eager, compiled):
        assert row["error"] is None and row["fill"] == packed["fill"]
        assert row["steps_per_pass"] == packed["steps_per_pass"] and row["real_tokens_per_s"]["median"] > 0
        assert row["profile"]["host_ms"] > 0 and row["profile"]["device_ms"] is None  # no device on CPU
    # the same packs from the same seed: the same losses, step after step (first: before any update)
    assert eager["first_losses"][0] == pytest.approx(packed["first_losses"][0], rel=1e-5)
    n = len(eager["first_losses"])
    assert n >= 2 and compiled["first_losses"][:n] == pytest.approx(eager["first_losses"], rel=1e-4)
    assert compiled["compile_counters"] == {"unique_graphs": 1, "graph_breaks": 0, "cudagraph_skips": 0}
    assert compiled["first_step_s"] > eager["first_step_s"]  # the compilation is in the warm-up
    assert compiled["launches_per_step"] > 0
    static = train["layout"]["static"]
    assert static["image_slots"] >= static["images_per_pack_mean"] > 0 and static["segments"] > 1
    assert train["ratio_check"] is None and train["loss_position_head"] is None  # their rows were not asked for


GPU_CHECK = REPO / "scripts" / "gpu_check.sh"


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)


@pytest.mark.slow
def test_gpu_check_dry_run_records_every_part(tmp_path, make_dataset, tiny_tokenizer):
    """``GPU_CHECK_DRY=1 scripts/gpu_check.sh``: the GPU run's parts on CPU at tiny sizes (the install check, pytest
    -m gpu, the decode benchmark, an eager and a compiled-step train run), each recorded with its JSON, and a
    summary; exit 0."""
    make_dataset(tmp_path / "ds", 60, samples_per_shard=30)
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out)}
    env["GPU_CHECK_BENCH_ARGS"] = f"--data {tmp_path / 'ds'} --tokenizer {tmp_path / 'tok'}"
    done = subprocess.run(["bash", str(GPU_CHECK)], env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    parts = {p["part"]: p for p in summary["parts"]}
    assert list(parts) == ["install", "pytest_gpu", "decode", "train_dry_eager", "train_dry_step"]  # no demo
    assert all(p["status"] == "ok" for p in parts.values()), parts
    assert summary["pytest_gpu"]["tests"] > 0 and summary["pytest_gpu"]["failed"] == []
    rows = {r["row"]: r for r in summary["train"]["train_dry_step"]["rows"]}
    assert set(rows) == {"packed", STATIC_EAGER, STATIC_COMPILED}
    assert rows[STATIC_COMPILED]["first_loss"] == pytest.approx(rows[STATIC_EAGER]["first_loss"], rel=1e-4)
    eager_rows = {r["row"] for r in summary["train"]["train_dry_eager"]["rows"]}
    decode = summary["decode"]
    assert [r["path"] for r in decode["rows"]] == ["worker", "device"]
    assert all(r["images_per_s"] > 0 and r["host_cpu_ms_per_image"] > 0 for r in decode["rows"])
    # off CUDA both decode paths use Pillow: only the resize filters differ, by rounding
    assert decode["decoder"].startswith("Pillow") and decode["pixel_diff_vs_worker_no_draft"]["max"] <= 4
    assert {"packed", "pad_to_longest", "packed/sdpa"} <= eager_rows
    table = (out / "summary.md").read_text()
    assert "| dry_step | packed/static compiled step |" in table and "| decode | JPEG, device |" in table
    for name in ("env.json", "gpu_check.log", "train_dry_eager.json", "train_dry_step.md", "pytest_gpu.xml"):
        assert (out / name).stat().st_size > 0, name
