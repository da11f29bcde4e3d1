"""End-of-run evaluation: unusable held-out samples are counted skips, any valid conversation shape works."""

from __future__ import annotations

import pytest
from helpers import faults
from helpers.data import make_cfg

from nanovlm.data.format import Record
from nanovlm.data.prepare import write_dataset
from nanovlm.model import build_model
from nanovlm.train.evaluate import evaluate_answers, format_report


def test_evaluation_skips_and_counts_unusable_samples(tmp_path, tiny_tokenizer):
    user = {"role": "user", "content": "<image>\nWhat colour is it?"}
    records = [
        Record("q0", [user, {"role": "assistant", "content": "red"}], [faults.png(seed=0)], {"answer": "red"}),
        Record("q1", [user, {"role": "assistant", "content": "blue"}], [faults.png(seed=1)], {"answer": "blue"}),
        Record("q2", [{"role": "assistant", "content": "green"}], [], {"answer": "green"}),  # no question
        Record("q3", [user, {"role": "assistant", "content": "big"}], [faults.png((64, 64))], {"answer": "big"}),
    ]
    write_dataset(records, tmp_path / "val", tiny_tokenizer, 16, samples_per_shard=8)
    # same-size garbage for q1's image: the index stays valid, the image is unreadable when decoded
    faults.rewrite_shard(
        tmp_path / "val", 0, lambda key, suffix, data: b"\0" * len(data) if key == "q1" and suffix != "json" else data
    )
    cfg = make_cfg([tmp_path / "val"], [tmp_path / "val"], max_image_pixels=40 * 40)  # q3's 64x64 image: too large
    model = build_model(cfg.model, tiny_tokenizer)
    result = evaluate_answers(model, tiny_tokenizer, cfg, [str(tmp_path / "val")], limit=10)
    assert [r["key"] for r in result["rows"]] == ["q0", "q2"]
    assert result["skipped"] == {"unreadable_image": 1, "image_too_large": 1}
    assert result["rows"][1]["question"] == ""  # a conversation with no user turn has no question to show
    assert "skipped 2 unusable samples (image_too_large=1, unreadable_image=1)" in format_report(result)


def test_a_perfect_model_scores_every_long_answer_and_prompts_fill_no_context(tmp_path, tiny_tokenizer, monkeypatch):
    """An oracle that generates exactly the expected answer scores 100%, however long the answer (a fixed budget of
    8 new tokens cut every caption); a prompt that fills the model's context is a counted skip, not an error."""
    import torch

    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.tokenizer import IM_END

    long_answer = "a small red square sits in the middle of a large blue field next to a green circle"
    user = {"role": "user", "content": "<image>\nDescribe it."}
    records = [
        Record("long", [{"role": "user", "content": "<image>\nDescribe it in detail."}, {"role": "assistant", "content": long_answer}], [faults.png(seed=0)], {"answer": long_answer}),
        Record("short", [user, {"role": "assistant", "content": "red"}], [faults.png(seed=1)], {"answer": "red"}),
        Record("huge", [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "x"}], [], {"answer": "x"}),
    ]  # fmt: skip
    write_dataset(records, tmp_path / "val", tiny_tokenizer, 16, samples_per_shard=8)
    cfg = make_cfg([tmp_path / "val"], [tmp_path / "val"])
    model = build_model(cfg.model, tiny_tokenizer)
    eos = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    answers = {
        len(SampleProcessor(tiny_tokenizer, 32, 16).prompt(r.messages[:-1], r.images)[0]): r.extra["answer"]
        for r in records
    }

    def oracle(input_ids, pixel_values=None, max_new_tokens=32, eos_token_id=None, **kw):
        ids = tiny_tokenizer.encode(answers[input_ids.shape[1]], add_special_tokens=False) + [eos]
        return torch.tensor([ids[:max_new_tokens]])

    monkeypatch.setattr(model, "generate", oracle)
    result = evaluate_answers(model, tiny_tokenizer, cfg, [str(tmp_path / "val")], limit=10)
    assert [(r["key"], r["correct"]) for r in result["rows"]] == [("long", True), ("short", True)]
    assert result["accuracy"] == 1.0 and result["skipped"] == {"overlength": 1}


def test_chance_is_the_demos_only_on_demo_samples():
    """A user task named like a demo task ("count", 10 equally likely answers) was given the demo's 25% chance."""
    from nanovlm.train.evaluate import chance_level

    user = [{"key": f"q{i}", "task": "count", "expected": str(i % 10)} for i in range(20)]
    assert chance_level(user) == pytest.approx(0.1)  # the majority baseline: 2 of 20
    assert chance_level([dict(r, key=f"demo-{i:08d}") for i, r in enumerate(user)]) == pytest.approx(0.1)  # demo.jsonl
    demo = [dict(r, key=f"demo-val-{i:06d}") for i, r in enumerate(user)]
    from nanovlm.data.demo import CHANCE

    assert chance_level(demo) == pytest.approx(CHANCE["count"]) == 0.25


def test_every_validation_directory_is_evaluated(tmp_path, tiny_tokenizer):
    """The first eval_samples came from the first directory only; now the directories take turns."""
    from nanovlm.train.evaluate import iter_answered_records

    for name in ("a", "b"):
        recs = [
            Record(f"{name}{i}", [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "x"}], [],
                   {"answer": "x"})
            for i in range(5)
        ]  # fmt: skip
        write_dataset(recs, tmp_path / name, tiny_tokenizer, 16, samples_per_shard=2)
    got = [r.key for r in iter_answered_records([str(tmp_path / "a"), str(tmp_path / "b")], limit=6)]
    assert got == ["a0", "b0", "a1", "b1", "a2", "b2"]
    got = [r.key for r in iter_answered_records([str(tmp_path / "a"), str(tmp_path / "b")], limit=100)]
    assert sorted(got) == [f"{n}{i}" for n in "ab" for i in range(5)]


def test_blank_image_ablation_scores_each_sample_twice_and_reports_per_task(tmp_path, tiny_tokenizer, monkeypatch):
    """A model that answers from the pixels scores 100% with its images and the majority guess with blank ones;
    a sample without images is generated once and counts the same in both columns; eval.json holds it all."""
    import json

    import torch

    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.tokenizer import IM_END
    from nanovlm.train.evaluate import blank_like, write_eval

    user = {"role": "user", "content": "<image>\nWhat colour is it?"}
    colours = ["red", "blue", "red", "green"]
    records = [
        Record(f"c{i}", [user, {"role": "assistant", "content": c}], [faults.png(seed=i)], {"answer": c, "task": "colour"})
        for i, c in enumerate(colours)
    ] + [Record("t0", [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}], [],
                {"answer": "yes", "task": "text"})]  # fmt: skip
    write_dataset(records, tmp_path / "val", tiny_tokenizer, 16, samples_per_shard=8)
    cfg = make_cfg([tmp_path / "val"], [tmp_path / "val"])
    model = build_model(cfg.model, tiny_tokenizer)
    eos = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    proc = SampleProcessor(tiny_tokenizer, cfg.model.vision.image_size, 16)
    by_pixels = {proc.images(r.images).sum().item(): r.extra["answer"] for r in records if r.images}
    blank = blank_like(proc.images(records[0].images), cfg.model.vision.image_mean)
    assert blank.dtype == torch.uint8 and model.normalize(blank).abs().max() < 0.01  # the encoder sees ~zeros
    calls = []

    def looks(input_ids, pixel_values=None, max_new_tokens=32, eos_token_id=None, **kw):
        calls.append(pixel_values is None)
        if pixel_values is None:
            answer = "yes"
        else:  # the colour it was shown; for a blank image, always "red" (the majority answer)
            answer = by_pixels.get(pixel_values.sum().item(), "red")
        return torch.tensor([tiny_tokenizer.encode(answer, add_special_tokens=False) + [eos]])

    monkeypatch.setattr(model, "generate", looks)
    result = evaluate_answers(model, tiny_tokenizer, cfg, [str(tmp_path / "val")], limit=10)
    assert len(calls) == 4 * 2 + 1  # two passes for each sample with images, one for the text-only sample
    assert result["accuracy"] == 1.0 and result["accuracy_blank"] == pytest.approx(3 / 5)
    assert result["vision_lift"] == pytest.approx(2 / 5)
    colour = result["by_task"]["colour"]
    assert (colour["n"], colour["accuracy"], colour["accuracy_blank"], colour["chance"]) == (4, 1.0, 0.5, 0.5)
    assert result["by_task"]["text"]["accuracy_blank"] == 1.0 and result["by_task"]["text"]["with_images"] == 0
    report = format_report(result)
    assert "with blank images 60.0%: the images add +40.0 points" in report
    assert "colour" in report and "(no images)" in report
    saved = json.loads(write_eval(result, tmp_path / "run", step=7).read_text())
    assert saved["step"] == 7 and saved["by_task"]["colour"]["accuracy_blank"] == 0.5 and len(saved["rows"]) == 5
    without = evaluate_answers(model, tiny_tokenizer, cfg, [str(tmp_path / "val")], limit=10, blank_images=False)
    assert without["accuracy_blank"] is None and "blank" not in format_report(without).splitlines()[0]
