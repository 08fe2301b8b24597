"""ggmlpy.vision.preprocess against transformers' image processors and processors.

transformers 5 ships a PIL/numpy backend for each image processor (``Gemma3ImageProcessorPil``,
``Idefics3ImageProcessorPil``) beside the torchvision one; the plain names fall back to it when torchvision
is missing. The comparisons use the PIL classes (the slow, PIL-based classes of transformers 4 are the same
algorithm under the plain names) and expect exact equality of the float32 pixel values: both sides resize the
same uint8 pixels with Pillow and rescale/normalise with the same dtypes.

The prompt text is compared with ``Gemma3Processor``/``Idefics3Processor`` run end to end on a byte-level
tokenizer without merges (any text survives encode/decode unchanged), built here.

Tests that need transformers skip when it is missing, except under ``CI``, where they must run.
"""

from __future__ import annotations

import base64
import io
import os
import sys
import urllib.parse

import numpy as np
import pytest

from ggmlpy import GGMLTypeError, GGMLValueError
from ggmlpy.vision.preprocess import (
    ImageConfig,
    ImageError,
    PreprocessedImage,
    gemma3_image_prompt,
    idefics3_image_prompt,
    image_prompt,
    load_image,
    preprocess,
)

Image = pytest.importorskip("PIL.Image") if not os.environ.get("CI") else __import__("PIL.Image").Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# (height, width): odd sizes, both orientations, exactly one tile, one pixel, extreme aspect ratios.
SIZES = [(37, 53), (53, 37), (300, 120), (120, 300), (64, 64), (1, 1), (2, 1000), (1000, 3), (600, 800)]

GEMMA3_CONFIGS = {
    "small": ImageConfig("gemma3", 64, 8),
    "gemma3-4b": ImageConfig("gemma3", 896, 14, image_mean=CLIP_MEAN, image_std=CLIP_STD),
}
IDEFICS3_CONFIGS = {
    "small": ImageConfig("idefics3", 64, 8, longest_edge=256),
    "small-edge-not-multiple": ImageConfig("idefics3", 64, 8, longest_edge=100),
    "small-one-tile": ImageConfig("idefics3", 64, 8, longest_edge=40),
    "small-no-split": ImageConfig("idefics3", 64, 8, longest_edge=256, do_image_splitting=False),
    "idefics3-8b": ImageConfig("idefics3", 364, 14, longest_edge=1456, image_mean=CLIP_MEAN, image_std=CLIP_STD),
    "smolvlm-256m": ImageConfig("idefics3", 512, 16, longest_edge=2048, scale_factor=4),
}


def _transformers():
    if os.environ.get("CI"):
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def _rand(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _hf_image_processor(cfg: ImageConfig):
    t = _transformers()
    common = {"image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std)}
    if cfg.projector_type == "gemma3":
        cls = getattr(t, "Gemma3ImageProcessorPil", None) or t.Gemma3ImageProcessor
        return cls(size={"height": cfg.image_size, "width": cfg.image_size}, **common)
    cls = getattr(t, "Idefics3ImageProcessorPil", None) or t.Idefics3ImageProcessor
    return cls(size={"longest_edge": cfg.longest_edge}, max_image_size={"longest_edge": cfg.image_size},
               do_image_splitting=cfg.do_image_splitting, **common)


def _hf(cfg: ImageConfig, image, **kw) -> tuple[np.ndarray, int, int]:
    """HF's pixel values ``(n, 3, S, S)`` for one image, and the idefics3 grid (0, 0 for gemma3)."""
    ip = _hf_image_processor(cfg)
    if cfg.projector_type == "gemma3":
        return np.asarray(ip(image, **kw)["pixel_values"]), 0, 0
    out = ip(image, return_row_col_info=True, **kw)
    return np.asarray(out["pixel_values"])[0], out["rows"][0][0], out["cols"][0][0]


def _assert_matches_hf(cfg: ImageConfig, ours_input, hf_input, **hf_kw) -> PreprocessedImage:
    ref, rows, cols = _hf(cfg, hf_input, **hf_kw)
    got = preprocess(ours_input, cfg)
    assert (got.rows, got.cols) == (rows, cols)
    assert got.pixel_values.dtype == np.float32 and ref.dtype == np.float32
    np.testing.assert_array_equal(got.pixel_values, ref)  # exact: same Pillow resizes, same float steps
    return got


# ---------------------------------------------------------------------------------------------------------------
# pixel values vs transformers
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("name", list(GEMMA3_CONFIGS))
@pytest.mark.parametrize("hw", SIZES + [(896, 896)], ids=str)
def test_gemma3_matches_hf(name, hw):
    cfg = GEMMA3_CONFIGS[name]
    a = _rand((*hw, 3), seed=hw[0] * 7 + hw[1])
    got = _assert_matches_hf(cfg, a, a, input_data_format="channels_last")
    assert got.n_tiles == 1 and not got.has_global
    assert got.tiles[0].shape == (3, cfg.image_size, cfg.image_size)
    assert got.source_size == hw


@pytest.mark.hf
@pytest.mark.parametrize("name", list(IDEFICS3_CONFIGS))
@pytest.mark.parametrize("hw", SIZES + [(364, 364), (1456, 1456), (500, 1000)], ids=str)
def test_idefics3_matches_hf(name, hw):
    cfg = IDEFICS3_CONFIGS[name]
    a = _rand((*hw, 3), seed=hw[0] * 7 + hw[1])
    got = _assert_matches_hf(cfg, a, a, input_data_format="channels_last")
    split = got.rows > 0
    assert got.has_global == split
    assert got.n_tiles == (got.rows * got.cols + 1 if split else 1)
    if not cfg.do_image_splitting or name == "small-one-tile":
        assert not split
    for t in got.tiles:
        assert t.shape == (3, cfg.image_size, cfg.image_size) and t.dtype == np.float32


def _pil_mode_images() -> dict:
    a = _rand((37, 53, 4), seed=1)
    imgs = {
        "RGB": Image.fromarray(a[..., :3]),
        "RGBA": Image.fromarray(a),
        "L": Image.fromarray(a[..., 0]),
        "LA": Image.fromarray(a).convert("LA"),
        "1": Image.fromarray(a[..., 0]).convert("1"),
        "CMYK": Image.fromarray(a[..., :3]).convert("CMYK"),
        "P": Image.fromarray(a[..., :3]).convert("P"),
        "I;16": Image.fromarray(a[..., 0].astype(np.uint16) * 3),
    }
    p = Image.fromarray(a[..., :3]).convert("P")
    p.info["transparency"] = int(np.asarray(p)[0, 0])  # one palette entry transparent, as a GIF/PNG tRNS gives
    imgs["P+transparency"] = p
    grey = a[..., 0].copy()
    grey[:5] = 7
    la = Image.fromarray(grey)
    la.info["transparency"] = 7  # an L image with a transparent grey level
    imgs["L+transparency"] = la
    # modes Pillow converts but rarely seen; LAB's "A" band (the a* axis) makes HF composite it as if alpha
    for mode in ("LAB", "HSV"):
        imgs[mode] = Image.frombytes(mode, (53, 37), a[..., :3].tobytes())
    imgs["YCbCr"] = Image.fromarray(a[..., :3]).convert("YCbCr")
    imgs["RGBa"] = Image.fromarray(a).convert("RGBa")  # premultiplied: lowercase "a", so HF does not composite
    return imgs


@pytest.mark.hf
@pytest.mark.parametrize("mode", list(_pil_mode_images()))
@pytest.mark.parametrize("kind", ["gemma3", "idefics3"])
def test_pil_modes_match_hf(mode, kind):
    """Every PIL mode is converted as HF's convert_to_rgb does (transparency composited onto white)."""
    img = _pil_mode_images()[mode]
    before = img.tobytes()
    cfg = GEMMA3_CONFIGS["small"] if kind == "gemma3" else IDEFICS3_CONFIGS["small"]
    _assert_matches_hf(cfg, img, img)
    assert img.tobytes() == before  # the caller's image is not modified


@pytest.mark.hf
@pytest.mark.parametrize("channels", [None, 1, 4], ids=["HxW", "HxWx1", "HxWx4"])
def test_numpy_grey_and_rgba_match_hf(channels):
    """Greyscale arrays are repeated to RGB and RGBA arrays blended onto white, with HF's numpy formula."""
    shape = (37, 53) if channels is None else (37, 53, channels)
    a = _rand(shape, seed=2)
    a.reshape(-1)[::7] = 0  # fully transparent pixels (and black ones) for the RGBA case
    a.reshape(-1)[1::7] = 255
    hf_input = a[..., None] if channels is None else a  # HF takes no 2-D array: give it (H, W, 1)
    for cfg in (GEMMA3_CONFIGS["small"], IDEFICS3_CONFIGS["small"]):
        _assert_matches_hf(cfg, a, hf_input, input_data_format="channels_last")


@pytest.mark.hf
def test_path_matches_hf(tmp_path):
    """A path is read as HF's load_image reads it: EXIF orientation applied, alpha dropped (not composited)."""
    a = _rand((37, 53, 4), seed=3)
    png = tmp_path / "rgba.png"
    Image.fromarray(a).save(png)
    jpg = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.fromarray(a[..., :3]).save(jpg, exif=exif.tobytes())
    for cfg in (GEMMA3_CONFIGS["small"], IDEFICS3_CONFIGS["small"]):
        _assert_matches_hf(cfg, png, str(png))
        got = _assert_matches_hf(cfg, str(jpg), str(jpg))
        assert got.source_size == (53, 37)  # transposed by the EXIF tag
    # alpha is dropped for a path, composited for the opened image: the two differ, in HF as here
    assert not np.array_equal(np.asarray(load_image(png)), np.asarray(load_image(Image.open(png))))
    np.testing.assert_array_equal(np.asarray(load_image(png)), a[..., :3])


# ---------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------

def test_bytes_same_as_path(tmp_path):
    a = _rand((20, 30, 3), seed=4)
    path = tmp_path / "x.png"
    Image.fromarray(a).save(path)
    data = path.read_bytes()
    b64 = base64.b64encode(data).decode()
    sources = (data, bytearray(data), memoryview(data), str(path), path, path.as_uri(),
               f"data:image/png;base64,{b64}", "data:image/png," + urllib.parse.quote_from_bytes(data))
    for source in sources:
        img = load_image(source)
        assert img.mode == "RGB" and img.size == (30, 20)
        np.testing.assert_array_equal(np.asarray(img), a)


def test_array_dtypes():
    a = _rand((20, 30, 3), seed=5)
    ref = np.asarray(load_image(a))
    np.testing.assert_array_equal(ref, a)
    # other integer dtypes in [0, 255] are taken as uint8
    np.testing.assert_array_equal(np.asarray(load_image(a.astype(np.int64))), ref)
    # floats in [0, 1] are quantised with round(x * 255)
    np.testing.assert_array_equal(np.asarray(load_image(a / 255.0)), ref)
    np.testing.assert_array_equal(np.asarray(load_image((a / 255.0).astype(np.float32))), ref)
    # a non-contiguous view works and is not modified
    big = _rand((40, 60, 3), seed=6)
    view = big[::2, ::2]
    np.testing.assert_array_equal(np.asarray(load_image(view)), view)
    cfg = GEMMA3_CONFIGS["small"]
    np.testing.assert_array_equal(preprocess(view, cfg).pixel_values,
                                  preprocess(np.ascontiguousarray(view), cfg).pixel_values)


def test_normalisation_values():
    """A flat image gives (v / 255 - mean) / std in every pixel, per channel."""
    cfg = ImageConfig("gemma3", 16, 4, image_mean=(0.1, 0.2, 0.3), image_std=(0.5, 0.25, 2.0), scale_factor=2)
    a = np.empty((5, 9, 3), np.uint8)
    a[...] = (0, 128, 255)
    t = preprocess(a, cfg).tiles[0]
    assert t.shape == (3, 16, 16) and t.dtype == np.float32 and t.flags.c_contiguous
    x = np.float32(np.array([0, 128, 255], np.float64) / 255)
    want = (x - np.float32([0.1, 0.2, 0.3])) / np.float32([0.5, 0.25, 2.0])
    np.testing.assert_array_equal(t[:, 3, 7], want)
    assert np.all(t == want[:, None, None])


def test_idefics3_layout():
    cfg = IDEFICS3_CONFIGS["small"]
    got = preprocess(_rand((37, 53, 3)), cfg)
    # 53 wide -> 256; 37 -> int(256 / (53/37)) = 178 -> 178 (even); grid: 256 x 192 -> 3 rows x 4 cols
    assert (got.rows, got.cols, got.has_global, got.n_tiles) == (3, 4, True, 13)
    assert got.pixel_values.shape == (13, 3, 64, 64)
    assert got.source_size == (37, 53)
    single = preprocess(_rand((37, 53, 3)), IDEFICS3_CONFIGS["small-one-tile"])
    assert (single.rows, single.cols, single.has_global, single.n_tiles) == (0, 0, False, 1)


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------

def _md(ptype="gemma3", **extra):
    md = {"general.architecture": "clip", "clip.projector_type": ptype, "clip.vision.image_size": 896,
          "clip.vision.patch_size": 14, "clip.vision.image_mean": np.array([0.5, 0.5, 0.5], np.float32),
          "clip.vision.image_std": [0.5, 0.5, 0.5]}
    if ptype == "idefics3":
        md.update({"clip.vision.image_size": 364, "clip.vision.projector.scale_factor": 2,
                   "clip.vision.preproc_image_size": 1456})
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def test_from_metadata():
    g = ImageConfig.from_metadata(_md())
    assert (g.projector_type, g.image_size, g.patch_size, g.scale_factor) == ("gemma3", 896, 14, 4)
    assert g.image_mean == (0.5, 0.5, 0.5) and g.tokens_per_tile == 256
    assert ImageConfig.from_metadata(_md(**{"clip.vision.projector.scale_factor": 2})).tokens_per_tile == 1024
    i = ImageConfig.from_metadata(_md("idefics3"))
    assert (i.image_size, i.longest_edge, i.scale_factor, i.tokens_per_tile) == (364, 1456, 2, 169)
    assert i.do_image_splitting
    assert not ImageConfig.from_metadata(_md("idefics3"), do_image_splitting=False).do_image_splitting
    # files converted before preproc_image_size was written: HF's 4 * image_size
    assert ImageConfig.from_metadata(_md("idefics3", **{"clip.vision.preproc_image_size": None})).longest_edge == 1456
    # mixed-modality files name the vision projector under clip.vision.projector_type, which wins
    mixed = _md("idefics3", **{"clip.projector_type": None, "clip.vision.projector_type": "idefics3"})
    assert ImageConfig.from_metadata(mixed).projector_type == "idefics3"
    smol = ImageConfig("idefics3", 512, 16, scale_factor=4)
    assert (smol.tokens_per_tile, smol.longest_edge) == (64, 2048)


@pytest.mark.parametrize("md, exc, words", [
    (_md(**{"clip.projector_type": None}), GGMLValueError, ["missing", "clip.projector_type"]),
    (_md(**{"clip.vision.image_size": None}), GGMLValueError, ["missing", "clip.vision.image_size"]),
    (_md(**{"clip.vision.image_std": None}), GGMLValueError, ["missing", "clip.vision.image_std"]),
    (_md("idefics3", **{"clip.vision.projector.scale_factor": None}), GGMLValueError,
     ["missing", "clip.vision.projector.scale_factor"]),
    (_md(**{"clip.projector_type": "cogvlm"}), GGMLValueError, ["cogvlm", "gemma3", "idefics3"]),
    (_md(**{"clip.projector_type": 3}), GGMLTypeError, ["clip.projector_type", "string"]),
    (_md(**{"clip.vision.image_size": "896"}), GGMLTypeError, ["clip.vision.image_size", "integer"]),
    (_md(**{"clip.vision.image_size": 0}), GGMLValueError, ["clip.vision.image_size", ">= 1"]),
    (_md(**{"clip.vision.patch_size": True}), GGMLTypeError, ["clip.vision.patch_size"]),
    (_md(**{"clip.vision.image_size": 900}), GGMLValueError,
     ["clip.vision.image_size", "900", "multiple of patch_size"]),
    (_md(**{"clip.vision.image_mean": [0.5, 0.5]}), GGMLValueError, ["clip.vision.image_mean", "3"]),
    (_md(**{"clip.vision.image_mean": ["a", "b", "c"]}), GGMLTypeError, ["clip.vision.image_mean"]),
    (_md(**{"clip.vision.image_std": [0.5, 0.0, 0.5]}), GGMLValueError, ["clip.vision.image_std", "> 0"]),
    (_md(**{"clip.vision.image_std": [0.5, float("nan"), 0.5]}), GGMLValueError, ["clip.vision.image_std"]),
    (_md(**{"clip.vision.projector.scale_factor": 5}), GGMLValueError, ["clip.vision.projector.scale_factor", "64"]),
    (_md("idefics3", **{"clip.vision.preproc_image_size": -1}), GGMLValueError,
     ["clip.vision.preproc_image_size"]),
])
def test_from_metadata_errors(md, exc, words):
    with pytest.raises(exc) as ei:
        ImageConfig.from_metadata(md)
    for w in words:
        assert w in str(ei.value)


def test_config_errors():
    with pytest.raises(GGMLValueError, match="projector_type 'llava'"):
        ImageConfig("llava", 336, 14)
    with pytest.raises(GGMLTypeError, match="image_size is 64.0"):
        ImageConfig("gemma3", 64.0, 8)
    with pytest.raises(GGMLTypeError, match="do_image_splitting"):
        ImageConfig("idefics3", 64, 8, do_image_splitting="no")
    with pytest.raises(GGMLTypeError, match="metadata dict"):
        ImageConfig.from_metadata([("clip.projector_type", "gemma3")])
    with pytest.raises(GGMLTypeError, match="expected an ImageConfig"):
        preprocess(_rand((4, 4, 3)), {"clip.projector_type": "gemma3"})


# ---------------------------------------------------------------------------------------------------------------
# errors on images
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, exc, words", [
    (None, GGMLTypeError, ["NoneType", "PIL image"]),
    (5, GGMLTypeError, ["int", "numpy array"]),
    ([[0, 0, 0]], GGMLTypeError, ["list"]),
    (np.zeros((5, 7, 2), np.uint8), GGMLValueError, ["(5, 7, 2)", "(H, W, 3)"]),
    (np.zeros((5, 7, 3, 1), np.uint8), GGMLValueError, ["(5, 7, 3, 1)"]),
    (np.zeros((7,), np.uint8), GGMLValueError, ["(7,)"]),
    (np.zeros((3, 10, 12), np.uint8), GGMLValueError, ["(3, 10, 12)", "transpose(1, 2, 0)"]),
    (np.zeros((0, 7, 3), np.uint8), GGMLValueError, ["(0, 7, 3)", "no pixels"]),
    (np.zeros((5, 0), np.uint8), GGMLValueError, ["(5, 0)", "no pixels"]),
    (np.zeros((5, 7, 3), bool), GGMLTypeError, ["bool", "uint8"]),
    (np.zeros((5, 7, 3), np.complex64), GGMLTypeError, ["complex64"]),
    (np.zeros((5, 7, 3), object), GGMLTypeError, ["object"]),
    (np.full((5, 7, 3), 1.5), GGMLValueError, ["[0, 1]"]),
    (np.full((5, 7, 3), np.nan, np.float32), GGMLValueError, ["NaN"]),
    (np.full((5, 7, 3), 256, np.int16), GGMLValueError, ["int16", "[256, 256]", "[0, 255]"]),
    (np.full((5, 7, 3), -1, np.int32), GGMLValueError, ["[0, 255]"]),
    (b"", GGMLValueError, ["empty"]),
    (b"this is not an image", GGMLValueError, ["image bytes", "cannot decode"]),
    ("https://example.com/cat.png", GGMLValueError, ["URL"]),
    ("data:image/png;base64,@@@@", GGMLValueError, ["base64"]),
    ("data:image/png;base64", GGMLValueError, ["data URL", "','"]),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), GGMLValueError, ["data URL", "cannot decode"]),
])
def test_bad_images(value, exc, words):
    with pytest.raises(exc) as ei:
        load_image(value)
    for w in words:
        assert w in str(ei.value)
    with pytest.raises(exc):
        preprocess(value, GEMMA3_CONFIGS["small"])


def _png_bytes(shape=(64, 64, 3)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_rand(shape)).save(buf, format="PNG")
    return buf.getvalue()


def test_corrupt_and_truncated_files(tmp_path):
    data = _png_bytes()
    for bad in (data[: len(data) // 2], data[:40] + b"\0" * 200):
        with pytest.raises(GGMLValueError, match="cannot decode") as ei:
            load_image(bad)
        assert ei.value.__cause__ is not None  # Pillow's own error is chained
    path = tmp_path / "broken.png"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGMLValueError, match="broken.png"):
        load_image(path)
    # ImageError (a GGMLValueError) for every input it cannot read, naming it
    with pytest.raises(ImageError, match="missing.png': no such file"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="a directory; only regular files"):
        load_image(tmp_path)


def test_decompression_bomb(monkeypatch):
    data = _png_bytes((64, 64, 3))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels > 2 * 1000: Pillow would refuse
    # Pillow's limit, lower than the module's, is the bound; the header is read before Pillow opens the data
    with pytest.raises(ImageError, match="too large: 64x64 = 4,096 pixels, more than the 1,000"):
        load_image(data)


def test_zero_size_pil_image():
    with pytest.raises(GGMLValueError, match="0x5"):
        load_image(Image.new("RGB", (0, 5)))


def test_pil_mode_without_rgb_conversion():
    # "La" (premultiplied alpha) has no conversion to RGB in Pillow: the error names the mode and chains Pillow's
    img = Image.new("La", (4, 4))
    with pytest.raises(GGMLValueError, match="'La'") as ei:
        load_image(img)
    assert ei.value.__cause__ is not None


def test_without_pillow(monkeypatch):
    data = _png_bytes()
    for name in ("PIL", "PIL.Image", "PIL.ImageOps"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import PIL` fail
    with pytest.raises(ImportError, match="pip install pillow"):
        load_image(data)
    with pytest.raises(ImportError, match="pip install pillow"):
        preprocess(_rand((4, 4, 3)), GEMMA3_CONFIGS["small"])
    # type errors do not need Pillow to be reported
    with pytest.raises(GGMLTypeError):
        load_image(3.5)
    # prompts and configuration need no Pillow
    assert ImageConfig.from_metadata(_md()).tokens_per_tile == 256
    assert gemma3_image_prompt(1).count("<image_soft_token>") == 1


# ---------------------------------------------------------------------------------------------------------------
# prompt text
# ---------------------------------------------------------------------------------------------------------------

def test_prompt_strings():
    assert gemma3_image_prompt(3) == (
        "\n\n<start_of_image><image_soft_token><image_soft_token><image_soft_token><end_of_image>\n\n")
    f, i, g = "<fake_token_around_image>", "<image>", "<global-img>"
    assert idefics3_image_prompt(0, 0, 2) == f"{f}{g}{i}{i}{f}"
    assert idefics3_image_prompt(2, 2, 1) == (
        f"{f}<row_1_col_1>{i}{f}<row_1_col_2>{i}\n"
        f"{f}<row_2_col_1>{i}{f}<row_2_col_2>{i}\n"
        f"\n{f}{g}{i}{f}")
    assert idefics3_image_prompt(1, 1, 1, fake_image_token="F", image_token="I", global_image_token="G") == (
        "F<row_1_col_1>I\n\nFGIF")
    pre = preprocess(_rand((37, 53, 3)), IDEFICS3_CONFIGS["small"])
    cfg = IDEFICS3_CONFIGS["small"]
    assert image_prompt(pre, cfg) == idefics3_image_prompt(3, 4, cfg.tokens_per_tile)
    assert image_prompt(preprocess(_rand((4, 4, 3)), GEMMA3_CONFIGS["gemma3-4b"]),
                        GEMMA3_CONFIGS["gemma3-4b"]) == gemma3_image_prompt(256)


@pytest.mark.parametrize("call, exc", [
    (lambda: idefics3_image_prompt(0, 2, 4), GGMLValueError),
    (lambda: idefics3_image_prompt(-1, -1, 4), GGMLValueError),
    (lambda: idefics3_image_prompt(1, 1, 0), GGMLValueError),
    (lambda: idefics3_image_prompt(1.0, 1, 4), GGMLTypeError),
    (lambda: gemma3_image_prompt(0), GGMLValueError),
    (lambda: gemma3_image_prompt("256"), GGMLTypeError),
    (lambda: image_prompt("x", GEMMA3_CONFIGS["small"]), GGMLTypeError),
])
def test_prompt_errors(call, exc):
    with pytest.raises(exc):
        call()


def _byte_tokenizer(**kw):
    """A transformers tokenizer over bytes with no merges: decode(encode(text)) == text for any text."""
    t = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: n for n, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return t.PreTrainedTokenizerFast(tokenizer_object=tk, **kw)


@pytest.mark.hf
@pytest.mark.parametrize("name", ["small", "gemma3-4b"])
def test_gemma3_prompt_matches_processor(name):
    t = _transformers()
    cfg = GEMMA3_CONFIGS[name]
    tok = _byte_tokenizer(extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                "image_token": "<image_soft_token>"})
    proc = t.Gemma3Processor(image_processor=_hf_image_processor(cfg), tokenizer=tok,
                             image_seq_length=cfg.tokens_per_tile)
    imgs = [Image.fromarray(_rand((37, 53, 3))), Image.fromarray(_rand((90, 20, 3)))]
    text = "A <start_of_image> and <start_of_image>?"
    out = proc(text=text, images=imgs)
    pres = [preprocess(im, cfg) for im in imgs]
    want = text.replace("<start_of_image>", "\0").replace("\0", image_prompt(pres[0], cfg), 1)
    want = want.replace("\0", image_prompt(pres[1], cfg), 1)
    assert tok.decode(out["input_ids"][0]) == want
    np.testing.assert_array_equal(np.asarray(out["pixel_values"]), np.concatenate([p.pixel_values for p in pres]))


@pytest.mark.hf
@pytest.mark.parametrize("name", ["small", "small-one-tile", "small-no-split", "smolvlm-256m"])
def test_idefics3_prompt_matches_processor(name):
    t = _transformers()
    cfg = IDEFICS3_CONFIGS[name]
    specials = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
    tok = _byte_tokenizer(extra_special_tokens=specials)
    proc = t.Idefics3Processor(image_processor=_hf_image_processor(cfg), tokenizer=tok,
                               image_seq_len=cfg.tokens_per_tile)
    imgs = [Image.fromarray(_rand((37, 53, 3))), Image.fromarray(_rand((300, 120, 3), seed=1))]
    text = "User:<image>then<image>\nAssistant:"
    out = proc(text=[text], images=[imgs])
    pres = [preprocess(im, cfg) for im in imgs]
    a, b, c = text.split("<image>")
    assert tok.decode(out["input_ids"][0]) == a + image_prompt(pres[0], cfg) + b + image_prompt(pres[1], cfg) + c
    # one sample: the tiles of both images one after the other
    np.testing.assert_array_equal(np.asarray(out["pixel_values"])[0],
                                  np.concatenate([p.pixel_values for p in pres]))
