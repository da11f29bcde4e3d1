"""JPEG decode on the device (``data.image_decode=device``): what the workers defer, how a pack carries it, and
the pixels the device path writes, against the worker path's.

On CPU the device path decodes with Pillow (nvJPEG needs CUDA: ``tests/integration/test_gpu.py`` checks it), so
these tests check everything but the decoder: which images are deferred, the boxes, the rows in a pack, the
resize, the pasting, the DataModule hook and a training run.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data import make_cfg, make_dm, take
from helpers.faults import cmyk_jpeg, conversation, encode, image, jpeg, png, reason_of, truncated_jpeg
from PIL import Image, ImageFilter

from nanovlm.config import ConfigError, load_config
from nanovlm.constants import DEFERRED_JPEGS
from nanovlm.data.collate import collate_packed, collate_padded
from nanovlm.data.device_decode import DeviceDecoder, resize_uint8
from nanovlm.data.format import Record
from nanovlm.data.processing import LETTERBOX_FILL, SampleProcessor, image_box

S = 32
GREY = LETTERBOX_FILL[0]


def processors(tok, resize="squash"):
    """(worker, device) processors of one config."""
    return tuple(SampleProcessor(tok, S, 4, resize, decode=d) for d in ("worker", "device"))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two paths' uint8 pixels of one image: equal up to resampling rounding (torch's antialiased bicubic
    against Pillow's: at most 0.7 of 255 on average, and 18 at one pixel, on these sharp synthetic images)."""
    d = (a.int() - b.int()).abs().float()
    assert d.mean() < 1.0 and d.max() <= 32, (d.mean(), d.max())


@pytest.mark.parametrize("resize", ["squash", "letterbox"])
@pytest.mark.parametrize("size", [(48, 20), (20, 48), (32, 32), (90, 70)])
def test_a_deferred_jpeg_decodes_to_the_worker_paths_pixels(tiny_tokenizer, resize, size):
    worker, device = processors(tiny_tokenizer, resize)
    data = jpeg(size)
    rec = Record("k", conversation(1)["messages"], [data])
    w, d = worker.process(rec), device.process(rec)
    assert torch.equal(w.input_ids, d.input_ids) and torch.equal(w.labels, d.labels)
    assert w.jpegs == () and len(d.jpegs) == 1
    (j,) = d.jpegs
    assert (j.data, j.view, j.box) == (data, 0, image_box(*size, S, resize))
    assert (d.pixel_values == GREY).all()  # a grey canvas until the device decodes it
    pixels = DeviceDecoder()(d.pixel_values.clone(), [(j.data, 0, j.box, "k")])
    close(pixels, w.pixel_values)
    x, y, bw, bh = j.box
    outside = torch.ones(S, S, dtype=torch.bool)
    outside[y : y + bh, x : x + bw] = False
    assert (pixels[0][:, outside] == GREY).all() and torch.equal(pixels[0][:, outside], w.pixel_values[0][:, outside])


def test_what_the_device_cannot_decode_stays_on_the_worker_path(tiny_tokenizer):
    worker, device = processors(tiny_tokenizer)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate for display: the worker turns it upright
    for name, data in {
        "png": png((24, 40)),
        "cmyk": cmyk_jpeg(),
        "grey-png": png((24, 40), mode="L"),
        "exif-turned": encode(image((40, 24)), "JPEG", exif=exif.tobytes()),
    }.items():
        rec = Record(name, conversation(1)["messages"], [data])
        d = device.process(rec)
        assert d.jpegs == (), name
        assert torch.equal(d.pixel_values, worker.process(rec).pixel_values), name
    grey = device.process(Record("g", conversation(1)["messages"], [jpeg((24, 40), mode="L")]))
    assert len(grey.jpegs) == 1  # a grey JPEG is deferred (decoded to RGB on the device)
    # a JPEG cut short fails in the worker with the worker path's reason, not later on the device
    bad = Record("cut", conversation(1)["messages"], [truncated_jpeg()])
    assert reason_of(device.process, bad) == reason_of(worker.process, bad) == "unreadable_image"


def test_a_packs_deferred_jpegs_land_in_their_rows(tiny_tokenizer):
    worker, device = processors(tiny_tokenizer, "letterbox")
    records = [
        Record("a", conversation(1)["messages"], [png((20, 30), seed=1)]),
        Record(
            "b", conversation(3)["messages"], [jpeg((40, 24), seed=2), png((16, 16), seed=3), jpeg((24, 40), seed=4)]
        ),
        Record("c", conversation(0)["messages"], []),
        Record("d", conversation(1)["messages"], [jpeg((50, 50), seed=5)]),
    ]
    ws, ds = [worker.process(r) for r in records], [device.process(r) for r in records]
    for collate in (lambda s: collate_packed(s, 512, 0, S), lambda s: collate_padded(s, 0, S)):
        wb, db = collate(ws), collate(ds)
        assert DEFERRED_JPEGS not in wb
        assert [(row, key) for _, row, _, key in db[DEFERRED_JPEGS]] == [(1, "b"), (3, "b"), (4, "d")]
        pixels = DeviceDecoder()(db["pixel_values"], db[DEFERRED_JPEGS])
        for row in range(5):
            if row in (1, 3, 4):
                close(pixels[row], wb["pixel_values"][row])
            else:
                assert torch.equal(pixels[row], wb["pixel_values"][row])


def test_an_image_no_decoder_reads_stays_grey_and_is_counted_and_logged(caplog):
    header_only = jpeg((64, 64))
    header_only = header_only[: header_only.index(b"\xff\xda")] + b"\xff\xd9"  # SOS cut out: complete-looking
    decoder = DeviceDecoder()
    pixels = torch.full((2, 3, S, S), GREY, dtype=torch.uint8)
    decoder(pixels, [(header_only, 0, (0, 0, S, S), "key-7"), (jpeg((40, 40)), 1, (0, 0, S, S), "key-8")])
    assert (pixels[0] == GREY).all() and not (pixels[1] == GREY).all()  # the readable one is decoded
    assert decoder.counts() == {"device_decode_fallbacks": 0, "device_decode_failures": 1}
    assert decoder.counts() == {"device_decode_fallbacks": 0, "device_decode_failures": 0}  # since the last call
    assert "sample 'key-7'" in caplog.text and "stays grey" in caplog.text


def test_a_batch_whose_jpegs_were_not_decoded_is_refused_by_the_model(tiny_tokenizer):
    from helpers.training import tiny_cfg, tiny_model

    device = SampleProcessor(tiny_tokenizer, S, 4, decode="device")
    batch = collate_packed([device.process(Record("k", conversation(1)["messages"], [jpeg((40, 40))]))], 64, 0, S)
    model = tiny_model(tiny_cfg(Path("unused")))
    with pytest.raises(ValueError, match="still holds JPEGs to decode on the device"):
        model(batch)


def test_resize_matches_pillows_bicubic_when_shrinking():
    noise = np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    arr = np.asarray(Image.fromarray(noise).filter(ImageFilter.GaussianBlur(2)))  # smooth, like a photo
    ours = resize_uint8(torch.from_numpy(arr.transpose(2, 0, 1).copy()), 20, 30)
    pil = np.asarray(Image.fromarray(arr).resize((30, 20), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    assert (ours.int() - torch.from_numpy(pil.copy()).int()).abs().max() <= 2


def test_the_datamodule_decodes_after_the_move(tmp_path, make_dataset, tiny_tokenizer):
    make_dataset(tmp_path / "ds", 40, samples_per_shard=10, image_token_count=16)
    batches = {}
    for decode in ("worker", "device"):
        dm = make_dm(make_cfg([tmp_path / "ds"], image_decode=decode), tiny_tokenizer)
        batches[decode] = [dm.transfer_batch_to_device(b, torch.device("cpu"), 0) for b in take(dm, 4)]
    deferred = 0
    for w, d in zip(batches["worker"], batches["device"], strict=True):
        assert DEFERRED_JPEGS not in d
        assert d["sample_keys"] == w["sample_keys"] and torch.equal(d["input_ids"], w["input_ids"])
        changed = (d["pixel_values"] != w["pixel_values"]).flatten(1).any(1)
        deferred += int(changed.sum())
        for row in changed.nonzero().flatten().tolist():
            close(d["pixel_values"][row], w["pixel_values"][row])
    assert deferred > 0  # the synthetic data's JPEGs went the device way


def test_config_refuses_device_decode_with_tiles_and_unknown_values():
    with pytest.raises(ConfigError, match="image_decode=device.*image_splitting"):
        load_config(["tiles_cpu.yaml"], ["data.image_decode=device"])
    with pytest.raises(ConfigError, match="data.image_decode"):
        load_config(["tiny_cpu.yaml"], ["data.image_decode=gpu"])


def test_device_decode_on_cuda_without_torchvision_fails_before_training():
    from nanovlm.data.device_decode import _nvjpeg, check_decoder

    if not isinstance(_nvjpeg(), str):
        pytest.skip("torchvision imports here: nothing is missing")
    check_decoder(torch.device("cpu"))  # off CUDA Pillow decodes: nothing needed
    with pytest.raises(
        RuntimeError, match="data.image_decode=device on CUDA needs torchvision.*pip install -e .\\[decode\\]"
    ):
        check_decoder(torch.device("cuda"))
