"""``train()`` end to end on a demo dataset whose answers follow from the image, then the evaluation: a trained
model gets a vision lift that a blind one cannot."""

from __future__ import annotations

import pytest

from nanovlm.data.format import Record
from nanovlm.data.prepare import write_dataset
from nanovlm.model import build_model
from nanovlm.train.evaluate import evaluate_answers, format_report


def _demo_tasks(root, tasks: tuple[str, ...], n_train: int, n_val: int):
    """A demo dataset of only ``tasks`` (their answers follow from the image alone) with its own tokenizer."""
    import numpy as np

    from nanovlm.data.demo import make_sample, tokenizer_texts
    from nanovlm.data.tokenizer import build_tokenizer

    def records(split: int, n: int):
        for i in range(n):
            rng = np.random.default_rng([7, split, i])
            messages, images, extra = make_sample(tasks[i % len(tasks)], rng)
            yield Record(f"demo-{'train' if split == 0 else 'val'}-{i:06d}", messages, images, extra)

    train = list(records(0, n_train))
    tok = build_tokenizer(root / "tokenizer", tokenizer_texts(train), vocab_size=512)
    write_dataset(train, root / "train", tok, 16, samples_per_shard=500)
    write_dataset(records(1, n_val), root / "val", tok, 16, samples_per_shard=500)


@pytest.mark.slow
def test_a_trained_model_gets_a_vision_lift_that_a_blind_one_cannot(tmp_path, monkeypatch):
    """Briefly trained on questions only the image answers, the model gains most of its accuracy from the pixels;
    with its image embeddings zeroed (a blind model: the image path broken) the same evaluation gives no lift."""
    import torch

    from nanovlm.config import load_config
    from nanovlm.train.run import train

    _demo_tasks(tmp_path / "d", ("colour", "background"), n_train=1200, n_val=60)
    d = tmp_path / "d"
    cfg = load_config(
        ["tiny_cpu.yaml"],
        [f"data.train=[{d}/train]", f"data.val=[{d}/val]", f"data.tokenizer={d}/tokenizer", "data.max_tokens=512",
         "data.num_workers=0", "trainer.max_steps=150", "trainer.val_every_n_steps=0", "trainer.progress_bar=false",
         "trainer.logger=none", "checkpoint.every_n_steps=0", f"trainer.run_dir={tmp_path}/run",
         "trainer.eval_samples=60", "optim.warmup_steps=15"],
    )  # fmt: skip
    result = train(cfg)
    ev = result.eval
    assert ev["n"] == 60
    chance = ev["chance"]  # (1/6 + 1/3) / 2
    assert ev["accuracy"] >= 0.9, format_report(ev)
    assert ev["vision_lift"] >= 0.5, format_report(ev)  # blank images: about chance
    assert abs(ev["accuracy_blank"] - chance) <= 0.25, format_report(ev)
    assert (tmp_path / "run" / "eval.json").is_file()

    from nanovlm.data.datamodule import PackedMultimodalDataModule

    tok = PackedMultimodalDataModule(cfg.data, cfg.model).tokenizer
    model = build_model(cfg.model, tok)
    state = torch.load(result.last_checkpoint, weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda pixels: torch.zeros_like(encode(pixels)))
    blind = evaluate_answers(model, tok, cfg, cfg.data.val, limit=60)
    assert blind["vision_lift"] == 0.0 and blind["accuracy"] <= chance + 0.25, format_report(blind)
