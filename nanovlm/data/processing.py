"""Turn one Record into model inputs: decoded, resized images and chat-formatted token ids with loss labels.

The token sequence of a conversation is built piecewise, turn by turn (``chat.py`` holds the formats; ChatML)::

    <|im_start|> role\\n  content  <|im_end|> \\n

with each ``<image>`` in a content replaced by the image's tokens: ``image_token_count`` copies of the ``<image>``
id, or with image splitting its tiles' ids framed by markers (``tiling.py``). Building it
piecewise (instead of tokenizing one rendered string) places the loss labels exactly: labels are the token ids
on an assistant turn's content and its end token (``<|im_end|>``: the model learns to stop) and -100 everywhere else.
Text inside a content is tokenized with special-token matching off, so a literal ``<|im_end|>`` typed by a
user is plain text, never a turn boundary. The same piecewise encoding gives the index's ``text_tokens`` and
the generation prompt, so training, the index and generation agree token for token.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from nanovlm.config import DataConfig, ModelConfig, image_token_count
from nanovlm.constants import DEVICE_MAX_PIXELS, IGNORE_INDEX, IMAGE_DECODES, IMAGE_TOKEN
from nanovlm.data import chat
from nanovlm.data.format import Record, SampleError
from nanovlm.data.tiling import (
    GLOBAL_MARKER,
    NO_SPLIT,
    SPLIT_TOKENS,
    TILE_MARKER,
    ImageLayout,
    idefics3_resized,
    idefics3_side,
    position_marker,
)
from nanovlm.data.tokenizer import plain_text_tokenizer

LETTERBOX_FILL = (128, 128, 128)  # ~the normalisation mean, so padding is ~0 after normalisation
CACHED_PIECES = 4096  # text pieces whose token ids are kept (see SampleProcessor._encode_text)
CACHED_PIECE_CHARS = 256  # longer pieces are rarely repeated: always tokenized


# ----------------------------------------------------------------------------------------------------------
# images


# The raster formats PIL may decode: the members IMAGE_SUFFIXES names (JPEG includes camera MPO files). An explicit
# list, because sniffing every format PIL knows would hand an EPS/PostScript member to Ghostscript, i.e. execute
# it: nothing in a dataset is ever executed.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")


@functools.cache
def _available_formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin; a Pillow built without e.g. WebP simply lacks that one
    return tuple(f for f in IMAGE_FORMATS if f in Image.ID)


def open_image(data: bytes) -> Image.Image:
    """Open (not yet decode) image bytes as one of IMAGE_FORMATS, whatever the member is named."""
    return Image.open(io.BytesIO(data), formats=_available_formats())


ROTATED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def open_checked(data: bytes, max_pixels: int = 0, key: str = "") -> Image.Image:
    """Open image bytes (header only) under the size guard: SampleError ``image_too_large`` past ``max_pixels``
    (> 0) or PIL's bomb limit, ``unreadable_image`` when no allowed format reads them."""
    try:
        with warnings.catch_warnings():  # our own max_pixels check below replaces PIL's warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = open_image(data)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SampleError("image_too_large", key, str(e)) from None
    except Exception as e:  # PIL raises many types (OSError, ValueError, SyntaxError, struct.error, ...)
        raise SampleError("unreadable_image", key, describe_error(e)) from None
    check_pixels(*img.size, max_pixels, key)
    return img


def check_pixels(w: int, h: int, max_pixels: int = 0, key: str = "") -> None:
    """SampleError ``image_too_large`` past ``max_pixels`` (> 0) or past twice Pillow's MAX_IMAGE_PIXELS (where
    Pillow refuses to open a file as a possible decompression bomb)."""
    if max_pixels > 0 and w * h > max_pixels:
        raise SampleError("image_too_large", key, f"{w}x{h} > max_image_pixels={max_pixels}")
    if Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS:
        raise SampleError("image_too_large", key, f"{w}x{h} pixels: a possible decompression bomb")


def open_upright(data: bytes, max_pixels: int = 0, key: str = "") -> tuple[Image.Image, tuple[int, int]]:
    """(opened image, its (width, height) once EXIF orientation is applied): the size decoding will give.

    JPEG is read from its header only (its EXIF sits there, and decoding may then use a draft scale). Other
    formats are decoded here: a PNG may keep its EXIF after the pixels, and Pillow turns a TIFF upright itself
    while loading, so only the loaded image tells its orientation, exactly as ``decode_image`` sees it.
    Raises SampleError ``image_too_large`` or ``unreadable_image``.
    """
    img = open_checked(data, max_pixels, key)
    try:
        if img.format not in ("JPEG", "MPO"):
            img.load()
        w, h = img.size
        try:
            orientation = img.getexif().get(0x0112)
        except Exception:  # a corrupt EXIF block: decoding ignores it too
            orientation = None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SampleError("image_too_large", key, str(e)) from None
    except Exception as e:
        raise SampleError("unreadable_image", key, describe_error(e)) from None
    return img, ((h, w) if orientation in ROTATED_ORIENTATIONS else (w, h))


def load_image(img: Image.Image, draft_size: int = 0, key: str = "") -> Image.Image:
    """An image from ``open_upright`` -> fully decoded, upright RGB. ``draft_size`` > 0 lets JPEG decode at a
    reduced scale that still covers draft_size x draft_size (fast). Raises SampleError ``unreadable_image``
    (also for truncated files)."""
    try:
        if draft_size > 0 and img.format == "JPEG":
            img.draft("RGB", (draft_size, draft_size))
        img.load()  # decodes everything: truncated or corrupt data fails here, not later
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise SampleError("image_too_large", key, str(e)) from None
    except Exception as e:
        raise SampleError("unreadable_image", key, describe_error(e)) from None
    with contextlib.suppress(Exception):  # a corrupt EXIF block must not cost an otherwise readable image
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of the (usual) upright image
    return to_rgb(img)


def decode_image(data: bytes, max_pixels: int = 0, draft_size: int = 0, key: str = "") -> Image.Image:
    """Bytes -> fully decoded RGB PIL image, upright (EXIF orientation applied). Format is sniffed from content.

    ``max_pixels`` > 0 rejects larger images before decoding pixels (decompression-bomb guard); ``draft_size``
    as in ``load_image``. Raises SampleError ``image_too_large`` or ``unreadable_image``.
    """
    return load_image(open_upright(data, max_pixels, key)[0], draft_size, key)


def describe_error(e: Exception) -> str:
    """A decoder error as a stable message (no object addresses, so rejection logs are reproducible)."""
    if isinstance(e, UnidentifiedImageError):
        return "not a recognised image format"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(e).__name__}: {e}")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Transparency is composited over white; 16-bit and float greys are scaled to 8 bit."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode.startswith("I") or img.mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        # I;16 is 16-bit by definition (a dark image has small values, not 8-bit ones); for I and F the values
        # are the only hint
        if img.mode.startswith("I;16") or arr.max(initial=0) > 255:
            arr = arr / 257.0
        img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def image_box(w: int, h: int, size: int, mode: str = "squash") -> tuple[int, int, int, int]:
    """(x, y, width, height) of a w x h image resized onto the size x size canvas: all of it with ``squash``
    (the aspect ratio ignored), centred with its aspect kept with ``letterbox`` (grey around it)."""
    if mode == "squash":
        return 0, 0, size, size
    if mode == "letterbox":
        scale = size / max(w, h)
        nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
        return (size - nw) // 2, (size - nh) // 2, nw, nh
    raise ValueError(f"unknown resize mode {mode!r}; choose squash or letterbox")


def resize_image(img: Image.Image, size: int, mode: str = "squash") -> Image.Image:
    """Resize to size x size as ``image_box`` places it (bicubic)."""
    x, y, w, h = image_box(*img.size, size, mode)
    if (w, h) == (size, size):
        return img if img.size == (size, size) else img.resize((size, size), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), LETTERBOX_FILL)
    canvas.paste(img.resize((w, h), Image.Resampling.BICUBIC), (x, y))
    return canvas


def split_image(img: Image.Image, grid: tuple[int, int], size: int, resize: str = "squash") -> list[Image.Image]:
    """An upright RGB image -> its views for ``grid`` (tiling.py): the tiles row by row, then the global view.

    A 1 x 1 grid is one view, the whole image resized like an unsplit image. Otherwise the image keeps its aspect
    and fills the ``cols*size x rows*size`` canvas as far as that allows, centred on grey.
    """
    rows, cols = grid
    whole = resize_image(img, size, resize)
    if rows * cols <= 1:
        return [whole]
    cw, ch = cols * size, rows * size
    w, h = img.size
    scale = min(cw / w, ch / h)
    nw, nh = min(cw, max(1, round(w * scale))), min(ch, max(1, round(h * scale)))
    canvas = Image.new("RGB", (cw, ch), LETTERBOX_FILL)
    canvas.paste(img.resize((nw, nh), Image.Resampling.BICUBIC), ((cw - nw) // 2, (ch - nh) // 2))
    boxes = [(c * size, r * size, (c + 1) * size, (r + 1) * size) for r in range(rows) for c in range(cols)]
    return [canvas.crop(b) for b in boxes] + [whole]


def split_idefics3(img: Image.Image, grid: tuple[int, int], size: int, longest_edge: int) -> list[Image.Image]:
    """An upright RGB image -> its views for ``grid`` (``tiling.idefics3_grids`` of its size), resized as
    transformers' ``Idefics3ImageProcessor`` resizes them (LANCZOS): the longest edge to ``longest_edge``, then to
    the grid's whole tiles; the tiles row by row, then the global view (none when the grid is one tile)."""
    w, h = (int(x[0]) for x in idefics3_resized([img.width], [img.height], longest_edge))
    rows, cols = grid
    img = img.resize((w, h), Image.Resampling.LANCZOS).resize((cols * size, rows * size), Image.Resampling.LANCZOS)
    if rows * cols == 1:
        return [img]
    boxes = [(c * size, r * size, (c + 1) * size, (r + 1) * size) for r in range(rows) for c in range(cols)]
    return [img.crop(b) for b in boxes] + [img.resize((size, size), Image.Resampling.LANCZOS)]


def images_to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """Same-size RGB PIL images -> one contiguous uint8 tensor [n, 3, H, W] (normalised later, on the device).

    One numpy stack and one transposing copy for all images: per-image torch calls (from_numpy, permute,
    contiguous, then a stack) cost more than the copy itself at VLM image sizes."""
    hwc = np.stack([np.asarray(img, dtype=np.uint8) for img in images])  # [n, H, W, 3]
    return torch.from_numpy(np.ascontiguousarray(hwc.transpose(0, 3, 1, 2)))


JPEG_END = b"\xff\xd9"  # EOI: a JPEG cut short (the common corruption) lacks it


@dataclass(frozen=True)
class DeferredJpeg:
    """A JPEG left for the training device to decode (``data.image_decode=device``, ``device_decode.py``): its
    bytes, its row in the sample's ``pixel_values`` (a grey canvas until then) and its ``image_box`` there."""

    data: bytes
    view: int
    box: tuple[int, int, int, int]  # (x, y, width, height) on the image_size x image_size canvas


def device_decodable(img: Image.Image, data: bytes) -> bool:
    """Whether an opened image can be decoded on the device instead: a complete RGB or grey JPEG of at most
    ``DEVICE_MAX_PIXELS`` that needs no EXIF turn (the rest, and anything split into tiles, is decoded in the
    worker, as before)."""
    if img.format != "JPEG" or img.mode not in ("RGB", "L") or img.width * img.height > DEVICE_MAX_PIXELS:
        return False
    if data.rstrip(b"\0")[-2:] != JPEG_END:
        return False
    try:
        return img.getexif().get(0x0112) in (None, 1)
    except Exception:  # a corrupt EXIF block: the worker's decoder ignores it, the device's might not
        return False


# ----------------------------------------------------------------------------------------------------------
# text


def long_tensor(ids: Sequence[int]) -> torch.Tensor:
    """Token ids -> int64 tensor [L], through numpy: about 3x faster than ``torch.tensor(list)``."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


@dataclass
class ProcessedSample:
    """Model inputs of one sample. ``labels`` are unshifted (the model shifts inside the loss)."""

    key: str
    input_ids: torch.Tensor  # LongTensor [L]
    labels: torch.Tensor  # LongTensor [L], -100 except on assistant content and its end token
    pixel_values: torch.Tensor  # uint8 [n_img, 3, H, W]
    truncated: bool = False
    jpegs: tuple[DeferredJpeg, ...] = ()  # views of pixel_values still to be decoded on the device


class SampleProcessor:
    """Decode images and tokenize a conversation with ChatML, loss labels on assistant turns only.

    ``max_tiles`` > 0 splits images (``tiling.py``): each ``<image>`` becomes its grid's tiles, global view and
    markers. The tokenizer must then carry the markers (``load_tokenizer(..., image_splitting=True)``).
    """

    @classmethod
    def from_config(cls, tokenizer, model_cfg: ModelConfig, data_cfg: DataConfig) -> SampleProcessor:
        """The processor a run with these configs trains on."""
        vision = model_cfg.vision
        args = (vision.image_size, image_token_count(model_cfg), data_cfg.image_resize, data_cfg.max_image_pixels)
        fmt = data_cfg.chat_format
        if not vision.image_splitting:
            return cls(tokenizer, *args, chat_format=fmt, decode=data_cfg.image_decode)
        if vision.longest_edge:
            side = idefics3_side(vision.image_size, vision.longest_edge)
            return cls(tokenizer, *args, max_tiles=side * side, longest_edge=vision.longest_edge, chat_format=fmt)
        return cls(tokenizer, *args, max_tiles=vision.max_tiles, chat_format=fmt)

    def __init__(
        self,
        tokenizer,
        image_size: int,
        image_token_count: int,
        resize: str = "squash",
        max_image_pixels: int = 64_000_000,
        max_tiles: int = 0,
        longest_edge: int = 0,
        chat_format: str = "chatml",
        decode: str = "worker",
    ):
        if resize not in ("squash", "letterbox"):
            raise ValueError(f"unknown resize mode {resize!r}; choose squash or letterbox")
        if decode not in IMAGE_DECODES or (decode == "device" and max_tiles):
            raise ValueError(f"image decode {decode!r}: choose one of {IMAGE_DECODES} (device: without tiles)")
        self.decode = decode
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.image_token_count = image_token_count
        self.resize = resize
        self.max_image_pixels = max_image_pixels
        self._text = plain_text_tokenizer(tokenizer)  # content text is plain text (no special tokens, no padding)
        self.chat_format = chat.check_format(chat_format)
        needed = (*chat.special_tokens(chat_format), IMAGE_TOKEN, *(SPLIT_TOKENS if max_tiles else ()))
        self._ids = self._special_ids(tokenizer, needed)
        self.end_id, self.image_token_id = self._ids[chat.end_token(chat_format)], self._ids[IMAGE_TOKEN]
        self._start = [self._ids[t] for t in chat.conversation_start(chat_format)]
        self._headers: dict[str, list[int]] = {}
        # Prompts repeat across a dataset ("Describe the image.", the demo's questions): one tokenizer call
        # costs ~20 us, a dict hit well under 1. Short pieces only, and the first CACHED_PIECES distinct ones
        # (a plain dict: picklable, no eviction work), so memory stays under ~4 MB.
        self._piece_ids: dict[str, tuple[int, ...]] = {}
        self._newline = self._encode_text("\n")
        self._grid_ids: dict[tuple[int, int], tuple[int, ...]] = {}
        nl2 = len(self._encode_text("\n\n"))
        self.layout = ImageLayout(image_size, image_token_count, max_tiles, len(self._newline), nl2, longest_edge)

    def __getstate__(self) -> dict:
        # a pickled tokenizers.Tokenizer forgets encode_special_tokens: spawned DataLoader workers rebuild it
        return {k: v for k, v in self.__dict__.items() if k != "_text"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._text = plain_text_tokenizer(self.tokenizer)

    @staticmethod
    def _special_ids(tokenizer, tokens: Sequence[str]) -> dict[str, int]:
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
        missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(
                f"tokenizer lacks special tokens {missing[:4]}{' ...' if len(missing) > 4 else ''}; load it with "
                "nanovlm.data.tokenizer.load_tokenizer (image_splitting=True adds the grid markers; "
                f"{chat.END_OF_UTTERANCE} for data.chat_format=smolvlm comes with SmolVLM's tokenizer)"
            )
        return ids

    def _encode_text(self, text: str) -> tuple[int, ...]:
        """Token ids of plain text (special-token strings inside it stay text)."""
        if not text:
            return ()
        ids = self._piece_ids.get(text)
        if ids is None:
            ids = tuple(self._text.encode(text, add_special_tokens=False).ids)
            if len(text) <= CACHED_PIECE_CHARS and len(self._piece_ids) < CACHED_PIECES:
                self._piece_ids[text] = ids
        return ids

    def _pieces(self, specials: Sequence[str], text: str) -> list[int]:
        return [self._ids[t] for t in specials] + list(self._encode_text(text))

    def _header(self, role: str) -> list[int]:
        if role not in self._headers:
            self._headers[role] = self._pieces(*chat.header(self.chat_format, role))
        return self._headers[role]

    # ---- images ------------------------------------------------------------------------------------------

    def image_ids(self, grid: tuple[int, int] = NO_SPLIT) -> tuple[int, ...]:
        """The token ids standing for one image with this grid (tiling.py's layout; NO_SPLIT: plain tokens)."""
        if grid not in self._grid_ids:  # at most 1 + (grids of <= 36 tiles) entries
            self._grid_ids[grid] = self._layout_ids(grid)
        return self._grid_ids[grid]

    def _layout_ids(self, grid: tuple[int, int]) -> tuple[int, ...]:
        image = (self.image_token_id,) * self.image_token_count
        if grid == NO_SPLIT:
            return image
        mark, glob = self._ids[TILE_MARKER], self._ids[GLOBAL_MARKER]
        whole = (mark, glob, *image, mark)
        rows, cols = grid
        if rows * cols == 1:
            return whole
        ids: list[int] = []
        for r in range(1, rows + 1):
            for c in range(1, cols + 1):
                ids += (mark, self._ids[position_marker(r, c)], *image)
            ids += self._newline if r < rows else self._encode_text("\n\n")
        return (*ids, *whole)

    def _open(self, data: bytes, key: str) -> tuple[Image.Image, tuple[int, int]]:
        """(opened image, its grid): the grid from the upright size alone (NO_SPLIT without splitting)."""
        img, size = open_upright(data, self.max_image_pixels, key)
        return img, self.layout.grid_of(*size)

    def grid(self, data: bytes, key: str = "") -> tuple[int, int]:
        """An image's grid (tiling.py), from its size."""
        return self._open(data, key)[1]

    def _views(self, img: Image.Image, grid: tuple[int, int], key: str) -> list[Image.Image]:
        """An opened image -> its image_size x image_size views (one without splitting)."""
        rows, cols = grid
        draft = self.image_size * max(1, rows, cols)  # JPEG may decode at a scale that still covers the canvas
        img = load_image(img, draft_size=draft, key=key)
        if grid == NO_SPLIT:
            return [resize_image(img, self.image_size, self.resize)]
        if self.layout.longest_edge:
            return split_idefics3(img, grid, self.image_size, self.layout.longest_edge)
        return split_image(img, grid, self.image_size, self.resize)

    def _pixels(
        self, opened: Sequence[tuple[Image.Image, tuple[int, int]]], key: str, datas: Sequence[bytes] = ()
    ) -> tuple[torch.Tensor, tuple[DeferredJpeg, ...]]:
        """Every image's views, uint8 [n_views, 3, S, S]. Given the images' bytes (``datas``) and
        ``decode="device"``, a ``device_decodable`` image's view is a grey canvas and comes back deferred."""
        if not opened:
            return torch.zeros(0, 3, self.image_size, self.image_size, dtype=torch.uint8), ()
        views: list[Image.Image] = []
        deferred: list[DeferredJpeg] = []
        for (img, grid), data in itertools.zip_longest(opened, datas[: len(opened)]):
            if data is not None and self.decode == "device" and device_decodable(img, data):
                deferred.append(DeferredJpeg(data, len(views), image_box(*img.size, self.image_size, self.resize)))
                views.append(Image.new("RGB", (self.image_size, self.image_size), LETTERBOX_FILL))
            else:
                views += self._views(img, grid, key)
        return images_to_tensor(views), tuple(deferred)

    def images(self, datas: Sequence[bytes], key: str = "") -> torch.Tensor:
        """The images of one sample -> uint8 [n_views, 3, S, S]: every image's views in order ([0, 3, S, S] for
        none); a view per image without splitting, else each image's tiles then its global view."""
        return self._pixels([self._open(b, key) for b in datas], key)[0]

    def image(self, data: bytes, key: str = "") -> torch.Tensor:
        """Image bytes -> uint8 [3, S, S]: the first (without splitting: the only) view."""
        return self.images([data], key)[0]

    # ---- text --------------------------------------------------------------------------------------------

    def _content(self, content: str, images: Iterator[Sequence[int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Content ids (each ``<image>`` replaced by the next of ``images``) and each image's (start, end)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, piece in enumerate(content.split(IMAGE_TOKEN)):
            if i > 0:
                image = next(images)
                spans.append((len(ids), len(ids) + len(image)))
                ids += image
            ids += self._encode_text(piece)
        return ids, spans

    def _encode(
        self, messages: list[dict], image_ids: Sequence[Sequence[int]] | None
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(input_ids, labels, each image's (start, end) in them); see ``encode``."""
        if image_ids is None:
            n = sum(m["content"].count(IMAGE_TOKEN) for m in messages)
            image_ids = [self.image_ids()] * n
        images = iter(image_ids)
        ids: list[int] = list(self._start)
        labels: list[int] = [IGNORE_INDEX] * len(ids)
        spans: list[tuple[int, int]] = []
        for m in messages:
            header = self._header(m["role"])
            ids += header
            labels += [IGNORE_INDEX] * len(header)
            content, content_spans = self._content(chat.content(self.chat_format, m["content"]), images)
            spans += [(len(ids) + a, len(ids) + b) for a, b in content_spans]
            ids += content
            if m["role"] == "assistant":
                masked = list(content)
                for a, b in content_spans:
                    masked[a:b] = [IGNORE_INDEX] * (b - a)
                labels += masked
                labels.append(self.end_id)
            else:
                labels += [IGNORE_INDEX] * len(content)
                labels.append(IGNORE_INDEX)
            ids.append(self.end_id)
            ids += self._newline
            labels += [IGNORE_INDEX] * len(self._newline)
        return ids, labels, spans

    def encode(
        self, messages: list[dict], image_ids: Sequence[Sequence[int]] | None = None
    ) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of a whole conversation; the i-th ``<image>`` becomes ``image_ids[i]``
        (default: ``image_token_count`` image tokens each, the unsplit layout)."""
        ids, labels, _ = self._encode(messages, image_ids)
        return ids, labels

    def prompt(
        self, messages: list[dict], images: Sequence[bytes] = (), key: str = ""
    ) -> tuple[list[int], torch.Tensor]:
        """(ids, pixel values) to generate the next assistant turn from: the conversation with its images laid out
        as in training, then the header of an assistant turn. Raises SampleError for a placeholder/image mismatch
        and for unreadable images."""
        self._check_images(messages, images, key)
        opened = [self._open(b, key) for b in images]
        ids, _ = self.encode(messages, [self.image_ids(g) for _, g in opened])
        return ids + self._header("assistant"), self._pixels(opened, key)[0]

    @staticmethod
    def _check_images(messages: list[dict], images: Sequence[bytes], key: str) -> None:
        n_placeholders = sum(m["content"].count(IMAGE_TOKEN) for m in messages)
        if n_placeholders != len(images):
            raise SampleError("image_count_mismatch", key, f"{n_placeholders} placeholders, {len(images)} images")

    def text_tokens(self, messages: list[dict]) -> int:
        """Token count with each ``<image>`` counted as one token (the index's ``text_tokens``)."""
        return self.token_counts(messages)[0]

    def token_counts(self, messages: list[dict]) -> tuple[int, int, int]:
        """(text tokens, prompt tokens, prompt images) with each ``<image>`` counted as one token.

        The prompt is everything before the first loss token. The index keeps it so that, with
        ``overlength="truncate"``, the planner can tell in advance that a cut would leave no answer (the sample
        is then skipped at planning time instead of leaving an empty pack behind at read time).
        """
        n = sum(m["content"].count(IMAGE_TOKEN) for m in messages)
        ids, labels, spans = self._encode(messages, [(self.image_token_id,)] * n)
        first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
        return len(ids), first, sum(1 for a, _ in spans if a < first)

    # ---- samples -----------------------------------------------------------------------------------------

    def process(self, record: Record, max_tokens: int | None = None, overlength: str = "drop") -> ProcessedSample:
        """Record -> ProcessedSample. Raises SampleError for bad images, placeholder mismatch and over-length.

        ``overlength="drop"`` rejects a sample longer than ``max_tokens`` (reason ``overlength``);
        ``"truncate"`` cuts it to ``max_tokens`` without splitting an image's tokens (an image that would be
        cut is removed whole, with everything after it). A truncated sample with no loss token left is dropped.
        """
        if overlength not in ("drop", "truncate"):
            raise ValueError(f"overlength must be 'drop' or 'truncate', got {overlength!r}")
        self._check_images(record.messages, record.images, record.key)
        opened = [self._open(b, record.key) for b in record.images]
        ids, labels, spans = self._encode(record.messages, [self.image_ids(g) for _, g in opened])
        n_images = len(record.images)
        truncated = False
        if max_tokens is not None and len(ids) > max_tokens:
            if overlength == "drop":
                raise SampleError("overlength", record.key, f"{len(ids)} tokens > max_tokens={max_tokens}")
            n_images = sum(1 for _, end in spans if end <= max_tokens)  # images that end before the cut stay
            cut = min(max_tokens, spans[n_images][0]) if n_images < len(spans) else max_tokens
            ids, labels = ids[:cut], labels[:cut]
            truncated = True
            if all(label == IGNORE_INDEX for label in labels):
                raise SampleError("overlength", record.key, f"no answer token left after truncation to {max_tokens}")
        pixel_values, jpegs = self._pixels(opened[:n_images], record.key, record.images)
        return ProcessedSample(record.key, long_tensor(ids), long_tensor(labels), pixel_values, truncated, jpegs)
