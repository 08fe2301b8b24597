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
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import stat
import sys
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from ggmlpy._core import GGMLTypeError, GGMLValueError

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
    "load_image",
    "preprocess",
]

#: The projector types this module preprocesses for.
PROJECTOR_TYPES = ("gemma3", "idefics3")

#: transformers' ``rescale_factor`` default, 1/255 as a Python float (the exact value matters for bit equality).
RESCALE_FACTOR = 1 / 255

#: Idefics3's absolute cap on either edge after the first resize (transformers' ``MAX_IMAGE_SIZE``).
IDEFICS3_MAX_IMAGE_SIZE = 4096

#: The encoded formats decoded (Pillow's names): those the HF image processors are used with. Pillow tries
#: no other plugin, so a TIFF, PSD, ICO or EPS file (which would reach Ghostscript) is refused unread.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

#: The most bytes of encoded image read from a file, a ``data:`` URL or bytes (64 MiB; a 50-megapixel
#: photo is 10-30 MB as JPEG). Read at each call: a program may raise it for images it trusts.
MAX_IMAGE_BYTES = 64 * 2**20

#: The most pixels (width x height) an encoded image may declare; checked from the header, before decoding
#: (50 million: a 50-megapixel camera's 8160 x 6120 passes; its pixels take 150-200 MB decoded).
#: It stays below Pillow's own ``PIL.Image.MAX_IMAGE_PIXELS`` (89.5 million), so Pillow never warns about
#: an image that is decoded; when that is set lower, the lower bound holds. Read at each call.
MAX_IMAGE_PIXELS = 50_000_000

# Pillow's JPEG opener gives a multi-picture JPEG (as many cameras write) the format "MPO": still a JPEG.
_OPENED_FORMATS = frozenset(IMAGE_FORMATS) | {"MPO"}
_FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"

# mmproj GGUF keys, as llama.cpp's converter writes them.
KEY_PROJECTOR_TYPE = "clip.projector_type"
KEY_VISION_PROJECTOR_TYPE = "clip.vision.projector_type"  # mixed-modality files name the vision one here
KEY_IMAGE_SIZE = "clip.vision.image_size"
KEY_PATCH_SIZE = "clip.vision.patch_size"
KEY_IMAGE_MEAN = "clip.vision.image_mean"
KEY_IMAGE_STD = "clip.vision.image_std"
KEY_PREPROC_IMAGE_SIZE = "clip.vision.preproc_image_size"
KEY_SCALE_FACTOR = "clip.vision.projector.scale_factor"

# llama.cpp's default when a gemma3 file has no scale factor (the converter writes it only when it is not 4).
_GEMMA3_SCALE_FACTOR = 4
# Idefics3Config's default, used when ImageConfig is built by hand without one.
_IDEFICS3_SCALE_FACTOR = 2


class ImageError(GGMLValueError):
    """An image input that cannot be read or decoded, or that is refused (a file that is not a regular file,
    over :data:`MAX_IMAGE_BYTES` or :data:`MAX_IMAGE_PIXELS`, not in :data:`IMAGE_FORMATS`, or a local file
    where local files are not allowed). The message names the input: its path (truncated), "image data URL"
    or "image bytes"."""


def _pil():
    """Pillow's ``Image`` and ``ImageOps`` modules, or an ImportError that says how to get them."""
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise ImportError("ggmlpy.vision needs Pillow to decode and resize images: pip install pillow") from e
    return Image, ImageOps


def _is_pil_image(x: Any) -> bool:
    # A PIL image can exist only if PIL.Image was imported, so this check never imports Pillow itself.
    mod = sys.modules.get("PIL.Image")
    return mod is not None and isinstance(x, mod.Image)


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------

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


def _short(text: str, limit: int = 80) -> str:
    """``text`` quoted, its middle cut when long (a path's two ends say the most)."""
    if len(text) > limit:
        text = text[: limit // 2] + "..." + text[-(limit // 2 - 3):]
    return repr(text)


def _too_many_bytes(source: str, n: str, limit: int) -> ImageError:
    return ImageError(f"{source}: {n}, more than the {limit:,} bytes read for an image "
                      "(ggmlpy.vision.preprocess.MAX_IMAGE_BYTES)")


def _pixel_limit(Image) -> int:
    """The most pixels decoded: :data:`MAX_IMAGE_PIXELS`, or Pillow's own limit when that is lower."""
    pil = getattr(Image, "MAX_IMAGE_PIXELS", None)
    return MAX_IMAGE_PIXELS if pil is None else min(MAX_IMAGE_PIXELS, int(pil))


def _too_many_pixels(source: str, width: int, height: int, limit: int) -> ImageError:
    return ImageError(f"{source}: the image is too large: {width}x{height} = {width * height:,} pixels, "
                      f"more than the {limit:,} decoded (ggmlpy.vision.preprocess.MAX_IMAGE_PIXELS, or "
                      "PIL.Image.MAX_IMAGE_PIXELS if lower); refused before decoding")


def _jpeg_size(data) -> Optional[tuple[int, int]]:
    """The size in a JPEG's frame header (the first SOFn marker), or None if not found near the start."""
    at = 2
    for _ in range(256):                 # a real file reaches its frame header within a few segments
        if at + 9 > len(data) or data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:               # fill byte
            at += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # SOF0..SOF15 (not DHT, JPG, DAC)
            return int.from_bytes(data[at + 7:at + 9], "big"), int.from_bytes(data[at + 5:at + 7], "big")
        if marker == 0xD8 or 0xD0 <= marker <= 0xD7:   # markers without a length
            at += 2
            continue
        at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return None


def _webp_size(data) -> Optional[tuple[int, int]]:
    """The canvas size a WebP file declares (RFC 9649), or None."""
    chunk = bytes(data[12:16])
    if chunk == b"VP8X":            # extended format: 24-bit canvas width and height, minus one
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8L" and data[20] == 0x2F:     # lossless: two 14-bit fields, minus one
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":    # lossy key frame: 14-bit sizes
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    return None


def _declared_size(data) -> Optional[tuple[int, int]]:
    """The ``(width, height)`` an encoded image's header declares, read from the bytes before Pillow sees
    them (so that no Pillow opener allocates for, or warns about, an image refused anyway); None when the
    header is not one of :data:`IMAGE_FORMATS`' or is malformed (Pillow's opener then decides)."""
    if len(data) < 30:
        return None
    head = bytes(data[:30])
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head.startswith((b"GIF87a", b"GIF89a")):       # the logical screen
        return int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")
    if head.startswith(b"BM"):
        if int.from_bytes(head[14:18], "little") == 12:                 # OS/2 core header: 16-bit sizes
            return int.from_bytes(head[18:20], "little"), int.from_bytes(head[20:22], "little")
        # height is negative for a top-down bitmap
        return (abs(int.from_bytes(head[18:22], "little", signed=True)),
                abs(int.from_bytes(head[22:26], "little", signed=True)))
    if head.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return _webp_size(head)
    return None


def _decode(data, source: str) -> _PILImageModule.Image:
    """Decode encoded image bytes as HF's ``load_image`` does for a file: EXIF orientation, then RGB.

    Only :data:`IMAGE_FORMATS` are tried, and the size the header declares is checked against the pixel
    bound before anything is decoded (``Image.open`` reads only the header).
    """
    Image, ImageOps = _pil()
    from PIL import UnidentifiedImageError

    if not len(data):
        raise ImageError(f"{source}: empty (0 bytes); expected an encoded image ({_FORMAT_NAMES})")
    limit = _pixel_limit(Image)
    # Checked before Image.open: some openers allocate (WebP's sets up its canvas), and Pillow's own check
    # in open would warn about an image refused here anyway. The check after open stays the rule.
    size = _declared_size(data)
    if size is not None and size[0] * size[1] > limit:
        raise _too_many_pixels(source, size[0], size[1], limit)
    try:
        img = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except Image.DecompressionBombError as e:   # Pillow's own check, inside open: still before decoding
        raise ImageError(f"{source}: the image is too large ({e}); refused before decoding") from e
    except UnidentifiedImageError as e:
        raise ImageError(f"{source}: cannot decode the image: not a {_FORMAT_NAMES} file, or a damaged one "
                         "(no other format is read)") from e
    except Exception as e:
        raise ImageError(f"{source}: cannot decode the image ({type(e).__name__}: {e})") from e
    try:
        if img.format not in _OPENED_FORMATS:   # formats= makes this impossible; kept as the rule itself
            raise ImageError(f"{source}: a {img.format} image; only {_FORMAT_NAMES} images are read")
        width, height = img.size
        if width * height > limit:
            raise _too_many_pixels(source, width, height, limit)
        if width == 0 or height == 0:
            raise ImageError(f"{source}: the image has no pixels ({width}x{height})")
        try:
            img.load()  # Image.open is lazy: decode now, so that a truncated file fails here
            try:
                ImageOps.exif_transpose(img, in_place=True)   # no copy of the decoded pixels
                oriented = img
            except TypeError:                                  # Pillow < 9.4 has no in_place
                oriented = ImageOps.exif_transpose(img)
            return oriented.convert("RGB")
        except Exception as e:
            raise ImageError(f"{source}: cannot decode the image ({type(e).__name__}: {e})") from e
    finally:
        img.close()   # frees the decoded pixels now, not when the collector gets to them


def _data_url(url: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (RFC 2397), as chat messages carry images.

    The payload's length is checked against :data:`MAX_IMAGE_BYTES` before it is decoded.
    """
    source = "image data URL"
    head, sep, data = url.partition(",")
    if not sep:
        raise ImageError(f"{source}: no ',' ({_short(url, 40)}); expected data:image/png;base64,...")
    limit = MAX_IMAGE_BYTES
    if head.lower().endswith(";base64"):
        if len(data) > 4 * -(-limit // 3):     # 4 characters per 3 bytes: it would decode to more
            raise _too_many_bytes(source, f"{len(data):,} characters of base64", limit)
        try:
            out = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{source}: the base64 payload is not valid ({e})") from e
    else:
        if len(data) > 3 * limit:              # at most 3 characters (%XX) per byte: it would decode to more
            raise _too_many_bytes(source, f"{len(data):,} characters", limit)
        out = urllib.parse.unquote_to_bytes(data)
    if len(out) > limit:
        raise _too_many_bytes(source, f"{len(out):,} bytes", limit)
    return out


# the kinds of file never opened, each with the test of its st_mode
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
# O_NONBLOCK: should the path turn into a FIFO between stat and open, open returns rather than waits for a
# writer; O_NOCTTY: a terminal never becomes the controlling one
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_BINARY", 0))


def _check_regular(st: os.stat_result, source: str, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _NOT_REGULAR if test(st.st_mode)), "not a regular file")
        raise ImageError(f"{source}: {kind}; only regular files are read as images")
    if st.st_size > limit:
        raise _too_many_bytes(source, f"{st.st_size:,} bytes", limit)


def _read_file(path: str, source: str) -> bytes:
    """A regular file's bytes, at most :data:`MAX_IMAGE_BYTES`; nothing else is opened, nothing blocks."""
    limit = MAX_IMAGE_BYTES
    try:
        _check_regular(os.stat(path), source, limit)   # a device or FIFO is refused unopened
        fd = os.open(path, _OPEN_FLAGS)
    except ImageError:
        raise
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ImageError(f"{source}: no such file") from e
    except PermissionError as e:
        raise ImageError(f"{source}: permission denied") from e
    except (OSError, ValueError) as e:     # ValueError: a NUL in the path
        raise ImageError(f"{source}: cannot open ({e})") from e
    try:
        st = os.fstat(fd)
        _check_regular(st, source, limit)   # what was opened, should the path have changed since stat
        chunks, n = [], 0
        while n <= limit:                   # a file may grow while it is read: never more than limit + 1
            chunk = os.read(fd, min(limit + 1 - n, max(st.st_size + 1, 1 << 16)))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    except OSError as e:
        raise ImageError(f"{source}: cannot read ({e})") from e
    finally:
        os.close(fd)
    if n > limit:
        raise _too_many_bytes(source, "more bytes than its size said", limit)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _scheme(text: str) -> str:
    """The scheme of a str image that is a URL ("data", "file", "http", "https"; any case), else ""."""
    head, sep, _ = text[:8].partition(":")
    head = head.lower()
    return head if sep and head in ("data", "file", "http", "https") else ""


def _file_url_path(url: str) -> str:
    """The local path of a ``file:`` URL (``file:///path`` or ``file://localhost/path``)."""
    rest = url[len("file:"):]
    if rest.startswith("//"):
        rest = rest[2:]
        host, slash, rest = rest.partition("/")
        if host.lower() not in ("", "localhost"):
            raise ImageError(f"image URL {_short(url)}: a file on host {host!r}; only local files "
                             "(file:///path) are read")
        rest = slash + rest
    if os.name == "nt":
        from urllib.request import url2pathname  # drive letters; imported only there (it is heavy)

        return url2pathname(rest)
    return urllib.parse.unquote(rest)


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
            return _decode(_data_url(path), "image data URL")
        check_source(path, allow_local_files=allow_local_files)
        if scheme == "file":
            path = _file_url_path(path)
        _pil()  # fail on a missing Pillow before reading the file
        source = f"image file {_short(path)}"
        return _decode(_read_file(path, source), source)
    if isinstance(image, (bytes, bytearray, memoryview)):
        n = memoryview(image).nbytes
        if n > MAX_IMAGE_BYTES:
            raise _too_many_bytes("image bytes", f"{n:,} bytes", MAX_IMAGE_BYTES)
        return _decode(image if isinstance(image, bytes) else bytes(image), "image bytes")
    if _is_pil_image(image):
        return _pil_to_rgb(image)
    cls = type(image)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    raise GGMLTypeError(f"image: got {name}; expected a PIL image, a numpy array (H, W, 3) uint8, a path or the "
                        "bytes of an encoded image")


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------

def _check_int(name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGMLTypeError(f"ImageConfig: {name} is {v!r} ({type(v).__name__}); expected an integer >= {minimum}")
    if v < minimum:
        raise GGMLValueError(f"ImageConfig: {name} is {v}; expected an integer >= {minimum}")
    return int(v)


def _check_triple(name: str, v: Any, positive: bool) -> tuple[float, float, float]:
    try:
        arr = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise GGMLTypeError(f"ImageConfig: {name} is {v!r}; expected 3 numbers (one per RGB channel)") from e
    if arr.shape != (3,) or not np.all(np.isfinite(arr)) or (positive and not np.all(arr > 0)):
        what = "3 finite numbers > 0" if positive else "3 finite numbers"
        raise GGMLValueError(f"ImageConfig: {name} is {v!r}; expected {what} (one per RGB channel)")
    return (float(arr[0]), float(arr[1]), float(arr[2]))


@dataclass(frozen=True)
class ImageConfig:
    """How to preprocess images for one vision encoder (the settings of the model's HF image processor).

    Parameters
    ----------
    projector_type : {"gemma3", "idefics3"}
        The mmproj projector, which picks the preprocessing pipeline.
    image_size : int
        The encoder's input side in pixels: the tile size (HF's ``size`` for gemma3, ``max_image_size``'s
        ``longest_edge`` for idefics3). A multiple of ``patch_size``.
    patch_size : int
        The encoder's patch side in pixels.
    image_mean, image_std : tuple of 3 floats
        Per-channel normalisation, ``(x / 255 - mean) / std``; both default to transformers'
        ``IMAGENET_STANDARD_MEAN``/``STD`` (0.5), which Gemma 3 and Idefics3/SmolVLM use.
    scale_factor : int, optional
        Patches merged per side by the projector (Gemma 3's pooling kernel, Idefics3's pixel shuffle); it sets
        the number of tokens per tile. Defaults to 4 for gemma3 (llama.cpp's default) and 2 for idefics3
        (``Idefics3Config``'s). ``image_size / patch_size`` must be a multiple of it.
    longest_edge : int, optional
        idefics3 only (ignored for gemma3): the first resize's longest edge, HF's ``size["longest_edge"]``.
        Defaults to ``4 * image_size``, the ratio every published Idefics3/SmolVLM processor uses.
    do_image_splitting : bool
        idefics3 only: split into tiles plus a global image (HF's default) or resize to one tile.

    Raises
    ------
    GGMLTypeError, GGMLValueError
        A field of the wrong type or out of range (the message names it).
    """

    projector_type: str
    image_size: int
    patch_size: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    scale_factor: int | None = None
    longest_edge: int | None = None
    do_image_splitting: bool = True

    def __post_init__(self) -> None:
        if self.projector_type not in PROJECTOR_TYPES:
            raise GGMLValueError(f"ImageConfig: projector_type {self.projector_type!r} is not supported; "
                                 f"expected one of {PROJECTOR_TYPES}")
        set_ = object.__setattr__  # frozen: normalise the fields in place once, here
        set_(self, "image_size", _check_int("image_size", self.image_size))
        set_(self, "patch_size", _check_int("patch_size", self.patch_size))
        if self.image_size % self.patch_size:
            raise GGMLValueError(f"ImageConfig: image_size is {self.image_size}, not a multiple of patch_size "
                                 f"{self.patch_size}")
        set_(self, "image_mean", _check_triple("image_mean", self.image_mean, positive=False))
        set_(self, "image_std", _check_triple("image_std", self.image_std, positive=True))
        default_scale = _GEMMA3_SCALE_FACTOR if self.projector_type == "gemma3" else _IDEFICS3_SCALE_FACTOR
        scale = default_scale if self.scale_factor is None else _check_int("scale_factor", self.scale_factor)
        side = self.image_size // self.patch_size
        if side % scale:
            raise GGMLValueError(f"ImageConfig: scale_factor is {scale}, which does not divide the {side} patches "
                                 f"per side (image_size {self.image_size} / patch_size {self.patch_size})")
        set_(self, "scale_factor", scale)
        if self.projector_type == "idefics3":
            edge = 4 * self.image_size if self.longest_edge is None else _check_int("longest_edge", self.longest_edge)
            set_(self, "longest_edge", edge)
        if not isinstance(self.do_image_splitting, (bool, np.bool_)):
            raise GGMLTypeError(f"ImageConfig: do_image_splitting is {self.do_image_splitting!r}; expected a bool")
        set_(self, "do_image_splitting", bool(self.do_image_splitting))

    @property
    def tokens_per_tile(self) -> int:
        """Tokens the projector emits per tile: ``(image_size / patch_size / scale_factor) ** 2``.

        Gemma 3's ``mm_tokens_per_image`` (256 for 896/14/4); Idefics3's ``image_seq_len`` (169 for 364/14/2).
        """
        assert self.scale_factor is not None  # set by __post_init__
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    @classmethod
    def from_metadata(cls, md: dict[str, Any], *, do_image_splitting: bool = True) -> ImageConfig:
        """The configuration an mmproj GGUF's metadata describes.

        Parameters
        ----------
        md : dict
            Metadata key to Python value (as :attr:`ggmlpy.gguf.GGUFReader.metadata`); arrays may be lists or
            numpy arrays. Read: ``clip.projector_type`` (or ``clip.vision.projector_type``, which mixed-modality
            files use and which wins), ``clip.vision.image_size``, ``clip.vision.patch_size``,
            ``clip.vision.image_mean``, ``clip.vision.image_std``, ``clip.vision.projector.scale_factor``
            (optional for gemma3, default 4, as in llama.cpp; required for idefics3, which llama.cpp's converter
            always writes) and for idefics3 ``clip.vision.preproc_image_size`` (optional, default
            ``4 * image_size``; files converted before llama.cpp wrote it lack it).
        do_image_splitting : bool
            See :class:`ImageConfig`.

        Raises
        ------
        GGMLValueError
            A required key is missing, or the projector type is not one this module handles.
        GGMLTypeError, GGMLValueError
            A value of the wrong type or out of range (the message names the key).
        """
        if not isinstance(md, dict):
            raise GGMLTypeError(f"ImageConfig.from_metadata: got {type(md).__name__}; expected the metadata dict "
                                "of an mmproj GGUF")

        def get(key: str, required: bool = True) -> Any:
            if key not in md:
                if required:
                    raise GGMLValueError(f"mmproj metadata: missing key {key!r} (is this an mmproj GGUF of a "
                                         "vision model?)")
                return None
            return md[key]

        ptype_key = KEY_VISION_PROJECTOR_TYPE if KEY_VISION_PROJECTOR_TYPE in md else KEY_PROJECTOR_TYPE
        ptype = get(ptype_key)
        if not isinstance(ptype, str):
            raise GGMLTypeError(f"mmproj metadata: {ptype_key!r} is {ptype!r}; expected a string")
        if ptype not in PROJECTOR_TYPES:
            raise GGMLValueError(f"mmproj metadata: {ptype_key!r} is {ptype!r}, a projector type this module does "
                                 f"not preprocess for; expected one of {PROJECTOR_TYPES}")
        fields = {
            "image_size": (KEY_IMAGE_SIZE, get(KEY_IMAGE_SIZE)),
            "patch_size": (KEY_PATCH_SIZE, get(KEY_PATCH_SIZE)),
            "image_mean": (KEY_IMAGE_MEAN, get(KEY_IMAGE_MEAN)),
            "image_std": (KEY_IMAGE_STD, get(KEY_IMAGE_STD)),
            "scale_factor": (KEY_SCALE_FACTOR, get(KEY_SCALE_FACTOR, required=ptype == "idefics3")),
        }
        if ptype == "idefics3":
            fields["longest_edge"] = (KEY_PREPROC_IMAGE_SIZE, get(KEY_PREPROC_IMAGE_SIZE, required=False))
        kwargs = {name: value for name, (_, value) in fields.items()}
        try:
            return cls(projector_type=ptype, do_image_splitting=do_image_splitting, **kwargs)
        except (GGMLTypeError, GGMLValueError) as e:
            # name the GGUF key rather than the field
            msg = str(e)
            for name, (key, _) in fields.items():
                if msg.startswith(f"ImageConfig: {name} "):
                    msg = f"mmproj metadata: {key!r}" + msg[len(f"ImageConfig: {name}"):]
                    break
            raise type(e)(msg) from e


# ---------------------------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PreprocessedImage:
    """An image ready for the encoder: normalised tiles and their layout.

    Attributes
    ----------
    tiles : list of numpy.ndarray
        float32 arrays ``(3, image_size, image_size)`` (channel-first, HF's ``pixel_values`` layout), in the
        order the model consumes them: for idefics3 the grid tiles row by row, then the global image.
    rows, cols : int
        The idefics3 tile grid; both 0 when the image was not split (gemma3 always).
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
    Image, _ = _pil()
    resampling = getattr(Image, "Resampling", Image)  # Pillow < 9.1 has the filters on the module only
    size = cfg.image_size
    source_size = (img.height, img.width)

    if cfg.projector_type == "gemma3":
        tile = np.asarray(img.resize((size, size), resampling.BILINEAR))
        return PreprocessedImage([_normalize(tile, cfg)], source_size=source_size)

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


# ---------------------------------------------------------------------------------------------------------------
# Prompt text
# ---------------------------------------------------------------------------------------------------------------

def gemma3_image_prompt(n_tokens: int = 256, *, boi_token: str = "<start_of_image>",
                        image_token: str = "<image_soft_token>", eoi_token: str = "<end_of_image>") -> str:
    """The text ``Gemma3Processor`` puts in place of each ``<start_of_image>`` in the prompt.

    ``"\\n\\n<start_of_image>" + "<image_soft_token>" * n_tokens + "<end_of_image>\\n\\n"`` (pan-and-scan's
    extra crops are not supported).

    Parameters
    ----------
    n_tokens : int
        The soft tokens per image, ``mm_tokens_per_image`` (:attr:`ImageConfig.tokens_per_tile`).
    boi_token, image_token, eoi_token : str
        The tokenizer's begin-of-image, image placeholder and end-of-image tokens.
    """
    n_tokens = _check_prompt_int("n_tokens", n_tokens, 1)
    return f"\n\n{boi_token}{image_token * n_tokens}{eoi_token}\n\n"


def idefics3_image_prompt(rows: int, cols: int, image_seq_len: int, *,
                          fake_image_token: str = "<fake_token_around_image>", image_token: str = "<image>",
                          global_image_token: str = "<global-img>") -> str:
    """The text ``Idefics3Processor`` puts in place of each ``<image>`` in the prompt.

    For a split image, each grid row is ``<fake_token_around_image><row_R_col_C>`` + ``<image>`` *
    ``image_seq_len`` per tile, then ``"\\n"``; then ``"\\n<fake_token_around_image><global-img>"`` +
    ``<image>`` * ``image_seq_len`` + ``<fake_token_around_image>``. An image that was not split
    (``rows == cols == 0``) is only the global part, without the leading newline.

    Parameters
    ----------
    rows, cols : int
        :attr:`PreprocessedImage.rows` and ``cols``; both 0, or both >= 1.
    image_seq_len : int
        Tokens per tile (:attr:`ImageConfig.tokens_per_tile`).
    fake_image_token, image_token, global_image_token : str
        The tokenizer's spellings of these tokens.

    Raises
    ------
    GGMLValueError
        Negative counts, or one of ``rows``/``cols`` 0 and the other not.
    """
    rows = _check_prompt_int("rows", rows, 0)
    cols = _check_prompt_int("cols", cols, 0)
    image_seq_len = _check_prompt_int("image_seq_len", image_seq_len, 1)
    if (rows == 0) != (cols == 0):
        raise GGMLValueError(f"idefics3_image_prompt: rows={rows}, cols={cols}; expected both 0 (image not split) "
                             "or both >= 1")
    tokens = image_token * image_seq_len
    global_part = f"{fake_image_token}{global_image_token}{tokens}{fake_image_token}"
    if rows == 0:
        return global_part
    grid = "".join(
        "".join(f"{fake_image_token}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_part}"


def image_prompt(image: PreprocessedImage, cfg: ImageConfig) -> str:
    """The prompt text for a preprocessed image, as the model's HF processor expands its placeholder.

    The placeholder the text holds before expansion is ``<start_of_image>`` for gemma3 and ``<image>`` for
    idefics3; the returned text replaces it.
    """
    if not isinstance(image, PreprocessedImage):
        raise GGMLTypeError(f"image_prompt: image is {type(image).__name__}; expected a PreprocessedImage")
    if not isinstance(cfg, ImageConfig):
        raise GGMLTypeError(f"image_prompt: cfg is {type(cfg).__name__}; expected an ImageConfig")
    if cfg.projector_type == "gemma3":
        return gemma3_image_prompt(cfg.tokens_per_tile)
    return idefics3_image_prompt(image.rows, image.cols, cfg.tokens_per_tile)


def _check_prompt_int(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGMLTypeError(f"{name} is {v!r} ({type(v).__name__}); expected an integer >= {minimum}")
    if v < minimum:
        raise GGMLValueError(f"{name} is {v}; expected an integer >= {minimum}")
    return int(v)
