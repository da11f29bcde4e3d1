"""The transformers round trip as users run it: a SmolVLM-architecture (Idefics3) checkpoint -> ``scripts/train.py``
with ``model.vlm_checkpoint`` -> ``scripts/export_hf.py`` -> ``Idefics3ForConditionalGeneration.from_pretrained``,
whose logits equal the trained model's."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from helpers.runs import TIMEOUT, final_weights, run_train, tiny_overrides
from PIL import Image

from nanovlm.config import load_config
from nanovlm.data.demo import generate_records
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.tokenizer import load_tokenizer
from nanovlm.model import build_model, resolve_vocab_size

transformers = pytest.importorskip("transformers")


def micro_idefics3(tokenizer, vocab: int, scale: int):
    """A random Idefics3 with the shapes of helpers.training.MICRO_MODEL and the demo tokenizer's <image> id."""
    torch.manual_seed(0)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64)  # fmt: skip
    text = transformers.LlamaConfig(vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, rope_theta=100000.0,
                                    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)  # fmt: skip
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=scale,
                                      image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                      tie_word_embeddings=True)  # fmt: skip
    return transformers.Idefics3ForConditionalGeneration(cfg).eval()


SMOLVLM_LAYOUT = ["model.vision.image_splitting=true", "model.vision.longest_edge=32", "data.max_images=80"]


@pytest.mark.slow
def test_idefics3_in_train_export_out_equal_logits(small_demo, tmp_path):
    """With SmolVLM's image layout (Idefics3's grid rule, read from the checkpoint's processor and checked):
    the exported processor prepares a demo sample as training did, and the exported model gives its logits."""
    overrides = [*tiny_overrides(small_demo), *SMOLVLM_LAYOUT]
    cfg = load_config(["tiny_cpu.yaml"], overrides)  # what scripts/train.py loads
    tok = load_tokenizer(str(small_demo / "tokenizer"), image_splitting=True)
    hf = micro_idefics3(tok, resolve_vocab_size(cfg.model, tok), cfg.model.projector.pixel_shuffle_factor)
    hf.save_pretrained(tmp_path / "start")
    tok.save_pretrained(tmp_path / "start")  # its tokenizer.json: the run checks data.tokenizer against it
    transformers.Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16}).save_pretrained(tmp_path / "start")  # fmt: skip
    run, out = tmp_path / "run", tmp_path / "exported"
    log = run_train(
        small_demo, run, f"model.vlm_checkpoint={tmp_path / 'start'}", "trainer.max_steps=3", *SMOLVLM_LAYOUT
    )
    assert f"all from {tmp_path / 'start'}" in log
    export = [sys.executable, "scripts/export_hf.py", str(run), str(out)]
    proc = subprocess.run(export, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with its processor" in proc.stdout
    back = transformers.Idefics3ForConditionalGeneration.from_pretrained(out).eval()

    ours = build_model(cfg.model, tok).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in final_weights(run, 3).items()})
    start = hf.model.connector.modality_projection.proj.weight
    assert not torch.equal(ours.projector.proj.weight, start)  # it trained
    assert torch.equal(back.model.connector.modality_projection.proj.weight, ours.projector.proj.weight)
    record = next(
        r for r in generate_records(20, "val") if r.messages[0]["content"].count("<image>") == len(r.images) > 0
    )
    question = record.messages[:1]  # the first user turn, with its images
    ids, pixels = SampleProcessor.from_config(tok, cfg.model, cfg.data).prompt(question, record.images)
    assert len(pixels) > len(record.images)  # tiled
    hf_proc = transformers.AutoProcessor.from_pretrained(out, backend="pil")
    text = hf_proc.apply_chat_template(question, add_generation_prompt=True)
    enc = hf_proc(text=text, images=[Image.open(io.BytesIO(b)) for b in record.images], return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ids
    batch = {"input_ids": torch.tensor([ids]), "position_ids": torch.arange(len(ids))[None], "pixel_values": pixels,
             "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32), "max_seqlen": len(ids)}  # fmt: skip
    with torch.no_grad():
        want = back(**enc).logits[0]
        torch.testing.assert_close(ours(batch)["logits"][0], want, atol=1e-4, rtol=1e-4)


def test_export_cli_errors(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", str(tmp_path), str(tmp_path / "o")], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 1 and "no config.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_export_without_a_checkpoint_names_where_it_looked(tmp_path):
    from nanovlm.cli.export_hf import main
    from nanovlm.config import save_config

    cfg = load_config(["tiny_cpu.yaml"], [f"trainer.run_dir={tmp_path}"])
    save_config(cfg, tmp_path)
    with pytest.raises(SystemExit, match="no checkpoint in .*checkpoints"):
        main([str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"--checkpoint .*nope.ckpt: no such checkpoint \(file or sharded directory\)"):
        main([str(tmp_path), str(tmp_path / "out"), "--checkpoint", str(tmp_path / "nope.ckpt")])
