"""Cache bookkeeping: which cell holds which position of which sequences (:class:`Cells`).

:class:`Cells` is pure numpy; it owns no ggml tensors (the caches in
:mod:`ggmlpy.kvcache.causal` do). A cache has ``n_cells``
storage rows (cells). :class:`Cells` records, for every cell, the position of
the token stored there and the set of sequences that reference it. A cell is
free when no sequence references it. Sharing one cell between several
sequences is how a common prefix is stored once (:meth:`Cells.copy_prefix`).

Layout
------
Everything lives in a few flat numpy arrays, never one Python object per cell:

``pos``
    ``int32[n_cells]``, the token position in the cell, ``-1`` when free.
``seqs``
    ``bool[n_cells, n_seq_max]``, ``seqs[c, s]`` is true when sequence ``s``
    references cell ``c``.

Per-sequence minimum and maximum positions are recomputed (vectorised) after
every mutation. Masks are numpy ``float32[n_batch, n_history]``: batch on the
first axis, history on the last; the matching ggml tensor has
``ne = (n_history, n_batch)``.

Plan, then commit
-----------------
Methods that *compute* something (:meth:`Cells.find_free`,
:meth:`Cells.mask`, :meth:`Cells.visible_range`, :meth:`Cells.can_resume`,
:meth:`Cells.defrag_plan`) never change the state, so a caller can build the
tensors for a forward pass and commit the metadata only once that succeeded.
Methods that *apply* a change (:meth:`Cells.apply`, :meth:`Cells.remove`,
:meth:`Cells.copy_prefix`, :meth:`Cells.trim_window`, :meth:`Cells.clear`,
:meth:`Cells.apply_defrag`) validate all their arguments first and either
apply the whole change or raise with the state untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from ggmlpy._core import GGMLError, GGMLTypeError, GGMLValueError, _kv_mask

__all__ = ["CacheStateError", "Cells", "NotSupported"]

_INT32_MAX = 2**31 - 1          # positions are I32 in the graph


class CacheStateError(RuntimeError, GGMLError):
    """The cache is not in a state for this call: not initialised (or closed), initialised twice, or
    asked for a layer nothing was stored for."""


class NotSupported(RuntimeError, GGMLError):
    """The operation is not supported for the current cache state.

    Raised by :meth:`Cells.remove` when shifting positions would touch a cell
    that is shared with another sequence. Nothing has been changed when it is
    raised.
    """


def _int_array(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise GGMLValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise GGMLValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view


class Cells:
    """Per-cell metadata of a causal KV cache.

    Parameters
    ----------
    n_cells : int
        Number of cache rows. Must be at least 1.
    n_seq_max : int
        Number of sequence ids; valid ids are ``0 .. n_seq_max - 1``.
    """

    def __init__(self, n_cells: int, n_seq_max: int) -> None:
        n_cells = int(n_cells)
        n_seq_max = int(n_seq_max)
        if n_cells < 1:
            raise GGMLValueError(f"n_cells must be >= 1, got {n_cells}")
        if n_seq_max < 1:
            raise GGMLValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        self._n_cells = n_cells
        self._n_seq_max = n_seq_max
        self._pos = np.full(n_cells, -1, dtype=np.int32)
        self._seq = np.zeros((n_cells, n_seq_max), dtype=bool)
        self._pos_min = np.full(n_seq_max, -1, dtype=np.int32)
        self._pos_max = np.full(n_seq_max, -1, dtype=np.int32)
        self._occ = np.zeros(n_cells, dtype=bool)      # cell referenced by any sequence
        self._used = 0
        self._version = 0           # bumped by every change, so a plan can tell it is still current

    def copy(self) -> Cells:
        """An independent copy (plain array copies: much cheaper than ``copy.deepcopy``)."""
        c = object.__new__(Cells)
        c._n_cells, c._n_seq_max, c._used, c._version = self._n_cells, self._n_seq_max, self._used, self._version
        c._pos, c._seq = self._pos.copy(), self._seq.copy()
        c._pos_min, c._pos_max = self._pos_min.copy(), self._pos_max.copy()
        c._occ = self._occ.copy()
        return c

    def __deepcopy__(self, memo) -> Cells:
        return self.copy()

    # ------------------------------------------------------------------ state

    @property
    def n_cells(self) -> int:
        """Number of cache rows."""
        return self._n_cells

    @property
    def n_seq_max(self) -> int:
        """Number of sequence ids."""
        return self._n_seq_max

    @property
    def used(self) -> int:
        """Number of cells referenced by at least one sequence."""
        return self._used

    @property
    def pos(self) -> np.ndarray:
        """Read-only ``int32[n_cells]`` view of the positions (-1 = free)."""
        return _readonly(self._pos)

    @property
    def seqs(self) -> np.ndarray:
        """Read-only ``bool[n_cells, n_seq_max]`` view of cell membership."""
        return _readonly(self._seq)

    def __repr__(self) -> str:
        return f"Cells(n_cells={self._n_cells}, n_seq_max={self._n_seq_max}, used={self._used})"

    def _refresh(self) -> None:
        """Free empty cells and recompute ``used`` and per-sequence min/max."""
        self._version += 1
        self._occ = occupied = self._seq.any(axis=1)
        self._pos[~occupied] = -1
        self._used = int(occupied.sum())
        big = _INT32_MAX
        pos = self._pos[:, None]
        lo = np.where(self._seq, pos, big).min(axis=0)
        hi = np.where(self._seq, pos, -1).max(axis=0)
        self._pos_min = np.where(lo == big, -1, lo).astype(np.int32)
        self._pos_max = hi.astype(np.int32)

    def _check_seq(self, seq, name: str = "seq") -> int:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise GGMLTypeError(f"{name} must be an int, got {type(seq).__name__}")
        seq = int(seq)
        if not 0 <= seq < self._n_seq_max:
            raise GGMLValueError(f"{name} {seq} out of range [0, {self._n_seq_max})")
        return seq

    def _check_seq_array(self, seq_ids: np.ndarray) -> None:
        bad = (seq_ids < 0) | (seq_ids >= self._n_seq_max)
        if bad.any():
            raise GGMLValueError(
                f"sequence id {int(seq_ids[bad][0])} out of range [0, {self._n_seq_max})"
            )

    # ------------------------------------------------------------------ queries

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position stored for a sequence.

        Parameters
        ----------
        seq : int
            Sequence id.

        Returns
        -------
        int
            The position, or -1 if the sequence holds no cell.
        """
        return int(self._pos_min[self._check_seq(seq)])

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for a sequence.

        Parameters
        ----------
        seq : int
            Sequence id.

        Returns
        -------
        int
            The position, or -1 if the sequence holds no cell.
        """
        return int(self._pos_max[self._check_seq(seq)])

    def find_free(self, n_tokens: int) -> Optional[np.ndarray]:
        """Plan where a batch goes: the first ``n_tokens`` free cells.

        The cells need not be contiguous (writes are a scatter). Nothing is
        changed; commit with :meth:`apply`.

        Parameters
        ----------
        n_tokens : int
            Number of tokens in the batch.

        Returns
        -------
        numpy.ndarray or None
            ``int64[n_tokens]`` ascending cell indices, or None if fewer than
            ``n_tokens`` cells are free.
        """
        n_tokens = int(n_tokens)
        if n_tokens < 0:
            raise GGMLValueError(f"n_tokens must be >= 0, got {n_tokens}")
        free = np.flatnonzero(~self._occ)
        if free.size < n_tokens:
            return None
        return free[:n_tokens].astype(np.int64)

    def mask(
        self,
        positions,
        seq_ids,
        *,
        window: Optional[int] = None,
        causal: bool = True,
        except_rows: Optional[Iterable[int]] = None,
        lo: int = 0,
        hi: Optional[int] = None,
        dtype=np.float32,
    ) -> np.ndarray:
        """Build the attention mask of a batch over cells ``lo .. hi-1``.

        Entry ``[i, j]`` (cell ``c = lo + j``) is 0 when all of these hold,
        else ``-inf``: cell ``c`` holds ``seq_ids[i]``; ``causal`` is off,
        ``pos[c] <= positions[i]`` or ``i`` is in ``except_rows``; and
        ``pos[c] >= positions[i] - window`` (window given).
        Call it after :meth:`apply` so the batch sees its own tokens.

        Parameters
        ----------
        positions, seq_ids : array_like of int
            Position and sequence id of each batch token, equal length.
        window : int, optional
            Sliding window; a token sees ``window + 1`` positions with itself.
        causal : bool
            Mask future positions.
        except_rows : iterable of int, optional
            Batch rows exempt from the causal rule (bidirectional spans).
        lo, hi : int
            Cell range; ``hi`` None means ``n_cells``.
        dtype : numpy.float32 or numpy.float16
            Of the result (0 and -inf are exact in both; float16 is what the graph reads).

        Returns
        -------
        numpy.ndarray
            ``dtype[n_batch, hi - lo]``.
        """
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if positions.shape != seq_ids.shape:
            raise GGMLValueError(
                f"positions and seq_ids differ in length: {positions.size} != {seq_ids.size}"
            )
        self._check_seq_array(seq_ids)
        hi = self._n_cells if hi is None else int(hi)
        lo = int(lo)
        if not 0 <= lo <= hi <= self._n_cells:
            raise GGMLValueError(f"bad cell range [{lo}, {hi}) for {self._n_cells} cells")
        if window is not None and window < 0:
            raise GGMLValueError(f"window must be >= 0, got {window}")

        exempt = None
        if except_rows is not None:
            rows = _int_array(list(except_rows), "except_rows")
            if rows.size and ((rows < 0) | (rows >= positions.size)).any():
                raise GGMLValueError("except_rows index out of range")
            exempt = np.zeros(positions.size, dtype=np.uint8)
            exempt[rows] = 1
        if np.dtype(dtype) not in (np.float32, np.float16):
            raise GGMLValueError(f"mask dtype must be float32 or float16, got {np.dtype(dtype)}")
        return _kv_mask(self._seq.view(np.uint8), self._pos, positions, seq_ids, lo, hi,
                        -1 if window is None else int(window), bool(causal), exempt, np.dtype(dtype) == np.float16)

    def visible_range(self, seq_ids, pad: int = 1) -> tuple[int, int]:
        """Smallest cell range covering every cell of some sequences.

        Parameters
        ----------
        seq_ids : array_like of int
            Sequence ids.
        pad : int
            ``lo`` is rounded down and ``hi`` up to a multiple of ``pad``;
            ``hi`` is then clamped to ``n_cells``.

        Returns
        -------
        tuple of int
            ``(lo, hi)``; ``(0, 0)`` when those sequences hold no cell.
        """
        seq_ids = _int_array(seq_ids, "seq_ids")
        self._check_seq_array(seq_ids)
        pad = int(pad)
        if pad < 1:
            raise GGMLValueError(f"pad must be >= 1, got {pad}")
        seqs = np.unique(seq_ids) if seq_ids.size > 1 else seq_ids
        cells = np.flatnonzero(self._seq[:, seqs].any(axis=1))
        if cells.size == 0:
            return (0, 0)
        lo = int(cells[0]) // pad * pad
        hi = -(-(int(cells[-1]) + 1) // pad) * pad
        return (lo, min(hi, self._n_cells))

    def can_resume(self, seq: int, pos: int, window: Optional[int] = None) -> bool:
        """Whether a sequence can continue at ``pos`` from what is stored.

        True iff every position in ``[max(0, pos - window), pos)`` is stored
        for ``seq``; with ``window`` None (or 0, "unlimited") that is all of
        ``[0, pos)``. Always true for ``pos == 0``.

        Parameters
        ----------
        seq : int
            Sequence id.
        pos : int
            Position of the next token.
        window : int, optional
            Sliding window of the attention.

        Returns
        -------
        bool
        """
        seq = self._check_seq(seq)
        pos = int(pos)
        if pos < 0:
            raise GGMLValueError(f"pos must be >= 0, got {pos}")
        start = max(0, pos - (window or pos))
        if start >= pos:
            return True
        stored = self._pos[self._seq[:, seq]]
        need = np.arange(start, pos)
        return bool(np.isin(need, stored).all())

    def defrag_plan(self) -> list[tuple[int, int, int]]:
        """Plan moves that make the live cells exactly ``[0, used)``.

        Only live cells at or beyond ``used`` move, each once, into the holes
        below ``used``, in order (the lowest such cell fills the lowest hole),
        so each cell is moved the minimum number of times. Consecutive moves
        are merged into one run when both source and destination ascend by
        one. Sources and destinations never overlap, so the moves can be
        applied in any order. Nothing is changed; commit with
        :meth:`apply_defrag` after copying the payload rows.

        Returns
        -------
        list of tuple of int
            ``(src, dst, n)``: copy cells ``src .. src+n-1`` to
            ``dst .. dst+n-1``.
        """
        occupied = self._seq.any(axis=1)
        used = self._used
        holes = np.flatnonzero(~occupied[:used])
        srcs = np.flatnonzero(occupied[used:]) + used
        if holes.size == 0:
            return []
        # A new run starts where either index sequence stops ascending by one.
        brk = np.flatnonzero((np.diff(holes) != 1) | (np.diff(srcs) != 1)) + 1
        starts = np.concatenate(([0], brk))
        ends = np.concatenate((brk, [holes.size]))
        return [(int(srcs[a]), int(holes[a]), int(b - a)) for a, b in zip(starts, ends)]

    # ------------------------------------------------------------------ mutations

    def apply(self, cell_ids, positions, seq_ids) -> None:
        """Commit a batch: cell ``cell_ids[k]`` becomes ``(positions[k], {seq_ids[k]})``.

        Parameters
        ----------
        cell_ids, positions, seq_ids : array_like of int
            Equal-length arrays, usually ``cell_ids`` from :meth:`find_free`.

        Raises
        ------
        ValueError
            If lengths differ, a cell is out of range, repeated or not free,
            a position is negative, or a sequence id is out of range. Nothing
            is changed.
        """
        cell_ids = _int_array(cell_ids, "cell_ids")
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if not cell_ids.size == positions.size == seq_ids.size:
            raise GGMLValueError(
                "cell_ids, positions and seq_ids differ in length: "
                f"{cell_ids.size}, {positions.size}, {seq_ids.size}"
            )
        if ((cell_ids < 0) | (cell_ids >= self._n_cells)).any():
            raise GGMLValueError(f"cell out of range [0, {self._n_cells})")
        if cell_ids.size > 1 and np.unique(cell_ids).size != cell_ids.size:
            raise GGMLValueError("cell_ids contain a repeated cell")
        if positions.size and (positions.min() < 0 or positions.max() > _INT32_MAX):
            raise GGMLValueError("positions must be in [0, 2**31)")
        self._check_seq_array(seq_ids)
        taken = self._seq[cell_ids].any(axis=1)
        if taken.any():
            raise GGMLValueError(f"cell {int(cell_ids[taken][0])} is not free")
        self._pos[cell_ids] = positions
        self._seq[cell_ids, seq_ids] = True
        self._refresh()

    def _append_one(self, cell: int, pos: int, seq: int) -> None:
        # apply() of one token into a free cell (checked by the caller), updating the
        # summaries in place instead of recomputing them: the one-token step of generation
        self._version += 1
        self._pos[cell] = pos
        self._seq[cell, seq] = True
        self._occ[cell] = True
        self._used += 1
        lo = int(self._pos_min[seq])
        if lo < 0 or pos < lo:
            self._pos_min[seq] = pos
        if pos > int(self._pos_max[seq]):
            self._pos_max[seq] = pos

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> np.ndarray:
        """Drop ``seq`` from cells with ``begin <= pos < end``, shifting later ones.

        With ``end`` given, the cells of ``seq`` with ``pos >= end`` move down
        by ``end - begin`` so the sequence stays gap-free; the caller must
        re-rotate their keys. With ``end`` None everything from ``begin`` on is
        dropped and nothing shifts. Cells left with no sequence become free.

        Parameters
        ----------
        seq : int
            Sequence id.
        begin : int
            First position removed.
        end : int, optional
            One past the last position removed; None means to the end.

        Returns
        -------
        numpy.ndarray
            ``int64`` indices of the shifted cells (empty when none).

        Raises
        ------
        NotSupported
            If a cell to shift is shared with another sequence. Checked before
            anything changes, so the state is untouched.
        """
        seq = self._check_seq(seq)
        begin = int(begin)
        if begin < 0:
            raise GGMLValueError(f"begin must be >= 0, got {begin}")
        if end is not None:
            end = int(end)
            if end < begin:
                raise GGMLValueError(f"end {end} < begin {begin}")
        held = self._seq[:, seq]
        pos = self._pos
        drop = held & (pos >= begin)
        if end is None:
            shift = np.zeros_like(held)
        else:
            drop &= pos < end
            shift = held & (pos >= end)
            if end == begin:
                shift[:] = False
        if (self._seq[shift].sum(axis=1) > 1).any():
            raise NotSupported("shifting cells shared by multiple sequences is not supported")
        self._seq[drop, seq] = False
        if end is not None:
            self._pos[shift] -= end - begin
        self._refresh()
        return np.flatnonzero(shift).astype(np.int64)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` share the first ``length`` positions of ``src``.

        ``dst`` is first removed from every cell, then added to every cell of
        ``src`` with ``pos < length``. Metadata only: no data is copied.

        Parameters
        ----------
        src, dst : int
            Distinct sequence ids.
        length : int
            Number of leading positions to share.
        """
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        if src == dst:
            raise GGMLValueError("src and dst must differ")
        length = int(length)
        if length < 0:
            raise GGMLValueError(f"length must be >= 0, got {length}")
        self._seq[:, dst] = self._seq[:, src] & (self._pos < length)
        self._refresh()

    def trim_window(self, seq_positions: dict[int, int], window: int) -> None:
        """Sliding-window eviction: drop old cells of the given sequences.

        For each ``seq -> p`` (``p`` is the lowest position of that sequence
        in the coming batch, or last stored position + 1 for an idle one), the
        sequence is dropped from cells with ``pos < p - window``. Cells left
        with no sequence become free.

        Parameters
        ----------
        seq_positions : dict of int to int
            Lowest position per sequence.
        window : int
            Number of positions kept before ``p``.
        """
        window = int(window)
        if window < 0:
            raise GGMLValueError(f"window must be >= 0, got {window}")
        items = [(self._check_seq(s), int(p)) for s, p in seq_positions.items()]
        for s, p in items:
            self._seq[:, s] &= ~(self._pos < p - window)
        self._refresh()

    def clear(self, seq: Optional[int] = None) -> None:
        """Drop one sequence from every cell, or empty the whole cache.

        Parameters
        ----------
        seq : int, optional
            Sequence id; None clears everything.
        """
        if seq is None:
            self._seq[:] = False
        else:
            self._seq[:, self._check_seq(seq)] = False
        self._refresh()

    def apply_defrag(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Commit block moves of cell metadata, e.g. from :meth:`defrag_plan`.

        Each ``(src, dst, n)`` moves cells ``src .. src+n-1`` to
        ``dst .. dst+n-1`` (in list order, like ``memmove``); the source cells
        not overwritten become free. Every destination cell must be free or
        part of the same move's source.

        Parameters
        ----------
        moves : sequence of tuple of int
            ``(src, dst, n)`` triples.

        Raises
        ------
        ValueError
            If a range is out of bounds or a move would overwrite a live cell.
            Nothing is changed.
        """
        pos = self._pos.copy()
        seq = self._seq.copy()
        for move in moves:
            src, dst, n = (int(v) for v in move)
            if n < 0 or src < 0 or dst < 0 or src + n > self._n_cells or dst + n > self._n_cells:
                raise GGMLValueError(f"move {move} out of range for {self._n_cells} cells")
            p = pos[src:src + n].copy()
            q = seq[src:src + n].copy()
            pos[src:src + n] = -1
            seq[src:src + n] = False
            if seq[dst:dst + n].any():
                raise GGMLValueError(f"move {move} would overwrite a live cell")
            pos[dst:dst + n] = p
            seq[dst:dst + n] = q
        self._pos = pos
        self._seq = seq
        self._refresh()
