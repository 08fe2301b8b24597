"""The four positions a token of a multi-section RoPE model (Qwen-VL, :mod:`ggmlpy.models.qwenvl`) rotates by.

The cache keeps one position per token, its index in the sequence, which orders attention as transformers'
``cache_position`` does. The rotary positions follow transformers' ``get_rope_index`` instead:

- a text token: its index plus the sequence's *offset*, in all four;
- an image token at row ``r``, column ``c`` of its merged grid, the image's first token at index ``i``:
  ``t = i + offset``, then ``(t, t + r, t + c, t)``;
- after an image's last token the offset grows by ``max(rows, cols) - rows * cols``: the image takes as
  many positions as its longer side, not one per token.

The offset before a micro-batch comes from the sequence's record (the tokens the cache holds before it: image
rows are ids below ``-1``, :mod:`.images`); a micro-batch may start or end inside an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import numpy as np

from .images import FIRST_IMAGE_ID, ImageStore

__all__ = ["mrope_positions"]


def _image_rows(tokens: np.ndarray, store: ImageStore, grid: Callable) -> tuple:
    """For the image rows among ``tokens``: their indices, row within the image, the image's rows, its grid
    width and the offset its end adds (``max(rows, cols) - rows * cols``)."""
    at = np.flatnonzero(tokens <= FIRST_IMAGE_ID)
    if not at.size:
        return at, None, None, None, None
    idx, rows, entries = store.index(tokens[at])
    # per image, not per row: a long history holds thousands of image rows
    uniq, inv = np.unique(idx, return_inverse=True)
    shapes = np.array([grid(entries[i].tiles) for i in uniq.tolist()], np.int64).reshape(-1, 2)
    n_u = np.array([entries[i].n_rows for i in uniq.tolist()], np.int64)
    return at, rows, n_u[inv], shapes[inv, 1], (shapes.max(1) - n_u)[inv]


def _offset(history: Sequence[int], p0: int, store: ImageStore, grid: Callable) -> int:
    """The offset of the token at index ``p0``: what the whole images before it add."""
    if p0 <= 0:
        return 0
    toks = np.asarray(history[:p0], np.int64)
    at, rows, n_rows, _gw, grow = _image_rows(toks, store, grid)
    if not at.size:
        return 0
    return int(grow[rows == n_rows - 1].sum())


def mrope_positions(tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray,
                    history: Callable[[int], Sequence[int]], store: ImageStore | None,
                    grid: Callable | None) -> np.ndarray:
    """The ``inp_pos`` values of a micro-batch, int32 ``(4 * n,)``: the time, height, width and fourth positions
    of every row in turn (see the module docstring).

    ``history(seq)`` is the sequence's token record (its first ``positions`` entries what the cache holds
    before this micro-batch); ``grid(tiles)`` an image's ``(rows, cols)`` of tokens (the vision encoder's).
    """
    tokens = np.asarray(tokens, np.int64)
    pos = np.asarray(positions, np.int64)
    out = np.empty((4, len(tokens)), np.int64)
    out[:] = pos
    if store is None or grid is None or store.empty:
        return out.reshape(-1).astype(np.int32)
    for s in np.unique(seqs):
        idx = np.flatnonzero(seqs == s)
        idx = idx[np.argsort(pos[idx], kind="stable")]
        p = pos[idx]
        d0 = _offset(history(int(s)), int(p[0]), store, grid)
        at, rows, n_rows, gw, grow = _image_rows(tokens[idx], store, grid)
        inc = np.zeros(len(idx), np.int64)
        if at.size:
            last = rows == n_rows - 1
            inc[at[last]] = grow[last]
        # the offset each row sees: what the images ending before it add
        off = d0 + np.cumsum(inc) - inc
        t = p + off
        out[:, idx] = t
        if at.size:
            t0 = t[at] - rows
            out[0, idx[at]] = t0
            out[1, idx[at]] = t0 + rows // gw
            out[2, idx[at]] = t0 + rows % gw
            out[3, idx[at]] = t0
    return out.reshape(-1).astype(np.int32)
