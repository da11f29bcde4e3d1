"""JPEG decode on the training device (``data.image_decode=device``).

Decoding and resizing images is most of a DataLoader worker's time on image-heavy data, and on a GPU node the
host's cores are few per GPU. With ``device`` decode the workers only open each JPEG's header (its size, for the
grid and the token count), leave a grey canvas in its ``pixel_values`` row and hand the bytes on
(``processing.DeferredJpeg``, gathered per pack by ``collate``). Once the pack is on the device,
``DeviceDecoder`` decodes its JPEGs in batched calls (nvJPEG through ``torchvision.io.decode_jpeg`` on CUDA),
resizes each (bicubic, antialiased, the worker path's filter) and writes it into its box on the canvas.

Anything the device cannot take stays on the worker path: non-JPEG images, JPEGs that need an EXIF turn,
CMYK JPEGs, files cut short, images over ``DEVICE_MAX_PIXELS`` (the worker's JPEG draft scaling decodes those at
a fraction of their size; the device would hold them whole) and images split into tiles. A batch nvJPEG refuses
is decoded image by image with Pillow instead (``fallbacks``); an image neither reads keeps its grey canvas and is
logged with its sample's key and counted (``failures``), like a skip: the run goes on.

Off CUDA (tests, a CPU run) the same path decodes with Pillow in the training process: the plumbing is the
same, only the decoder differs. The two paths' pixels differ by rounding; ``scripts/benchmark.py --sections
decode`` measures by how much.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Deferred = tuple[bytes, int, tuple[int, int, int, int], str]  # (bytes, row, (x, y, w, h) box, sample key)
DECODE_CHUNK = 8  # JPEGs per nvJPEG call: bounds the decoded images alive at once (8 x 16 MP x 3 B = 384 MB)


@functools.cache
def _nvjpeg() -> Callable | str:
    """torchvision's decode_jpeg, or why it cannot be imported (it is only needed on CUDA)."""
    try:
        from torchvision.io import decode_jpeg
    except Exception as e:  # ImportError, or an operator missing for this torch build
        return f"torchvision is not importable ({type(e).__name__}: {e}); pip install -e .[decode]"
    return decode_jpeg


def check_decoder(device: torch.device) -> None:
    """Fail now, not at the first batch, when ``device`` is CUDA and nvJPEG (torchvision) is missing."""
    if device.type == "cuda" and isinstance(_nvjpeg(), str):
        raise RuntimeError(f"data.image_decode=device on CUDA needs torchvision: {_nvjpeg()}")


def _pillow(data: bytes, key: str) -> torch.Tensor | None:
    """One JPEG -> uint8 [3, H, W] on the CPU with the worker path's decoder; None when it cannot read it."""
    from nanovlm.data.format import SampleError
    from nanovlm.data.processing import decode_image

    try:
        img = decode_image(data, key=key)
    except SampleError as e:
        log.warning("sample %r: its JPEG is unreadable on the device and in Pillow (%s); its image stays grey", key, e)
        return None
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1).copy())


class DeviceDecoder:
    """Decodes packs' deferred JPEGs onto their device, counting what fell back to Pillow or failed."""

    def __init__(self) -> None:
        self.fallbacks = 0  # nvJPEG calls refused (one bad image fails a call), decoded with Pillow instead
        self.failures = 0  # images no decoder read: left grey, logged

    def counts(self) -> dict[str, int]:
        """Fallbacks and failures since the last call (telemetry)."""
        out = {"device_decode_fallbacks": self.fallbacks, "device_decode_failures": self.failures}
        self.fallbacks = self.failures = 0
        return out

    def decode(self, datas: Sequence[bytes], keys: Sequence[str], device: torch.device) -> list[torch.Tensor | None]:
        """JPEG bytes -> uint8 [3, H, W] tensors on ``device`` (None: unreadable): one nvJPEG call on CUDA, else
        (and for a call nvJPEG refuses) Pillow."""
        if device.type == "cuda":
            check_decoder(device)
            try:
                inputs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]  # read on the host
                return _nvjpeg()(inputs, mode="RGB", device=device)
            except RuntimeError as e:  # no partial results: one bad image fails the whole call
                self.fallbacks += 1
                log.warning("nvJPEG refused JPEGs of %s (%s); decoding them with Pillow", sorted(set(keys)), e)
        images = [_pillow(d, k) for d, k in zip(datas, keys)]
        return [None if img is None else img.to(device, non_blocking=True) for img in images]

    def __call__(self, pixel_values: torch.Tensor, deferred: Sequence[Deferred]) -> torch.Tensor:
        """Decode ``deferred`` (collate's list) into their rows of ``pixel_values`` [n, 3, S, S] uint8, in place."""
        for lo in range(0, len(deferred), DECODE_CHUNK):
            datas, rows, boxes, keys = zip(*deferred[lo : lo + DECODE_CHUNK])
            images = self.decode(datas, keys, pixel_values.device)
            for i, (row, (x, y, w, h)) in enumerate(zip(rows, boxes)):
                img, images[i] = images[i], None  # freed once pasted
                if img is None:
                    self.failures += 1
                    continue
                pixel_values[row, :, y : y + h, x : x + w] = resize_uint8(img, h, w)
        return pixel_values


def resize_uint8(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """uint8 [3, H0, W0] -> uint8 [3, h, w]: bicubic with antialiasing (Pillow's filter when shrinking)."""
    if img.shape[-2:] == (h, w):
        return img
    out = F.interpolate(img[None].float(), size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)
