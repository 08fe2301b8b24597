"""Hostile image inputs (issue 33, item 4): what ``load_image`` reads, how much, in which formats, and which
local files a chat message may name.

* Only regular files are opened: devices (``/dev/zero``, ``file:///dev/urandom``), FIFOs, sockets and
  directories give an :class:`ImageError` at once. These run in a child process with an address-space
  limit and a timeout per input, so a regression ends as a failure, never as a hang or an exhausted machine.
* At most ``MAX_IMAGE_BYTES`` are read, from a file, a ``data:`` URL or bytes alike.
* Only PNG, JPEG, WebP, GIF and BMP are tried: TIFF, ICO, PSD, TGA, PPM and EPS (whose loader runs
  Ghostscript) are refused without their decoder ever running.
* An image declaring more than ``MAX_IMAGE_PIXELS`` is refused from its header, before a pixel is decoded
  (small files declaring 64 to 400 megapixels, in every accepted format), and a child process shows the
  peak RSS stays flat.
* A chat message naming a local file (path or ``file://`` URL) is refused unless the caller passes
  ``allow_local_files=True``, with the same error whether the file exists or not.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import pathlib
import socket
import struct
import sys
import urllib.parse
import warnings
import zlib

import numpy as np
import pytest
from helpers import run_child

from ggmlpy import GGMLValueError
from ggmlpy.runner.inputs import chat_images
from ggmlpy.vision.preprocess import ImageError, load_image

# the module (ggmlpy.vision's attribute "preprocess" is the function of that name)
pp = importlib.import_module("ggmlpy.vision.preprocess")

Image = pytest.importorskip("PIL.Image")

LINUX = sys.platform.startswith("linux")


# ---------------------------------------------------------------------------------------------------------------
# small files, written by hand where Pillow cannot write them (or not with a lying header)
# ---------------------------------------------------------------------------------------------------------------

def _png(width: int, height: int, rows=None) -> bytes:
    """A greyscale PNG of zeros: ``rows`` rows of image data (all of them by default), compressed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    c = zlib.compressobj(1)
    n = (width + 1) * (height if rows is None else rows)     # each row: filter byte 0, then the pixels
    block = bytes(1 << 20)
    parts = []
    while n > 0:
        parts.append(c.compress(block[:min(n, len(block))]))
        n -= len(block)
    parts.append(c.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def _gif(width: int, height: int, frame=(1, 1)) -> bytes:
    """A GIF whose logical screen is ``width x height`` holding one frame declared ``frame`` with one pixel
    of data (a 35-byte file)."""
    return (b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00" + b"\xff\xff\xff\x00\x00\x00"
            + b"\x2c" + struct.pack("<HHHH", 0, 0, *frame) + b"\x00" + b"\x02\x02\x44\x01\x00" + b"\x3b")


def _bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP's headers declaring ``width x height``, without its pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    size = 14 + len(info) + ((width * 3 + 3) // 4 * 4) * height
    return b"BM" + struct.pack("<IHHI", min(size, 2**32 - 1), 0, 0, 14 + len(info)) + info


def _jpeg_declaring(width: int, height: int, segments: int = 0) -> bytes:
    """A 16x16 JPEG whose frame header (SOF0) is rewritten to declare ``width x height``, after
    ``segments`` more empty APP5 segments."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    at = data.index(b"\xff\xc0")       # marker, length (2), precision (1), height (2), width (2)
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data[:2]) + b"\xff\xe5\x00\x02" * segments + bytes(data[2:])


def _webp_declaring(width: int, height: int) -> bytes:
    """The first 30 bytes of an extended WebP file (RIFF, VP8X chunk) declaring a ``width x height`` canvas."""
    vp8x = b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _psd(width: int = 4, height: int = 4) -> bytes:
    """A minimal uncompressed RGB Photoshop file (Pillow reads PSD but does not write it)."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3)
    sections = struct.pack(">III", 0, 0, 0)       # colour mode data, image resources, layers: all empty
    return header + sections + struct.pack(">H", 0) + bytes(3 * width * height)


def _saved(fmt: str, mode: str = "RGB", size=(8, 8), **kw) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def huge_png(tmp_path_factory) -> pathlib.Path:
    """A 97-436 KB PNG of 10000 x 10000 zeros (100 megapixels: over MAX_IMAGE_PIXELS, under Pillow's error)."""
    path = tmp_path_factory.mktemp("huge") / "huge.png"
    path.write_bytes(_png(10000, 10000))
    return path


# ---------------------------------------------------------------------------------------------------------------
# only regular files, and nothing blocks: in a child process, with a memory limit and a timeout per input
# ---------------------------------------------------------------------------------------------------------------

_CHILD = r"""
import json, os, resource, sys, threading, time
from ggmlpy.vision.preprocess import load_image

# an input read without end fails with MemoryError after 1 GiB more, instead of exhausting the machine
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))
cases = json.loads(sys.argv[1])
out = {}
for name, source in cases.items():
    box = {}

    def run():
        t = time.perf_counter()
        try:
            load_image(source)
            box["r"] = ["ok", ""]
        except BaseException as e:
            box["r"] = [type(e).__name__, str(e)[:400]]
        box["s"] = time.perf_counter() - t

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(float(sys.argv[2]))        # a hang (a FIFO with no writer) shows as "timeout"
    out[name] = box.get("r", ["timeout", ""]) + [box.get("s", -1.0)]
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)                            # a thread still blocked does not keep the child alive
"""


@pytest.fixture(scope="module")
def special_files(tmp_path_factory):
    """What ``load_image`` gives for each special file, run in one child process: name -> (error type,
    message, seconds)."""
    if not LINUX:
        pytest.skip("device files and /proc are Linux's")
    d = tmp_path_factory.mktemp("special")
    fifo = d / "pipe.png"
    os.mkfifo(fifo)
    (d / "zero.png").symlink_to("/dev/zero")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock.png"))
    cases = {
        "/dev/zero": "/dev/zero",
        "file:///dev/urandom": "file:///dev/urandom",
        "/dev/null": "/dev/null",
        "symlink to /dev/zero": str(d / "zero.png"),
        "FIFO": str(fifo),
        "FIFO as file URL": fifo.as_uri(),
        "directory": str(d),
        "socket": str(d / "sock.png"),
    }
    try:
        r = run_child(_CHILD, json.dumps(cases), 5, timeout=120)
    finally:
        sock.close()
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, kind", [
    ("/dev/zero", "a character device"),
    ("file:///dev/urandom", "a character device"),
    ("/dev/null", "a character device"),
    ("symlink to /dev/zero", "a character device"),
    ("FIFO", "a FIFO"),
    ("FIFO as file URL", "a FIFO"),
    ("directory", "a directory"),
    ("socket", "a socket"),
])
def test_only_regular_files_are_opened(special_files, name, kind):
    """A device, FIFO, socket or directory is refused from its stat within a second: never read without end
    (old: MemoryError after reading /dev/zero whole), never blocked on (old: a FIFO hung forever)."""
    error, message, seconds = special_files[name]
    assert error == "ImageError", (error, message)
    assert f"{kind}; only regular files are read" in message
    assert 0 <= seconds < 1.0


def test_a_file_over_the_byte_bound_is_refused_unread(tmp_path, monkeypatch):
    """A file over MAX_IMAGE_BYTES is refused from its size (a sparse file: nothing on disk, nothing read);
    a smaller bound applies to files, data URLs and bytes alike, before anything is decoded."""
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.truncate(pp.MAX_IMAGE_BYTES + 1)
    with pytest.raises(ImageError, match=f"{pp.MAX_IMAGE_BYTES + 1:,} bytes, more than the "
                                         f"{pp.MAX_IMAGE_BYTES:,} bytes read"):
        load_image(big)
    assert pp.MAX_IMAGE_BYTES == 64 * 2**20     # the documented bound

    data = _saved("PNG", size=(64, 64))
    path = tmp_path / "x.png"
    path.write_bytes(data)
    monkeypatch.setattr(pp, "MAX_IMAGE_BYTES", len(data) - 1)
    for source in (path, path.as_uri(), data, bytearray(data), memoryview(data), _data_url(data),
                   "data:image/png," + urllib.parse.quote_from_bytes(data)):
        with pytest.raises(ImageError, match="MAX_IMAGE_BYTES"):
            load_image(source)
    # a data URL too long to fit is refused before its payload is decoded
    with pytest.raises(ImageError, match="characters of base64"):
        load_image(_data_url(data + bytes(100)))
    monkeypatch.setattr(pp, "MAX_IMAGE_BYTES", len(data))
    assert load_image(path).size == (64, 64)        # exactly the bound is fine
    assert load_image(_data_url(data)).size == (64, 64)


# ---------------------------------------------------------------------------------------------------------------
# formats: an allow-list given to Pillow
# ---------------------------------------------------------------------------------------------------------------

REFUSED_FORMATS = {
    "TIFF": lambda: _saved("TIFF"),
    "ICO": lambda: _saved("ICO", size=(16, 16)),
    "PSD": _psd,
    "TGA": lambda: _saved("TGA"),
    "PPM": lambda: _saved("PPM"),
    "EPS": lambda: _saved("EPS"),
}


@pytest.mark.parametrize("fmt", REFUSED_FORMATS)
def test_other_formats_are_refused_unread(fmt, tmp_path, monkeypatch):
    """Formats outside PNG, JPEG, WebP, GIF and BMP are refused (old: decoded), whatever the file is
    called, and no other decoder runs: an EPS file never reaches Ghostscript."""
    from PIL import EpsImagePlugin, ImageFile

    data = REFUSED_FORMATS[fmt]()
    assert Image.open(io.BytesIO(data)).format == fmt      # Pillow itself would read it
    decoded = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: decoded.append("gs"))
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.format) or real_load(self))
    path = tmp_path / "image.png"
    path.write_bytes(data)
    for source, name in ((data, "image bytes"), (_data_url(data), "image data URL"), (path, "image.png")):
        with pytest.raises(ImageError, match="not a PNG, JPEG, WebP, GIF or BMP file") as ei:
            load_image(source)
        assert name in str(ei.value)
    assert decoded == []


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "MPO"])
def test_accepted_formats(fmt, tmp_path):
    """The five formats decode, whatever the file's name; a multi-picture JPEG (MPO, as cameras write) is a
    JPEG."""
    from PIL import features

    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("Pillow without WebP")
    if fmt == "MPO":
        buf = io.BytesIO()
        Image.new("RGB", (8, 6), (1, 2, 3)).save(buf, format="MPO", save_all=True,
                                                   append_images=[Image.new("RGB", (8, 6))])
        data = buf.getvalue()
        assert Image.open(io.BytesIO(data)).format == "MPO"
    else:
        data = _saved(fmt, size=(8, 6), **({"lossless": True} if fmt == "WEBP" else {}))
    path = tmp_path / "named.tiff"        # the name does not matter, the content does
    path.write_bytes(data)
    for source in (data, path, _data_url(data)):
        img = load_image(source)
        assert img.mode == "RGB" and img.size == (8, 6)


# ---------------------------------------------------------------------------------------------------------------
# the pixel bound: checked from the header, before decoding
# ---------------------------------------------------------------------------------------------------------------

DECLARING = {   # small inputs declaring more than MAX_IMAGE_PIXELS (50 million): name -> (make, size)
    "PNG 10000x10000": (None, (10000, 10000)),                  # the huge_png fixture (valid, all rows)
    "PNG 20000x20000": (lambda: _png(20000, 20000, rows=16), (20000, 20000)),
    "PNG 60000000x1": (lambda: _png(60_000_000, 1, rows=0), (60_000_000, 1)),
    "GIF 8000x8000": (lambda: _gif(8000, 8000), (8000, 8000)),
    "BMP 8000x8000": (lambda: _bmp_header(8000, 8000), (8000, 8000)),
    "JPEG 8000x8000": (lambda: _jpeg_declaring(8000, 8000), (8000, 8000)),
    "WebP 12000x12000": (lambda: _webp_declaring(12000, 12000), (12000, 12000)),
    # where the header read before Pillow says less, the size Pillow opens is checked before decoding
    "GIF 1x1 screen, 8000x8000 frame": (lambda: _gif(1, 1, frame=(8000, 8000)), (8000, 8000)),
    "JPEG 8000x8000 after 300 segments": (lambda: _jpeg_declaring(8000, 8000, segments=300), (8000, 8000)),
}


@pytest.mark.parametrize("case", DECLARING)
def test_too_many_pixels_is_refused_before_decoding(case, huge_png, monkeypatch):
    """Over MAX_IMAGE_PIXELS: refused from the header, naming the size, and no decoder runs (old: a
    100-megapixel PNG decoded, +384 MiB; the others failed only after allocating, or decoded)."""
    from PIL import ImageFile

    make, (w, h) = DECLARING[case]
    data = huge_png.read_bytes() if make is None else make()
    assert len(data) < 500_000
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.format))
    for source in (data, _data_url(data)):
        with pytest.raises(ImageError, match="too large") as ei, warnings.catch_warnings():
            # the header is checked before Pillow's opener, which would warn (or allocate, for WebP)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            load_image(source)
        msg = str(ei.value)
        assert "refused before decoding" in msg
        assert f"{w}x{h} = {w * h:,} pixels, more than the 50,000,000" in msg
    assert decoded == []


def test_pixel_bound_follows_pillow_when_lower(monkeypatch, recwarn):
    """Pillow's own limit, when lower, is the bound: an image over it is refused whether Pillow would only
    warn (old: decoded) or raise, and Pillow never warns (the header is checked first); an image at the
    bound decodes. With Pillow's check off, the module's bound still holds."""
    data = _saved("PNG", size=(40, 30))                       # 1200 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)      # Pillow: warns over 1000, raises over 2000
    with pytest.raises(ImageError, match="1,200 pixels, more than the 1,000"):
        load_image(data)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1200)
    assert load_image(data).size == (40, 30)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)      # Pillow's check off: ours still holds
    monkeypatch.setattr(pp, "MAX_IMAGE_PIXELS", 1199)
    with pytest.raises(ImageError, match="too large"):
        load_image(data)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
    assert pp.MAX_IMAGE_PIXELS == 1199 and Image.MAX_IMAGE_PIXELS is None


@pytest.mark.skipif(not LINUX, reason="peak RSS from getrusage is in KiB on Linux")
def test_refusing_a_huge_image_takes_no_memory(huge_png):
    """In a fresh process, refusing the 100-megapixel PNG (as a path and as a data URL) raises the peak RSS
    by under 32 MiB (old: the image decoded, +400 MiB or more)."""
    code = r"""
    import base64, io, json, resource, sys
    from PIL import Image
    from ggmlpy.vision.preprocess import load_image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    load_image(buf.getvalue())                      # plugins imported, caches warm
    path = sys.argv[1]
    url = "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = []
    for source in (path, url):
        try:
            load_image(source)
            out.append("decoded")
        except Exception as e:
            out.append(type(e).__name__ + ": " + str(e)[:200])
    print(json.dumps([out, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024]))
    """
    r = run_child(code, huge_png, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    results, peak_mib = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(x.startswith("ImageError") and "too large" in x for x in results), results
    assert peak_mib < 32, peak_mib


# ---------------------------------------------------------------------------------------------------------------
# local files in chat messages
# ---------------------------------------------------------------------------------------------------------------

FORMS = {   # the ways a chat message can name a file
    "path": lambda p: {"type": "image", "path": str(p)},
    "url": lambda p: {"type": "image", "url": pathlib.Path(p).as_uri()},
    "image": lambda p: {"type": "image", "image": str(p)},
    "pathlib": lambda p: {"type": "image", "image": pathlib.Path(p)},
    "image_url path": lambda p: {"type": "image_url", "image_url": {"url": str(p)}},
    "image_url file url": lambda p: {"type": "image_url", "image_url": {"url": pathlib.Path(p).as_uri()}},
    "image_url localhost": lambda p: {"type": "image_url", "image_url": {"url": "FILE://localhost" + str(p)}},
}


def _chat(part) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in "}, part]}]


def _refusal(messages, **kw) -> str:
    with pytest.raises(ImageError, match=r"allow_local_files=True") as ei:
        chat_images(messages, "submit_chat", **kw)
    return str(ei.value)


@pytest.mark.parametrize("form", FORMS)
def test_chat_messages_name_no_local_file_by_default(form, tmp_path):
    """A message naming a local file is refused unless allow_local_files=True (old: read any file), and the
    error is the same for a file that exists, one that does not, a directory or a device: it tells the
    sender nothing about the file system."""
    existing = tmp_path / "aaaa.png"
    existing.write_bytes(_saved("PNG"))
    missing = tmp_path / "bbbb.png"
    make = FORMS[form]
    a = _refusal(_chat(make(existing)))
    b = _refusal(_chat(make(missing)))
    assert a.replace("aaaa", "bbbb") == b
    for other in (tmp_path, "/dev/zero", "/etc/passwd"):
        msg = _refusal(_chat(make(other)))
        for telling in ("no such file", "directory", "device", "permission", "decode", "regular"):
            assert telling not in msg
    msgs, images = chat_images(_chat(make(existing)), "submit_chat", allow_local_files=True)
    assert len(images) == 1 and msgs[0]["content"][1] == {"type": "image"}
    assert load_image(images[0]).size == (8, 8)


def test_chat_messages_take_image_data_always():
    """A data URL, encoded bytes, a PIL image or an array is always taken; an http URL is left to
    load_image, which refuses it without downloading."""
    png = _saved("PNG")
    parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}},
             {"type": "image", "url": "DATA:image/png;base64," + base64.b64encode(png).decode()},
             {"type": "image", "image": png}, {"type": "image", "image": Image.new("RGB", (3, 3))},
             {"type": "image", "image": np.zeros((3, 3, 3), np.uint8)},
             {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]
    _, images = chat_images([{"role": "user", "content": parts}], "chat")
    assert len(images) == len(parts)
    for im in images[:-1]:
        assert load_image(im, allow_local_files=False).mode == "RGB"
    with pytest.raises(ImageError, match="does not download"):
        load_image(images[-1], allow_local_files=False)


def test_load_image_and_preprocess_take_the_same_switch(tmp_path):
    """load_image and preprocess read paths by default (the caller's own argument) and refuse them with
    allow_local_files=False, before looking the file up."""
    path = tmp_path / "x.png"
    path.write_bytes(_saved("PNG", size=(30, 20)))
    cfg = pp.ImageConfig(projector_type="gemma3", image_size=28, patch_size=14, image_mean=(0.5,) * 3,
                         image_std=(0.5,) * 3, scale_factor=1)
    assert load_image(path).size == (30, 20) and pp.preprocess(str(path), cfg).n_tiles == 1
    for source in (path, str(path), path.as_uri(), str(tmp_path / "missing.png")):
        with pytest.raises(ImageError, match="allow_local_files=True"):
            load_image(source, allow_local_files=False)
        with pytest.raises(ImageError, match="allow_local_files=True"):
            pp.preprocess(source, cfg, allow_local_files=False)
    with pytest.raises(ImageError, match="on host 'example.com'"):
        load_image("file://example.com/etc/passwd")


@pytest.fixture(scope="module")
def text_runner(tmp_path_factory):
    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import write_synthetic
    from ggmlpy.runner import Runner

    path = write_synthetic(tmp_path_factory.mktemp("img") / "tiny.gguf", "tiny", "F16", seed=3)
    with load_model(path, devices="cpu") as model, Runner(model, n_ctx=64) as rt:
        yield rt


def test_runner_chat_entry_points_refuse_local_files(text_runner, tmp_path):
    """Runner.chat_prompt, submit_chat and chat refuse a message naming a local file by default, before the
    template runs; allow_local_files=True lets it through (to the next check: this model has no tokenizer)."""
    path = tmp_path / "x.png"
    path.write_bytes(_saved("PNG"))
    template = "{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"
    rt = text_runner
    for call in (rt.chat_prompt, rt.submit_chat, rt.chat):
        for part in (FORMS["path"](path), FORMS["url"](path)):
            with pytest.raises(ImageError, match="allow_local_files=True"):
                call(_chat(part), template=template)
            with pytest.raises(GGMLValueError) as ei:
                call(_chat(part), template=template, allow_local_files=True)
            assert not isinstance(ei.value, ImageError)
