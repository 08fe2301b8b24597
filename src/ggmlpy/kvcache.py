"""A causal KV cache: bookkeeping (:class:`Cells`) and storage (:class:`Causal`).

:class:`Cells` is pure numpy; it owns no ggml tensors. :class:`Causal` owns
the per-layer K/V tensors (CPU host memory) and builds the graph pieces that
write and read them. A cache has ``n_cells``
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
Methods that *compute* something (:meth:`Cells.find_slots`,
:meth:`Cells.mask`, :meth:`Cells.visible_range`, :meth:`Cells.can_resume`,
:meth:`Cells.defrag_plan`) never change the state, so a caller can build the
tensors for a forward pass and commit the metadata only once that succeeded.
Methods that *apply* a change (:meth:`Cells.apply`, :meth:`Cells.remove`,
:meth:`Cells.copy_prefix`, :meth:`Cells.trim_window`, :meth:`Cells.clear`,
:meth:`Cells.apply_defrag`) validate all their arguments first and either
apply the whole change or raise with the state untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ._core import (
    Context,
    GGMLError,
    GGMLMemoryError,
    GGMLTypeError,
    GGMLValueError,
    Tensor,
    Type,
    _kv_mask,
    _kv_plan_one,
    graph_overhead,
    tensor_overhead,
)

__all__ = ["CacheStateError", "Causal", "Cells", "Encoder", "EncoderPlan", "Forward", "ForwardPlan", "KVCacheFull", "NotSupported",
           "Wrapper", "WrapperPlan"]


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

    def find_slots(self, n_tokens: int) -> Optional[np.ndarray]:
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
        chunk: Optional[int] = None,
        causal: bool = True,
        except_rows: Optional[Iterable[int]] = None,
        lo: int = 0,
        hi: Optional[int] = None,
        dtype=np.float32,
    ) -> np.ndarray:
        """Build the attention mask of a batch over cells ``lo .. hi-1``.

        Entry ``[i, j]`` (cell ``c = lo + j``) is 0 when all of these hold,
        else ``-inf``: cell ``c`` holds ``seq_ids[i]``; ``causal`` is off,
        ``pos[c] <= positions[i]`` or ``i`` is in ``except_rows``;
        ``pos[c] >= positions[i] - window`` (window given); and
        ``pos[c] >= positions[i] - positions[i] % chunk`` (chunk given).
        Call it after :meth:`apply` so the batch sees its own tokens.

        Parameters
        ----------
        positions, seq_ids : array_like of int
            Position and sequence id of each batch token, equal length.
        window : int, optional
            Sliding window; a token sees ``window + 1`` positions with itself.
        chunk : int, optional
            Chunked attention: a token sees only its own chunk.
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
        if chunk is not None and chunk < 1:
            raise GGMLValueError(f"chunk must be >= 1, got {chunk}")

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
                        -1 if window is None else int(window), -1 if chunk is None else int(chunk), bool(causal),
                        exempt, np.dtype(dtype) == np.float16)

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

    def apply(self, slots, positions, seq_ids) -> None:
        """Commit a batch: cell ``slots[k]`` becomes ``(positions[k], {seq_ids[k]})``.

        Parameters
        ----------
        slots, positions, seq_ids : array_like of int
            Equal-length arrays, usually ``slots`` from :meth:`find_slots`.

        Raises
        ------
        ValueError
            If lengths differ, a slot is out of range, repeated or not free,
            a position is negative, or a sequence id is out of range. Nothing
            is changed.
        """
        slots = _int_array(slots, "slots")
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if not slots.size == positions.size == seq_ids.size:
            raise GGMLValueError(
                "slots, positions and seq_ids differ in length: "
                f"{slots.size}, {positions.size}, {seq_ids.size}"
            )
        if ((slots < 0) | (slots >= self._n_cells)).any():
            raise GGMLValueError(f"slot out of range [0, {self._n_cells})")
        if slots.size > 1 and np.unique(slots).size != slots.size:
            raise GGMLValueError("slots contain a repeated cell")
        if positions.size and (positions.min() < 0 or positions.max() > _INT32_MAX):
            raise GGMLValueError("positions must be in [0, 2**31)")
        self._check_seq_array(seq_ids)
        taken = self._seq[slots].any(axis=1)
        if taken.any():
            raise GGMLValueError(f"cell {int(slots[taken][0])} is not free")
        self._pos[slots] = positions
        self._seq[slots, seq_ids] = True
        self._refresh()

    def _append_one(self, slot: int, pos: int, seq: int) -> None:
        # apply() of one token into a free cell (checked by the caller), updating the
        # summaries in place instead of recomputing them: the one-token step of generation
        self._version += 1
        self._pos[slot] = pos
        self._seq[slot, seq] = True
        self._occ[slot] = True
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


# ====================================================================== Causal
#
# The tensor-owning cache built on :class:`Cells`, following the semantics of
# Ollama's causal cache (see module docstring of :class:`Causal`).

_INT32_MAX = 2**31 - 1

#: V types the ``mul_mat`` path can store transposed (one element per row: no quantized blocks).
V_TRANS_TYPES = (Type.F32, Type.F16, Type.BF16)


class KVCacheFull(RuntimeError, GGMLError):
    """No free cache slots for a batch. Nothing has been changed."""


@dataclass(frozen=True)
class ForwardPlan:
    """Where one batch goes and what it sees, from :meth:`Causal.start_forward`.

    Attributes
    ----------
    positions, seq_ids : numpy.ndarray
        ``int64[n_batch]``, the batch's tokens.
    slots : numpy.ndarray
        ``int64[n_batch]``, the cache row written for each token.
    lo, hi : int
        The cell range ``[lo, hi)`` the batch attends over (padded).
    mask : numpy.ndarray
        ``float16[n_batch, hi - lo]`` (numpy order), 0 visible, ``-inf``
        masked (exact in float16, the type the graph reads); the ggml tensor
        is ``ne = (hi - lo, n_batch)``.
    reserve : bool
        A worst-case sizing plan: commits nothing.
    trim : dict of int to int
        Sliding-window eviction to apply first (``seq -> lowest position``);
        empty for an unlimited cache.
    n_cells : int
        Size of the cache the plan was made for.
    """

    positions: np.ndarray
    seq_ids: np.ndarray
    slots: np.ndarray
    lo: int
    hi: int
    mask: np.ndarray
    reserve: bool
    trim: dict
    n_cells: int
    _base: Optional[tuple] = field(default=None, repr=False, compare=False)
    _after: Optional[Cells] = field(default=None, repr=False, compare=False)
    _one: Optional[tuple] = field(default=None, repr=False, compare=False)    # (slot, pos, seq) of a one-token plan

    @property
    def n_batch(self) -> int:
        """Number of tokens in the batch."""
        return int(self.slots.size)

    @property
    def n_kv(self) -> int:
        """Length of the visible cell range, ``hi - lo``."""
        return self.hi - self.lo


class Forward:
    """The per-forward view of a cache, in the shape of Ollama's Cache protocol.

    Made by ``cache.forward(ctx, plan)``: ``set_layer(i)``, then ``put(k, v)``
    and ``get()`` for that layer. The index and mask tensors are created once
    and shared by every layer; ``pending`` collects the writes to expand into
    the graph before anything that reads the cache.
    """

    def __init__(self, cache, ctx: Context, plan) -> None:
        self.cache, self.ctx, self.plan = cache, ctx, plan
        self.layer: Optional[int] = None
        self.pending: list = []
        self._idx = None
        self._mask = None

    def set_layer(self, layer: int) -> Forward:
        self.layer = self.cache._check_layer(layer)
        return self

    def _need_layer(self) -> int:
        if self.layer is None:
            raise GGMLValueError("call set_layer(i) first")
        return self.layer

    def put(self, k: Tensor, v: Tensor) -> tuple:
        """Write this batch's K and V for the current layer (a batch-size mismatch raises ValueError)."""
        layer = self._need_layer()
        if self._idx is None:
            self._idx = self.cache.index_tensor(self.ctx, self.plan)
        out = self.cache.put(self.ctx, layer, self.plan, k, v, idx=self._idx)
        self.pending.extend(out)
        return out

    def get(self) -> tuple:
        """``(k_view, v_view, mask)`` of the current layer."""
        layer = self._need_layer()
        if self._mask is None:
            self._mask = self.cache.mask_tensor(self.ctx, self.plan)
        return self.cache.get(self.ctx, layer, self.plan, mask=self._mask)


class Causal:
    """A causal KV cache: per-layer K/V tensors plus :class:`Cells`.

    Follows Ollama's causal cache. One forward pass is (or, layer by layer,
    ``fw = cache.forward(ctx, plan)``, then ``fw.set_layer(i)``, ``fw.put(k,
    v)``, ``fw.get()``)::

        plan = cache.start_forward(positions, seq_ids)   # plan only
        for each layer:
            cache.put(ctx, layer, plan, k, v)          # expand the results
            k_view, v_view, mask = cache.get(ctx, layer, plan)
            ... attention ...
        gf.compute(); cache.apply(plan)                # commit the metadata

    Storage: layer ``i`` has K ``ne = (n_embd_k, cells)`` in ``dtype`` and V
    ``ne = (n_embd_v, cells)`` in ``dtype_v``, zero-filled, in host memory or,
    with ``init(..., placement=...)``, in a buffer on the layer's device. A
    row is one cell, laid out as ``(head_dim, n_head_kv)``.

    Attention paths and cache types: ``flash_attn_ext`` takes K and V each of
    its own type (F32, F16, BF16 or a quantized type with a CPU dot product:
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) with an F16 mask (``mask_tensor``
    default) and V in the plain layout; the ``mul_mat`` + ``soft_max_ext``
    path takes K of any of those types but V only as F32/F16/BF16 (V
    transposed is best there: ``v_trans=True``, and a quantized row cannot
    be transposed), with an F16 or F32 mask. A quantized V therefore needs
    flash attention, as in llama.cpp.

    Parameters
    ----------
    n_layers : int
        Number of layers.
    n_embd_k, n_embd_v : int
        ``head_dim_k * n_head_kv`` and ``head_dim_v * n_head_kv``.
    dtype : Type
        Storage type of K (and of V unless ``dtype_v`` is given): F32, F16,
        BF16 or a quantized type (Q8_0, Q4_0, ...).
    dtype_v : Type, optional
        Storage type of V (default ``dtype``).
    window : int, optional
        Sliding window: a token sees ``window + 1`` positions including
        itself. Old cells are evicted as in Ollama's SWA cache (memory equals
        the window, ``window + 1`` with several sequences) unless that is at
        least the capacity.
    padding : int
        The cell count and every visible range are rounded to this.
    n_head_kv : int
        Number of KV heads; :meth:`get` splits rows into heads with it.
    v_trans : bool
        Store V transposed, ``ne = (cells, n_embd_v)`` (one row per channel,
        Ollama's ``PermutedV``), so :meth:`get` returns a V view
        ``ne = (hi - lo, head_dim_v, n_head_kv)`` that ``mul_mat(v, kq)``
        uses without a copy. V of F32/F16/BF16 only. Not usable with ``flash_attn_ext``.
    chunk : int, optional
        Chunked attention (Ollama's ``NewChunkedAttentionCache``): a token
        sees only positions of its own chunk, ``[p - p % chunk, p]``. Mask
        only, nothing is evicted.
    memory : int, optional
        With ``window``: keep ``memory`` positions (``>= window``) per
        sequence for prefix reuse while the mask still uses ``window``
        (Ollama's ``NewSWAMemCache``). None or 0 means ``window``.
    shift_fn : callable, optional
        The model's key shift, ``shift_fn(ctx, layer, k, offsets) -> Tensor``:
        ``k`` is ``ne = (head_dim_k, n_head_kv, n)`` (F32/F16; F32 for a
        quantized cache) and ``offsets`` an I32 ``ne = (n,)`` of position
        deltas, typically ``ctx.rope_ext(k, offsets, n_dims=..., mode=...,
        freq_base=...)`` with the model's RoPE settings. Without it
        :meth:`remove` of a middle range raises :class:`NotSupported`.
    """

    def __init__(self, n_layers: int, n_embd_k: int, n_embd_v: int, dtype=Type.F16, *,
                 window: Optional[int] = None, padding: int = 1, n_head_kv: int = 1,
                 shift_fn: Optional[Callable[[Context, int, Tensor, Tensor], Tensor]] = None,
                 v_trans: bool = False, chunk: Optional[int] = None,
                 memory: Optional[int] = None, dtype_v=None) -> None:
        self.n_layers = int(n_layers)
        self.n_embd_k = int(n_embd_k)
        self.n_embd_v = int(n_embd_v)
        self.dtype = Type(dtype)
        self.dtype_v = self.dtype if dtype_v is None else Type(dtype_v)
        self.n_head_kv = int(n_head_kv)
        if self.n_layers < 1 or self.n_embd_k < 1 or self.n_embd_v < 1:
            raise GGMLValueError("n_layers, n_embd_k and n_embd_v must be >= 1")
        if self.n_head_kv < 1 or self.n_embd_k % self.n_head_kv or self.n_embd_v % self.n_head_kv:
            raise GGMLValueError(f"n_head_kv {self.n_head_kv} must divide n_embd_k and n_embd_v")
        if window is not None and int(window) < 0:
            raise GGMLValueError(f"window must be >= 0, got {window}")
        # Ollama: window 0 means unlimited.
        self.window = None if not window else int(window)
        self.padding = max(1, int(padding))
        # a cache row is split into heads by views: a head must hold whole blocks
        for what, t, hd in (("K", self.dtype, self.n_embd_k // self.n_head_kv),
                            ("V", self.dtype_v, self.n_embd_v // self.n_head_kv)):
            if hd % t.block_size:
                raise GGMLValueError(f"the {what} head dim {hd} must be a multiple of the {t.name} block size "
                                     f"{t.block_size}")
        if shift_fn is not None and not callable(shift_fn):
            raise GGMLTypeError(f"shift_fn must be callable, got {type(shift_fn).__name__}")
        self.shift_fn = shift_fn
        self.v_trans = bool(v_trans)
        if self.v_trans and self.dtype_v not in V_TRANS_TYPES:
            raise GGMLValueError(f"v_trans needs an F32, F16 or BF16 V cache, got {self.dtype_v.name} (a quantized "
                                 "row cannot be stored transposed)")
        if chunk is not None and int(chunk) < 1:
            raise GGMLValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = None if chunk is None else int(chunk)
        if memory is not None and int(memory) < 0:
            raise GGMLValueError(f"memory must be >= 0, got {memory}")
        memory = None if not memory else int(memory)
        if memory is not None:
            if self.window is None:
                raise GGMLValueError("memory needs a window")
            if memory < self.window:
                raise GGMLValueError(f"memory {memory} must be >= window {self.window}")
        self.memory_size = memory
        self.memory: Optional[int] = None
        self._cells: Optional[Cells] = None
        self._ctx: Optional[Context] = None
        self._placed: Optional[list] = None
        self.report = None
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    # ------------------------------------------------------------------ lifecycle

    @property
    def dtype_k(self) -> Type:
        """Storage type of K (the same as :attr:`dtype`)."""
        return self.dtype

    @property
    def head_dim_k(self) -> int:
        return self.n_embd_k // self.n_head_kv

    @property
    def head_dim_v(self) -> int:
        return self.n_embd_v // self.n_head_kv

    @property
    def cells(self) -> Cells:
        """The metadata (do not mutate it directly)."""
        if self._cells is None:
            raise CacheStateError("kv cache: not initialised (call init() first) or closed")
        return self._cells

    @property
    def n_cells(self) -> int:
        return self.cells.n_cells

    def init(self, capacity: int, n_seq_max: int, max_batch: int, *, placement=None, report=None) -> None:
        """Size the cache and allocate zero-filled K/V for every layer.

        ``capacity`` is per sequence. Cells: ``n_seq_max * capacity`` for an
        unlimited cache, ``n_seq_max * memory + max_batch`` with a sliding
        window, rounded up to ``padding``. ``memory`` is the ``memory``
        option (default the window), at least ``window + 1`` with several
        sequences, and unlimited when that reaches ``capacity``.

        With ``placement`` (a :class:`ggmlpy.backend.Placement`), each layer's
        K/V live in a buffer on that layer's device and their bytes are
        recorded in ``report`` (a :class:`ggmlpy.backend.MemoryReport`) as
        cache; otherwise they are host memory. Shift and defragmentation run on
        the host, so on other devices they raise :class:`NotSupported` (the
        caller clears and re-processes instead).

        Raises
        ------
        GGMLMemoryError
            A device had no room; ``.report`` has what every device needed.
        """
        if self._ctx is not None:
            raise CacheStateError("kv cache: already initialised (close() it first)")
        capacity, n_seq_max, max_batch = int(capacity), int(n_seq_max), int(max_batch)
        n, self.memory = self._size(capacity, n_seq_max, max_batch)
        self.max_batch = max_batch
        k_row = self.dtype.row_size(self.n_embd_k)
        v_row = self.dtype_v.row_size(self.n_embd_v)
        size = self.n_layers * ((k_row + v_row) * n + 2 * (tensor_overhead() + 64))
        v_ne = (n, self.n_embd_v) if self.v_trans else (self.n_embd_v, n)
        if placement is not None:
            self._init_placed(n, v_ne, placement, report)
            self._cells = Cells(n, n_seq_max)
            return
        ctx = Context(size + 1024, no_alloc=False)
        keys, values = [], []
        zeros_k = np.zeros((n, self.n_embd_k), dtype=np.float32)
        zeros_v = np.zeros(v_ne[::-1], dtype=np.float32)
        for i in range(self.n_layers):
            k = ctx.new_tensor(self.dtype, (self.n_embd_k, n), name=f"cache_k_l{i}")
            v = ctx.new_tensor(self.dtype_v, v_ne, name=f"cache_v_l{i}")
            k.set(zeros_k)
            v.set(zeros_v)
            keys.append(k)
            values.append(v)
        self._ctx = ctx
        self.keys, self.values = keys, values
        self._cells = Cells(n, n_seq_max)

    def _size(self, capacity: int, n_seq_max: int, max_batch: int) -> tuple[int, Optional[int]]:
        """``(cells, memory)`` that :meth:`init` would use (see there)."""
        if capacity < 1 or n_seq_max < 1 or max_batch < 1:
            raise GGMLValueError("capacity, n_seq_max and max_batch must be >= 1")
        memory = self.memory_size or self.window
        if memory is not None and n_seq_max > 1:
            # keep the stop token so a conversation can resume
            memory = max(memory, self.window + 1)
        if memory is not None and memory >= capacity:
            memory = None
        n = n_seq_max * capacity if memory is None else n_seq_max * memory + max_batch
        return -(-n // self.padding) * self.padding, memory

    def cells_needed(self, capacity: int, n_seq_max: int, max_batch: int) -> int:
        """Cells :meth:`init` would allocate for these arguments (nothing is allocated)."""
        return self._size(int(capacity), int(n_seq_max), int(max_batch))[0]

    def _init_placed(self, n: int, v_ne, placement, report) -> None:
        # One no_alloc context and one buffer per device, as the weights do.
        from ggmlpy import _core
        from ggmlpy.backend import MemoryReport

        if report is None:
            report = MemoryReport(placement.n_layers)
        ctxs: dict = {}
        keys, values = [], []
        for i in range(self.n_layers):
            dev = placement.device_of(i)
            ctx = ctxs.get(dev.name)
            if ctx is None:
                ctx = ctxs[dev.name] = (dev, Context.for_tensors(2 * self.n_layers, no_alloc=True))
            k = ctx[1].new_tensor(self.dtype, (self.n_embd_k, n), name=f"cache_k_l{i}")
            v = ctx[1].new_tensor(self.dtype_v, v_ne, name=f"cache_v_l{i}")
            keys.append(k)
            values.append(v)
        failed = None
        # this cache replaces what an earlier one on the same model recorded, on whatever device that was
        # (a runner without KV offload keeps on the CPU the layers an earlier one kept on their devices)
        for m in report.devices.values():
            for i in range(self.n_layers):
                m.cache.pop(i, None)
        for i in range(self.n_layers):
            dev = placement.device_of(i)
            m = report.device(dev)
            m.cache[i] = 0
        for dev, ctx in ctxs.values():
            bt = dev.buffer_type()
            for i, (k, v) in enumerate(zip(keys, values)):
                if placement.device_of(i) == dev:
                    report.add_cache(dev, i, sum(-(-bt.alloc_size(t) // bt.alignment) * bt.alignment for t in (k, v)))
            try:
                buf = _core.alloc_ctx_tensors(ctx, bt)
            except MemoryError as e:
                report.device(dev).cache_ok = False
                failed = failed or e
                continue
            buf.clear(0)
            report.device(dev).cache_ok = True
        if failed is not None:
            for _dev, ctx in ctxs.values():
                ctx.free()
            raise GGMLMemoryError(f"kv cache: allocation failed ({failed})\n{report}", report)
        self._placed = [ctx for _dev, ctx in ctxs.values()]
        self.report = report
        self.keys, self.values = keys, values
        self._ctx = self._placed[0]

    def _require_host(self, what: str) -> None:
        if not all(t.is_host for t in (*self.keys, *self.values)):
            raise NotSupported(f"{what} runs on the host; this cache lives in device memory")

    def forward(self, ctx: Context, plan: ForwardPlan) -> Forward:
        """A :class:`Forward` for building this batch's graph layer by layer."""
        self._check_plan(plan)
        return Forward(self, ctx, plan)

    def bytes_per_layer(self) -> int:
        """Bytes of K plus V storage of one layer."""
        return self.keys[0].nbytes + self.values[0].nbytes if self.keys else 0

    def close(self) -> None:
        """Free the storage; the cache must be initialised again to be used."""
        self.keys, self.values = [], []
        for ctx in getattr(self, "_placed", None) or ([self._ctx] if self._ctx is not None else []):
            ctx.free()
        self._placed = None
        self._ctx = None
        self._cells = None

    def __repr__(self) -> str:
        n = None if self._cells is None else self._cells.n_cells
        return (f"Causal(n_layers={self.n_layers}, n_embd_k={self.n_embd_k}, n_embd_v={self.n_embd_v}, "
                f"dtype={self.dtype.name}{'' if self.dtype_v == self.dtype else '/' + self.dtype_v.name}, "
                f"window={self.window}, cells={n})")

    # ------------------------------------------------------------------ forward

    def _trim_positions(self, cells: Cells, positions: np.ndarray, seq_ids: np.ndarray) -> dict:
        """Ollama's updateSlidingWindow: lowest position per sequence to trim at."""
        if self.memory is None:
            return {}
        lowest = {}
        for s in np.unique(seq_ids):
            lowest[int(s)] = int(positions[seq_ids == s].min())
        for s in range(cells.n_seq_max):
            if s not in lowest and cells.seq_pos_max(s) >= 0:
                lowest[s] = cells.seq_pos_max(s) + 1
        return lowest

    def start_forward(self, positions, seq_ids, reserve: bool = False, *,
                      except_rows: Optional[Iterable[int]] = None) -> ForwardPlan:
        """Plan a batch: slots, visible range and mask. Changes nothing.

        ``except_rows`` are batch rows exempt from the causal rule (Ollama's
        ``SetCausal`` with ``Except``): they also see later positions of
        their own sequence, i.e. the rest of the batch (bidirectional spans
        such as image tokens). Sequence, window and chunk rules still apply.

        With a sliding window, eviction (Ollama's ``updateSlidingWindow``) is
        planned first and committed by :meth:`apply`; the visible range then
        still spans every remaining cell of the batch's sequences (Ollama
        narrows it to the window), the mask hides what is out of the window.
        Commit with :meth:`apply` once the graph was computed.

        Raises
        ------
        KVCacheFull
            Too few free cells (after sliding-window eviction).
        """
        cells = self.cells
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if positions.shape != seq_ids.shape:
            raise GGMLValueError(
                f"positions and seq_ids differ in length: {positions.size} != {seq_ids.size}")
        n = positions.size
        if n == 0:
            raise GGMLValueError("empty batch")
        if n == 1 and not reserve and except_rows is None and self.memory is None:
            return self._plan_one(cells, positions, seq_ids)
        cells._check_seq_array(seq_ids)
        if (positions < 0).any():
            raise GGMLValueError("positions must be >= 0")
        if reserve:
            if n > cells.n_cells:
                raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: {n})")
            slots = np.arange(n, dtype=np.int64)
            mask = np.zeros((n, cells.n_cells), dtype=np.float16)
            return ForwardPlan(positions, seq_ids, slots, 0, cells.n_cells, mask, True, {},
                               cells.n_cells)
        trial = cells.copy()
        trim = self._trim_positions(trial, positions, seq_ids)
        if trim:
            trial.trim_window(trim, self.memory)
        slots = trial.find_slots(n)
        if slots is None:
            raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: {n})")
        trial.apply(slots, positions, seq_ids)
        lo, hi = trial.visible_range(seq_ids, pad=self.padding)
        mask = trial.mask(positions, seq_ids, window=self.window, chunk=self.chunk,
                          except_rows=except_rows, lo=lo, hi=hi, dtype=np.float16)
        return ForwardPlan(positions, seq_ids, slots, lo, hi, mask, False, trim, cells.n_cells,
                           _base=(cells, cells._version), _after=trial)

    def _plan_one(self, cells: Cells, positions: np.ndarray, seq_ids: np.ndarray) -> ForwardPlan:
        # start_forward for one token without eviction, from scalars and the current cells (no trial copy):
        # the same slot, range and mask as the general path, planned in C (_core._kv_plan_one)
        s, p = int(seq_ids[0]), int(positions[0])
        if not 0 <= s < cells._n_seq_max:
            raise GGMLValueError(f"sequence id {s} out of range [0, {cells._n_seq_max})")
        if not 0 <= p <= _INT32_MAX:
            raise GGMLValueError("positions must be >= 0" if p < 0 else "positions must be in [0, 2**31)")
        slot, lo, hi, mask = _kv_plan_one(cells._occ.view(np.uint8), cells._seq.view(np.uint8), cells._pos, s, p,
                                          self.padding, -1 if self.window is None else self.window,
                                          -1 if self.chunk is None else self.chunk)
        if slot < 0:
            raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: 1)")
        return ForwardPlan(positions, seq_ids, np.array([slot], dtype=np.int64), lo, hi, mask, False, {},
                           cells.n_cells, _base=(cells, cells._version), _one=(slot, p, s))

    def apply(self, plan: ForwardPlan) -> None:
        """Commit a plan's metadata (eviction, then the new cells); all or nothing."""
        self._check_plan(plan)
        base, cells = plan._base, self._cells
        if plan._one is not None and base is not None and base[0] is cells and base[1] == cells._version:
            object.__setattr__(plan, "_base", None)         # a plan commits once
            cells._append_one(*plan._one)
            return
        trial = self._planned_cells(plan)
        if trial is not None:
            self._cells = trial

    def _planned_cells(self, plan: ForwardPlan) -> Optional[Cells]:
        """The metadata after committing ``plan`` (None for a reserve plan); changes nothing."""
        self._check_plan(plan)
        if plan.reserve:
            return None
        base = plan._base
        if (plan._after is not None and base is not None and base[0] is self._cells
                and base[1] == self._cells._version):
            # nothing changed since the plan was made: its planned state is the answer
            object.__setattr__(plan, "_base", None)
            return plan._after
        trial = self.cells.copy()
        if plan.trim:
            trial.trim_window(plan.trim, self.memory)
        trial.apply(plan.slots, plan.positions, plan.seq_ids)
        return trial

    def _check_plan(self, plan: ForwardPlan) -> None:
        if not isinstance(plan, ForwardPlan):
            raise GGMLTypeError(f"plan must be a ForwardPlan, got {type(plan).__name__}")
        if plan.n_cells != self.cells.n_cells:
            raise GGMLValueError("plan was made for a different cache")

    def _check_layer(self, layer: int) -> int:
        layer = int(layer)
        if not 0 <= layer < len(self.keys):
            raise GGMLValueError(f"layer {layer} out of range [0, {len(self.keys)})")
        return layer

    # ------------------------------------------------------------------ graph building

    @staticmethod
    def index_tensor(ctx: Context, plan: ForwardPlan) -> Tensor:
        """The I64 destination-row tensor ``ne = (n_batch,)``, created in ``ctx`` and filled.

        ``ctx`` must be an allocating context (the data is set immediately).
        """
        idx = ctx.new_tensor(Type.I64, (plan.n_batch,), name="kv_slots")
        idx.set(plan.slots)
        return idx

    @staticmethod
    def mask_tensor(ctx: Context, plan: ForwardPlan, dtype=Type.F16) -> Tensor:
        """The mask tensor ``ne = (hi - lo, n_batch)``, created in ``ctx`` and filled."""
        m = ctx.new_tensor(dtype, (plan.n_kv, plan.n_batch), name="kv_mask")
        m.set(plan.mask)
        return m

    def put(self, ctx: Context, layer: int, plan: ForwardPlan, k: Tensor, v: Tensor,
            *, idx: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Write a batch's K and V (``ne = (head_dim, n_head_kv, n_batch)``) at ``plan.slots``.

        ``k`` and ``v`` must be f32 or f16. With ``v_trans`` V is scattered
        along the cell axis of a ``(1, cells, n_embd_v)`` view of the
        transposed storage. The index tensor is made with
        :meth:`index_tensor` unless ``idx`` is given (share it between layers).
        Returns the two ``set_rows`` results; expand both into the graph.
        """
        self._check_plan(plan)
        layer = self._check_layer(layer)
        n = plan.n_batch
        for name, t, embd in (("k", k, self.n_embd_k), ("v", v, self.n_embd_v)):
            ne = t.ne
            if ne[0] * ne[1] != embd or ne[2] * ne[3] != n:
                raise GGMLValueError(f"put: {name} ne={ne} does not hold {n} rows of {embd} "
                                 f"(expected (head_dim, n_head_kv, n_batch))")
        if idx is None:
            idx = self.index_tensor(ctx, plan)
        out = []
        for t, cache, embd in ((k, self.keys[layer], self.n_embd_k),
                               (v, self.values[layer], self.n_embd_v)):
            if t.is_contiguous:
                rows = ctx.reshape(t, (embd, n))
            elif t.nb[1] == t.ne[0] * t.nb[0] == t.type.row_size(t.ne[0]) and t.ne[3] == 1:
                # each token's heads are one contiguous row, the rows strided (views of a fused
                # projection's output): set_rows reads them where they are, no copy
                rows = ctx.view(t, (embd, n), (t.nb[2],), 0)
            else:
                rows = ctx.reshape(ctx.cont(t), (embd, n))
            if cache is self.values[layer] and self.v_trans:
                # one-element rows: row i of channel j is token i's value j
                et = rows.nb[0]
                src = ctx.view(rows, (1, n, embd), (rows.nb[1], et))
                es = cache.nb[0]
                n_cells = cache.ne[0]
                dst = ctx.view(cache, (1, n_cells, embd), (es, n_cells * es))
                out.append(ctx.set_rows(dst, src, idx))
            else:
                out.append(ctx.set_rows(cache, rows, idx))
        return out[0], out[1]

    def get(self, ctx: Context, layer: int, plan: ForwardPlan, *, mask: Optional[Tensor] = None,
            mask_type=Type.F16) -> tuple[Tensor, Tensor, Tensor]:
        """Views of the visible cells and the mask, for ``flash_attn_ext``.

        Returns ``(k, v, mask)``: ``k`` is a strided view
        ``ne = (head_dim_k, hi - lo, n_head_kv)`` of cells ``lo .. hi-1``
        (``v`` likewise with ``head_dim_v``), directly usable as
        ``flash_attn_ext``'s ``k``/``v``; for a ``mul_mat`` path use
        ``ctx.cont`` first where needed. With ``v_trans``, ``v`` is instead
        ``ne = (hi - lo, head_dim_v, n_head_kv)``, ready for
        ``mul_mat(v, softmax(kq))`` with ``kq`` ``ne = (hi - lo, n_batch, n_head)``.
        ``mask`` is ``ne = (hi - lo, n_batch)``
        in ``mask_type``, made with :meth:`mask_tensor` unless given (share it
        between layers). The views read the cache as it is at compute time, so
        expand the :meth:`put` results into the graph first.
        """
        self._check_plan(plan)
        layer = self._check_layer(layer)
        if plan.n_kv == 0:
            raise GGMLValueError("get: empty visible range")
        views = []
        for cache, hd in ((self.keys[layer], self.head_dim_k), (self.values[layer], self.head_dim_v)):
            row = cache.nb[1]
            if cache is self.values[layer] and self.v_trans:
                es = cache.nb[0]
                views.append(ctx.view(cache, (plan.n_kv, hd, self.n_head_kv),
                                      (row, hd * row), plan.lo * es))
                continue
            views.append(ctx.view(cache, (hd, plan.n_kv, self.n_head_kv),
                                  (row, cache.type.row_size(hd)), plan.lo * row))
        if mask is None:
            mask = self.mask_tensor(ctx, plan, mask_type)
        return views[0], views[1], mask

    # ------------------------------------------------------------------ management

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Drop positions ``[begin, end)`` of ``seq``; ``end`` None (or ``2**31-1``) = to the end.

        With a finite ``end``, the later positions of ``seq`` move down by
        ``end - begin`` and their keys are re-rotated with ``shift_fn``
        (Ollama's ``Remove`` + ``shift``): the shifted cells' span is walked
        in chunks of at most ``max_batch`` cells, one graph per chunk, every
        layer's K rows of the chunk viewed, passed through ``shift_fn`` with
        per-cell offsets (``begin - end`` for shifted cells, 0 for the others
        in the span) and copied back. V is not touched. The metadata is
        committed only after every chunk was computed.

        Raises
        ------
        NotSupported
            Shifting is needed but there is no ``shift_fn``, or a cell to
            shift is shared with another sequence. Nothing is changed.
        """
        trial, shifted, begin, end = self._plan_remove(seq, begin, end)
        if shifted.size:
            self._require_host("shifting positions")
            self._shift(shifted, int(begin) - int(end))
        self._cells = trial

    def _plan_remove(self, seq: int, begin: int, end: Optional[int]):
        """Check a :meth:`remove` and return ``(cells after, shifted, begin, end)``; changes nothing."""
        cells = self.cells
        seq = cells._check_seq(seq)
        if end is not None and int(end) >= _INT32_MAX:
            end = None
        if self.shift_fn is None and end is not None and int(end) > int(begin) >= 0:
            held = cells.seqs[:, seq]
            if (held & (cells.pos >= int(end))).any():
                raise NotSupported("model does not support operation: shifting positions")
        trial = cells.copy()
        shifted = trial.remove(seq, begin, end)
        return trial, shifted, begin, end

    def _shift(self, shifted: np.ndarray, offset: int) -> None:
        """Re-rotate the K rows of cells ``shifted`` by ``offset`` positions (chunked)."""
        flag = np.zeros(self.cells.n_cells, dtype=bool)
        flag[shifted] = True
        lo, hi = int(shifted.min()), int(shifted.max()) + 1
        step = self.max_batch
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            sel = np.flatnonzero(flag[a:b])
            if sel.size == 0:
                continue
            s, e = a + int(sel[0]), a + int(sel[-1]) + 1
            self._shift_chunk(s, np.where(flag[s:e], offset, 0).astype(np.int32))

    def _shift_chunk(self, start: int, offsets: np.ndarray) -> None:
        """One shift graph: K rows ``start .. start + len(offsets) - 1`` of every layer."""
        n = int(offsets.size)
        hd = self.head_dim_k
        quantized = self.dtype not in (Type.F32, Type.F16)
        nodes = max(2048, 16 * self.n_layers + 64)
        # Room for the offsets, the graph and, per layer, a few f32 copies of
        # the chunk plus whatever tensors shift_fn creates.
        per_layer = 3 * 4 * n * self.n_embd_k + 16 * (tensor_overhead() + 64)
        size = graph_overhead(nodes) + self.n_layers * per_layer + 4 * n + 4096
        with Context(size) as ctx:
            pos = ctx.new_tensor(Type.I32, (n,), name="kv_shift_offsets")
            pos.set(offsets)
            gf = ctx.new_graph(nodes)
            for layer, cache in enumerate(self.keys):
                row = cache.nb[1]
                view = ctx.view(cache, (hd, self.n_head_kv, n), (self.dtype.row_size(hd), row),
                                start * row)
                src = ctx.cast(view, Type.F32) if quantized else view
                out = self.shift_fn(ctx, layer, src, pos)
                if not isinstance(out, Tensor):
                    raise GGMLTypeError(f"shift_fn must return a Tensor, got {type(out).__name__}")
                gf.build_forward_expand(ctx.cpy(out, view))
            gf.compute(1)

    def fragmentation(self) -> float:
        """``1 - used / (last live cell + 1)``; 0 when empty or compact."""
        cells = self.cells
        live = np.flatnonzero(cells.seqs.any(axis=1))
        if live.size == 0:
            return 0.0
        return 1.0 - cells.used / (int(live[-1]) + 1)

    def defrag(self, max_nodes: int = 2048) -> list[tuple[int, int, int]]:
        """Compact the live cells into ``[0, used)``, moving K and V rows.

        Follows :meth:`Cells.defrag_plan`; every move copies the K and V rows
        of every layer (a source view, a destination view and a copy each, 6
        nodes per layer), batched into graphs of at most about ``max_nodes``
        nodes (at least one move per graph). The metadata is committed after
        all copies were computed. Returns the moves made.
        """
        cells = self.cells
        moves = cells.defrag_plan()
        if not moves:
            return moves
        self._require_host("defragmentation")
        per_move = 6 * self.n_layers
        batch = max(1, (int(max_nodes) - 2 * self.n_layers) // per_move)
        for i in range(0, len(moves), batch):
            group = moves[i:i + batch]
            nodes = len(group) * per_move + 2 * self.n_layers + 16
            size = graph_overhead(nodes) + (nodes + 16) * (tensor_overhead() + 64) + 4096
            with Context(size) as ctx:
                gf = ctx.new_graph(nodes)
                for src, dst, n in group:
                    for t in (*self.keys, *self.values):
                        row = t.nb[1]
                        if self.v_trans and any(t is v for v in self.values):
                            # cells are columns: n elements of every channel row
                            es = t.nb[0]
                            a = ctx.view(t, (n, t.ne[1]), (row,), src * es)
                            b = ctx.view(t, (n, t.ne[1]), (row,), dst * es)
                        else:
                            a = ctx.view(t, (t.ne[0], n), (row,), src * row)
                            b = ctx.view(t, (t.ne[0], n), (row,), dst * row)
                        gf.build_forward_expand(ctx.cpy(a, b))
                gf.compute(1)
        cells.apply_defrag(moves)
        return moves

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` share the first ``length`` positions of ``src`` (metadata only)."""
        self.cells.copy_prefix(src, dst, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos`` from the stored cells.

        Every position the next token can see before ``pos`` must be stored:
        ``[0, pos)``, or only the last ``window`` of them when the cache
        evicts (sliding window with limited memory, as Ollama's ``CanResume``).
        Unlike Ollama (which answers False there when the oldest positions
        were evicted), ``pos == 0`` is always resumable: it needs no history.
        """
        return self.cells.can_resume(seq, pos, window=None if self.memory is None else self.window)

    def seq_pos_min(self, seq: int) -> int:
        return self.cells.seq_pos_min(seq)

    def seq_pos_max(self, seq: int) -> int:
        return self.cells.seq_pos_max(seq)

    def clear(self, seq: Optional[int] = None) -> None:
        """Drop one sequence, or everything (the K/V data is left as is)."""
        self.cells.clear(seq)


# ====================================================================== Wrapper


@dataclass(frozen=True)
class WrapperPlan:
    """One plan per wrapped cache, from :meth:`Wrapper.start_forward`."""

    plans: tuple

    def __getitem__(self, i: int):
        return self.plans[i]

    def __len__(self) -> int:
        return len(self.plans)


class Wrapper:
    """Several caches behind one interface, for models whose layers differ (Ollama's Wrapper).

    Layer ``i`` of the model uses ``caches[layer_to_cache[i]]``; inside that
    cache it is the ``j``-th layer routed there (layers are numbered per
    cache, in model order), so each cache needs at least that many layers.
    E.g. gemma-style: a sliding-window :class:`Causal` for local layers and a
    full one for global layers.

    Parameters
    ----------
    caches : sequence of Causal or Encoder
        The wrapped caches.
    layer_to_cache : sequence of int
        Cache index of every model layer.
    """

    def __init__(self, caches, layer_to_cache) -> None:
        self.caches = list(caches)
        if not self.caches:
            raise GGMLValueError("Wrapper needs at least one cache")
        layer_to_cache = [int(i) for i in layer_to_cache]
        if not layer_to_cache:
            raise GGMLValueError("layer_to_cache must not be empty")
        for i in layer_to_cache:
            if not 0 <= i < len(self.caches):
                raise GGMLValueError(f"cache index {i} out of range [0, {len(self.caches)})")
        self.layer_to_cache = layer_to_cache
        counts = [0] * len(self.caches)
        local = []
        for i in layer_to_cache:
            local.append(counts[i])
            counts[i] += 1
        for k, (cache, n) in enumerate(zip(self.caches, counts)):
            if n > cache.n_layers:
                raise GGMLValueError(f"cache {k} has {cache.n_layers} layers but {n} are routed to it")
        self._local = local

    @property
    def n_layers(self) -> int:
        return len(self.layer_to_cache)

    def route(self, layer: int) -> tuple:
        """``(cache, layer within that cache)`` of a model layer."""
        layer = int(layer)
        if not 0 <= layer < len(self.layer_to_cache):
            raise GGMLValueError(f"layer {layer} out of range [0, {len(self.layer_to_cache)})")
        return self.caches[self.layer_to_cache[layer]], self._local[layer]

    def underlying(self, layer: int):
        """The cache a model layer uses."""
        return self.route(layer)[0]

    def init(self, capacity: int, n_seq_max: int, max_batch: int, **kw) -> None:
        """Initialise every cache (see :meth:`Causal.init`)."""
        for cache in self.caches:
            if isinstance(cache, Causal):
                cache.init(capacity, n_seq_max, max_batch, **kw)
            else:
                cache.init(capacity, n_seq_max, max_batch)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, WrapperPlan) or len(plan) != len(self.caches):
            raise GGMLTypeError("plan must be a WrapperPlan from this Wrapper")

    def start_forward(self, positions, seq_ids, reserve: bool = False, **kw) -> WrapperPlan:
        """Plan the batch on every cache; changes nothing (an error leaves nothing to unwind)."""
        return WrapperPlan(tuple(c.start_forward(positions, seq_ids, reserve, **kw)
                                 for c in self.caches))

    def apply(self, plan: WrapperPlan) -> None:
        """Commit every cache's plan; all or nothing."""
        self._check_plan(plan)
        staged = [c._planned_cells(p) for c, p in zip(self.caches, plan.plans)]
        for c, p, cells in zip(self.caches, plan.plans, staged):
            if isinstance(c, Causal):
                if cells is not None:
                    c._cells = cells
            else:
                c.apply(p)

    def put(self, ctx: Context, layer: int, plan: WrapperPlan, k: Tensor, v: Tensor, **kw):
        """:meth:`Causal.put` on the layer's cache."""
        self._check_plan(plan)
        cache, local = self.route(layer)
        return cache.put(ctx, local, plan.plans[self.layer_to_cache[int(layer)]], k, v, **kw)

    def get(self, ctx: Context, layer: int, plan: WrapperPlan, **kw):
        """:meth:`Causal.get` on the layer's cache."""
        self._check_plan(plan)
        cache, local = self.route(layer)
        return cache.get(ctx, local, plan.plans[self.layer_to_cache[int(layer)]], **kw)

    def can_resume(self, seq: int, pos: int) -> bool:
        """True iff every cache can resume."""
        return all(c.can_resume(seq, pos) for c in self.caches)

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Remove from every cache; checked on all first, so :class:`NotSupported` changes nothing."""
        for c in self.caches:
            c._plan_remove(seq, begin, end)
        for c in self.caches:
            c.remove(seq, begin, end)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for c in self.caches:
            c.copy_prefix(src, dst, length)

    def clear(self, seq: Optional[int] = None) -> None:
        for c in self.caches:
            c.clear(seq)


# ====================================================================== Encoder


@dataclass
class EncoderPlan:
    """A batch for :class:`Encoder`: the encoder position and whether it is a reserve pass."""

    pos: int
    reserve: bool
    wrote: bool = False


class Encoder:
    """Position-independent K/V stored once, e.g. cross-attention over image features.

    Ollama's encoder cache: one sequence, no mask. :meth:`put` stores K and V
    as given (any shape, f32/f16; storage in ``dtype`` or the input's type)
    and :meth:`get` returns the stored tensors whole. Storage is allocated on
    the first :meth:`put` of each layer (again if the shape changes).

    Parameters
    ----------
    n_layers : int
        Number of layers.
    dtype : Type, optional
        Storage type; None keeps the input's type.
    """

    def __init__(self, n_layers: int, dtype=None) -> None:
        self.n_layers = int(n_layers)
        if self.n_layers < 1:
            raise GGMLValueError("n_layers must be >= 1")
        self.dtype = None if dtype is None else Type(dtype)
        self.keys: list = [None] * self.n_layers
        self.values: list = [None] * self.n_layers
        self._ctxs: list = [None] * self.n_layers
        self.encoder_pos = -1
        self.encoder_cached = False
        self._ready = False

    def init(self, capacity: int = 1, n_seq_max: int = 1, max_batch: int = 1) -> None:
        """Check the sizing: only one sequence is supported."""
        if int(n_seq_max) != 1:
            raise GGMLValueError(f"the encoder cache supports one sequence, got n_seq_max={n_seq_max}")
        self._ready = True

    def close(self) -> None:
        for ctx in self._ctxs:
            if ctx is not None:
                ctx.free()
        self.keys = [None] * self.n_layers
        self.values = [None] * self.n_layers
        self._ctxs = [None] * self.n_layers
        self.encoder_cached = False
        self.encoder_pos = -1

    def _check_layer(self, layer: int) -> int:
        layer = int(layer)
        if not 0 <= layer < self.n_layers:
            raise GGMLValueError(f"layer {layer} out of range [0, {self.n_layers})")
        return layer

    def start_forward(self, positions, seq_ids, reserve: bool = False, **kw) -> EncoderPlan:
        """Plan a batch; the encoder position is the batch's last position (or ``encoder_pos``)."""
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if positions.size == 0:
            raise GGMLValueError("empty batch")
        if (seq_ids != 0).any():
            raise GGMLValueError("the encoder cache supports only sequence 0")
        pos = kw.get("encoder_pos")
        pos = int(positions[-1]) if pos is None else int(pos)
        return EncoderPlan(pos, bool(reserve))

    def _planned_cells(self, plan) -> None:
        if not isinstance(plan, EncoderPlan):
            raise GGMLTypeError(f"plan must be an EncoderPlan, got {type(plan).__name__}")
        return None

    def apply(self, plan: EncoderPlan) -> None:
        """Commit: after a non-reserve batch that stored K/V, the encoder output is cached."""
        if not isinstance(plan, EncoderPlan):
            raise GGMLTypeError(f"plan must be an EncoderPlan, got {type(plan).__name__}")
        if plan.wrote and not plan.reserve:
            self.encoder_cached = True
            self.encoder_pos = plan.pos

    def _storage(self, layer: int, k: Tensor, v: Tensor) -> None:
        kt = self.dtype or k.type
        vt = self.dtype or v.type
        old_k, old_v = self.keys[layer], self.values[layer]
        if (old_k is not None and old_k.ne == k.ne and old_k.type == kt
                and old_v.ne == v.ne and old_v.type == vt):
            return
        size = Type(kt).row_size(k.ne[0]) * k.ne[1] * k.ne[2] * k.ne[3]
        size += Type(vt).row_size(v.ne[0]) * v.ne[1] * v.ne[2] * v.ne[3]
        ctx = Context(size + 2 * (tensor_overhead() + 64) + 1024, no_alloc=False)
        nk = ctx.new_tensor(kt, k.ne, name=f"enc_k_l{layer}")
        nv = ctx.new_tensor(vt, v.ne, name=f"enc_v_l{layer}")
        if self._ctxs[layer] is not None:
            self._ctxs[layer].free()
        self._ctxs[layer] = ctx
        self.keys[layer], self.values[layer] = nk, nv

    def put(self, ctx: Context, layer: int, plan: EncoderPlan, k: Tensor, v: Tensor):
        """Copy ``k`` and ``v`` into the layer's storage; returns the two copies to expand."""
        layer = self._check_layer(layer)
        if not isinstance(plan, EncoderPlan):
            raise GGMLTypeError(f"plan must be an EncoderPlan, got {type(plan).__name__}")
        self._storage(layer, k, v)
        plan.wrote = True
        return ctx.cpy(k, self.keys[layer]), ctx.cpy(v, self.values[layer])

    def get(self, ctx: Context, layer: int, plan: Optional[EncoderPlan] = None, **kw):
        """``(k, v, None)``: the stored tensors, whole (no mask)."""
        layer = self._check_layer(layer)
        if self.keys[layer] is None:
            raise CacheStateError(f"encoder cache: nothing stored for layer {layer} (put() it first)")
        return self.keys[layer], self.values[layer], None

    def _plan_remove(self, seq: int, begin: int, end: Optional[int]):
        if int(seq) != 0:
            raise GGMLValueError("the encoder cache supports only sequence 0")

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Forget the encoder output if its position lies in ``[begin, end)``."""
        self._plan_remove(seq, begin, end)
        end = _INT32_MAX if end is None else int(end)
        if int(begin) <= self.encoder_pos < end:
            self.encoder_cached = False

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        raise NotSupported("the encoder cache has one sequence; copy_prefix is not supported")

    def can_resume(self, seq: int, pos: int) -> bool:
        return True

    def clear(self, seq: Optional[int] = None) -> None:
        self.encoder_cached = False
        self.encoder_pos = -1
