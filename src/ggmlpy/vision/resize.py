"""Resizing, tiling and normalising an RGB image as the model's Hugging Face image processor does, into a
:class:`PreprocessedImage` (gemma3: one tile; idefics3 and llama4: a grid of tiles and the global image).

For gemma3 and idefics3 every resize goes through Pillow on uint8 pixels (HF's PIL backend), so the result is
bit for bit what transformers gives; the rescale is done in float64 and rounded to float32, the normalisation
in float32, again as transformers does. Llama 4's processor has only a torchvision backend: its resize and
bfloat16 normalisation are reproduced in :mod:`.canvas`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ggmlpy._core import GGMLValueError

from .canvas import normalize_bf16, resize_aa, tile_canvas
from .decode import _pil
from .image_config import ImageConfig

if TYPE_CHECKING:
    from PIL import Image as _PILImageModule

__all__ = ["PreprocessedImage", "pixtral_size", "qwen_size", "resize_and_tile"]

#: transformers' ``rescale_factor`` default, 1/255 as a Python float (the exact value matters for bit equality).
RESCALE_FACTOR = 1 / 255

#: Idefics3's absolute cap on either edge after the first resize (transformers' ``MAX_IMAGE_SIZE``).
IDEFICS3_MAX_IMAGE_SIZE = 4096


@dataclass(frozen=True)
class PreprocessedImage:
    """An image ready for the encoder: normalised tiles and their layout.

    Attributes
    ----------
    tiles : list of numpy.ndarray
        float32 arrays ``(3, image_size, image_size)`` (channel-first, HF's ``pixel_values`` layout), in the
        order the model consumes them: for idefics3 and llama4 the grid tiles row by row, then the global
        image. pixtral: one array ``(3, H, W)`` of the image's own size (multiples of ``ImageConfig.align``).
    rows, cols : int
        The idefics3 / llama4 tile grid; both 0 when the image was not split (gemma3 always). pixtral: the
        grid of output tokens, ``H / align`` rows of ``W / align``.
    has_global : bool
        Whether the last tile is the whole image downscaled, appended after the ``rows * cols`` grid tiles
        (idefics3 when split). An image that is not split is a single tile and ``has_global`` is False.
    source_size : tuple of int
        ``(height, width)`` of the image after :func:`load_image`, before any resize.
    """

    tiles: list[np.ndarray]
    rows: int = 0
    cols: int = 0
    has_global: bool = False
    source_size: tuple[int, int] = (0, 0)

    @property
    def pixel_values(self) -> np.ndarray:
        """The tiles stacked: float32 ``(n_tiles, 3, image_size, image_size)``."""
        return np.stack(self.tiles)

    @property
    def n_tiles(self) -> int:
        """The number of encoder passes: ``rows * cols + has_global`` when split, else 1."""
        return len(self.tiles)


def _normalize(hwc: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """uint8 ``(H, W, 3)`` to normalised float32 ``(3, H, W)``, with transformers' dtypes at each step."""
    chw = hwc.transpose(2, 0, 1)
    # transformers rescales in float64 and rounds to float32 once, then normalises in float32
    x = (chw.astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    return np.ascontiguousarray((x - mean) / std)


def _idefics3_first_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Idefics3's first resize: longest edge to ``longest_edge``, the other edge even; both capped at 4096.

    The float arithmetic (``int(w / (w / h))`` rather than an integer formula) is transformers', so that the
    truncation lands on the same side.
    """
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)

    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_IMAGE_SIZE:
        width = IDEFICS3_MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > IDEFICS3_MAX_IMAGE_SIZE:
        height = IDEFICS3_MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _idefics3_grid_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3's second resize: both edges up to multiples of ``tile``.

    The longer edge is rounded up first and the shorter one is derived from it through the aspect ratio before
    being rounded up, as in transformers' ``resize_for_vision_encoder`` (its ``get_number_of_image_patches``
    rounds the original shorter edge instead and can disagree; the tiles actually produced follow this one).
    """
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect)
        width = math.ceil(width / tile) * tile
    return height, width


def pixtral_size(height: int, width: int, longest_edge: int, align: int) -> tuple[int, int]:
    """``PixtralImageProcessor``'s target size: scaled down (never up) so that the longest edge is at most
    ``longest_edge`` (each side floored), then each side rounded up to a multiple of ``align`` (the patch
    side times the merge size, as ``PixtralProcessor`` passes it). The two roundings do not keep the aspect
    ratio exactly: the image is stretched to that size. A side scaled down to 0 (an image over
    ``longest_edge`` times longer than it is wide) is kept at one ``align``, where transformers fails."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return max(-(-height // align), 1) * align, max(-(-width // align), 1) * align


def qwen_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``Qwen2VLImageProcessor``'s ``smart_resize`` (Qwen2.5-VL, Qwen3-VL): each side rounded to a multiple of
    ``factor`` (Python's ``round``: halves to even, as transformers), then scaled down into ``max_pixels`` (sides
    floored) or up to ``min_pixels`` (sides ceiled). The image is stretched to that size.

    Raises
    ------
    GGMLValueError
        An aspect ratio over 200, which transformers refuses too.
    """
    if max(height, width) / min(height, width) > 200:
        raise GGMLValueError(f"an image of {width}x{height} pixels: the Qwen-VL processor takes aspect ratios up to "
                             f"200 (this one is {max(height, width) / min(height, width):.0f})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize_and_tile(img: _PILImageModule.Image, cfg: ImageConfig) -> PreprocessedImage:
    """The tiles of an RGB PIL image (from :func:`~ggmlpy.vision.preprocess.load_image`) for ``cfg``'s
    projector: resized, tiled and normalised as its HF image processor does (see
    :func:`~ggmlpy.vision.preprocess.preprocess`)."""
    Image, _ = _pil()
    resampling = getattr(Image, "Resampling", Image)  # Pillow < 9.1 has the filters on the module only
    size = cfg.image_size
    source_size = (img.height, img.width)

    if cfg.projector_type == "gemma3":
        tile = np.asarray(img.resize((size, size), resampling.BILINEAR))
        return PreprocessedImage([_normalize(tile, cfg)], source_size=source_size)
    if cfg.projector_type == "llama4":
        return _llama4_tiles(np.asarray(img), cfg, source_size)
    if cfg.projector_type == "pixtral":
        h, w = pixtral_size(img.height, img.width, cfg.image_size, cfg.align)
        tile = np.asarray(img.resize((w, h), resampling.BICUBIC))
        return PreprocessedImage([_normalize(tile, cfg)], rows=h // cfg.align, cols=w // cfg.align,
                                 source_size=source_size)
    if cfg.min_pixels is not None:        # Qwen-VL
        assert cfg.max_pixels is not None
        h, w = qwen_size(img.height, img.width, cfg.align, cfg.min_pixels, cfg.max_pixels)
        tile = np.asarray(img.resize((w, h), resampling.BICUBIC))
        return PreprocessedImage([_normalize(tile, cfg)], rows=h // cfg.align, cols=w // cfg.align,
                                 source_size=source_size)

    lanczos = resampling.LANCZOS
    assert cfg.longest_edge is not None  # set by ImageConfig.__post_init__ for idefics3
    h, w = _idefics3_first_size(img.height, img.width, cfg.longest_edge)
    img = img.resize((w, h), lanczos)  # PIL sizes are (width, height)
    if not cfg.do_image_splitting:
        tile = np.asarray(img.resize((size, size), lanczos))
        return PreprocessedImage([_normalize(tile, cfg)], source_size=source_size)

    h, w = _idefics3_grid_size(h, w, size)
    img = img.resize((w, h), lanczos)
    if h <= size and w <= size:
        # exactly one tile: transformers does not split it and adds no global image
        return PreprocessedImage([_normalize(np.asarray(img), cfg)], source_size=source_size)

    pixels = np.asarray(img)
    rows, cols = h // size, w // size
    tiles = [_normalize(pixels[r * size:(r + 1) * size, c * size:(c + 1) * size], cfg)
             for r in range(rows) for c in range(cols)]
    # the global image is the tiled image (not the original) resized to one tile
    tiles.append(_normalize(np.asarray(img.resize((size, size), lanczos)), cfg))
    return PreprocessedImage(tiles, rows=rows, cols=cols, has_global=True, source_size=source_size)


def _llama4_tiles(pixels: np.ndarray, cfg: ImageConfig, source_size: tuple[int, int]) -> PreprocessedImage:
    """Llama 4: the best-fit canvas of tiles, then the stretched global tile (:mod:`.canvas`)."""
    size = cfg.image_size

    def norm(hwc: np.ndarray) -> np.ndarray:
        return normalize_bf16(hwc, cfg.image_mean, cfg.image_std, RESCALE_FACTOR)

    canvas, rows, cols = tile_canvas(pixels, size, cfg.max_patches)
    tiles = [norm(canvas[r * size:(r + 1) * size, c * size:(c + 1) * size])
             for r in range(rows) for c in range(cols)]
    if rows * cols == 1:
        return PreprocessedImage(tiles, source_size=source_size)
    # the global tile is the original image stretched to one tile (not the canvas, unlike Idefics3's)
    tiles.append(norm(resize_aa(pixels, size, size)))
    return PreprocessedImage(tiles, rows=rows, cols=cols, has_global=True, source_size=source_size)
