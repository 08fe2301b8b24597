"""Llama 4's preprocessing (ggmlpy.vision.canvas) against transformers' ``Llama4ImageProcessor``.

That processor has only a torchvision backend, and PyPI's torchvision does not load against the CPU
build of torch these tests run on. Its module needs torchvision for three functions only (``resize``,
``pad``, ``normalize``), so the test imports it with a stand-in for ``torchvision.transforms.v2.functional``
that does what torchvision 0.28 does with them (tests/torchvision_stub.py) and runs transformers' own
``_preprocess``: the
canvas choice, the resize sizes with their float32/float64 mixture, the padding, the bfloat16
normalisation, the tiles and the global tile are all transformers' code. torchvision's resize of a
uint8 image on a CPU with AVX2/AVX-512 (or ARM) is ``torch.nn.functional.interpolate`` on the uint8
tensor (bilinear, ``antialias=True``); the stand-in calls exactly that, and the fixed-point kernel in
ggmlpy is checked against the same call on its own (``test_resize_aa_equals_torch``).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from ggmlpy.vision.canvas import best_canvas, canvases, fit_size, normalize_bf16, resize_aa
from ggmlpy.vision.preprocess import (
    ImageConfig,
    PreprocessedImage,
    image_prompt,
    llama4_image_prompt,
    preprocess,
)

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
pytest.importorskip("transformers") if not os.environ.get("CI") else __import__("transformers")
Image = pytest.importorskip("PIL.Image") if not os.environ.get("CI") else __import__("PIL.Image").Image

F = torch.nn.functional

import torchvision_stub  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    """transformers' llama4 image processor and processor modules, imported with the stand-in."""
    ip, proc = torchvision_stub.import_with_stub("transformers.models.llama4.image_processing_llama4",
                                                 "transformers.models.llama4.processing_llama4")
    with torchvision_stub.backends_with_stub():
        yield types.SimpleNamespace(ip=ip, proc=proc)


def _hf_pixels(hf, rgb: np.ndarray, size: int, max_patches: int = 16):
    proc = object.__new__(hf.ip.Llama4ImageProcessor)        # no __init__: it asks for torchvision
    image = torch.from_numpy(rgb).permute(2, 0, 1)
    out = proc._preprocess(
        [image], do_resize=True, size=hf.ip.SizeDict(height=size, width=size), resample=None, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        max_patches=max_patches, resize_to_max_canvas=False, disable_grouping=None, return_tensors=None)
    pixels = out["pixel_values"][0].float().numpy()
    rows, cols = (int(v) for v in out["aspect_ratios"][0])
    return pixels, rows, cols


def _image(rng, h: int, w: int) -> np.ndarray:
    # a smooth part (where rounding ties are common) and noise
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], -1)
    noise = rng.integers(0, 256, (h, w, 3))
    return np.where(rng.random((h, w, 1)) < 0.5, smooth, noise).astype(np.uint8)


# (height, width): under one tile, exactly one tile, the note's worked examples, extreme aspect ratios
# (16 x 1 canvases), downscaled past every canvas, one pixel.
SIZES_336 = [(300, 200), (336, 336), (480, 640), (300, 1000), (1080, 1920), (3000, 4000), (50, 3000),
             (3000, 50), (1, 1), (337, 335), (700, 700), (2000, 900)]


@pytest.mark.parametrize("hw", SIZES_336, ids=[f"{h}x{w}" for h, w in SIZES_336])
def test_pixels_equal_transformers(hf, hw):
    rng = np.random.default_rng(hw[0] * 10007 + hw[1])
    rgb = _image(rng, *hw)
    want, rows, cols = _hf_pixels(hf, rgb, 336)
    got = preprocess(rgb, ImageConfig("llama4", 336, 14))
    assert (got.rows, got.cols) == ((rows, cols) if rows * cols > 1 else (0, 0))
    assert got.has_global == (rows * cols > 1)
    np.testing.assert_array_equal(got.pixel_values, want)


def test_pixels_equal_transformers_random_sizes(hf):
    """Small tiles, many sizes: each canvas size and scale tie seen many times."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        h, w = (int(v) for v in rng.integers(1, 400, 2))
        max_patches = int(rng.choice([1, 2, 5, 16]))
        rgb = _image(rng, h, w)
        want, rows, cols = _hf_pixels(hf, rgb, 28, max_patches)
        got = preprocess(rgb, ImageConfig("llama4", 28, 14, max_patches=max_patches))
        assert got.n_tiles == len(want), (h, w, max_patches)
        np.testing.assert_array_equal(got.pixel_values, want, err_msg=f"{h}x{w}, max_patches {max_patches}")


def test_canvases_equal_transformers(hf):
    for n in (1, 4, 5, 16, 30):
        assert list(canvases(n, 336)) == [tuple(c) for c in hf.ip.find_supported_resolutions(
            n, hf.ip.SizeDict(height=336, width=336))]


def test_best_canvas_equal_transformers(hf):
    rng = np.random.default_rng(3)
    cands = canvases(16, 336)
    table = torch.tensor(cands)
    for h, w in [(336, 336), (672, 336), (1, 1), (5376, 336)] + [tuple(rng.integers(1, 6000, 2)) for _ in range(300)]:
        want = tuple(int(v) for v in hf.ip.get_best_fit((int(h), int(w)), table))
        assert best_canvas(int(h), int(w), cands) == want, (h, w)


@pytest.mark.parametrize("tile", [336, 28])
def test_fit_size_equals_transformers(hf, tile):
    """The resize before padding, as ``_preprocess`` computes it from the canvas (a torch tensor) and the
    image size (ints): ``min(max(side, tile), canvas_side)``, then ``get_max_res_without_distortion``."""
    rng = np.random.default_rng(tile)
    cands = canvases(16, tile)
    table = torch.tensor(cands)
    for i in range(3000):
        h, w = (int(v) for v in rng.integers(1, 20 * tile, 2))
        if i % 3 == 0:
            w = int(rng.integers(1, 3 * tile))
        canvas = hf.ip.get_best_fit((h, w), table)
        target = (min(max(h, tile), canvas[0]), min(max(w, tile), canvas[1]))
        want = tuple(max(int(v), 1) for v in hf.ip.get_max_res_without_distortion((h, w), target))
        assert fit_size(h, w, best_canvas(h, w, cands), tile) == want, (h, w)


def test_resize_aa_equals_torch():
    """The fixed-point kernel: up, down, one axis unchanged, to and from one pixel."""
    rng = np.random.default_rng(0)
    shapes = [((1, 1), (5, 7)), ((9, 1), (1, 1)), ((40, 30), (40, 17)), ((40, 30), (13, 30))]
    shapes += [(tuple(rng.integers(1, 300, 2)), tuple(rng.integers(1, 300, 2))) for _ in range(80)]
    for (h, w), (nh, nw) in shapes:
        a = _image(rng, int(h), int(w))
        want = F.interpolate(torch.from_numpy(a).permute(2, 0, 1)[None], size=(int(nh), int(nw)), mode="bilinear",
                             align_corners=False, antialias=True)[0].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(resize_aa(a, int(nh), int(nw)), want, err_msg=f"{h}x{w} -> {nh}x{nw}")


@pytest.mark.parametrize("mean,std", [((0.5,) * 3, (0.5,) * 3), ((0.48145466, 0.4578275, 0.40821073),
                                                               (0.26862954, 0.26130258, 0.27577711))])
def test_normalize_bf16_equals_torch(mean, std):
    levels = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (1, 256, 3)).copy()
    t = torch.from_numpy(levels).permute(2, 0, 1).to(torch.bfloat16) * (1 / 255)
    want = torchvision_stub.normalize(t, list(mean), list(std)).float().numpy()
    np.testing.assert_array_equal(normalize_bf16(levels, mean, std, 1 / 255), want)


@pytest.mark.parametrize("rows,cols", [(0, 0), (1, 1), (1, 2), (2, 1), (3, 5), (4, 4)])
def test_prompt_equals_transformers(hf, rows, cols):
    want = hf.proc.Llama4Processor._prompt_split_image(None, (max(rows, 1), max(cols, 1)), 144)
    assert llama4_image_prompt(rows, cols, 144) == want
    cfg = ImageConfig("llama4", 336, 14)
    n = rows * cols + (rows * cols > 1)
    tiles = [np.zeros((3, 336, 336), np.float32)] * max(n, 1)
    pre = PreprocessedImage(tiles, rows=rows, cols=cols, has_global=rows * cols > 1)
    assert image_prompt(pre, cfg) == want
    assert want.count("<|patch|>") == 144 * len(tiles)


def test_config_checks_max_patches():
    from ggmlpy import GGMLTypeError, GGMLValueError

    with pytest.raises(GGMLValueError, match="max_patches"):
        ImageConfig("llama4", 336, 14, max_patches=0)
    with pytest.raises(GGMLTypeError, match="max_patches"):
        ImageConfig("llama4", 336, 14, max_patches=2.5)
    assert ImageConfig("llama4", 336, 14).tokens_per_tile == 144
