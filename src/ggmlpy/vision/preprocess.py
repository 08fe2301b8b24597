"""Image preprocessing for the vision encoders, reproducing Hugging Face transformers' image processors.

An image goes through three steps before the encoder sees it:

1. :func:`load_image` turns a PIL image, a numpy array, a path or encoded bytes into an RGB PIL image;
2. :func:`preprocess` resizes and (for Idefics3) tiles it as the model's HF image processor does, then
   rescales to ``[0, 1]`` and normalises with the model's mean and std, giving float32 tiles in
   HF's ``pixel_values`` layout ``(3, H, W)``;
3. :func:`image_prompt` (or :func:`gemma3_image_prompt` / :func:`idefics3_image_prompt`) gives the text
   the HF processor puts into the prompt in place of the image's placeholder token.

The preprocessing settings come from an mmproj GGUF's metadata (:meth:`ImageConfig.from_metadata`).

Supported projector types
-------------------------
``gemma3``
    ``Gemma3ImageProcessor`` with its defaults (pan-and-scan off): resize to ``image_size x image_size``
    with bilinear resampling, rescale by 1/255, normalise. One tile; the prompt holds
    ``(image_size / patch_size / scale_factor)**2`` soft tokens.
``idefics3`` (Idefics3, SmolVLM)
    ``Idefics3ImageProcessor`` with its defaults: resize (Lanczos) so that the longest edge is
    ``longest_edge`` (the processor's ``size["longest_edge"]``, the GGUF's ``preproc_image_size``), the
    other edge rounded up to an even length; resize again so both edges are multiples of ``image_size``
    (the processor's ``max_image_size``); cut that into ``rows x cols`` tiles in row-major order and append
    the whole image resized to ``image_size x image_size`` as the last tile. An image whose second resize is
    exactly one tile is not split (``rows == cols == 0``, one tile). Without splitting the image is resized
    to ``image_size x image_size`` after the first resize.
``llama4``
    ``Llama4ImageProcessor``: the best-fitting canvas of up to ``max_patches`` tiles, torch's antialiased
    bilinear resize, bfloat16 normalisation, the global tile (:mod:`~ggmlpy.vision.canvas`).
``pixtral``
    ``PixtralImageProcessor``: scaled down into the longest edge, sides up to whole tokens, bicubic; one
    image of its own size.
``qwen2.5vl_merger``, ``qwen3vl_merger`` (Qwen2.5-VL, Qwen3-VL)
    ``Qwen2VLImageProcessor``'s ``smart_resize`` into ``min_pixels``..``max_pixels``, bicubic; one image of
    its own size (sides multiples of twice the patch).

Every resize goes through Pillow (as HF's PIL backend does), on uint8 pixels, so the result is bit for bit
what transformers gives; the rescale is done in float64 and rounded to float32, the normalisation in float32,
again as transformers does.

Inputs, and where they differ from transformers
-----------------------------------------------
* PIL images of any mode are converted as HF's ``convert_to_rgb`` does: a mode with an alpha band, or a
  palette/greyscale image with a ``transparency`` entry, is composited onto white; anything else is
  ``Image.convert("RGB")``. EXIF orientation is not applied (HF does not apply it to PIL input either).
* Paths and bytes are decoded as HF's ``load_image`` does for a path: EXIF orientation applied, then
  ``convert("RGB")``, which *drops* an alpha band rather than compositing onto white. So a transparent PNG
  gives different pixels from a path than from ``Image.open`` of the same file, in transformers and here.
  Nothing is fetched: a ``str`` is a local path, a ``file://`` URL, or a ``data:`` URL (RFC 2397, e.g.
  ``data:image/png;base64,...``, as chat messages carry images), whose bytes are decoded as above.
* numpy arrays must be channel-last, ``(H, W)``, ``(H, W, 1)``, ``(H, W, 3)`` or ``(H, W, 4)``: greyscale
  is repeated to three channels and RGBA is composited onto white with HF's float64 formula. Integer arrays
  of any dtype with values in ``[0, 255]`` are taken as uint8. Float arrays must hold values in ``[0, 1]``
  and are quantised to uint8 (``round(x * 255)``) first; transformers would instead rescale them twice
  (once around its PIL resize, once in ``rescale``), which no model expects. HF also guesses channel-first
  when the first axis has length 1, 3 or 4; here the layout is always ``(H, W, C)``.

Untrusted inputs
----------------
Encoded images (files, ``data:`` URLs, bytes) may come from anyone, so reading them is bounded, and every
refusal is an :class:`ImageError` naming the input (a path, truncated, or "data URL" / "bytes"):

* only regular files are opened: a directory, FIFO, socket or device is refused from its ``stat``, and the
  file is opened non-blocking and checked again, so nothing blocks or reads without end;
* at most :data:`MAX_IMAGE_BYTES` of encoded image are read, from a file, a ``data:`` URL or bytes alike;
* only the formats of :data:`IMAGE_FORMATS` (PNG, JPEG, WebP, GIF, BMP, as the HF processors take) are
  tried: Pillow is given that list, so no other plugin (TIFF, EPS through Ghostscript, ...) ever sees the
  data, whatever the file is called;
* an image of more than :data:`MAX_IMAGE_PIXELS` pixels (width x height, or Pillow's own
  ``PIL.Image.MAX_IMAGE_PIXELS`` when that is lower) is refused from its header, before a pixel is decoded;
* local files are read only where the caller allows them: :func:`load_image` and :func:`preprocess` read
  paths (the caller's own argument), while chat messages (:meth:`ggmlpy.runner.Runner.chat`) do not
  unless ``allow_local_files=True``; a refusal reads nothing, so it is the same for a file that exists and
  one that does not. A ``data:`` URL, bytes, a PIL image or an array is always accepted.

The two bounds are module attributes, read at each call: a program that trusts its images may raise them.

Pillow is needed to decode and resize, and is imported only when a function needs it.

This module holds the entry points (:func:`load_image` with the two bounds and the conversions of arrays
and PIL images, :func:`check_source`, :func:`preprocess`) and re-exports the rest, one module per job:
:mod:`~ggmlpy.vision.decode` (encoded images read within bounds), :mod:`~ggmlpy.vision.image_config`
(:class:`ImageConfig`), :mod:`~ggmlpy.vision.resize` (resize, tiles, normalisation:
:class:`PreprocessedImage`) and :mod:`~ggmlpy.vision.prompt` (the prompt text of an image).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ggmlpy._core import GGMLTypeError

from .decode import (
    IMAGE_FORMATS,
    ImageError,
    _data_url,
    _decode,
    _file_url_path,
    _pil,
    _read_file,
    _scheme,
    _short,
    _too_many_bytes,
)
from .image_config import (  # noqa: F401  (the mmproj keys and projector types: names of this module)
    KEY_IMAGE_MEAN,
    KEY_IMAGE_SIZE,
    KEY_IMAGE_STD,
    KEY_PATCH_SIZE,
    KEY_PREPROC_IMAGE_SIZE,
    KEY_PROJECTOR_TYPE,
    KEY_SCALE_FACTOR,
    KEY_VISION_PROJECTOR_TYPE,
    PROJECTOR_TYPES,
    ImageConfig,
)
from .prompt import (
    gemma3_image_prompt,
    idefics3_image_prompt,
    image_prompt,
    llama4_image_prompt,
    pixtral_image_prompt,
)
from .resize import IDEFICS3_MAX_IMAGE_SIZE, RESCALE_FACTOR, PreprocessedImage, resize_and_tile  # noqa: F401 (same)

if TYPE_CHECKING:
    from PIL import Image as _PILImageModule

    ImageInput = Union["_PILImageModule.Image", np.ndarray, str, "os.PathLike[str]", bytes, bytearray, memoryview]

__all__ = [
    "IMAGE_FORMATS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "ImageConfig",
    "ImageError",
    "PreprocessedImage",
    "check_source",
    "gemma3_image_prompt",
    "idefics3_image_prompt",
    "image_prompt",
    "llama4_image_prompt",
    "load_image",
    "pixtral_image_prompt",
    "preprocess",
]

#: The most bytes of encoded image read from a file, a ``data:`` URL or bytes (64 MiB; a 50-megapixel
#: photo is 10-30 MB as JPEG). Read at each call: a program may raise it for images it trusts.
MAX_IMAGE_BYTES = 64 * 2**20

#: The most pixels (width x height) an encoded image may declare; checked from the header, before decoding
#: (50 million: a 50-megapixel camera's 8160 x 6120 passes; its pixels take 150-200 MB decoded).
#: It stays below Pillow's own ``PIL.Image.MAX_IMAGE_PIXELS`` (89.5 million), so Pillow never warns about
#: an image that is decoded; when that is set lower, the lower bound holds. Read at each call.
MAX_IMAGE_PIXELS = 50_000_000


def _is_pil_image(x: Any) -> bool:
    # A PIL image can exist only if PIL.Image was imported, so this check never imports Pillow itself.
    mod = sys.modules.get("PIL.Image")
    return mod is not None and isinstance(x, mod.Image)


def _array_to_rgb(a: np.ndarray) -> np.ndarray:
    """A validated ``(H, W, 3)`` uint8 C-contiguous copy of a channel-last image array."""
    expected = "expected (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) with H, W >= 1"
    shape = a.shape
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise GGMLTypeError(f"image: array of dtype {a.dtype}; expected uint8 (or another integer dtype with values "
                            "in [0, 255], or a float dtype with values in [0, 1])")
    if a.ndim == 2:
        a = a[:, :, None]
    elif a.ndim != 3 or a.shape[2] not in (1, 3, 4):
        hint = ""
        if a.ndim == 3 and a.shape[0] in (1, 3, 4):
            hint = "; a channel-first array must be transposed first: a.transpose(1, 2, 0)"
        raise ImageError(f"image: array of shape {a.shape}; {expected}{hint}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ImageError(f"image: array of shape {shape} has no pixels; {expected}")

    if np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
            raise ImageError(f"image: float array of shape {a.shape} has values outside [0, 1] (or NaN/inf); "
                             "float images must be in [0, 1] (uint8 images in [0, 255])")
        # Quantise first, so that a float image is processed exactly as its uint8 counterpart would be.
        a = np.round(a.astype(np.float64) * 255).astype(np.uint8)
    elif a.dtype != np.uint8:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise ImageError(f"image: {a.dtype} array has values in [{lo}, {hi}]; expected [0, 255]")
        a = a.astype(np.uint8)

    channels = a.shape[2]
    if channels == 1:
        a = np.repeat(a, 3, axis=2)
    elif channels == 4:
        # transformers' numpy convert_to_rgb: blend onto white in float64, round half to even.
        alpha = a[..., 3:4] / 255
        a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(a)


def _pil_to_rgb(img: _PILImageModule.Image) -> _PILImageModule.Image:
    """HF's ``convert_to_rgb`` for a PIL image: transparency is composited onto white."""
    Image, _ = _pil()
    if img.width == 0 or img.height == 0:
        raise ImageError(f"image: PIL image of size {img.width}x{img.height} has no pixels")
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")
    except Exception as e:
        # a lazily opened file may fail to decode only now, or the mode may have no RGB conversion
        raise ImageError(f"image: cannot convert a PIL image of mode {img.mode!r} and size "
                         f"{img.width}x{img.height} to RGB ({type(e).__name__}: {e})") from e


def check_source(image: Any, *, allow_local_files: bool, what: str = "image") -> None:
    """Refuse an image that would be read from a local file, unless local files are allowed.

    A path (``str`` or ``os.PathLike``) or a ``file://`` URL reads a local file; a ``data:`` URL, bytes, a
    PIL image, an array or a preprocessed image does not. Nothing is read or looked up, so the refusal is
    the same whether the file exists or not (a caller relaying untrusted messages learns nothing about
    the file system from it).

    Raises
    ------
    ImageError
        ``image`` names a local file and ``allow_local_files`` is false.
    """
    if allow_local_files or not isinstance(image, (str, os.PathLike)):
        return
    try:
        text = os.fspath(image)
    except TypeError:
        return                                # load_image reports the type
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if _scheme(text) in ("data", "http", "https"):
        return                                # not a file: load_image decodes or refuses it
    kind = "image URL" if _scheme(text) == "file" else "image path"
    raise ImageError(f"{what}: {kind} {_short(text)}: local files are not read unless the caller allows them "
                     "(allow_local_files=True); give the image itself: a data: URL, encoded bytes or an image "
                     "object")


def load_image(image: ImageInput, *, allow_local_files: bool = True) -> _PILImageModule.Image:
    """An image as an RGB PIL image, converted as transformers converts it.

    Parameters
    ----------
    image : PIL.Image.Image, numpy.ndarray, str, os.PathLike or bytes
        A PIL image of any mode (transparency is composited onto white); a channel-last numpy array
        ``(H, W)``, ``(H, W, 1)``, ``(H, W, 3)`` or ``(H, W, 4)`` of uint8 (other integer dtypes with values in
        ``[0, 255]`` and float dtypes with values in ``[0, 1]`` are accepted, see the module notes); the path
        of an image file (or a ``file://`` URL, or a ``data:`` URL such as ``data:image/png;base64,...``); or
        the bytes of an encoded image (``bytearray`` and ``memoryview`` too). Files and bytes get their EXIF
        orientation applied and any alpha band dropped, as transformers' ``load_image``. Encoded images are
        read within the module's bounds (see "Untrusted inputs" in the module notes): a regular file only, at
        most :data:`MAX_IMAGE_BYTES`, one of :data:`IMAGE_FORMATS`, at most :data:`MAX_IMAGE_PIXELS`.
    allow_local_files : bool
        Whether a path or ``file://`` URL is read (default True: the caller's own argument). False for an
        image that comes from someone else (a chat message): such an input is then refused without looking
        at the file system.

    Returns
    -------
    PIL.Image.Image
        A new image of mode ``"RGB"`` (the input is never modified).

    Raises
    ------
    GGMLTypeError
        Not one of the types above, or an array of a non-numeric or bool dtype.
    ImageError
        (a GGMLValueError) An array of the wrong shape, with no pixels or with out-of-range values; a missing
        or unreadable file, or a path that is not a regular file; an encoded image that is empty, corrupt,
        truncated, over :data:`MAX_IMAGE_BYTES` or :data:`MAX_IMAGE_PIXELS` (checked before decoding), or
        not in :data:`IMAGE_FORMATS` (the decoder's exception is chained); a local file where
        ``allow_local_files`` is false; an ``http(s)://`` URL; a malformed ``data:`` URL. The message names
        the input.
    ImportError
        Pillow is not installed.
    """
    if isinstance(image, np.ndarray):
        rgb = _array_to_rgb(image)
        Image, _ = _pil()
        return Image.fromarray(rgb)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        scheme = _scheme(path)
        if scheme in ("http", "https"):
            raise ImageError(f"image: {_short(path)} is a URL; ggmlpy does not download images: fetch it and "
                             "pass the bytes or a local path")
        if scheme == "data":
            return _decode(_data_url(path, MAX_IMAGE_BYTES), "image data URL", MAX_IMAGE_PIXELS)
        check_source(path, allow_local_files=allow_local_files)
        if scheme == "file":
            path = _file_url_path(path)
        _pil()  # fail on a missing Pillow before reading the file
        source = f"image file {_short(path)}"
        return _decode(_read_file(path, source, MAX_IMAGE_BYTES), source, MAX_IMAGE_PIXELS)
    if isinstance(image, (bytes, bytearray, memoryview)):
        n = memoryview(image).nbytes
        if n > MAX_IMAGE_BYTES:
            raise _too_many_bytes("image bytes", f"{n:,} bytes", MAX_IMAGE_BYTES)
        return _decode(image if isinstance(image, bytes) else bytes(image), "image bytes", MAX_IMAGE_PIXELS)
    if _is_pil_image(image):
        return _pil_to_rgb(image)
    cls = type(image)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    raise GGMLTypeError(f"image: got {name}; expected a PIL image, a numpy array (H, W, 3) uint8, a path or the "
                        "bytes of an encoded image")


def preprocess(image: ImageInput, cfg: ImageConfig, *, allow_local_files: bool = True) -> PreprocessedImage:
    """Resize, tile and normalise an image as the model's HF image processor does.

    Parameters
    ----------
    image : PIL.Image.Image, numpy.ndarray, str, os.PathLike or bytes
        Anything :func:`load_image` accepts.
    cfg : ImageConfig
        The encoder's preprocessing settings.
    allow_local_files : bool
        Whether a path or ``file://`` URL is read, as for :func:`load_image` (default True).

    Returns
    -------
    PreprocessedImage
        For gemma3 one tile; for idefics3 the grid tiles and the global image, or one tile when the image is
        not split.

    Raises
    ------
    GGMLTypeError, ImageError, ImportError
        As :func:`load_image`; GGMLTypeError also when ``cfg`` is not an :class:`ImageConfig`.
    """
    if not isinstance(cfg, ImageConfig):
        raise GGMLTypeError(f"preprocess: cfg is {type(cfg).__name__}; expected an ImageConfig "
                            "(ImageConfig.from_metadata(mmproj_metadata))")
    img = load_image(image, allow_local_files=allow_local_files)
    return resize_and_tile(img, cfg)
