"""The JPEG header reader behind ``prepare_data --image-check header`` gives Pillow's upright size wherever it
answers, and leaves to Pillow every header it does not fully understand."""

import io
import struct

import numpy as np
import pytest
from PIL import Image

from nanovlm.data.format import SampleError
from nanovlm.data.jpeg_header import jpeg_header
from nanovlm.data.prepare import inspect_image
from nanovlm.data.processing import open_upright


def _jpeg(size=(40, 24), mode="RGB", orientation=None, **save) -> bytes:
    arr = np.random.default_rng(sum(size)).integers(0, 255, (size[1], size[0], len(mode)), np.uint8)
    img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **save)
    return buf.getvalue()


def _pillow(data: bytes) -> list[int]:
    return list(open_upright(data)[1])


VARIANTS = {
    **{f"orientation {o}": _jpeg(orientation=o) for o in range(1, 9)},
    "no exif": _jpeg(),
    "progressive": _jpeg(progressive=True, orientation=6),
    "grayscale": _jpeg(mode="L", orientation=8),
    "cmyk": _jpeg(mode="CMYK"),
    "icc profile": _jpeg(icc_profile=b"\0" * 300, orientation=5),
    "restart markers": _jpeg(size=(300, 200), restart_marker_blocks=1, orientation=7),
    "1x1": _jpeg(size=(1, 1)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_plain_headers_give_pillows_upright_size_without_pillow(name):
    data = VARIANTS[name]
    assert jpeg_header(data) is not None  # answered here
    assert inspect_image(data, decode=False)[1] == _pillow(data)
    assert inspect_image(data, decode=False)[0] == "jpg"
    assert jpeg_header(memoryview(bytearray(data))) == jpeg_header(data)  # indexing hands images on as views


def _with_segment(data: bytes, marker: int, body: bytes) -> bytes:
    """``data`` with one more segment right after SOI."""
    return data[:2] + bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body + data[2:]


def test_headers_it_does_not_fully_understand_go_to_pillow():
    xmp = b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    plain = _jpeg()
    cases = {
        "xmp orientation": _with_segment(plain, 0xE1, xmp),
        "two exif blocks": _with_segment(_jpeg(orientation=6), 0xE1, b"Exif\x00\x00" + Image.Exif().tobytes()),
        "mpf": _with_segment(plain, 0xE2, b"MPF\x00" + b"\x00" * 8),
        "exif orientation as a LONG": _with_segment(
            plain, 0xE1, b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x04\x00\x01\x00\x00\x00\x06\x00\x00\x00"
        ),
        "not a jpeg": b"\x89PNG\r\n\x1a\n" + plain,
        "cut in its header": plain[:40],
        "a stray byte between segments": plain[:2] + b"\x00" + plain[2:],
    }
    for name, data in cases.items():
        assert jpeg_header(data) is None, name
    assert inspect_image(cases["xmp orientation"], decode=False)[1] == [24, 40]  # Pillow read the XMP
    with pytest.raises(SampleError, match="unreadable_image"):
        inspect_image(cases["cut in its header"], decode=False)


def _agrees_with_pillow(data: bytes) -> bool:
    """The reader answered nothing, or Pillow opens the file and gives the same upright size."""
    head = jpeg_header(data)
    if head is None:
        return True
    try:
        upright = _pillow(data)
    except SampleError:
        return False
    w, h, orientation = head
    return upright == ([h, w] if orientation in (5, 6, 7, 8) else [w, h])


def _exif(*entries) -> bytes:
    """An EXIF block whose IFD0 holds ``entries`` = (tag, type, count, 4 value bytes)."""
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHI", t, k, n) + v for t, k, n, v in entries)
    return b"Exif\x00\x00II*\x00\x08\x00\x00\x00" + ifd + b"\x00" * 4


def test_segments_pillow_refuses_are_left_to_pillow():
    """Pillow parses some segments while opening and refuses the file when they are short or odd; the reader
    must then not answer, or a file Pillow cannot open would be indexed."""
    plain = _jpeg()
    sof = plain.index(b"\xff\xc0")
    cut_sof = plain[:sof] + b"\xff\xc0\x00\x0a" + plain[sof + 4 : sof + 12] + plain[sof + 2 + 17 :]
    cases = {
        "a SOF cut inside its components": cut_sof,
        "a short ICC profile": _with_segment(plain, 0xE2, b"ICC_PROFILE\x00"),
        "a short quantisation table": _with_segment(plain, 0xDB, b"\x00" + b"\x01" * 10),
        "a short JFIF block": _with_segment(plain, 0xE0, b"JFIF\x00"),
        "a short Adobe block": _with_segment(plain, 0xEE, b"Adobe"),
        "a Photoshop block": _with_segment(plain, 0xED, b"Photoshop 3.0\x00" + b"8BIM\x03\xed"),
        "an XResolution Pillow cannot divide": _with_segment(
            plain,
            0xE1,
            _exif(
                (0x0112, 3, 1, b"\x06\x00\x00\x00"), (0x011A, 2, 1, b"\x00" * 4), (0x0128, 3, 1, b"\x02\x00\x00\x00")
            ),
        ),
    }
    for name, data in cases.items():
        assert jpeg_header(data) is None, name
        assert _agrees_with_pillow(data), name


def test_truncated_bodies_of_every_segment_kind_are_answered_only_where_pillow_agrees():
    plain = _jpeg()
    prefixes = {0xE0: b"JFIF\x00\x01\x01\x01\x00H\x00H\x00\x00", 0xE1: _exif((0x0112, 3, 1, b"\x06\x00\x00\x00")),
                0xE2: b"ICC_PROFILE\x00\x01\x01" + b"\x00" * 8, 0xED: b"Photoshop 3.0\x008BIM\x04\x04\x00\x00\x00\x00\x00\x028BIM\x03\xed\x00\x00\x00\x00\x00\x10" + b"\x00" * 16, 0xEE: b"Adobe\x00d\x00\x00\x00\x00\x01",
                0xDB: b"\x00" + b"\x01" * 64, 0xC4: b"\x00" * 17, 0xDD: b"\x00\x04", 0xFE: b"a comment"}  # fmt: skip
    answered = 0
    for marker, full in prefixes.items():
        for n in range(len(full) + 1):
            data = _with_segment(plain, marker, full[:n])
            assert _agrees_with_pillow(data), (hex(marker), n)
            answered += jpeg_header(data) is not None
    assert answered > 20  # the reader still answers for plain, whole segments


def test_a_big_endian_exif_block_is_read():
    tiff = b"MM\x00*\x00\x00\x00\x08\x00\x01" + struct.pack(">HHIH2x", 0x0112, 3, 1, 6) + b"\x00\x00\x00\x00"
    data = _with_segment(_jpeg(), 0xE1, b"Exif\x00\x00" + tiff)
    assert jpeg_header(data) == (40, 24, 6)
    assert inspect_image(data, decode=False)[1] == _pillow(data) == [24, 40]


def test_the_size_guards_hold_on_the_fast_path():
    data = _jpeg(size=(64, 48))
    with pytest.raises(SampleError, match="image_too_large"):
        inspect_image(data, max_pixels=64 * 48 - 1, decode=False)
    i = data.index(b"\xff\xc0") + 5  # the SOF's height and width
    bomb = data[:i] + struct.pack(">HH", 60000, 60000) + data[i + 4 :]
    assert jpeg_header(bomb) == (60000, 60000, None)
    with pytest.raises(SampleError, match="image_too_large"):
        inspect_image(bomb, decode=False)
