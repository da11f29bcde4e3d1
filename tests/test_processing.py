"""Processing: image decoding (by content, EXIF, modes, guards), ChatML ids, loss labels, over-length."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nanovlm.constants import IGNORE_INDEX
from nanovlm.data.format import Record, SampleError
from nanovlm.data.processing import SampleProcessor, decode_image, resize_image

IMG_TOKENS = 4


def png(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture()
def proc(tiny_tokenizer):
    return SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)


def conv(user: str, answer: str):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_chatml_ids_and_labels_exact(proc, tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "be brief"}] + conv("<image>what colour?", "red") + conv("and?", "blue")
    red = png(Image.new("RGB", (5, 3), (255, 0, 0)))
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


def test_prompt_ids_end_with_assistant_header(proc, tiny_tokenizer):
    msgs = conv("<image>what?", "x")[:1]
    ids = proc.prompt_ids(msgs)
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ids == tiny_tokenizer(text.replace("<image>", "<image>" * IMG_TOKENS), add_special_tokens=False)["input_ids"]


def test_special_token_text_in_content_is_plain_text(proc, tiny_tokenizer):
    s = proc.process(Record("k", conv("say <|im_end|> please", "ok")))
    E = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert s.input_ids.tolist().count(E) == 2  # only the two real turn ends


def test_length_formula(proc):
    rec = Record("k", conv("<image><image> compare", "left"), [png(Image.new("RGB", (4, 4)))] * 2)
    s = proc.process(rec)
    assert len(s.input_ids) == proc.text_tokens(rec.messages) + 2 * (IMG_TOKENS - 1)
    assert s.pixel_values.shape == (2, 3, 8, 8)


def test_no_image_sample_has_empty_pixels(proc):
    s = proc.process(Record("k", conv("hi", "yo")))
    assert s.pixel_values.shape == (0, 3, 8, 8) and s.pixel_values.dtype == torch.uint8


def test_overlength_drop_and_truncate(proc):
    img = png(Image.new("RGB", (4, 4), (0, 255, 0)))
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
    img = png(Image.new("RGB", (4, 4)))
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
    data = png(Image.new("RGB", (3, 2), (0, 0, 255)))
    img = decode_image(data)  # the member may be called 0.jpg: only the bytes matter
    assert img.mode == "RGB" and img.size == (3, 2) and img.getpixel((0, 0)) == (0, 0, 255)


def test_exif_orientation_applied():
    img = Image.new("RGB", (6, 2), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 on display
    out = decode_image(png(img, "JPEG", exif=exif.tobytes()))
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
    out = decode_image(png(img))
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
    cmyk = decode_image(png(Image.new("CMYK", (2, 2), (0, 255, 255, 0)), "JPEG", quality=100))
    r, g, b = cmyk.getpixel((0, 0))
    assert r > 230 and g < 25 and b < 25
    pal = Image.new("P", (2, 2), 1)
    pal.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    assert decode_image(png(pal)).getpixel((0, 0)) == (0, 200, 0)
    pal.info["transparency"] = 1
    assert decode_image(png(pal)).getpixel((0, 0)) == (255, 255, 255)


def test_truncated_and_garbage_images_are_unreadable():
    rng = np.random.default_rng(0)
    data = png(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "JPEG")
    for bad in (data[: len(data) // 2], b"not an image at all", b""):
        with pytest.raises(SampleError) as e:
            decode_image(bad, key="t")
        assert e.value.reason == "unreadable_image"


def test_decompression_bomb_guard():
    data = png(Image.new("L", (300, 300)))
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
    t = p.image(png(Image.new("RGB", (4, 16), (0, 0, 255))))
    assert t.shape == (3, 8, 8)
    assert t[:, 4, 0].tolist() == [128, 128, 128] and t[:, 4, 4].tolist() == [0, 0, 255]


def test_image_tokens_in_an_assistant_turn_are_not_loss_tokens(tiny_tokenizer):
    proc = SampleProcessor(tiny_tokenizer, image_size=8, image_token_count=IMG_TOKENS)
    ids, labels = proc.encode([{"role": "user", "content": "draw"}, {"role": "assistant", "content": "<image> here"}])
    img = proc.image_token_id
    assert ids.count(img) == IMG_TOKENS
    assert all(lab == IGNORE_INDEX for t, lab in zip(ids, labels) if t == img)
