"""Llama 4's image preprocessing: the best-fit canvas of tiles, reproducing ``Llama4ImageProcessor``.

transformers' processor (its torchvision backend, the only one it has) does, for an image of
``H x W`` pixels and tiles of ``S x S`` (``S = 336``):

1. list the canvases of at most ``max_patches`` (16) tiles, ``rows x cols`` for every factor pair of every
   count, in the processor's order (:func:`canvases`);
2. pick the canvas needing the least upscaling, or if none fits, the least downscaling; among equal
   scales the smallest area (:func:`best_canvas`), computing the scales in float32 as torch does;
3. resize without distortion to fit it, never upscaling a side past ``max(side, S)``
   (:func:`fit_size`, whose float precision follows the tensors and ints transformers mixes);
4. resize with torchvision's bilinear filter with antialiasing, on uint8 (:func:`resize_aa`: torch's
   fixed-point kernel, equal to ``torch.nn.functional.interpolate(..., antialias=True)`` on uint8 bit for
   bit), pad with black on the right and bottom to the canvas;
5. rescale by 1/255 and normalise **in bfloat16** (:func:`normalize_bf16`);
6. cut the canvas into ``rows x cols`` tiles, row-major, and when there is more than one, append the
   original image stretched to ``S x S`` (resized as in 4, normalised as in 5) as a global tile.

The values are float32 holding bfloat16 numbers, as transformers' ``pixel_values`` are once a float32
model casts them. On x86 CPUs with AVX2 and on ARM, torchvision resizes uint8 images with that fixed-point
kernel; elsewhere it resizes in float32 and rounds, which can differ by one level on a few pixels: ggmlpy
always gives the fixed-point result.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["best_canvas", "canvases", "fit_size", "normalize_bf16", "resize_aa", "tile_canvas"]


@lru_cache(maxsize=8)
def canvases(max_tiles: int, tile: int) -> tuple[tuple[int, int], ...]:
    """The candidate canvases ``(height, width)`` in pixels, in ``find_supported_resolutions``' order.

    For each tile count from ``max_tiles`` down to 1, each factor pair ``(rows, cols)`` (rows ascending)
    is filed under its ratio ``rows / cols``; the list is the groups in the order their ratio first
    appeared, each group in the order its members were filed.
    """
    groups: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            groups.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple((r * tile, c * tile) for group in groups.values() for r, c in group)


def best_canvas(height: int, width: int, candidates: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """``get_best_fit`` without ``resize_to_max_canvas``: the canvas an ``height x width`` image goes on."""
    cand = np.asarray(candidates, np.int64)
    # torch divides int tensors by ints in float32
    scale_h = cand[:, 0].astype(np.float32) / np.float32(height)
    scale_w = cand[:, 1].astype(np.float32) / np.float32(width)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    chosen = up.min() if up.size else scales[scales < 1].max()
    at = np.flatnonzero(scales == chosen)
    area = cand[at, 0] * cand[at, 1]
    h, w = cand[at[int(np.argmin(area))]]    # argmin: the first of equal areas, as torch's
    return int(h), int(w)


def _div(num: int, num_is_f32: bool, den: int) -> tuple[float, bool]:
    # transformers mixes torch scalars (float32 arithmetic) and Python ints (float64) here
    if num_is_f32:
        return float(np.float32(num) / np.float32(den)), True
    return num / den, False


def _floor_mul(n: int, scale: float, is_f32: bool) -> int:
    if is_f32:
        return math.floor(np.float32(n) * np.float32(scale))
    return math.floor(n * scale)


def fit_size(height: int, width: int, canvas: tuple[int, int], tile: int) -> tuple[int, int]:
    """The size an image is resized to before padding to ``canvas``: its aspect kept, no side upscaled past
    ``max(side, tile)`` (``get_max_res_without_distortion`` on the limited target).

    In transformers the canvas is a torch tensor and the image size Python ints, and ``min`` returns
    whichever is smaller: a side limited by the canvas is then computed in float32, one limited by the
    image in float64. Both are followed here, so the truncations land where transformers' do.
    """
    target = []
    for side, canvas_side in ((height, canvas[0]), (width, canvas[1])):
        limit = max(side, tile)
        # Python's min keeps its first argument on a tie: the int
        target.append((canvas_side, True) if canvas_side < limit else (limit, False))
    (th, th_f32), (tw, tw_f32) = target
    scale_w, sw_f32 = _div(tw, tw_f32, width)
    scale_h, sh_f32 = _div(th, th_f32, height)
    if sw_f32 or sh_f32:   # a tensor compared with a Python float compares in float32
        narrower = np.float32(scale_w) < np.float32(scale_h)
    else:
        narrower = scale_w < scale_h
    if narrower:
        new_h, new_w = min(_floor_mul(height, scale_w, sw_f32), th), tw
    else:
        new_h, new_w = th, min(_floor_mul(width, scale_h, sh_f32), tw)
    return max(new_h, 1), max(new_w, 1)


def _aa_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Source indices, int16-range weights and their precision for one axis of torch's antialiased
    bilinear resize of uint8 images (a triangle filter widened by the downscale factor, normalised per
    output pixel, then scaled to the most bits that keep the largest weight under 2**15)."""
    scale = n_in / n_out
    support = scale if scale >= 1.0 else 1.0          # the bilinear filter's half-width is 1 input pixel
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    width = int(math.ceil(support)) * 2 + 1
    centre = scale * (np.arange(n_out) + 0.5)
    lo = np.maximum((centre - support + 0.5).astype(np.int64), 0)
    hi = np.minimum((centre + support + 0.5).astype(np.int64), n_in)
    j = np.arange(width)
    idx = lo[:, None] + j[None, :]
    valid = idx < hi[:, None]
    w = np.where(valid, np.maximum(0.0, 1.0 - np.abs((idx - centre[:, None] + 0.5) * inv)), 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
    w_max = float(w.max()) if w.size else 0.0
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    iw = np.where(v < 0, v - 0.5, v + 0.5).astype(np.int64)       # C's truncation of the rounded value
    return np.where(valid, idx, 0), iw, precision


def resize_aa(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``(H, W, C)`` resized to ``(height, width, C)`` as torch's bilinear interpolation with
    antialiasing does on uint8 (torchvision's resize): horizontal pass, then vertical, each in fixed point
    with rounding, the intermediate kept in uint8. An axis of unchanged length is not resampled."""
    a = pixels
    if width != a.shape[1]:
        a = _aa_pass(a, width, axis=1)
    if height != a.shape[0]:
        a = _aa_pass(a, height, axis=0)
    return np.ascontiguousarray(a, dtype=np.uint8)


def _aa_pass(a: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    idx, w, precision = _aa_weights(a.shape[axis], n_out)
    shape = list(a.shape)
    shape[axis] = n_out
    # int32 holds every sum: the weights of an output pixel add up to about 2**precision <= 2**15
    acc = np.full(shape, 1 << (precision - 1), np.int32)
    w = w.astype(np.int32)
    for k in range(idx.shape[1]):        # one tap at a time: a few passes over the output, little memory
        wk = w[:, k].reshape((-1, 1, 1) if axis == 0 else (1, -1, 1))
        acc += np.take(a, idx[:, k], axis=axis) * wk
    return np.clip(acc >> precision, 0, 255).astype(np.uint8)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def normalize_bf16(hwc: np.ndarray, mean, std, rescale: float) -> np.ndarray:
    """uint8 ``(H, W, 3)`` to float32 ``(3, H, W)`` holding bfloat16 values: ``bf16(x) * rescale``, then
    ``- mean``, then ``/ std``, each computed in float32 and rounded to bfloat16 as torch's bfloat16 ops
    are (Llama 4's processor normalises in bfloat16). Done once per channel on the 256 levels."""
    levels = np.arange(256, dtype=np.float32)          # every uint8 is exact in bfloat16
    out = np.empty((3,) + hwc.shape[:2], np.float32)
    for c in range(3):
        m = _to_bf16(np.float32(mean[c]))
        s = _to_bf16(np.float32(std[c]))
        table = _to_bf16(levels * np.float32(rescale))
        table = _to_bf16((table - m).astype(np.float32))
        table = _to_bf16((table / s).astype(np.float32))
        out[c] = table[hwc[:, :, c]]
    return out


def tile_canvas(pixels: np.ndarray, tile: int, max_tiles: int) -> tuple[np.ndarray, int, int]:
    """uint8 ``(H, W, 3)`` resized and padded onto its best canvas: ``(canvas, rows, cols)``."""
    h, w = pixels.shape[:2]
    ch, cw = best_canvas(h, w, canvases(max_tiles, tile))
    nh, nw = fit_size(h, w, (ch, cw), tile)
    resized = resize_aa(pixels, nh, nw)
    canvas = np.zeros((ch, cw, 3), np.uint8)       # black, the image at the top left
    canvas[:nh, :nw] = resized
    return canvas, ch // tile, cw // tile
