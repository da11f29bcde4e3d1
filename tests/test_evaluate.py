"""End-of-run evaluation: unusable held-out samples are counted skips, any valid conversation shape works."""

from __future__ import annotations

import faults
from test_datamodule import make_cfg

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
