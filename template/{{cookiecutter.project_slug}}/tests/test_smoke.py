"""CPU smoke test: decode a few raw samples, prepare a dataset (bad lines skipped and listed), train 2 steps of a
tiny model and evaluate it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from {{ cookiecutter.package_name }}.decode import decode_sample  # noqa: E402

TINY_MODEL = [
    "model.vision.image_size=16",
    "model.vision.patch_size=4",
    "model.vision.hidden_size=32",
    "model.vision.num_layers=1",
    "model.vision.num_heads=2",
    "model.vision.intermediate_size=64",
    "model.language.hidden_size=48",
    "model.language.num_layers=2",
    "model.language.num_heads=4",
    "model.language.num_kv_heads=2",
    "model.language.intermediate_size=96",
]


def write_raw(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        colour = ("red", "blue")[i % 2]
        buf = io.BytesIO()
        Image.new("RGB", (24, 24), colour).save(buf, "PNG")
        (folder / f"{i}.png").write_bytes(buf.getvalue())
        lines.append(json.dumps({"image": f"{i}.png", "question": "What colour is it?", "answer": colour}))
    path = folder / "samples.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_decode_sample(tmp_path):
    raw = write_raw(tmp_path / "raw", 1)
    record = decode_sample(json.loads(raw.read_text()), "k0", raw.parent)
    assert record.messages[0]["content"].count("<image>") == len(record.images) == 1
    assert record.extra == {"answer": "red"}


def test_prepare_skips_and_lists_bad_lines(tmp_path):
    raw = write_raw(tmp_path / "raw", 3)
    (tmp_path / "raw" / "broken.png").write_bytes(b"not an image")
    bad = [
        "{not json",
        json.dumps({"image": "0.png", "question": "What colour is it?"}),  # no answer
        json.dumps({"image": "../../../etc/hostname", "question": "q", "answer": "a"}),  # outside the data folder
        json.dumps({"image": "broken.png", "question": "q", "answer": "a"}),
    ]
    raw.write_text(raw.read_text() + "\n".join(bad) + "\n")
    out = tmp_path / "data" / "train"
    cmd = [sys.executable, "scripts/prepare_data.py", "--input", str(raw), "--out", str(out), "--build-tokenizer",
           f"data.tokenizer={tmp_path}/tokenizer"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote 3 of 7 samples" in proc.stdout
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["source"].rsplit(":", 1)[1]) for r in rejected] == [
        ("bad_json", "4"),
        ("missing_field", "5"),
        ("unsafe_path", "6"),
        ("unreadable_image", "7"),
    ]


def test_prepare_and_train_two_steps(tmp_path):
    data = tmp_path / "data"
    common = [
        *TINY_MODEL,
        f"data.train=[{data}/train]",
        f"data.val=[{data}/val]",
        f"data.tokenizer={data}/tokenizer",
    ]
    for split, n, build in (("train", 24, True), ("val", 6, False)):
        raw = write_raw(tmp_path / "raw" / split, n)
        cmd = [sys.executable, "scripts/prepare_data.py", "--input", str(raw), "--out", str(data / split), *common]
        subprocess.run(cmd + (["--build-tokenizer"] if build else []), cwd=ROOT, check=True, timeout=300)
    run_dir = tmp_path / "run"
    train = [
        sys.executable,
        "scripts/train.py",
        *common,
        "data.max_tokens=128",
        "data.num_workers=0",
        f"trainer.run_dir={run_dir}",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        "trainer.eval_samples=2",
    ]
    proc = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-00000002.ckpt").is_file()
    assert "[eval] held-out answer accuracy" in proc.stdout
    losses = [json.loads(line)["loss"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)
