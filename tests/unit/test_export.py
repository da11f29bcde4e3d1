"""model/export.py's processor: transformers' AutoProcessor, loaded from an export, prepares the inputs training
prepared (token ids, pixels), so the exported model gives our logits on a conversation and its images."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from nanovlm.config import load_config
from nanovlm.data.processing import SampleProcessor
from nanovlm.data.tokenizer import load_tokenizer
from nanovlm.model import build_model
from nanovlm.model.export import export_idefics3

SPLIT = ["model.vision.image_splitting=true"]
IDEFICS3_RULE = [*SPLIT, "model.vision.longest_edge=96"]  # 3 tiles of 32 px on the longest side
ONE_VIEW = [*SPLIT, "model.vision.max_tiles=1"]


# SmolVLM's chat template as its processor ships it (list content only): the reference for data.chat_format=smolvlm
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def split_tokenizer_dir(tiny_tokenizer, tmp_path_factory):
    """The tiny tokenizer, with SmolVLM's end-of-turn token added (as SmolVLM's tokenizer has it)."""
    path = tmp_path_factory.mktemp("tok") / "tok"
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_utterance>"]}, replace_extra_special_tokens=False)
    tok.save_pretrained(path)
    return path


def png(w: int, h: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def exported(tmp_path, tokenizer_dir, overrides: list[str]):
    cfg = load_config(["tiny_cpu.yaml"], overrides)
    tok = load_tokenizer(tokenizer_dir, cfg.model.vision.image_splitting)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok).eval()
    out, why_not = export_idefics3(model, tok, tmp_path / "out", cfg.data.image_resize, cfg.data.chat_format)
    return cfg, tok, model, out, why_not


def our_logits(model, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    batch = {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.arange(len(ids))[None],
        "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32),
        "max_seqlen": len(ids),
        "pixel_values": pixels,
    }
    with torch.no_grad():
        return model(batch)["logits"][0]


@pytest.mark.parametrize(
    "overrides",
    [IDEFICS3_RULE, ONE_VIEW, [*IDEFICS3_RULE, "data.chat_format=smolvlm"]],
    ids=["idefics3_rule", "one_view", "smolvlm_chat"],
)
def test_auto_processor_prepares_what_training_prepared(tmp_path, split_tokenizer_dir, overrides):
    cfg, tok, model, out, why_not = exported(tmp_path, split_tokenizer_dir, overrides)
    assert why_not == ""
    hf_proc = transformers.AutoProcessor.from_pretrained(out, backend="pil")
    hf_model = transformers.Idefics3ForConditionalGeneration.from_pretrained(out).eval()
    ours = SampleProcessor.from_config(tok, cfg.model, cfg.data)
    images = [png(150, 40, 0), png(33, 90, 1)]  # a wide strip and a tall image: grids 1 x 3 and 3 x 2
    messages = [
        {"role": "user", "content": "<image>what is here? and <image>"},
        {"role": "assistant", "content": "a red square"},
        {"role": "user", "content": "and the colour?"},
    ]
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is here? and "}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a red square"}]},
        {"role": "user", "content": [{"type": "text", "text": "and the colour?"}]},
    ]  # fmt: skip
    ids, pixels = ours.prompt(messages, images)
    text = hf_proc.apply_chat_template(hf_messages, add_generation_prompt=True)
    as_string = [{"role": "user", "content": "<image>what is here? and <image>"}]  # content as one string
    assert hf_proc.apply_chat_template(as_string) == hf_proc.apply_chat_template(hf_messages[:1])
    if cfg.data.chat_format == "smolvlm":  # the exported template renders as SmolVLM's own does
        assert text == hf_proc.apply_chat_template(
            hf_messages, add_generation_prompt=True, chat_template=SMOLVLM_TEMPLATE
        )
        assert text.startswith("<|im_start|>User:<image>what is here?") and text.endswith("\nAssistant:")
    pil = [Image.open(io.BytesIO(b)) for b in images]
    enc = hf_proc(text=text, images=pil, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ids
    mean, std = torch.tensor(cfg.model.vision.image_mean), torch.tensor(cfg.model.vision.image_std)
    normalised = (pixels.float() / 255 - mean[:, None, None]) / std[:, None, None]
    theirs = enc["pixel_values"][0][enc["pixel_attention_mask"][0].flatten(1).any(1)]  # its padding images dropped
    torch.testing.assert_close(theirs, normalised, atol=1e-6, rtol=0)
    end = "<end_of_utterance>" if cfg.data.chat_format == "smolvlm" else "<|im_end|>"
    assert hf_model.config.text_config.eos_token_id == tok.convert_tokens_to_ids(end)  # generation stops per turn
    if overrides is IDEFICS3_RULE:
        assert len(pixels) == (3 + 1) + (6 + 1)  # the tiles really were split, as transformers split them
    with torch.no_grad():
        hf = hf_model(**enc).logits[0]
    torch.testing.assert_close(our_logits(model, ids, pixels), hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ([], "without markers"),
        ([*SPLIT, "model.vision.max_tiles=4"], "this project's grid rule"),
        ([*ONE_VIEW, "data.image_resize=letterbox"], "image_resize=letterbox"),
    ],
)
def test_layouts_transformers_cannot_express_get_no_processor(tmp_path, split_tokenizer_dir, overrides, reason):
    """The weights and tokenizer are written; a processor that would prepare other inputs is not."""
    *_, out, why_not = exported(tmp_path, split_tokenizer_dir, overrides)
    assert reason in why_not
    assert not (out / "preprocessor_config.json").exists() and (out / "model.safetensors").is_file()
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template  # the ChatML the run trained on
