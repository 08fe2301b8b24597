"""Encoded images (files, ``data:`` URLs, bytes) read as untrusted and decoded to RGB, as transformers' ``load_image``.

* only regular files are opened, non-blocking; at most a byte bound is read; only :data:`IMAGE_FORMATS`
  are tried; a pixel bound is checked from the header before anything is decoded. The bounds are the
  caller's arguments: :func:`ggmlpy.vision.preprocess.load_image` passes its module's ``MAX_IMAGE_BYTES``
  and ``MAX_IMAGE_PIXELS``, read at each call;
* the tests of a ``str`` image: its URL scheme, a ``file:`` URL's path.

Every refusal is an :class:`ImageError` naming the input. The module notes of
:mod:`ggmlpy.vision.preprocess` say what is read and how it differs from transformers.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from typing import TYPE_CHECKING, Optional

from ggmlpy._core import GGMLValueError

if TYPE_CHECKING:
    from PIL import Image as _PILImageModule

__all__ = ["IMAGE_FORMATS", "ImageError"]

#: The encoded formats decoded (Pillow's names): those the HF image processors are used with. Pillow tries
#: no other plugin, so a TIFF, PSD, ICO or EPS file (which would reach Ghostscript) is refused unread.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# Pillow's JPEG opener gives a multi-picture JPEG (as many cameras write) the format "MPO": still a JPEG.
_OPENED_FORMATS = frozenset(IMAGE_FORMATS) | {"MPO"}
_FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"


class ImageError(GGMLValueError):
    """An image input that cannot be read or decoded, or that is refused (a file that is not a regular file,
    over :data:`~ggmlpy.vision.preprocess.MAX_IMAGE_BYTES` or
    :data:`~ggmlpy.vision.preprocess.MAX_IMAGE_PIXELS`, not in :data:`IMAGE_FORMATS`, or a local file
    where local files are not allowed). The message names the input: its path (truncated), "image data URL"
    or "image bytes"; the runner adds ``image_index``, the image's place among a prompt's (see
    :meth:`ggmlpy.runner.Runner.submit`)."""


def _pil():
    """Pillow's ``Image`` and ``ImageOps`` modules, or an ImportError that says how to get them."""
    try:
        from PIL import Image, ImageOps
    except ImportError as e:
        raise ImportError("ggmlpy.vision needs Pillow to decode and resize images: pip install pillow") from e
    return Image, ImageOps


def _short(text: str, limit: int = 80) -> str:
    """``text`` quoted, its middle cut when long (a path's two ends say the most)."""
    if len(text) > limit:
        text = text[: limit // 2] + "..." + text[-(limit // 2 - 3):]
    return repr(text)


def _too_many_bytes(source: str, n: str, limit: int) -> ImageError:
    return ImageError(f"{source}: {n}, more than the {limit:,} bytes read for an image "
                      "(ggmlpy.vision.preprocess.MAX_IMAGE_BYTES)")


def _pixel_limit(Image, max_pixels: int) -> int:
    """The most pixels decoded: ``max_pixels``, or Pillow's own limit when that is lower."""
    pil = getattr(Image, "MAX_IMAGE_PIXELS", None)
    return max_pixels if pil is None else min(max_pixels, int(pil))


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


def _decode(data, source: str, max_pixels: int) -> _PILImageModule.Image:
    """Decode encoded image bytes as HF's ``load_image`` does for a file: EXIF orientation, then RGB.

    Only :data:`IMAGE_FORMATS` are tried, and the size the header declares is checked against the pixel
    bound (``max_pixels``, or Pillow's own when lower) before anything is decoded (``Image.open`` reads
    only the header).
    """
    Image, ImageOps = _pil()
    from PIL import UnidentifiedImageError

    if not len(data):
        raise ImageError(f"{source}: empty (0 bytes); expected an encoded image ({_FORMAT_NAMES})")
    limit = _pixel_limit(Image, max_pixels)
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


def _data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (RFC 2397), as chat messages carry images.

    The payload's length is checked against ``max_bytes`` before it is decoded.
    """
    source = "image data URL"
    head, sep, data = url.partition(",")
    if not sep:
        raise ImageError(f"{source}: no ',' ({_short(url, 40)}); expected data:image/png;base64,...")
    limit = max_bytes
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


def _read_file(path: str, source: str, max_bytes: int) -> bytes:
    """A regular file's bytes, at most ``max_bytes``; nothing else is opened, nothing blocks."""
    limit = max_bytes
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
