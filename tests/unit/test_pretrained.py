"""Parity with transformers: tiny random Llama / SigLIP saved with save_pretrained load into our modules and
give the same outputs on the same inputs (fp32). Proves the architecture and the weight loader are the real thing."""

import copy
import dataclasses

import pytest
import torch

from nanovlm.config import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig
from nanovlm.model import CheckpointMismatchError, build_model
from nanovlm.model.language import LanguageModel
from nanovlm.model.pretrained import load_language_weights, load_vision_weights
from nanovlm.model.vision import VisionEncoder

transformers = pytest.importorskip("transformers")

VISION = VisionConfig(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
LANGUAGE = LanguageConfig(
    hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=80, rope_theta=50000.0
)
CKPT_VOCAB = 90


def hf_siglip(full: bool = False):
    torch.manual_seed(0)
    vision = transformers.SiglipVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    if full:  # the text+vision SiglipModel that hub checkpoints such as google/siglip-base-patch16-224 hold
        text = transformers.SiglipTextConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
        )
        cfg = transformers.SiglipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
        return transformers.SiglipModel(cfg).eval()
    return transformers.SiglipVisionModel(vision).eval()


# the decoder shapes of LANGUAGE, in transformers' config names
HF_DECODER = dict(
    vocab_size=CKPT_VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=80,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=256,
)


def hf_llama(tie: bool = True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**HF_DECODER, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).eval()


def word_tokenizer(n_words: int):
    """A real fast tokenizer with n_words words and <image> as the next id."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(n_words - 1)}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tok


def saved(model, path):
    """(model, the directory it was written to with save_pretrained)."""
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return saved(hf_siglip(), tmp_path_factory.mktemp("siglip"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved(hf_llama(), tmp_path_factory.mktemp("llama"))


def test_vision_matches_siglip(siglip_dir):
    hf, path = siglip_dir
    ours = VisionEncoder(VISION, attn_backend="sdpa")
    load_vision_weights(ours, str(path))
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state  # post_layernorm applied
        got = ours(pixels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_vision_loads_from_full_siglip_model(tmp_path):
    hf = hf_siglip(full=True)
    hf.save_pretrained(tmp_path)
    ours = VisionEncoder(VISION, attn_backend="sdpa")
    load_vision_weights(ours, str(tmp_path))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.vision_model(pixel_values=pixels).last_hidden_state
        got = ours(pixels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_language_matches_llama(llama_dir, caplog):
    hf, path = llama_dir
    vocab = 128  # larger than the checkpoint's 90: tokens added for the VLM keep their init
    ours = LanguageModel(LANGUAGE, vocab, attn_backend="sdpa")
    with caplog.at_level("WARNING"):
        load_language_weights(ours, str(path))
    # the checkpoint was made for 256 positions, the config allows more: said, not refused
    assert f"max_position_embeddings={LANGUAGE.max_position_embeddings} exceeds" in caplog.text
    ids = torch.randint(0, CKPT_VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ours.embed_tokens(ids), positions)
    torch.testing.assert_close(got[..., :CKPT_VOCAB], want, atol=1e-5, rtol=1e-5)


def test_untied_checkpoint_into_untied_model(tmp_path):
    hf = hf_llama(tie=False)
    hf.save_pretrained(tmp_path)
    cfg = copy.deepcopy(LANGUAGE)
    cfg.tie_embeddings = False
    ours = LanguageModel(cfg, CKPT_VOCAB, attn_backend="sdpa")
    load_language_weights(ours, str(tmp_path))
    ids = torch.randint(0, CKPT_VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ours.embed_tokens(ids), torch.arange(9)[None]), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    with pytest.raises(CheckpointMismatchError, match="tie_embeddings: checkpoint False vs config True"):
        load_language_weights(LanguageModel(LANGUAGE, CKPT_VOCAB), str(tmp_path))


def test_whole_vlm_packed_text_equals_llama(siglip_dir, llama_dir):
    """Both checkpoints through NanoVLM: a packed batch of two text samples gives Llama's logits per sample."""
    (hf_vis, vis_path), (hf_lm, lm_path) = siglip_dir, llama_dir
    cfg = ModelConfig(
        vision=VISION,
        projector=ProjectorConfig(pixel_shuffle_factor=2),
        language=LANGUAGE,
        attn_backend="sdpa",
        vision_checkpoint=str(vis_path),
        language_checkpoint=str(lm_path),
    )
    model = build_model(cfg, word_tokenizer(100))  # 101 tokens -> vocabulary 128, <image> = 100
    assert (model.vocab_size, model.image_token_id) == (128, 100)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, CKPT_VOCAB, (7,), generator=g), torch.randint(0, CKPT_VOCAB, (12,), generator=g)
    batch = {
        "input_ids": torch.cat([a, b])[None],
        "position_ids": torch.cat([torch.arange(7), torch.arange(12)])[None],
        "cu_seqlens": torch.tensor([0, 7, 19], dtype=torch.int32),
        "max_seqlen": 12,
        "pixel_values": torch.zeros(0, 3, 32, 32, dtype=torch.uint8),
    }
    with torch.no_grad():
        logits = model(batch)["logits"][0, :, :CKPT_VOCAB]
        torch.testing.assert_close(logits[:7], hf_lm(input_ids=a[None]).logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[7:], hf_lm(input_ids=b[None]).logits[0], atol=1e-5, rtol=1e-5)
        # and the image path uses SigLIP's features: the model's normalisation of uint8 pixels feeds hf_vis
        pixels = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=g)
        want = hf_vis(pixel_values=(pixels.float() / 255 - 0.5) / 0.5).last_hidden_state
        torch.testing.assert_close(model.vision(model.normalize(pixels)), want, atol=1e-5, rtol=1e-5)


def test_config_mismatch_lists_every_difference(siglip_dir, llama_dir):
    _, vis_path = siglip_dir
    _, lm_path = llama_dir
    wrong_vision = copy.deepcopy(VISION)
    wrong_vision.num_heads, wrong_vision.image_size = 2, 64
    with pytest.raises(
        CheckpointMismatchError, match=r"image_size: checkpoint 32 vs config 64.*num_heads: checkpoint 4 vs config 2"
    ):
        load_vision_weights(VisionEncoder(wrong_vision), str(vis_path))
    wrong_lm = copy.deepcopy(LANGUAGE)
    wrong_lm.rope_theta, wrong_lm.num_kv_heads = 10000.0, 3
    with pytest.raises(CheckpointMismatchError, match=r"num_kv_heads: checkpoint 2 vs config 3.*rope_theta"):
        load_language_weights(LanguageModel(wrong_lm, 128), str(lm_path))


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_scaled_rope_is_refused_also_in_the_older_config_layout(llama_dir, monkeypatch, key):
    """transformers 4.x configs keep RoPE scaling in ``rope_scaling`` (older ones under "type"), 5.x in
    ``rope_parameters``: a llama3-scaled checkpoint must not load with plain RoPE either way."""
    from types import SimpleNamespace

    import transformers

    _, path = llama_dir
    real = transformers.AutoConfig.from_pretrained

    def older_layout(*args, **kwargs):  # a 4.x-style config: plain attributes, rope_theta + rope_scaling
        hf = real(*args, **kwargs)
        names = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"]
        names += ["rms_norm_eps", "hidden_act", "tie_word_embeddings", "max_position_embeddings"]
        return SimpleNamespace(
            **{n: getattr(hf, n) for n in names},
            rope_theta=LANGUAGE.rope_theta,
            rope_scaling={key: "llama3", "factor": 8.0},
        )

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", older_layout)
    with pytest.raises(CheckpointMismatchError, match="rope_type: checkpoint 'llama3' vs config 'default'"):
        load_language_weights(LanguageModel(LANGUAGE, 128), str(path))


def test_shape_mismatch_and_missing_checkpoint(tmp_path, llama_dir):
    _, lm_path = llama_dir
    with pytest.raises(
        CheckpointMismatchError,
        match=r"embed_tokens.weight' has shape \(90, 48\) but embed_tokens.weight needs \(64, 48\) .*is "
        r"data.tokenizer the checkpoint's tokenizer",
    ):
        load_language_weights(LanguageModel(LANGUAGE, 64), str(lm_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_vision_weights(VisionEncoder(VISION), str(tmp_path / "nope"))


def _resave(src, dst, edit_state=None, edit_config=None):
    """A copy of a save_pretrained folder with its tensors and/or config.json edited."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_state:
        edit_state(state)
    if edit_config:
        edit_config(config)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_checkpoints_of_other_architectures_are_refused_not_loaded_with_weights_dropped(tmp_path, llama_dir):
    """A Qwen2-style checkpoint (q/k/v biases) or Qwen3-style one (q/k norms) has every tensor Llama has plus
    more; before, the extra tensors were silently left out. Both the model type and leftover tensors are caught."""
    _, path = llama_dir
    for name, extra in [
        ("bias", "model.layers.0.self_attn.q_proj.bias"),
        ("norm", "model.layers.1.self_attn.q_norm.weight"),
    ]:
        dst = _resave(path, tmp_path / name, edit_state=lambda st, k=extra: st.__setitem__(k, torch.zeros(48)))
        with pytest.raises(CheckpointMismatchError, match=rf"1 checkpoint tensor\(s\) have no place .*{extra}"):
            load_language_weights(LanguageModel(LANGUAGE, 128), str(dst))
    qwen = transformers.Qwen2Config(**HF_DECODER, tie_word_embeddings=True)  # the same shapes, q/k/v biases
    transformers.Qwen2ForCausalLM(qwen).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(CheckpointMismatchError, match="is a 'qwen2' model; this loader reads llama / mistral"):
        load_language_weights(LanguageModel(LANGUAGE, 128), str(tmp_path / "qwen2"))
    windowed = _resave(
        path, tmp_path / "mistral", edit_config=lambda c: c.update(model_type="mistral", sliding_window=128)
    )
    with pytest.raises(CheckpointMismatchError, match="sliding_window: checkpoint 128 vs config None.*not supported"):
        load_language_weights(LanguageModel(LANGUAGE, 128), str(windowed))


def test_vision_and_language_problems_are_reported_together(siglip_dir, llama_dir):
    (_, vis_path), (_, lm_path) = siglip_dir, llama_dir
    wrong_vision, wrong_lm = copy.deepcopy(VISION), copy.deepcopy(LANGUAGE)
    wrong_vision.num_layers, wrong_lm.num_layers = 3, 5
    cfg = ModelConfig(
        vision=wrong_vision,
        projector=ProjectorConfig(pixel_shuffle_factor=2),
        language=wrong_lm,
        vision_checkpoint=str(vis_path),
        language_checkpoint=str(lm_path),
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"(?s)vision checkpoint .*num_layers: checkpoint 2 vs config "
        r"3.*\nlanguage checkpoint .*num_layers: checkpoint 2 vs config 5",
    ):
        build_model(cfg, word_tokenizer(100))


def test_a_tokenizer_other_than_the_checkpoints_is_refused(tmp_path, llama_dir):
    """Its ids would pick the wrong embedding rows; tokens added after the checkpoint's vocabulary are fine."""
    _, path = llama_dir
    ckpt = _resave(path, tmp_path / "with_tokenizer")
    saved = word_tokenizer(90)  # the checkpoint's own: 90 words
    saved.backend_tokenizer.save(str(ckpt / "tokenizer.json"))
    cfg = ModelConfig(
        vision=VISION,
        projector=ProjectorConfig(pixel_shuffle_factor=2),
        language=LANGUAGE,
        language_checkpoint=str(ckpt),
    )
    build_model(cfg, word_tokenizer(90))  # same words and ids (+ <image> after them): loads
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    shuffled = {"<unk>": 0, **{f"w{i}": 89 - i for i in range(89)}}  # the same words, other ids
    other = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(shuffled, unk_token="<unk>")), unk_token="<unk>"
    )
    other.add_special_tokens({"additional_special_tokens": ["<image>"]})
    with pytest.raises(
        CheckpointMismatchError,
        match=r"data.tokenizer is not the tokenizer of language checkpoint .*"
        r"88 of its 91 tokens have another id",
    ):
        build_model(cfg, other)


# ----------------------------------------------------------------------------------------------------------
# a whole VLM: Idefics3 / SmolVLM in


def hf_idefics3(tie: bool = True, image_token_id: int = 100):
    """A tiny random Idefics3ForConditionalGeneration with VISION / LANGUAGE's shapes (vocabulary 128)."""
    torch.manual_seed(0)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64)  # fmt: skip
    text = transformers.LlamaConfig(**(HF_DECODER | {"vocab_size": 128}), tie_word_embeddings=tie)
    cfg = transformers.Idefics3Config(
        vision_config=vision, text_config=text.to_dict(), scale_factor=2, image_token_id=image_token_id,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.Idefics3ForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return saved(hf_idefics3(), tmp_path_factory.mktemp("idefics3"))


def vlm_config(**kw) -> ModelConfig:
    return ModelConfig(vision=VISION, projector=ProjectorConfig(pixel_shuffle_factor=2), language=LANGUAGE,
                       attn_backend="sdpa", **kw)  # fmt: skip


def _sample(g: torch.Generator, n_images: int, n_text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [T] (text with n_images runs of 4 <image> ids) and uint8 pixels [n_images, 3, 32, 32]."""
    parts = []
    for _ in range(n_images):
        parts += [torch.randint(0, 100, (n_text,), generator=g), torch.full((4,), 100)]
    parts.append(torch.randint(0, 100, (n_text,), generator=g))
    return torch.cat(parts), torch.randint(0, 256, (n_images, 3, 32, 32), dtype=torch.uint8, generator=g)


def hf_logits(hf, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, V] for one sample, its images normalised as our model normalises them."""
    pixel_values = ((pixels.float() / 255 - 0.5) / 0.5)[None] if len(pixels) else None
    with torch.no_grad():
        return hf(input_ids=ids[None], pixel_values=pixel_values).logits[0]


def packed_logits(model, samples) -> list[torch.Tensor]:
    """Our logits for samples packed into one row, split back per sample."""
    lens = [len(ids) for ids, _ in samples]
    batch = {
        "input_ids": torch.cat([ids for ids, _ in samples])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lens),
        "pixel_values": torch.cat([px for _, px in samples]),
    }
    with torch.no_grad():
        return list(model(batch)["logits"][0].split(lens))


def test_whole_idefics3_loads_with_equal_logits_alone_and_packed(idefics3_dir):
    hf, path = idefics3_dir
    model = build_model(vlm_config(vlm_checkpoint=str(path)), word_tokenizer(100)).eval()
    g = torch.Generator().manual_seed(7)
    samples = [_sample(g, 1, 5), _sample(g, 2, 3), _sample(g, 0, 9)]
    for got, (ids, px) in zip(packed_logits(model, samples), samples):
        torch.testing.assert_close(got, hf_logits(hf, ids, px), atol=1e-5, rtol=1e-5)


def test_idefics3_checkpoint_that_does_not_fit_lists_every_difference(idefics3_dir, tmp_path):
    _, path = idefics3_dir
    wrong = vlm_config(vlm_checkpoint=str(path))
    wrong.projector.pixel_shuffle_factor = 4
    wrong.vision = copy.deepcopy(VISION)
    wrong.vision.num_layers = 3
    with pytest.raises(CheckpointMismatchError) as e:
        build_model(wrong, word_tokenizer(100))
    assert "pixel_shuffle_factor: checkpoint 2 vs config 4" in str(e.value)
    assert "num_layers: checkpoint 2 vs config 3" in str(e.value)  # the vision tower, in the same error
    other_id = hf_idefics3(image_token_id=99)
    other_id.save_pretrained(tmp_path / "other")
    with pytest.raises(CheckpointMismatchError, match="image_token_id: checkpoint 99 vs config 100"):
        build_model(vlm_config(vlm_checkpoint=str(tmp_path / "other")), word_tokenizer(100))
    _resave(path, tmp_path / "no_connector", edit_state=lambda s: s.pop(CONNECTOR))
    with pytest.raises(CheckpointMismatchError, match=f"missing tensor '{CONNECTOR}'"):
        build_model(vlm_config(vlm_checkpoint=str(tmp_path / "no_connector")), word_tokenizer(100))
    with pytest.raises(ValueError, match="leave model.vision_checkpoint"):
        build_model(vlm_config(vlm_checkpoint=str(path), vision_checkpoint=str(path)), word_tokenizer(100))


CONNECTOR = "model.connector.modality_projection.proj.weight"


def test_a_checkpoint_tuned_in_another_chat_format_is_named_at_start(idefics3_dir, tmp_path, caplog):
    from nanovlm.model.pretrained import checkpoint_chat_format
    from nanovlm.train.module import warn_on_other_chat_format

    _, path = idefics3_dir
    assert checkpoint_chat_format(str(path)) is None  # no template shipped
    ckpt = _resave(path, tmp_path / "ckpt")
    (ckpt / "chat_template.json").write_text('{"chat_template": "<|im_start|>{{ m }}<end_of_utterance>\\n"}')
    assert checkpoint_chat_format(str(ckpt)) == "smolvlm"
    with caplog.at_level("WARNING"):
        warn_on_other_chat_format(str(ckpt), "smolvlm")
        assert not caplog.records
        warn_on_other_chat_format(str(ckpt), "chatml")
    assert "tuned with the smolvlm chat format but data.chat_format=chatml" in caplog.text


def test_the_checkpoints_image_preprocessing_is_checked(idefics3_dir, tmp_path):
    """A checkpoint with a processor (SmolVLM's tiles images by Idefics3's rule): a config that would show it
    images otherwise is refused with every difference in one error; the config that matches loads."""
    _, path = idefics3_dir
    _resave(path, tmp_path / "ckpt")
    transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 128}, max_image_size={"longest_edge": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(tmp_path / "ckpt")
    plain = vlm_config(vlm_checkpoint=str(tmp_path / "ckpt"))
    plain.vision = dataclasses.replace(VISION, image_mean=[0.4, 0.5, 0.5])
    with pytest.raises(CheckpointMismatchError) as e:
        build_model(plain, word_tokenizer(100))
    for diff in (
        "model.vision.image_mean: checkpoint [0.5, 0.5, 0.5] vs config [0.4, 0.5, 0.5]",
        "model.vision.image_splitting: checkpoint True vs config False",
        "model.vision.longest_edge: checkpoint 128 vs config 0",
    ):
        assert diff in str(e.value)
    assert "model.vision.image_size" not in str(e.value)  # 32 on both sides
    tiled = vlm_config(vlm_checkpoint=str(tmp_path / "ckpt"))
    tiled.vision = dataclasses.replace(VISION, image_splitting=True, longest_edge=128)
    build_model(tiled, word_tokenizer(100))


# ----------------------------------------------------------------------------------------------------------
# and back out: export to transformers


def test_round_trip_idefics3_in_train_export_back_equal_logits_and_generation(idefics3_dir, tmp_path):
    """transformers -> ours -> a few optimizer steps -> export -> transformers: the reloaded model's logits equal
    ours (each sample alone vs packed), and greedy generation gives the same tokens."""
    from nanovlm.model.export import export_idefics3

    _, path = idefics3_dir
    tok = word_tokenizer(100)
    tok.pad_token, tok.eos_token = "<unk>", "w1"
    model = build_model(vlm_config(vlm_checkpoint=str(path)), tok)
    g = torch.Generator().manual_seed(8)
    samples = [_sample(g, 1, 6), _sample(g, 2, 4)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # the weights move away from the checkpoint's
        ids = torch.cat([s[0] for s in samples])[None]
        lens = [len(s[0]) for s in samples]
        batch = {
            "input_ids": ids,
            "labels": ids,
            "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
            "cu_seqlens": torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
            "max_seqlen": max(lens),
            "pixel_values": torch.cat([s[1] for s in samples]),
        }
        model(batch)["loss"].backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    out, _ = export_idefics3(model, tok, tmp_path / "exported")
    back = transformers.Idefics3ForConditionalGeneration.from_pretrained(out).eval()
    moved = back.model.connector.modality_projection.proj.weight
    assert not torch.equal(moved, transformers.Idefics3ForConditionalGeneration.from_pretrained(path).model.connector.modality_projection.proj.weight)  # fmt: skip
    for got, (ids, px) in zip(packed_logits(model, samples), samples):
        torch.testing.assert_close(got, hf_logits(back, ids, px), atol=1e-5, rtol=1e-5)
    ids, px = samples[0]
    with torch.no_grad():
        ours = model.generate(ids[None], px, max_new_tokens=6, eos_token_id=-1)[0]
        theirs = back.generate(input_ids=ids[None], pixel_values=((px.float() / 255 - 0.5) / 0.5)[None],
                               max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(ids):]  # fmt: skip
    assert ours.tolist() == theirs.tolist()
