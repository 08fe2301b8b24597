"""Images in the runner's input stream (Ollama's multimodal inputs, llama.cpp's ``mtmd`` chunks).

An image enters a prompt as the rows of its embedding: one *chunk* of ``tokens_per_image`` rows per
encoded tile (Gemma 3: one tile; Idefics3, Llama 4: the tiles and the global image), or for an encoder
of images of any size (Pixtral) one chunk per row of its token grid (:meth:`~ggmlpy.vision.VisionModel.runs`).
In the prompt a chunk stands where the model's processor puts its image tokens: a run of the image token
id (Gemma 3's ``<image_soft_token>``, Idefics3's ``<image>``, Llama 4's ``<|patch|>``, Pixtral's
``[IMG]``), each run one chunk, in order.

Inside the runner each row of a chunk is a token id below ``-1``, unique to (image, row):
``-(2 + base + row)`` where the :class:`ImageStore` gives each distinct image (by the hash of its
pixels) a ``base``. The ids go through the token records unchanged, so prefix reuse compares images
by content, as Ollama compares the multimodal hash, and a same-batch group keeps each chunk whole in
one micro-batch. :mod:`.inputs` puts them in a prompt (:func:`~.inputs.place_images`). The embeddings
are computed on first use (:meth:`ImageStore.rows` with the runner step's encoder, on the compute
thread) and kept, a bounded number of images, so a prompt prefix with the same image is not encoded
again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np

from ggmlpy._core import GGMLValueError

__all__ = ["FIRST_IMAGE_ID", "MEDIA_MARKER", "ImageEntry", "ImageStore", "chunk_spans"]

#: where an image goes in a text prompt (llama.cpp's ``mtmd`` default marker)
MEDIA_MARKER = "<__media__>"
#: the largest id an image row takes (``-1`` is a token still being sampled)
FIRST_IMAGE_ID = -2


class ImageEntry:
    """One distinct image: its preprocessed tiles, their ids and (once encoded) their embeddings."""

    __slots__ = ("key", "base", "tiles", "n_rows", "embd")

    def __init__(self, key: bytes, base: int, tiles: np.ndarray, n_rows: int) -> None:
        self.key = key
        self.base = base
        self.tiles = tiles                   # float32 (n_tiles, 3, S, S); pixtral (1, 3, H, W)
        self.n_rows = n_rows
        self.embd: Optional[np.ndarray] = None   # float32 (n_rows, n_embd_text)


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

    @property
    def empty(self) -> bool:
        """Whether no image was ever added (no token can be an image row)."""
        return self._next == 0

    def add(self, tiles: np.ndarray, n_rows: Optional[int] = None) -> list[int]:
        """The row ids of an image with these preprocessed tiles (a new entry, or the one seen before):
        ``n_rows`` of them (default ``tokens_per_image`` per tile), in order."""
        tiles = np.ascontiguousarray(tiles, dtype=np.float32)
        h = hashlib.blake2b(repr(tiles.shape).encode(), digest_size=16)
        h.update(memoryview(tiles).cast("B"))
        key = h.digest()
        with self._lock:
            e = self._by_key.get(key)
            if e is None:
                rows = len(tiles) * self.rows_per_tile if n_rows is None else int(n_rows)
                e = ImageEntry(key, self._next, tiles, rows)
                self._next += e.n_rows
                self._by_key[key] = e
                self._bases.append(e.base)
                self._entries.append(e)
            else:
                e.tiles = tiles                  # kept for a re-encoding after its embeddings were dropped
        a = FIRST_IMAGE_ID - e.base
        return list(range(a, a - e.n_rows, -1))

    def locate(self, token_ids) -> tuple[list[ImageEntry], np.ndarray]:
        """The entry of each image row id and the row within it (one search for all of them).

        Raises
        ------
        GGMLValueError
            An id that is no row of an image this store knows.
        """
        idx, rows, entries = self.index(token_ids)
        return [entries[i] for i in idx.tolist()], rows

    def index(self, token_ids) -> tuple[np.ndarray, np.ndarray, list[ImageEntry]]:
        """:meth:`locate` in arrays: each id's entry as an index into the returned list of entries, and its row.

        Raises
        ------
        GGMLValueError
            An id that is no row of an image this store knows.
        """
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        k = FIRST_IMAGE_ID - ids
        with self._lock:
            entries = list(self._entries)
            bases = np.asarray(self._bases, np.int64)
        n_rows = np.array([e.n_rows for e in entries], np.int64)
        idx = np.searchsorted(bases, k, side="right") - 1
        safe = np.maximum(idx, 0)
        rows = k - bases[safe] if entries else np.full(len(k), -1, np.int64)
        bad = np.flatnonzero((idx < 0) | (rows < 0) | (rows >= (n_rows[safe] if entries else 0)))
        if bad.size:
            raise GGMLValueError(f"token id {int(ids[bad[0]])} is not an image row this runner knows")
        return idx, rows, entries

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

    def rows(self, token_ids: np.ndarray, encode: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> np.ndarray:
        """The embedding rows of image row ids, in order: float32 ``(len(token_ids), n_embd_text)``. An image
        not encoded yet (or whose embeddings were dropped) is encoded first by ``encode(tiles)`` (the
        vision encoder's :meth:`~ggmlpy.vision.VisionModel.run` on the runner's runtime, on the compute
        thread; its output read as rows), and kept."""
        entries, rows = self.locate(token_ids)
        out = []
        a = 0
        for b in range(1, len(entries) + 1):     # a run of one image's rows is copied at once
            if b == len(entries) or entries[b] is not entries[a]:
                e = entries[a]
                embd = e.embd
                if embd is None:
                    if encode is None:
                        raise GGMLValueError(f"image row {int(token_ids[a])}: its image is not encoded")
                    embd = np.asarray(encode(e.tiles), np.float32).reshape(e.n_rows, -1)
                    self.set_embd(e, embd)
                out.append(embd[rows[a:b]])
                with self._lock:
                    if e.key in self._encoded:
                        self._encoded.move_to_end(e.key)
                a = b
        return np.concatenate(out)


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
