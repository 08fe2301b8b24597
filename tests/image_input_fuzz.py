"""Fuzz ``ggmlpy.vision.preprocess.load_image`` with damaged encoded images (issue 33, item 4).

Small valid images of the accepted formats (PNG, JPEG, WebP, GIF, BMP) and of refused ones (TIFF, ICO,
PSD-like, EPS) get random damage: flipped bytes, truncation, and header sizes rewritten to random values
up to 2**32 - 1. Every case must give an image or an ``ImageError``, within ``--max-seconds``, and the
process's peak RSS must stay under ``--max-rss-mib``: a size declared in a header is never allocated past
``MAX_IMAGE_PIXELS``. Run as a script::

    python tests/image_input_fuzz.py --cases 20000 --seed 1
"""

from __future__ import annotations

import argparse
import io
import random
import resource
import struct
import sys
import time
import warnings


def _seeds():
    from PIL import Image, features

    rng = random.Random(0)
    img = Image.frombytes("RGB", (23, 17), bytes(rng.randrange(256) for _ in range(23 * 17 * 3)))
    out = {}
    for fmt, kw in (("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("GIF", {}), ("BMP", {}),
                    ("WEBP", {}), ("WEBP", {"lossless": True}), ("TIFF", {}), ("ICO", {}), ("EPS", {})):
        if fmt == "WEBP" and not features.check("webp"):
            continue
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        out[f"{fmt}{kw or ''}"] = buf.getvalue()
    return out


def _size_fields(data: bytes):
    """(offset, struct format) of the header fields holding a size, per format."""
    if data.startswith(b"\x89PNG"):
        return [(16, ">I"), (20, ">I")]
    if data.startswith(b"GIF"):
        return [(6, "<H"), (8, "<H")]
    if data.startswith(b"BM"):
        return [(18, "<i"), (22, "<i")]
    if data.startswith(b"\xff\xd8"):
        at = data.find(b"\xff\xc0")
        at = data.find(b"\xff\xc2") if at < 0 else at
        return [(at + 5, ">H"), (at + 7, ">H")] if at >= 0 else []
    if data.startswith(b"RIFF"):
        return [(24, "<I"), (21, "<I")]
    return []


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:                                   # rewrite the declared size
        for at, fmt in _size_fields(data):
            n = struct.calcsize(fmt)
            if at + n <= len(b):
                hi = 2 ** (8 * n - (1 if fmt[-1].islower() and fmt[-1] != "b" else 0)) - 1
                b[at:at + n] = struct.pack(fmt, rng.choice([0, 1, rng.randrange(hi + 1), hi, 8000, 65535]))
    elif kind == 1:                                 # flip bytes, mostly near the header
        for _ in range(rng.randrange(1, 8)):
            i = min(len(b) - 1, int(rng.expovariate(1 / 64)))
            b[i] = rng.randrange(256)
    elif kind == 2 and len(b) > 1:                  # truncate
        del b[rng.randrange(1, len(b)):]
    elif kind == 3:                                 # two of the above
        return _mutate(rng, _mutate(rng, data))
    return bytes(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, default=2.0, help="per case")
    ap.add_argument("--max-rss-mib", type=float, default=1024.0, help="peak RSS growth over the run")
    args = ap.parse_args(argv)

    from ggmlpy.vision.preprocess import ImageError, load_image

    warnings.simplefilter("ignore")                 # Pillow's warnings about damaged files are expected
    seeds = _seeds()
    names = sorted(seeds)
    rng = random.Random(args.seed)
    load_image(seeds["PNG"])                        # plugins imported before the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    counts = {"decoded": 0, "ImageError": 0}
    slowest = 0.0
    for case in range(args.cases):
        name = rng.choice(names)
        data = _mutate(rng, seeds[name])
        t = time.perf_counter()
        try:
            load_image(data)
            counts["decoded"] += 1
        except ImageError:
            counts["ImageError"] += 1
        except Exception as e:                      # anything else is a defect
            print(f"case {case} ({name}): {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        dt = time.perf_counter() - t
        slowest = max(slowest, dt)
        if dt > args.max_seconds:
            print(f"case {case} ({name}): {dt:.2f} s", file=sys.stderr)
            return 1
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    print(f"{args.cases} cases (seed {args.seed}): {counts['decoded']} decoded, {counts['ImageError']} "
          f"ImageError, other errors 0; slowest {slowest * 1000:.0f} ms; peak RSS +{grown:.0f} MiB")
    return 0 if grown <= args.max_rss_mib else 1


if __name__ == "__main__":
    sys.exit(main())
