"""Images in the runner's input stream (Ollama's multimodal inputs, llama.cpp's ``mtmd`` chunks).

An image enters a prompt as the rows of its embedding: one *chunk* of ``tokens_per_image`` rows per
encoded tile (Gemma 3: one tile; Idefics3: the tiles and the global image). In the prompt a chunk
stands where the model's processor puts its image tokens: a run of the image token id (Gemma 3's
``<image_soft_token>``, Idefics3's ``<image>``), each run one chunk, in order.

Inside the runner each row of a chunk is a token id below ``-1``, unique to (image, row):
``-(2 + base + row)`` where the :class:`ImageStore` gives each distinct image (by the hash of its
pixels) a ``base``. The ids go through the token records unchanged, so prefix reuse compares images
by content, as Ollama compares the multimodal hash, and a same-batch group keeps each chunk whole in
one micro-batch. The embeddings are computed on first use through the runner's scheduler (the compute
thread) and kept, a bounded number of images, so a prompt prefix with the same image is not encoded
again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ggmlpy._core import GGMLValueError

__all__ = ["FIRST_IMAGE_ID", "MEDIA_MARKER", "ImageEntry", "ImageStore", "chat_images", "chunk_spans",
           "place_images"]

#: where an image goes in a text prompt (llama.cpp's ``mtmd`` default marker)
MEDIA_MARKER = "<__media__>"
#: the largest id an image row takes (``-1`` is a token still being sampled)
FIRST_IMAGE_ID = -2


class ImageEntry:
    """One distinct image: its preprocessed tiles, their ids and (once encoded) their embeddings."""

    __slots__ = ("key", "base", "tiles", "n_rows", "embd")

    def __init__(self, key: bytes, base: int, tiles: np.ndarray, rows_per_tile: int) -> None:
        self.key = key
        self.base = base
        self.tiles = tiles                   # float32 (n_tiles, 3, S, S)
        self.n_rows = len(tiles) * rows_per_tile
        self.embd: Optional[np.ndarray] = None   # float32 (n_rows, n_embd_text)

    def ids(self, first_row: int, n: int) -> list[int]:
        """The token ids of rows ``first_row .. first_row + n - 1``."""
        a = FIRST_IMAGE_ID - self.base - first_row
        return list(range(a, a - n, -1))


class ImageStore:
    """The images a runner has seen: ids by content, embeddings kept for the ``keep`` most recent.

    Thread-safe (requests add images from their threads, the compute thread encodes).
    """

    def __init__(self, rows_per_tile: int, keep: int = 32) -> None:
        self.rows_per_tile = int(rows_per_tile)
        self.keep = int(keep)
        self._by_key: dict[bytes, ImageEntry] = {}
        self._bases: list[int] = []              # ascending, one per entry
        self._entries: list[ImageEntry] = []
        self._next = 0
        self._encoded: OrderedDict = OrderedDict()    # entries holding embeddings, least recent first
        self._lock = threading.Lock()
        self.n_encoded = 0                      # images encoded so far (diagnostics, tests)

    def add(self, tiles: np.ndarray) -> ImageEntry:
        """The entry of an image with these preprocessed tiles (a new one, or the one seen before)."""
        tiles = np.ascontiguousarray(tiles, dtype=np.float32)
        h = hashlib.blake2b(repr(tiles.shape).encode(), digest_size=16)
        h.update(memoryview(tiles).cast("B"))
        key = h.digest()
        with self._lock:
            e = self._by_key.get(key)
            if e is None:
                e = ImageEntry(key, self._next, tiles, self.rows_per_tile)
                self._next += e.n_rows
                self._by_key[key] = e
                self._bases.append(e.base)
                self._entries.append(e)
            else:
                e.tiles = tiles                  # kept for a re-encoding after its embeddings were dropped
            return e

    def locate(self, token_ids) -> tuple[list[ImageEntry], np.ndarray]:
        """The entry of each image row id and the row within it (one search for all of them).

        Raises
        ------
        GGMLValueError
            An id that is no row of an image this store knows.
        """
        k = FIRST_IMAGE_ID - np.asarray(token_ids, np.int64).reshape(-1)
        with self._lock:
            idx = np.searchsorted(np.asarray(self._bases, np.int64), k, side="right") - 1
            entries = [self._entries[i] if i >= 0 else None for i in idx.tolist()]
        rows = np.array([kk - e.base if e is not None else -1 for kk, e in zip(k.tolist(), entries)], np.int64)
        bad = [i for i, (e, r) in enumerate(zip(entries, rows.tolist())) if e is None or not 0 <= r < e.n_rows]
        if bad:
            raise GGMLValueError(f"token id {int(np.asarray(token_ids).reshape(-1)[bad[0]])} is not an image row "
                                 f"this runner knows")
        return entries, rows

    def missing(self, token_ids: np.ndarray) -> list[ImageEntry]:
        """The entries of these image rows whose embeddings are not computed (each once)."""
        entries, _ = self.locate(token_ids)
        return list({id(e): e for e in entries if e.embd is None}.values())

    def set_embd(self, e: ImageEntry, embd: np.ndarray) -> None:
        """Store an image's embeddings; the least recently used beyond ``keep`` are dropped."""
        with self._lock:
            e.embd = embd
            self.n_encoded += 1
            self._encoded[e.key] = e
            self._encoded.move_to_end(e.key)
            while len(self._encoded) > self.keep:
                _, old = self._encoded.popitem(last=False)
                old.embd = None

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding rows of image row ids, in order: float32 ``(len(token_ids), n_embd_text)``."""
        entries, rows = self.locate(token_ids)
        out = []
        a = 0
        for b in range(1, len(entries) + 1):     # a run of one image's rows is copied at once
            if b == len(entries) or entries[b] is not entries[a]:
                e = entries[a]
                embd = e.embd
                if embd is None:
                    raise GGMLValueError(f"image row {int(token_ids[a])}: its image is not encoded")
                out.append(embd[rows[a:b]])
                with self._lock:
                    if e.key in self._encoded:
                        self._encoded.move_to_end(e.key)
                a = b
        return np.concatenate(out)


def place_images(tokens: Sequence[int], entries: Sequence[ImageEntry], image_token: int, rows_per_tile: int,
                 what: str = "submit") -> tuple[list[int], list[int]]:
    """Put the images' rows where the prompt has its runs of ``image_token``; also the same-batch markers.

    Each run of the image token id is one chunk (tile) of ``rows_per_tile`` rows, taken in order from
    the images' tiles. Returns ``(tokens, same_batch)``.

    Raises
    ------
    GGMLValueError
        A run of another length, or fewer or more runs than the images have tiles.
    """
    toks = [int(t) for t in tokens]
    chunks = [(e, i * rows_per_tile) for e in entries for i in range(e.n_rows // rows_per_tile)]
    out, sb = list(toks), [0] * len(toks)
    i, k, n = 0, 0, len(toks)
    while i < n:
        if toks[i] != image_token:
            i += 1
            continue
        j = i
        while j < n and toks[j] == image_token:
            j += 1
        if k >= len(chunks):
            raise GGMLValueError(f"{what}: the prompt has more image placeholders than the {len(entries)} image(s) "
                                 f"fill ({len(chunks)} tile(s) of {rows_per_tile} image tokens)")
        if j - i != rows_per_tile:
            raise GGMLValueError(f"{what}: a run of {j - i} image tokens (id {image_token}) at index {i}; each image "
                                 f"tile takes exactly {rows_per_tile}")
        e, first = chunks[k]
        out[i:j] = e.ids(first, rows_per_tile)
        sb[i] = rows_per_tile - 1
        k += 1
        i = j
    if k != len(chunks):
        raise GGMLValueError(f"{what}: {len(entries)} image(s) ({len(chunks)} tile(s)) but the prompt has {k} image "
                             f"placeholder run(s) of {rows_per_tile} image tokens (id {image_token})")
    return out, sb


def chunk_spans(tokens: np.ndarray, rows_per_tile: int, store: ImageStore) -> list[tuple[int, int]]:
    """The ``(first_row, end_row)`` of each image chunk in a micro-batch's tokens (for bidirectional attention)."""
    at = np.flatnonzero(tokens <= FIRST_IMAGE_ID)
    if at.size == 0:
        return []
    _, rows = store.locate(tokens[at])
    # a chunk starts at a tile's first row, or where the image rows are not consecutive in the batch
    start = (rows % rows_per_tile == 0) | np.r_[True, np.diff(at) != 1]
    first = at[start]
    last = np.r_[at[np.flatnonzero(start)[1:] - 1], at[-1]] + 1
    return list(zip(first.tolist(), last.tolist()))


def chat_images(messages: Sequence, what: str, allow_local_files: bool = False) -> tuple[list, list]:
    """The images of a chat's messages, in order, and the messages with each image part as ``{"type": "image"}``.

    Image parts as transformers' processors take them (``{"type": "image", "image": ...}``, or ``"url"`` /
    ``"path"`` instead of ``"image"``) and as OpenAI's chat API sends them (``{"type": "image_url",
    "image_url": {"url": ...}}``); the value is anything :func:`ggmlpy.vision.preprocess.load_image` reads
    (a ``data:`` URL too). Chat templates written for vision models render ``{"type": "image"}`` as the
    model's image placeholder. Messages without image parts are returned as they are.

    Messages may come from someone other than the caller (a server relays them), so an image part that
    names a local file (a path or a ``file://`` URL) is refused here, before anything is read or looked
    up, unless ``allow_local_files`` (the same error whether the file exists or not); see
    :func:`ggmlpy.vision.preprocess.check_source`.

    Raises
    ------
    GGMLValueError
        An image part without an image.
    ggmlpy.vision.preprocess.ImageError
        An image part naming a local file while ``allow_local_files`` is false.
    """
    out: list = []
    images: list[Any] = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                src = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
            elif kind == "image_url":
                src = part.get("image_url")
                if isinstance(src, Mapping):
                    src = src.get("url")
            else:
                parts.append(part)
                continue
            if src is None:
                raise GGMLValueError(f"{what}: an {kind} part without an image (give it 'image', 'url' or 'path'; "
                                     f"OpenAI's form is {{'type': 'image_url', 'image_url': {{'url': ...}}}})")
            if not allow_local_files:
                from ggmlpy.vision.preprocess import check_source

                check_source(src, allow_local_files=False, what=what)
            images.append(src)
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images
