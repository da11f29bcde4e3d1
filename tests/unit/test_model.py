"""NanoVLM on CPU: packed == alone (logits and gradients), padded baseline, splicing errors, generation, counts."""

import copy

import pytest
import torch

from nanovlm.config import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig
from nanovlm.model import NanoVLM, build_model, flops_per_image, flops_per_token, num_parameters
from nanovlm.model.projector import pixel_shuffle
from nanovlm.model.vlm import loss_rows

VOCAB, IMAGE_ID, PAD_ID = 64, 5, 0
ITC = 4  # (16 / 4 / 2)^2 image tokens per image


def tiny_cfg(**language) -> ModelConfig:
    return ModelConfig(
        vision=VisionConfig(
            image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        ),
        projector=ProjectorConfig(pixel_shuffle_factor=2),
        language=LanguageConfig(
            hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, intermediate_size=96, **language
        ),
        attn_backend="sdpa",
        init_std=0.1,  # larger than default so that logits differ clearly between tokens
    )


def make_model(**language) -> NanoVLM:
    torch.manual_seed(0)
    return NanoVLM(tiny_cfg(**language), VOCAB, IMAGE_ID)


def make_sample(key, length, image_starts, g):
    ids = torch.randint(10, VOCAB, (length,), generator=g)
    for s in image_starts:
        ids[s : s + ITC] = IMAGE_ID
    labels = ids.clone()
    labels[ids == IMAGE_ID] = -100
    labels[: length // 3] = -100  # a prompt without loss
    labels[0] = -100
    pixels = torch.randint(0, 256, (len(image_starts), 3, 16, 16), dtype=torch.uint8, generator=g)
    return {"key": key, "input_ids": ids, "labels": labels, "pixel_values": pixels}


def samples():
    g = torch.Generator().manual_seed(1)
    return [
        make_sample("a", 11, [2], g),
        make_sample("b", 7, [], g),
        make_sample("c", 15, [1, 8], g),
        make_sample("d", 9, [0], g),
    ]


def pack(items, pad_tail=3):
    """The packed batch of docs/data.md, with a padding tail as its own last segment."""
    ids = [s["input_ids"] for s in items] + [torch.full((pad_tail,), PAD_ID)]
    labels = [s["labels"] for s in items] + [torch.full((pad_tail,), -100)]
    lengths = [len(x) for x in ids]
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "pixel_values": torch.cat([s["pixel_values"] for s in items]),
        "sample_keys": [s["key"] for s in items],
    }


def alone(s):
    return pack([s], pad_tail=0) | {"cu_seqlens": torch.tensor([0, len(s["input_ids"])], dtype=torch.int32)}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(model, got: dict, want: dict, atol: float, rtol: float) -> None:
    """Every parameter has a gradient in both, and they agree within the tolerance."""
    assert got.keys() == want.keys() == {n for n, _ in model.named_parameters()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol, msg=name)


def test_packed_equals_alone_logits_and_gradients():
    model, items = make_model(), samples()
    packed = pack(items)
    out = model(packed)
    (out["loss"] * out["n_loss_tokens"]).backward()  # sum of token losses
    packed_grads = grads(model)
    model.zero_grad()

    start, total_tokens = 0, 0
    for s in items:
        o = model(alone(s))
        n = len(s["input_ids"])
        torch.testing.assert_close(out["logits"][0, start : start + n], o["logits"][0], atol=2e-5, rtol=1e-5)
        (o["loss"] * o["n_loss_tokens"]).backward()  # accumulates over samples
        total_tokens += int(o["n_loss_tokens"])
        start += n
    assert int(out["n_loss_tokens"]) == total_tokens
    assert_same_grads(model, packed_grads, grads(model), atol=2e-5, rtol=1e-4)


def test_packed_loss_is_mean_over_loss_tokens():
    model, items = make_model(), samples()
    packed = pack(items)
    with torch.no_grad():
        out = model(packed)
        logits, labels = out["logits"][0, :-1], packed["labels"][0, 1:]
        keep = labels != -100
        want = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert int(out["n_loss_tokens"]) == int(keep.sum())
    torch.testing.assert_close(out["loss"], want)


def padded(items):
    """[B, longest] right-padded rows with attention_mask and labels, as collate_padded builds them."""
    width = max(len(s["input_ids"]) for s in items)
    ids = torch.full((len(items), width), PAD_ID)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, s in enumerate(items):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    pixels = torch.cat([s["pixel_values"] for s in items])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "pixel_values": pixels}


def test_loss_rows_are_the_positions_that_predict_a_loss_token():
    labels = torch.tensor([[-100, 7, -100, 9, 4], [-100, -100, 3, -100, -100]])
    # row 0: positions 0, 2, 3 predict 7, 9, 4; row 1: position 1 predicts 3 (flat 5 + 1)
    assert loss_rows(labels).tolist() == [0, 2, 3, 6]
    assert loss_rows(torch.full((2, 4), -100)).tolist() == []


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_head_on_loss_positions_only_gives_the_same_loss_and_gradients(layout):
    """Training's ``return_logits=False`` (LM head on loss positions only) vs the head on every position."""
    model, items = make_model(), samples()
    batch = pack(items) if layout == "packed" else padded(items)
    full = model(batch)
    full["loss"].backward()
    want = grads(model)
    model.zero_grad()
    got = model(batch, return_logits=False)
    got["loss"].backward()
    assert got["logits"] is None
    assert (
        int(got["n_loss_tokens"]) == int(full["n_loss_tokens"]) == sum(int((s["labels"] != -100).sum()) for s in items)
    )
    torch.testing.assert_close(got["loss"], full["loss"], atol=1e-6, rtol=1e-6)
    assert_same_grads(model, grads(model), want, atol=1e-6, rtol=1e-5)


def test_head_on_loss_positions_without_any_loss_token_is_a_zero_loss_in_the_graph():
    model, items = make_model(), samples()
    batch = pack(items)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    out = model(batch, return_logits=False)
    assert int(out["n_loss_tokens"]) == 0 and out["loss"].item() == 0.0
    out["loss"].backward()  # every parameter takes part (DDP needs that of each rank at each step)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_padded_batch_equals_alone():
    model, items = make_model(), samples()
    batch = padded(items)
    with torch.no_grad():
        out = model(batch)
        for i, s in enumerate(items):
            n = len(s["input_ids"])
            torch.testing.assert_close(out["logits"][i, :n], model(alone(s))["logits"][0], atol=2e-5, rtol=1e-5)


def test_precomputed_inputs_embeds_give_the_same_loss_and_skip_the_vision_path():
    model, items = make_model(), samples()
    batch = pack(items)
    want = model(batch)
    with torch.no_grad():
        embeds = model.embed(batch["input_ids"], batch["pixel_values"])
    model.zero_grad()
    got = model(batch | {"inputs_embeds": embeds, "pixel_values": None})
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["loss"], want["loss"])
    got["loss"].backward()
    vision = [*model.vision.parameters(), *model.projector.parameters()]
    assert all(p.grad is None for p in vision)  # cached features: the encoder is not run
    assert all(p.grad is not None for p in model.language.layers.parameters())


def test_placeholder_image_mismatch_names_the_sample():
    model, items = make_model(), samples()
    packed = pack(items)
    packed["pixel_values"] = packed["pixel_values"][:-1]  # one image fewer than placeholders
    with pytest.raises(ValueError, match=r"pixel_values holds 3 images") as e:
        model(packed)
    assert "a: 4" in str(e.value) and "c: 8" in str(e.value)

    broken = samples()
    broken[1]["input_ids"][3] = IMAGE_ID  # a stray placeholder in sample "b"
    with pytest.raises(ValueError, match=r"b: 1 \(not a multiple of 4\)"):
        model(pack(broken))


def test_no_loss_tokens_gives_zero_loss_with_graph_and_every_parameter_gets_a_gradient():
    model = make_model()
    s = samples()[1]  # no image: the vision path still takes part (blank image x 0)
    batch = alone(s) | {"labels": torch.full((1, len(s["input_ids"])), -100)}
    out = model(batch)
    assert out["loss"].item() == 0.0 and int(out["n_loss_tokens"]) == 0 and out["loss"].requires_grad
    out["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_sharded_model_runs_the_vision_path_for_an_image_less_pack_also_without_gradients():
    """Under FSDP2 every rank must gather the same weights in the same order: a pack without images (e.g. an empty
    validation pack on one rank) still runs the vision blocks, with no effect on the output."""
    model = make_model().eval()
    calls = []
    model.vision.register_forward_hook(lambda *_: calls.append(1))
    batch = alone(samples()[1])  # no image
    with torch.no_grad():
        plain = model(batch)["logits"]
        assert calls == []  # unsharded: nothing to keep in step, the vision path is skipped
        model.vision_every_forward = True  # what strategies.shard_model sets
        every = model(batch)["logits"]
    assert calls == [1] and torch.equal(plain, every)


def test_attention_backend_is_resolved_once_per_forward_not_in_every_layer(monkeypatch):
    """The layers get the backend from their model: a compiled block never runs the resolver, whose lazy import
    and log call split the block's graph (on CUDA each block compiled to about five graphs)."""
    import nanovlm.model.attention as attn_mod

    calls = []
    real = attn_mod._unavailable_reason
    monkeypatch.setattr(attn_mod, "_unavailable_reason", lambda *a: calls.append(a) or real(*a))
    batch = pack(samples())
    counts = {}
    for layers in (1, 4):
        cfg = tiny_cfg()
        cfg.language.num_layers = cfg.vision.num_layers = layers
        cfg.attn_backend = "auto"
        model = NanoVLM(cfg, VOCAB, IMAGE_ID)
        calls.clear()
        model(batch)
        counts[layers] = len(calls)
    assert counts[1] == counts[4] > 0, counts


def test_pixel_normalisation_constants_are_made_once_and_also_serve_training_after_generate():
    """mean/std are cached per device (made from Python lists they cost a host sync each on CUDA); made first
    inside generate()'s inference mode, they must still work in a training step."""
    model = make_model()
    item = samples()[0]
    pixels = item["pixel_values"]
    v = model.cfg.vision
    want = (pixels.float() / 255 - torch.tensor(v.image_mean).view(1, 3, 1, 1)) / torch.tensor(v.image_std).view(
        1, 3, 1, 1
    )
    model.generate(item["input_ids"][None, :6], pixels, max_new_tokens=2)
    assert torch.equal(model.normalize(pixels), want)
    cached = model._pixel_stats[pixels.device]
    model(alone(item))["loss"].backward()
    assert model._pixel_stats[pixels.device] is cached and len(model._pixel_stats) == 1
    assert model.vision.patch_embedding.weight.grad is not None


def test_uint8_pixels_are_required():
    model = make_model()
    batch = alone(samples()[0])
    batch["pixel_values"] = batch["pixel_values"].float()
    with pytest.raises(TypeError, match="uint8"):
        model(batch)


def greedy_without_cache(model, ids, pixels, steps):
    out = []
    for _ in range(steps):
        logits = model({"input_ids": ids, "pixel_values": pixels})["logits"]
        token = logits[0, -1].argmax()
        out.append(int(token))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return out


def test_generate_with_kv_cache_equals_full_recompute():
    model = make_model().eval()
    s = samples()[2]
    ids, pixels = s["input_ids"][None], s["pixel_values"]
    with torch.no_grad():
        want = greedy_without_cache(model, ids, pixels, 6)
    got = model.generate(ids, pixels, max_new_tokens=6)
    assert got.shape == (1, 6) and got[0].tolist() == want
    # eos stops decoding and is included
    stopped = model.generate(ids, pixels, max_new_tokens=6, eos_token_id=want[2])
    assert stopped[0].tolist() == want[: want.index(want[2]) + 1]
    # top_p this small keeps only the most likely token: sampling equals greedy
    nucleus = model.generate(ids, pixels, max_new_tokens=6, temperature=1.0, top_p=1e-6)
    assert nucleus[0].tolist() == want
    # ... and so does top_p 0 (it dropped every token: "invalid multinomial distribution")
    assert model.generate(ids, pixels, max_new_tokens=6, temperature=1.0, top_p=0.0)[0].tolist() == want
    # sampling is reproducible with a generator
    a = model.generate(ids, pixels, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = model.generate(ids, pixels, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_pixel_shuffle_groups_neighbouring_patches():
    x = torch.arange(16.0).view(1, 16, 1)  # a 4x4 grid, value = patch index
    y = pixel_shuffle(x, 2)
    assert y.shape == (1, 4, 4)
    assert y[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_num_parameters_counts_tied_weights_once():
    tied, untied = make_model(), make_model(tie_embeddings=False)
    counts = num_parameters(tied)
    assert counts["total"] == sum(p.numel() for p in tied.parameters())
    assert counts["total"] == counts["vision"] + counts["projector"] + counts["language"]
    assert num_parameters(untied)["language"] - counts["language"] == VOCAB * 48
    assert tied.language.lm_head.weight is tied.language.embed_tokens.weight


def test_flops_per_token_matches_the_model_structure():
    cfg, model = tiny_cfg(), make_model()
    lang_matmul = sum(m.weight.numel() for m in model.language.layers.modules() if isinstance(m, torch.nn.Linear))
    lang_matmul += model.language.lm_head.weight.numel()
    seq = 100
    attn = 6 * cfg.language.num_layers * cfg.language.hidden_size * seq
    assert flops_per_token(cfg, VOCAB, seq) == 6 * lang_matmul + attn

    vis_matmul = sum(
        m.weight.numel() for m in model.vision.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
    )
    patches = 16
    per_image = patches * (6 * vis_matmul + 12 * cfg.vision.num_layers * cfg.vision.hidden_size * patches)
    per_image += 6 * model.projector.proj.weight.numel() * ITC
    assert flops_per_image(cfg) == per_image
    assert flops_per_token(cfg, VOCAB, seq, images_per_token=0.25) == 6 * lang_matmul + attn + 0.25 * per_image
    # the LM head on a fifth of the tokens (training computes logits only where a loss is taken)
    head = model.language.lm_head.weight.numel()
    assert flops_per_token(cfg, VOCAB, seq, head_fraction=0.2) == 6 * (lang_matmul - head + 0.2 * head) + attn


def make_tokenizer(extra_tokens):
    """A real fast tokenizer (word level, 70 words) with the given special tokens added."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(69)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": extra_tokens})
    return tok


def test_build_model_resolves_vocab_and_image_token():
    tok = make_tokenizer(["<image>", "<|im_start|>"])  # 72 tokens -> vocabulary 128
    cfg = tiny_cfg()
    model = build_model(cfg, tok)
    assert model.vocab_size == 128 and model.language.embed_tokens.weight.shape[0] == 128
    assert model.image_token_id == tok.convert_tokens_to_ids("<image>") == 70
    with pytest.raises(ValueError, match="no <image> token"):
        build_model(cfg, make_tokenizer(["<|im_start|>"]))
    small = copy.deepcopy(cfg)
    small.language.vocab_size = 64
    with pytest.raises(ValueError, match="smaller than the tokenizer's 72 tokens"):
        build_model(small, tok)


def test_rmsnorm_is_llamas_formula_in_both_dtype_paths():
    """F.rms_norm (fused on CUDA) when input and weight share a dtype; the explicit fp32 path otherwise. Both give
    transformers' Llama formula: bitwise on fp32 input, and on bf16 input normalised in fp32 then cast."""
    from nanovlm.model.language import RMSNorm

    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 48)

    def llama(x):
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    assert torch.equal(norm(x), llama(x))
    xb = x.bfloat16()
    assert norm(xb).dtype == torch.float32 and torch.equal(norm(xb), llama(xb))
    nb = copy.deepcopy(norm).bfloat16()  # bf16 weight and input (e.g. FSDP2 bf16 params): the fused path
    torch.testing.assert_close(nb(xb).float(), llama(xb).float(), atol=2e-2, rtol=2e-2)


def test_rotary_equals_rotate_half_formula_bitwise_in_every_dtype():
    """The sign-folded tables give exactly x * cos + cat(-x2, x1) * sin (transformers' rotate_half convention)."""
    from nanovlm.model.language import Rotary

    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    rope = Rotary(pos, 8, 10000.0, {torch.bfloat16})
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    emb = torch.cat([pos.float()[..., None] * inv] * 2, -1)[:, :, None]  # [1, 7, 1, 8]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # float64: not precomputed, cast on the fly
        x = torch.randn(1, 7, 3, 8).to(dtype)
        x1, x2 = x.chunk(2, -1)
        want = x * emb.cos().to(dtype) + torch.cat([-x2, x1], -1) * emb.sin().to(dtype)
        got = rope(x)
        assert got.dtype == dtype and torch.equal(got, want)


def test_cached_decoding_logits_equal_a_full_recompute_at_every_step(monkeypatch):
    """Greedy tokens alone do not show a wrong prefill mask, cache length or decode position (a tiny random model
    mostly repeats its input); the logits of each generation step must equal the full forward's."""
    model = make_model().eval()
    s = samples()[2]
    ids, pixels = s["input_ids"][None], s["pixel_values"]
    seen = []
    real = NanoVLM._sample
    monkeypatch.setattr(NanoVLM, "_sample", staticmethod(lambda lg, *a: (seen.append(lg.clone()), real(lg, *a))[1]))
    got = model.generate(ids, pixels, max_new_tokens=4)
    with torch.no_grad():
        full = model({"input_ids": torch.cat([ids, got], 1), "pixel_values": pixels})["logits"][0]
    n = ids.shape[1]
    assert len(seen) == 4
    for i, logits in enumerate(seen):
        torch.testing.assert_close(logits[0], full[n - 1 + i], atol=1e-4, rtol=1e-4)


def test_left_padded_batch_equals_alone():
    """The padding mask must hide padded keys (right padding alone cannot tell keys from queries)."""
    model, items = make_model(), samples()
    width = max(len(s["input_ids"]) for s in items)
    ids = torch.full((len(items), width), PAD_ID)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, s in enumerate(items):
        n = len(s["input_ids"])
        ids[i, width - n :], mask[i, width - n :] = s["input_ids"], 1
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat([s["pixel_values"] for s in items])}
    with torch.no_grad():
        out = model(batch)["logits"]
        for i, s in enumerate(items):
            n = len(s["input_ids"])
            torch.testing.assert_close(out[i, width - n :], model(alone(s))["logits"][0], atol=2e-5, rtol=1e-5)


def test_generate_refuses_arguments_it_cannot_honour():
    """Negative budgets, nan temperatures, empty prompts and prompts past the trained context were a KV-cache
    error, a multinomial error, an IndexError, or (context) silently accepted."""
    model = make_model(max_position_embeddings=160).eval()  # small: the last case generates up to it
    s = samples()[2]
    ids, pixels = s["input_ids"][None], s["pixel_values"]
    context = model.cfg.language.max_position_embeddings
    for kwargs, match in [
        ({"max_new_tokens": -1}, "max_new_tokens >= 0"),
        ({"temperature": float("nan")}, "temperature >= 0"),
        ({"top_p": -0.5, "temperature": 1.0}, "top_p >= 0"),
        ({"max_new_tokens": context - ids.shape[1] + 2}, f"exceeds the model's max_position_embeddings={context}"),
    ]:
        with pytest.raises(ValueError, match=match):
            model.generate(ids, pixels, **kwargs)
    with pytest.raises(ValueError, match="L > 0"):
        model.generate(ids[:, :0])
    # exactly fits: the last new token is never fed back, so its position may be the context length
    assert model.generate(ids, pixels, max_new_tokens=context - ids.shape[1] + 1).shape[1] >= 1
    assert model.generate(ids, pixels, max_new_tokens=2, top_p=None).shape[1] >= 1  # None: no nucleus cut, as before


def test_the_vision_stream_starts_at_unit_scale_so_patches_stay_apart():
    """With the patch embedding at init_std (0.02) the ViT's input stream started at ~0.1 RMS: the attention
    outputs of the blocks soon outweighed it and the patches of an image converged to the image mean (measured
    in training: within-image spread of the encoder output fell from 0.67 to 0.23 and colour, shape and position
    questions stayed at chance). SigLIP's init keeps the stream at unit scale, and the positions below it."""
    cfg = ModelConfig(vision=VisionConfig(image_size=32, patch_size=4, hidden_size=128, num_layers=3, num_heads=4,
                                          intermediate_size=512))  # fmt: skip
    torch.manual_seed(0)
    model = NanoVLM(cfg, VOCAB, IMAGE_ID)
    pixels = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    patches = model.vision.patch_embedding(model.normalize(pixels)).flatten(2).transpose(1, 2)  # [8, 64, 128]
    positions = model.vision.position_embedding.weight
    patch_rms, pos_rms = patches.pow(2).mean().sqrt().item(), positions.pow(2).mean().sqrt().item()
    assert 0.3 < patch_rms < 1.5, patch_rms  # ~0.58 for uniform pixels (was 0.1)
    assert pos_rms == pytest.approx(128**-0.5, rel=0.1)
    assert patch_rms > 3 * pos_rms  # the content, not the position, dominates each patch
