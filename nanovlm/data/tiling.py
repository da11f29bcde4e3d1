"""Image splitting: how an image of (width, height) becomes vision-encoder tiles and decoder tokens.

With ``model.vision.image_splitting`` an image is shown to the encoder as a grid of ``image_size`` tiles plus
one downscaled global view, so a large or elongated image gets as many encoder inputs as its size needs.

**Grid rule.** Among the grids of ``rows x cols`` tiles with ``rows * cols <= max_tiles`` (and each side at most
``MAX_GRID_SIDE``, the markers a tokenizer carries), take the one that shows the image at the highest
resolution not above its own, and among those the one with the fewest tiles (then the fewest rows). The image
fits a grid at scale ``min(cols * S / width, rows * S / height)``; that scale capped at 1, squared, times the
image's pixels is the resolution the grid keeps. An image no larger than one tile therefore gets 1 x 1, a 4:1
strip at least ``4 * S`` wide gets ``1 x 4`` (when ``max_tiles >= 4``), and a large photo the grid closest to its
aspect that the budget allows. The image is resized with its aspect kept to fill the grid as far as the aspect allows, centred
on a grey canvas of ``cols * S x rows * S``, and cut into tiles row by row.

**Tokens.** Each tile becomes ``tokens_per_tile`` ``<image>`` tokens, framed by markers as Idefics3 / SmolVLM
frame them (so their checkpoints read our sequences)::

    grid 1 x 1:   <fake_token_around_image><global-img> <image>*n <fake_token_around_image>
    grid r x c:   for each row:  (<fake_token_around_image><row_i_col_j> <image>*n) per column, then "\\n"
                  then "\\n" <fake_token_around_image><global-img> <image>*n <fake_token_around_image>

(the last row's "\\n" and the one before the global view are one "\\n\\n" piece of text). A grid of one tile
has no separate global view: that tile is the whole image. An image's tile count and token count are pure
functions of its (width, height), so the index's stored sizes give every sample's length without decoding.

Without splitting an image is one ``image_size`` square of ``tokens_per_tile`` tokens and no markers.

**Idefics3's rule** (``model.vision.longest_edge`` > 0), what SmolVLM's own processor does, so that a SmolVLM
checkpoint sees its images as it was trained on them and an exported processor tiles as training did: the image
is resized (LANCZOS) so that its longest edge is ``longest_edge`` (up or down, the other side by the aspect and
rounded up to even), then each side up to a multiple of ``image_size``, and cut into that grid; the global view is
the resized image squashed to one tile. Every image of one aspect therefore gets the same grid, whatever its size.
``idefics3_grids`` restates the arithmetic of transformers' ``Idefics3ImageProcessor`` (float division and
truncation where it uses them), and a test compares both on random sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MAX_GRID_SIDE = 6  # rows and columns a grid may have: the <row_i_col_j> markers SmolVLM's tokenizer carries
TILE_MARKER = "<fake_token_around_image>"
GLOBAL_MARKER = "<global-img>"
NO_SPLIT = (0, 0)  # the grid of an image that is not split (one squashed or letterboxed view, no markers)
MAX_IDEFICS3_EDGE = 4096  # Idefics3's processor caps the resized image's longest edge here


def position_marker(row: int, col: int) -> str:
    """The marker before the tile at (row, col), both counted from 1."""
    return f"<row_{row}_col_{col}>"


SPLIT_TOKENS = (
    TILE_MARKER,
    GLOBAL_MARKER,
    *(position_marker(r, c) for r in range(1, MAX_GRID_SIDE + 1) for c in range(1, MAX_GRID_SIDE + 1)),
)


@functools.cache
def candidate_grids(max_tiles: int) -> np.ndarray:
    """[K, 2] (rows, cols) of every grid the rule may choose, fewest tiles first, then fewest rows."""
    grids = [
        (r, c) for r in range(1, MAX_GRID_SIDE + 1) for c in range(1, MAX_GRID_SIDE + 1) if r * c <= max(1, max_tiles)
    ]
    grids.sort(key=lambda g: (g[0] * g[1], g[0]))
    return np.asarray(grids, np.int64)


def choose_grids(sizes: np.ndarray, image_size: int, max_tiles: int, chunk: int = 1 << 16) -> np.ndarray:
    """[M, 2] (width, height) -> [M, 2] (rows, cols) by the grid rule (see the module docstring).

    Integer arithmetic only: the capped scale a grid shows the image at is ``min(cols*S*h, rows*S*w, w*h) / (w*h)``,
    so comparing the numerators ranks the grids of one image exactly. Sizes repeat (a dataset has far fewer
    distinct sizes than images), so the rule runs once per distinct size.
    """
    sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
    if len(sizes) == 0:
        return np.zeros((0, 2), np.int64)
    if (sizes <= 0).any():
        raise ValueError(f"image sizes must be positive, got {sizes[(sizes <= 0).any(axis=1)][0].tolist()}")
    keys, inverse = np.unique(sizes[:, 0] << 32 | sizes[:, 1], return_inverse=True)  # 1-D: far faster than axis=0
    distinct = np.stack([keys >> 32, keys & 0xFFFFFFFF], 1)
    grids = candidate_grids(max_tiles)  # [K, 2], in tie-break order
    rows, cols = grids[:, 0], grids[:, 1]
    out = np.empty_like(distinct)
    for lo in range(0, len(distinct), chunk):
        w = distinct[lo : lo + chunk, :1]  # [U, 1]
        h = distinct[lo : lo + chunk, 1:]
        kept = np.minimum(np.minimum(cols * image_size * h, rows * image_size * w), w * h)  # [U, K]
        out[lo : lo + chunk] = grids[np.argmax(kept, axis=1)]  # argmax takes the first best: the tie-break order
    return out[inverse.reshape(-1)]


def idefics3_resized(width: np.ndarray, height: np.ndarray, longest_edge: int) -> tuple[np.ndarray, np.ndarray]:
    """[M] sizes -> [M] (width, height) after Idefics3's resize of the longest edge to ``longest_edge``."""
    w, h = np.asarray(width, np.int64), np.asarray(height, np.int64)
    aspect = w / h  # float64, as Python's float division
    wide = w >= h
    short = np.where(wide, np.trunc(longest_edge / aspect), np.trunc(longest_edge * aspect)).astype(np.int64)
    short += short % 2  # rounded up to even
    new_w, new_h = np.where(wide, longest_edge, short), np.where(wide, short, longest_edge)
    return np.maximum(new_w, 1), np.maximum(new_h, 1)


def idefics3_tiled(width: np.ndarray, height: np.ndarray, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[M] sizes -> [M] (width, height) rounded up to whole tiles, the longer side first (as Idefics3 does)."""
    w, h = np.asarray(width, np.int64), np.asarray(height, np.int64)
    aspect = w / h
    wide = w >= h
    s = image_size
    long_side = -(-np.where(wide, w, h) // s) * s
    other = np.where(wide, np.trunc(long_side / aspect), np.trunc(long_side * aspect)).astype(np.int64)
    other = -(-other // s) * s
    return np.where(wide, long_side, other), np.where(wide, other, long_side)


def idefics3_grids(sizes: np.ndarray, image_size: int, longest_edge: int) -> np.ndarray:
    """[M, 2] (width, height) -> [M, 2] (rows, cols) by Idefics3's rule (see the module docstring); a grid that
    is one tile is (1, 1), one view with no global view beside it."""
    sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
    if (sizes <= 0).any():
        raise ValueError(f"image sizes must be positive, got {sizes[(sizes <= 0).any(axis=1)][0].tolist()}")
    w, h = idefics3_resized(sizes[:, 0], sizes[:, 1], longest_edge)
    w, h = idefics3_tiled(w, h, image_size)
    return np.stack([h // image_size, w // image_size], 1)


def per_sample(per_image: np.ndarray, counts: np.ndarray, take: np.ndarray | None = None) -> np.ndarray:
    """[M] values of images stored sample after sample (``counts`` [N] each) -> [N] the sum over each sample's
    first ``take`` images (default: all of them)."""
    cum = np.concatenate([[0], np.cumsum(per_image)])
    starts = np.cumsum(counts) - counts
    return cum[starts + (counts if take is None else take)] - cum[starts]


@functools.lru_cache(maxsize=4096)
def grid_of(width: int, height: int, image_size: int, max_tiles: int, longest_edge: int = 0) -> tuple[int, int]:
    """One image's grid (``choose_grids``, or ``idefics3_grids`` when ``longest_edge`` > 0, for one size; sizes
    repeat, so the processor's per-image calls hit this cache)."""
    size = np.asarray([[width, height]])
    grid = idefics3_grids(size, image_size, longest_edge) if longest_edge else choose_grids(size, image_size, max_tiles)
    return int(grid[0, 0]), int(grid[0, 1])


def grid_tiles(grids: np.ndarray) -> np.ndarray:
    """[M, 2] grids -> [M] encoder inputs: rows*cols, plus the global view when that is more than one tile."""
    n = grids[:, 0] * grids[:, 1]
    return n + (n > 1)


@dataclass(frozen=True)
class ImageLayout:
    """How many tiles and tokens each image costs: the fact that planning, processing and the model share.

    ``max_tiles == 0`` means no splitting: every image is one tile of ``tokens_per_tile`` tokens.
    ``longest_edge`` > 0 picks Idefics3's grid rule (``max_tiles`` is then its largest grid).
    ``newline_tokens`` / ``double_newline_tokens`` are the tokenizer's counts for "\\n" and "\\n\\n" (split
    grids contain both, see the module docstring).
    """

    image_size: int
    tokens_per_tile: int
    max_tiles: int = 0
    newline_tokens: int = 1
    double_newline_tokens: int = 1
    longest_edge: int = 0

    @property
    def splitting(self) -> bool:
        return self.max_tiles > 0

    @property
    def unit(self) -> str:
        """What data.max_images counts: images, or tiles with splitting."""
        return "tiles" if self.splitting else "images"

    def grids(self, sizes: np.ndarray) -> np.ndarray:
        """[M, 2] (width, height) -> [M, 2] (rows, cols); NO_SPLIT rows without splitting."""
        sizes = np.asarray(sizes, np.int64).reshape(-1, 2)
        if not self.splitting:
            return np.zeros_like(sizes)
        if self.longest_edge:
            return idefics3_grids(sizes, self.image_size, self.longest_edge)
        return choose_grids(sizes, self.image_size, self.max_tiles)

    def grid_of(self, width: int, height: int) -> tuple[int, int]:
        """One image's grid (cached per size); NO_SPLIT without splitting."""
        if not self.splitting:
            return NO_SPLIT
        return grid_of(width, height, self.image_size, self.max_tiles, self.longest_edge)

    def grid_tokens(self, grids: np.ndarray) -> np.ndarray:
        """[M, 2] grids -> [M] decoder tokens of each image, markers included."""
        if not self.splitting:
            return np.full(len(grids), self.tokens_per_tile, np.int64)
        n = grids[:, 0] * grids[:, 1]
        per_tile = self.tokens_per_tile + 2  # <fake_token_around_image><row_i_col_j> + the tile's tokens
        split = n * per_tile + (grids[:, 0] - 1) * self.newline_tokens + self.double_newline_tokens
        single = self.tokens_per_tile + 3  # <fake_token_around_image><global-img> ... <fake_token_around_image>
        return np.where(n > 1, split + single, single)

    def costs(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[M, 2] (width, height) -> ([M] tiles, [M] tokens) per image."""
        grids = self.grids(sizes)
        tiles = grid_tiles(grids) if self.splitting else np.ones(len(grids), np.int64)
        return tiles, self.grid_tokens(grids)


def idefics3_side(image_size: int, longest_edge: int) -> int:
    """The most tiles along one side under Idefics3's rule (an odd edge may gain one pixel from rounding)."""
    return -(-(longest_edge + longest_edge % 2) // image_size)


def as_layout(layout: ImageLayout | int) -> ImageLayout:
    """An ImageLayout, or an int read as that many tokens per image without splitting (image_size unused)."""
    return layout if isinstance(layout, ImageLayout) else ImageLayout(image_size=0, tokens_per_tile=int(layout))
