"""JPEG decode on the training device (``data.image_decode=device``).

Decoding and resizing images is most of a DataLoader worker's time on image-heavy data, and on a GPU node the
host's cores are few per GPU. With ``device`` decode the workers only open each JPEG's header (its size, for the
grid and the token count), leave a grey canvas in its ``pixel_values`` row and hand the bytes on
(``processing.DeferredJpeg``, gathered per pack by ``collate``). Once the pack is on the device,
``decode_deferred`` decodes all its JPEGs in one call (nvJPEG through ``torchvision.io.decode_jpeg`` on CUDA),
resizes each (bicubic, antialiased, the worker path's filter) and writes it into its box on the canvas.

Anything the device cannot take stays on the worker path: non-JPEG images, JPEGs that need an EXIF turn,
CMYK JPEGs, files cut short, and images split into tiles. A batch the device decoder refuses is decoded image by
image with Pillow instead (counted, logged); an image no decoder reads is an error naming its sample.

Off CUDA (tests, a CPU run) the same path decodes with Pillow in the training process: the plumbing is the
same, only the decoder differs. The two decoders' pixels differ by rounding, a unit or two of 255
(``scripts/benchmark.py --sections decode`` measures both and their difference).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Deferred = tuple[bytes, int, tuple[int, int, int, int], str]  # (bytes, row, (x, y, w, h), sample key): collate


@functools.cache
def _nvjpeg():
    """torchvision's decode_jpeg, or why it cannot be imported (it is only needed on CUDA)."""
    try:
        from torchvision.io import decode_jpeg
    except Exception as e:  # ImportError, or an operator missing for this torch build
        return f"torchvision is not importable ({type(e).__name__}: {e})"
    return decode_jpeg


def _pillow(data: bytes, key: str) -> torch.Tensor:
    """One JPEG -> uint8 [3, H, W] on the CPU, with the worker path's decoder."""
    from nanovlm.data.format import SampleError
    from nanovlm.data.processing import decode_image

    try:
        img = decode_image(data, key=key)
    except SampleError as e:
        raise RuntimeError(f"sample {key!r}: its JPEG is unreadable on the device and in Pillow ({e})") from None
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1).copy())


class DeviceDecoder:
    """Decodes packs' deferred JPEGs onto their device; counts the batches that fell back to Pillow."""

    def __init__(self) -> None:
        self.fallbacks = 0  # batches (CUDA) decoded image by image with Pillow after nvJPEG refused them

    def decode(self, datas: Sequence[bytes], keys: Sequence[str], device: torch.device) -> list[torch.Tensor]:
        """JPEG bytes -> uint8 [3, H, W] tensors on ``device``: one batched nvJPEG call on CUDA, else Pillow."""
        if device.type == "cuda":
            decode_jpeg = _nvjpeg()
            if isinstance(decode_jpeg, str):
                raise RuntimeError(f"data.image_decode=device on CUDA needs torchvision: {decode_jpeg}")
            inputs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
            try:
                return decode_jpeg(inputs, mode="RGB", device=device)
            except RuntimeError as e:  # one bad image fails the whole call: no partial results
                self.fallbacks += 1
                log.warning("nvJPEG refused a pack's JPEGs (%s); decoding them with Pillow (%s)", e, list(keys)[:4])
        return [_pillow(d, k).to(device, non_blocking=True) for d, k in zip(datas, keys)]

    def __call__(self, pixel_values: torch.Tensor, deferred: Sequence[Deferred]) -> torch.Tensor:
        """Decode ``deferred`` (collate's list) into their rows of ``pixel_values`` [n, 3, S, S] uint8, in place."""
        if not deferred:
            return pixel_values
        datas, rows, boxes, keys = zip(*deferred)
        images = self.decode(datas, keys, pixel_values.device)
        for img, row, (x, y, w, h) in zip(images, rows, boxes):
            pixel_values[row, :, y : y + h, x : x + w] = resize_uint8(img, h, w)
        return pixel_values


def resize_uint8(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """uint8 [3, H0, W0] -> uint8 [3, h, w]: bicubic with antialiasing (Pillow's filter when shrinking)."""
    if img.shape[-2:] == (h, w):
        return img
    out = F.interpolate(img[None].float(), size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)
