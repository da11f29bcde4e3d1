"""Processing: image decoding (by content, EXIF, modes, guards), ChatML ids, loss labels, over-length.

Faults: one sample -> ``SampleProcessor`` raises ``SampleError`` with the exact reason (over-length, placeholder
mismatch); one image -> decoded upright and RGB whatever its mode, or refused (unreadable / too large) before
decoding; an image in a format that would run an external program (PostScript) is refused, never handed to it.
"""

import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.faults import (
    bomb_png,
    cmyk_jpeg,
    conversation,
    encode,
    exif_rotated_png,
    grayscale_png,
    json_bytes,
    not_an_image,
    palette_png,
    png,
    png_named_jpg,
    reason_of,
    rgba_png,
    truncated_jpeg,
)
from PIL import Image

from nanovlm.constants import IGNORE_INDEX
from nanovlm.data.format import Record, SampleError, members_to_record
from nanovlm.data.processing import SampleProcessor, decode_image, resize_image

IMG_TOKENS = 4


@pytest.fixture()
def proc(tiny_tokenizer):
    return SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)


def conv(user: str, answer: str):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_chatml_ids_and_labels_exact(proc, tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "be brief"}] + conv("<image>what colour?", "red") + conv("and?", "blue")
    red = encode(Image.new("RGB", (5, 3), (255, 0, 0)))
    s = proc.process(Record("k", msgs, [red]))
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    S, E, IMG = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<image>"))
    nl = enc("\n")
    expected = (
        [S] + enc("system\n") + enc("be brief") + [E] + nl
        + [S] + enc("user\n") + [IMG] * IMG_TOKENS + enc("what colour?") + [E] + nl
        + [S] + enc("assistant\n") + enc("red") + [E] + nl
        + [S] + enc("user\n") + enc("and?") + [E] + nl
        + [S] + enc("assistant\n") + enc("blue") + [E] + nl
    )  # fmt: skip
    assert s.input_ids.tolist() == expected
    # Labels: exactly the assistant contents and their <|im_end|>, in order.
    kept = [t for t in s.labels.tolist() if t != IGNORE_INDEX]
    assert kept == enc("red") + [E] + enc("blue") + [E]
    assert (s.labels != IGNORE_INDEX).sum() == len(kept)
    assert all(lab == IGNORE_INDEX for t, lab in zip(s.input_ids.tolist(), s.labels.tolist()) if t == IMG)
    # Same token sequence as the tokenizer's chat template (with images expanded).
    templ = tok.apply_chat_template(msgs, tokenize=False).replace("<image>", "<image>" * IMG_TOKENS)
    assert enc(templ) == expected
    assert proc.text_tokens(msgs) == len(expected) - (IMG_TOKENS - 1)
    # The prompt: everything up to the assistant's first content token, with the image counted once.
    prompt = expected.index(enc("red")[0], expected.index(enc("assistant\n")[0]))
    assert proc.token_counts(msgs) == (len(expected) - (IMG_TOKENS - 1), prompt - (IMG_TOKENS - 1), 1)
    assert s.pixel_values.dtype == torch.uint8 and s.pixel_values.shape == (1, 3, 8, 8)
    assert s.pixel_values[0, 0].min() == 255 and s.pixel_values[0, 1:].max() == 0


def test_cached_piece_encodings_equal_fresh_ones_and_the_cache_is_bounded(tiny_tokenizer, monkeypatch):
    """Repeated prompts come from the piece cache: ids identical to a tokenizer call, long pieces never
    cached, and the cache stops growing at CACHED_PIECES entries."""
    import nanovlm.data.processing as processing

    monkeypatch.setattr(processing, "CACHED_PIECES", 5)
    cached = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)
    long_text = "a long answer " * 40  # > CACHED_PIECE_CHARS
    convs = [conv("what colour? <|im_end|>", "red")] + [conv(f"shape {i}?", "square") for i in range(8)]
    convs += [conv("what colour? <|im_end|>", long_text), conv("what colour? <|im_end|>", "red")]
    for msgs in convs:
        got = cached.encode(msgs)
        monkeypatch.setattr(processing, "CACHED_PIECES", 0)  # a processor that never caches
        fresh = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)
        assert got == fresh.encode(msgs)
        assert fresh._piece_ids == {}
        monkeypatch.setattr(processing, "CACHED_PIECES", 5)
    assert len(cached._piece_ids) == 5
    assert long_text not in cached._piece_ids


def test_smolvlm_chat_format_ids_and_labels_exact(tiny_tokenizer):
    """data.chat_format=smolvlm: one <|im_start|>, capitalised roles, ": " before text and ":" before an image;
    the loss is on each answer (its leading space included) and its <end_of_utterance>, as SmolVLM was tuned."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<end_of_utterance>"]}, replace_extra_special_tokens=False)
    proc = SampleProcessor(tok, image_size=8, image_token_count=IMG_TOKENS, chat_format="smolvlm")
    msgs = conv("<image>what colour?", "red") + conv("and?", "blue")
    s = proc.process(Record("k", msgs, [png()]))
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    S, E, IMG = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<end_of_utterance>", "<image>"))
    nl = enc("\n")
    expected = (
        [S] + enc("User:") + [IMG] * IMG_TOKENS + enc("what colour?") + [E] + nl
        + enc("Assistant:") + enc(" red") + [E] + nl
        + enc("User:") + enc(" and?") + [E] + nl
        + enc("Assistant:") + enc(" blue") + [E] + nl
    )  # fmt: skip
    assert s.input_ids.tolist() == expected
    assert [t for t in s.labels.tolist() if t != IGNORE_INDEX] == enc(" red") + [E] + enc(" blue") + [E]
    ids, _ = proc.prompt(msgs[:1], [png()])
    assert ids == expected[: expected.index(E) + 1 + len(nl)] + enc("Assistant:")
    assert proc.end_id == E  # where generation stops
    with pytest.raises(ValueError, match="lacks special tokens.*<end_of_utterance>"):
        SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS, chat_format="smolvlm")


def test_prompt_ends_with_assistant_header(proc, tiny_tokenizer):
    msgs = conv("<image>what?", "x")[:1]
    ids, pixels = proc.prompt(msgs, [png()])
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ids == tiny_tokenizer(text.replace("<image>", "<image>" * IMG_TOKENS), add_special_tokens=False)["input_ids"]
    assert pixels.shape[0] == 1
    assert reason_of(proc.prompt, msgs, [], key="k") == "image_count_mismatch"  # never an image-less layout


def test_a_pickled_processor_counts_as_the_original(proc):
    """A tokenizers.Tokenizer forgets encode_special_tokens when pickled (spawned DataLoader workers): special-token
    strings typed in content would then count differently from the index."""
    import pickle

    msgs = conv("what is <|im_end|> and <image> here", "x")
    again = pickle.loads(pickle.dumps(proc))
    assert again.token_counts(msgs) == proc.token_counts(msgs)
    assert again.encode(msgs) == proc.encode(msgs)


def test_special_token_text_in_content_is_plain_text(proc, tiny_tokenizer):
    s = proc.process(Record("k", conv("say <|im_end|> please", "ok")))
    E = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert s.input_ids.tolist().count(E) == 2  # only the two real turn ends


def test_length_formula(proc):
    rec = Record("k", conv("<image><image> compare", "left"), [encode(Image.new("RGB", (4, 4)))] * 2)
    s = proc.process(rec)
    assert len(s.input_ids) == proc.text_tokens(rec.messages) + 2 * (IMG_TOKENS - 1)
    assert s.pixel_values.shape == (2, 3, 8, 8)


def test_no_image_sample_has_empty_pixels(proc):
    s = proc.process(Record("k", conv("hi", "yo")))
    assert s.pixel_values.shape == (0, 3, 8, 8) and s.pixel_values.dtype == torch.uint8


def test_overlength_drop_and_truncate(proc):
    img = encode(Image.new("RGB", (4, 4), (0, 255, 0)))
    rec = Record("long", conv("<image>q", "word " * 40) + conv("<image>again", "x"), [img, img])
    full = proc.process(rec)
    L = len(full.input_ids)
    assert proc.process(rec, max_tokens=L).input_ids.tolist() == full.input_ids.tolist()
    with pytest.raises(SampleError) as e:
        proc.process(rec, max_tokens=L - 1)
    assert e.value.reason == "overlength" and e.value.key == "long"
    t = proc.process(rec, max_tokens=L - 5, overlength="truncate")
    assert t.truncated and len(t.input_ids) == L - 5
    assert t.input_ids.tolist() == full.input_ids[: L - 5].tolist()
    assert t.labels.tolist() == full.labels[: L - 5].tolist()
    assert t.pixel_values.shape[0] == 2


def test_truncate_never_splits_an_image(proc, tiny_tokenizer):
    img = encode(Image.new("RGB", (4, 4)))
    rec = Record("k", conv("hello", "answer one two") + conv("<image>more", "z"), [img])
    full = proc.process(rec).input_ids.tolist()
    IMG = tiny_tokenizer.convert_tokens_to_ids("<image>")
    start = full.index(IMG)
    for cut in range(start + 1, start + IMG_TOKENS):  # every cut inside the image span
        t = proc.process(rec, max_tokens=cut, overlength="truncate")
        assert t.input_ids.tolist() == full[:start]
        assert t.pixel_values.shape[0] == 0 and IMG not in t.input_ids.tolist()
    t = proc.process(rec, max_tokens=start + IMG_TOKENS, overlength="truncate")
    assert t.pixel_values.shape[0] == 1 and t.input_ids.tolist().count(IMG) == IMG_TOKENS


def test_truncate_without_answer_left_is_dropped(proc):
    rec = Record("k", conv("a long question " * 10, "yes"))
    with pytest.raises(SampleError) as e:
        proc.process(rec, max_tokens=5, overlength="truncate")
    assert e.value.reason == "overlength"


def test_placeholder_mismatch(proc):
    with pytest.raises(SampleError) as e:
        proc.process(Record("k", conv("<image>", "x"), []))
    assert e.value.reason == "image_count_mismatch"


# --------------------------------------------------------------------- images


def test_decoded_by_content_not_extension():
    data = encode(Image.new("RGB", (3, 2), (0, 0, 255)))
    img = decode_image(data)  # the member may be called 0.jpg: only the bytes matter
    assert img.mode == "RGB" and img.size == (3, 2) and img.getpixel((0, 0)) == (0, 0, 255)


def test_exif_orientation_applied():
    img = Image.new("RGB", (6, 2), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 on display
    out = decode_image(encode(img, "JPEG", exif=exif.tobytes()))
    assert out.size == (2, 6)


@pytest.mark.parametrize(
    "img,expected",
    [
        (Image.new("L", (2, 2), 77), (77, 77, 77)),
        (Image.new("1", (2, 2), 1), (255, 255, 255)),
        (Image.new("RGBA", (2, 2), (255, 0, 0, 0)), (255, 255, 255)),  # fully transparent -> white
        (Image.new("RGBA", (2, 2), (255, 0, 0, 255)), (255, 0, 0)),
        (Image.new("LA", (2, 2), (0, 255)), (0, 0, 0)),
        (Image.new("I;16", (2, 2), 65535), (255, 255, 255)),
        (Image.new("I;16", (2, 2), 200), (1, 1, 1)),  # a dark 16-bit image stays dark (it came out at 200)
        (Image.new("I;16", (2, 2), 25700), (100, 100, 100)),
    ],
)
def test_modes_to_rgb(img, expected):
    out = decode_image(encode(img))
    assert out.mode == "RGB" and out.getpixel((1, 1)) == expected


def test_padding_setting_in_tokenizer_json_does_not_reach_samples(tiny_tokenizer, tmp_path):
    """A tokenizer.json with a padding setting (e.g. pad_to_multiple_of) must not pad every piece of text."""
    import json
    import shutil

    from nanovlm.data.tokenizer import load_tokenizer

    src = Path(tiny_tokenizer.name_or_path)
    shutil.copytree(src, tmp_path / "tok")
    spec = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    pad = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": 8, "pad_type_id": 0}
    spec["padding"] = {**pad, "pad_id": tiny_tokenizer.pad_token_id, "pad_token": tiny_tokenizer.pad_token}
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    padded_tok = load_tokenizer(tmp_path / "tok")
    assert padded_tok.backend_tokenizer.padding is not None  # the setting is live in the loaded tokenizer
    record = Record("k", conv("What colour is the square?", "red"))
    want = SampleProcessor(tiny_tokenizer, 32, 4).process(record)
    got = SampleProcessor(padded_tok, 32, 4).process(record)
    assert got.input_ids.tolist() == want.input_ids.tolist() and got.labels.tolist() == want.labels.tolist()


def test_cmyk_and_palette():
    cmyk = decode_image(encode(Image.new("CMYK", (2, 2), (0, 255, 255, 0)), "JPEG", quality=100))
    r, g, b = cmyk.getpixel((0, 0))
    assert r > 230 and g < 25 and b < 25
    pal = Image.new("P", (2, 2), 1)
    pal.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    assert decode_image(encode(pal)).getpixel((0, 0)) == (0, 200, 0)
    pal.info["transparency"] = 1
    assert decode_image(encode(pal)).getpixel((0, 0)) == (255, 255, 255)


def test_truncated_and_garbage_images_are_unreadable():
    rng = np.random.default_rng(0)
    data = encode(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "JPEG")
    for bad in (data[: len(data) // 2], b"not an image at all", b""):
        with pytest.raises(SampleError) as e:
            decode_image(bad, key="t")
        assert e.value.reason == "unreadable_image"


def test_decompression_bomb_guard():
    data = encode(Image.new("L", (300, 300)))
    with pytest.raises(SampleError) as e:
        decode_image(data, max_pixels=300 * 299)
    assert e.value.reason == "image_too_large"
    assert decode_image(data, max_pixels=300 * 300).size == (300, 300)


def test_resize_modes():
    img = Image.new("RGB", (20, 10), (255, 0, 0))
    sq = resize_image(img, 8, "squash")
    assert sq.size == (8, 8) and sq.getpixel((0, 0)) == (255, 0, 0)
    lb = resize_image(img, 8, "letterbox")
    assert lb.size == (8, 8)
    assert lb.getpixel((4, 0)) == (128, 128, 128) and lb.getpixel((4, 4)) == (255, 0, 0)
    with pytest.raises(ValueError, match="unknown resize"):
        resize_image(img, 8, "crop")


def test_letterbox_processor(tiny_tokenizer):
    p = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS, resize="letterbox")
    t = p.image(encode(Image.new("RGB", (4, 16), (0, 0, 255))))
    assert t.shape == (3, 8, 8)
    assert t[:, 4, 0].tolist() == [128, 128, 128] and t[:, 4, 4].tolist() == [0, 0, 255]


def test_image_tokens_in_an_assistant_turn_are_not_loss_tokens(tiny_tokenizer):
    proc = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)
    ids, labels = proc.encode([{"role": "user", "content": "draw"}, {"role": "assistant", "content": "<image> here"}])
    img = proc.image_token_id
    assert ids.count(img) == IMG_TOKENS
    assert all(lab == IGNORE_INDEX for t, lab in zip(ids, labels) if t == img)


# ----------------------------------------------------------------------------------------------------------
# faults in one sample


IMAGE_SIZE = 32

TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def processor(tiny_tokenizer):
    return SampleProcessor(tiny_tokenizer, image_size=IMAGE_SIZE, image_token_count=TOKENS_PER_IMAGE)


def test_overlength_sample_is_dropped_or_truncated_as_configured(processor):
    record = Record("long", conversation(1, answer="red " * 400)["messages"], [png()])
    full = processor.process(record)
    assert len(full.input_ids) > 64
    assert reason_of(processor.process, record, max_tokens=64, overlength="drop") == "overlength"
    cut = processor.process(record, max_tokens=64, overlength="truncate")
    assert cut.truncated and len(cut.input_ids) == 64
    assert torch.equal(cut.input_ids, full.input_ids[:64])
    assert (cut.labels != -100).any()  # something is left to learn


def test_overlength_truncation_that_leaves_no_answer_is_dropped(processor):
    record = Record("long_q", conversation(1, question="why " * 300)["messages"], [png()])
    assert reason_of(processor.process, record, max_tokens=64, overlength="truncate") == "overlength"


def test_placeholder_mismatch_is_caught_at_processing_too(processor):
    """A Record built in code (not parsed) with 2 placeholders and 1 image never reaches the model."""
    record = Record("mm", conversation(2)["messages"], [png()])
    assert reason_of(processor.process, record) == "image_count_mismatch"


# ----------------------------------------------------------------------------------------------------------
# image faults


@pytest.mark.parametrize(
    "data",
    [not_an_image(), truncated_jpeg(), b"", b"\x89PNG\r\n\x1a\n" + b"\0" * 40],
    ids=["text_file", "truncated_jpeg", "empty", "png_signature_only"],
)
def test_unreadable_image_is_unreadable_image(processor, data):
    assert reason_of(processor.image, data, key="k") == "unreadable_image"


def test_decompression_bomb_is_refused_before_decoding(processor):
    """144 Mpx in 18 KB: refused by the pixel-count guard; the header-only variant proves the guard runs before
    any pixel is decoded (decoding it would fail as unreadable, not as too large)."""
    assert processor.max_image_pixels == 64_000_000
    assert reason_of(processor.image, bomb_png(), key="k") == "image_too_large"
    assert reason_of(processor.image, bomb_png(body=False), key="k") == "image_too_large"


def test_bomb_beyond_pils_own_limit_is_image_too_large_even_without_our_guard(tiny_tokenizer):
    """With the guard disabled (max_image_pixels=0), PIL's DecompressionBombError must still map to a skip."""
    p = SampleProcessor(tiny_tokenizer, IMAGE_SIZE, TOKENS_PER_IMAGE, max_image_pixels=0)
    huge = bomb_png(20_000, 20_000, body=False)  # 400 Mpx > 2 x PIL's MAX_IMAGE_PIXELS
    assert reason_of(p.image, huge, key="k") == "image_too_large"


def test_max_image_pixels_is_configurable(tiny_tokenizer):
    p = SampleProcessor(tiny_tokenizer, IMAGE_SIZE, TOKENS_PER_IMAGE, max_image_pixels=32 * 32 - 1)
    assert reason_of(p.image, png((32, 32)), key="k") == "image_too_large"
    assert p.image(png((31, 32))).shape == (3, IMAGE_SIZE, IMAGE_SIZE)


def test_png_named_jpg_decodes_by_content(processor):
    data = png_named_jpg()
    record = members_to_record({"0.jpg": data, "json": json_bytes(conversation(1))}, "k")
    out = processor.process(record)
    expected = Image.open(io.BytesIO(data)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    assert torch.equal(out.pixel_values[0], _pixels(expected))


def _pixels(img: Image.Image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("make", [grayscale_png, palette_png, cmyk_jpeg], ids=["L", "P", "CMYK"])
def test_non_rgb_modes_become_exact_rgb(processor, make):
    data = make()
    out = processor.image(data)
    assert out.dtype == torch.uint8 and out.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert torch.equal(out, _pixels(Image.open(io.BytesIO(data))))  # 32x32 in: no resize, exact conversion
    if make is grayscale_png:
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_transparent_image_is_composited_on_white(processor):
    rgba = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 16, 32))  # left half opaque blue, right half fully transparent
    out = processor.image(encode(rgba, "PNG"))
    assert out[:, :, :16].eq(torch.tensor([0, 0, 255], dtype=torch.uint8)[:, None, None]).all()
    assert out[:, :, 16:].eq(255).all()
    assert processor.image(rgba_png()).shape == (3, IMAGE_SIZE, IMAGE_SIZE)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotation_is_applied(processor, orientation):
    rotated, upright = exif_rotated_png(orientation)
    assert torch.equal(processor.image(rotated), processor.image(upright))
    # and the test can fail: ignoring EXIF gives other pixels
    raw = Image.open(io.BytesIO(rotated)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    assert not torch.equal(processor.image(rotated), _pixels(raw))


# ----------------------------------------------------------------------------------------------------------
# security: only raster formats are opened


def test_postscript_image_is_never_handed_to_ghostscript(tmp_path, monkeypatch):
    """PIL would open an EPS member named .jpg/.png and run Ghostscript on it when decoding; only raster
    formats are opened. A stand-in ``gs`` first on PATH would leave a marker if anything ran it."""
    from PIL import Image

    from nanovlm.data.prepare import inspect_image
    from nanovlm.data.processing import decode_image

    marker = tmp_path / "gs_ran"
    fake_gs = tmp_path / "bin" / "gs"
    fake_gs.parent.mkdir()
    fake_gs.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && echo 10.0 && exit 0\ntouch {marker}\nexit 1\n')
    fake_gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_gs.parent}{os.pathsep}{os.environ['PATH']}")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto stroke\nshowpage\n"
    with pytest.raises(subprocess.CalledProcessError):  # control: PIL itself does run "gs" on these bytes
        Image.open(io.BytesIO(eps)).load()
    assert marker.exists()
    marker.unlink()
    for decode in (inspect_image, decode_image):
        with pytest.raises(SampleError, match="unreadable_image"):
            decode(eps)
    assert not marker.exists()
