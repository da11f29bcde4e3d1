"""JPEG decode: the worker path against the device path (``data.image_decode=device``), images/s and host CPU.

- **worker**: what a DataLoader worker does per image: open, decode with Pillow (JPEG draft scaling to the
  target size), bicubic resize, to a uint8 tensor; one core, one image at a time.
- **device**: what ``nanovlm.data.device_decode.DeviceDecoder`` does per pack on ``--device``: batched decodes
  (nvJPEG on CUDA; Pillow, without draft scaling, elsewhere), antialiased bicubic resize, paste into the pack's
  ``pixel_values``, synchronised.

Both on the same JPEGs, resized to ``IMAGE_SIZE`` (nanoVLM-460M's 512-px view): ``--decode-jpegs`` (a directory
or a tar of real ones), else photo-sized synthetic ones (smooth noise at COCO's common sizes, quality 90). Host CPU per image is the process's CPU time (all its threads)
over the timed loop (a blocking wait for the GPU, so waiting is not counted): what the path takes from the node's
cores. Beside it, the device path's pixels against the worker path's without draft scaling (the same image
decoded whole; decoders and resize filters round differently).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFilter

from nanovlm.data.device_decode import DECODE_CHUNK, DeviceDecoder
from nanovlm.data.processing import image_box, images_to_tensor, load_image, open_upright, resize_image

IMAGE_SIZE = 512
PHOTO_SIZES = ((640, 480), (480, 640), (640, 427), (500, 375))  # COCO's most common (w, h)
PACK_IMAGES = 16  # images decoded per call on the device: a pack's image budget


def photos(n: int, seed: int) -> list[bytes]:
    """``n`` photo-like JPEGs: blurred noise (compresses like a photo, unlike flat or pure-noise images)."""
    rng = np.random.default_rng(seed)
    base = {s: Image.fromarray(rng.integers(0, 256, (s[1], s[0], 3), dtype=np.uint8)) for s in PHOTO_SIZES}
    out = []
    for i in range(n):
        img = base[PHOTO_SIZES[i % len(PHOTO_SIZES)]].filter(ImageFilter.GaussianBlur(2 + i % 3))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def read_jpegs(path: str, n: int) -> list[bytes]:
    """Up to ``n`` JPEGs (``.jpg`` / ``.jpeg``) from a directory or a tar file, in name order."""
    import tarfile
    from pathlib import Path

    root = Path(path)
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.suffix.lower() in (".jpg", ".jpeg"))[:n]
        out = [f.read_bytes() for f in files]
    else:
        with tarfile.open(root) as tar:
            members = sorted((m for m in tar if m.name.lower().endswith((".jpg", ".jpeg"))), key=lambda m: m.name)
            out = [tar.extractfile(m).read() for m in members[:n]]
    if not out:
        raise ValueError(f"{path}: no .jpg / .jpeg files in it")
    return out


def _worker(data: bytes, size: int, draft: bool = True) -> torch.Tensor:
    img, _ = open_upright(data)
    return images_to_tensor([resize_image(load_image(img, draft_size=size if draft else 0), size)])[0]


def _timed(fn, reps: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of ``fn()`` over ``reps`` runs."""
    walls, cpus = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def measure(args: argparse.Namespace, log) -> dict[str, Any]:
    device = torch.device(args.device)
    n = 64 if args.quick else 256
    datas = read_jpegs(args.decode_jpegs, n) if args.decode_jpegs else photos(n, args.seed)
    n = len(datas)
    boxes = [image_box(*open_upright(d)[1], IMAGE_SIZE) for d in datas]
    decoder = DeviceDecoder()
    pixels = torch.zeros(PACK_IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8, device=device)
    packs = [
        [(d, i, b, f"img{lo + i}") for i, (d, b) in enumerate(zip(datas[lo : lo + PACK_IMAGES], boxes[lo:]))]
        for lo in range(0, n, PACK_IMAGES)
    ]

    def device_path() -> None:
        for pack in packs:
            decoder(pixels, pack)
        if device.type == "cuda":  # a blocking wait: a spinning one would count as host CPU time
            done = torch.cuda.Event(blocking=True)
            done.record()
            done.synchronize()

    log(f"decode: {n} JPEGs to {IMAGE_SIZE} px, worker path vs device path on {device}")
    device_path()  # warm-up: nvJPEG handles, kernels
    rows = []
    for name, fn in (("worker", lambda: [_worker(d, IMAGE_SIZE) for d in datas]), ("device", device_path)):
        wall, cpu = _timed(fn, args.reps)
        rows.append({"path": name, "images_per_s": n / wall, "host_cpu_ms_per_image": 1e3 * cpu / n})
    first = packs[0]
    decoder(pixels, first)
    ref = torch.stack([_worker(d, IMAGE_SIZE, draft=False) for d, *_ in first])
    diff = (pixels[: len(first)].cpu().int() - ref.int()).abs().float()
    return {
        "device": str(device),
        "decoder": "nvJPEG (torchvision)" if device.type == "cuda" else "Pillow (no nvJPEG off CUDA)",
        "images": n,
        "image_size": IMAGE_SIZE,
        "pack_images": PACK_IMAGES,
        "decode_chunk": DECODE_CHUNK,
        "source": args.decode_jpegs or f"synthetic photos {[list(s) for s in PHOTO_SIZES]}",
        "rows": rows,
        "pixel_diff_vs_worker_no_draft": {"mean": float(diff.mean()), "max": float(diff.max())},
        "fallbacks": decoder.fallbacks,
    }
