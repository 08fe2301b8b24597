"""A batch through a :class:`~ggmlpy.kvcache.Causal` cache: the plan, its commit, and the graph's writes and views.

* :class:`ForwardPlan`: where one batch goes and what it sees (the cells written, the visible cell range,
  the mask), made by ``start_forward`` without changing anything; ``apply`` commits it once the graph exists;
* :class:`Forward`: one graph's view of a cache, which owns the graph inputs the cache needs (destination
  rows, mask) and fills them;
* ``_CausalForward``: the per-batch half of :class:`~ggmlpy.kvcache.Causal` (planning, committing, and the
  ``set_rows`` writes and strided views of K/V). ``Causal`` is this class plus its storage, its sizes and
  its maintenance (``kvcache/causal.py``), which set up what these methods read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from ggmlpy._core import (
    Context,
    GGMLError,
    GGMLTypeError,
    GGMLValueError,
    Tensor,
    Type,
    _kv_plan_one,
)

from .cells import _INT32_MAX, Cells, _int_array

__all__ = ["Forward", "ForwardPlan", "KVCacheFull"]


class KVCacheFull(RuntimeError, GGMLError):
    """No free cache cells for a batch. Nothing has been changed."""


@dataclass(frozen=True)
class ForwardPlan:
    """Where one batch goes and what it sees, from :meth:`~ggmlpy.kvcache.Causal.start_forward`.

    Attributes
    ----------
    positions, seq_ids : numpy.ndarray
        ``int64[n_batch]``, the batch's tokens.
    cell_ids : numpy.ndarray
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
    cell_ids: np.ndarray
    lo: int
    hi: int
    mask: np.ndarray
    reserve: bool
    trim: dict
    n_cells: int
    _base: Optional[tuple] = field(default=None, repr=False, compare=False)
    _after: Optional[Cells] = field(default=None, repr=False, compare=False)
    _one: Optional[tuple] = field(default=None, repr=False, compare=False)    # (cell, pos, seq) of a one-token plan

    @property
    def n_batch(self) -> int:
        """Number of tokens in the batch."""
        return int(self.cell_ids.size)

    @property
    def n_kv(self) -> int:
        """Length of the visible cell range, ``hi - lo``."""
        return self.hi - self.lo

    @property
    def key(self) -> tuple:
        """What a graph built for this plan depends on besides the batch size: the visible range."""
        return (self.lo, self.hi)


def _mask_chunks(mask: np.ndarray, cell_pos: np.ndarray, positions: np.ndarray, chunk: int) -> None:
    """Chunked attention, in place: row ``i`` of ``mask`` (``[n_batch, hi - lo]``, cells ``lo..hi`` at
    ``cell_pos``) hides the cells before its chunk, positions below ``p - p % chunk`` (llama.cpp's
    ``LLAMA_SWA_TYPE_CHUNKED``); the causal, sequence and emptiness rules were applied already."""
    start = positions - positions % chunk
    mask[cell_pos[None, :] < start[:, None]] = -np.inf


class _LayerView:
    """The current-layer cursor of a graph's view of a cache (``cache`` must have ``_check_layer``)."""

    cache: object
    layer: Optional[int] = None

    def set_layer(self, layer: int):
        self.layer = self.cache._check_layer(layer)
        return self

    def _need_layer(self) -> int:
        if self.layer is None:
            raise GGMLValueError("call set_layer(i) first")
        return self.layer


class Forward(_LayerView):
    """One graph's view of a cache, in the shape of Ollama's Cache protocol: the cache's inputs plus put/get.

    Made by ``cache.forward(ctx, plan)``: ``set_layer(i)``, then ``put(k, v)``
    and ``get()`` for that layer. The cache owns the graph's inputs it needs
    (llama.cpp's ``build_input_k_idxs``/``set_input_kq_mask``): the I64
    destination rows and the F16 mask, created once per graph and shared by
    every layer. In a ``no_alloc`` context (a graph the scheduler allocates)
    they are marked as inputs and filled by :meth:`fill` once allocated; in
    an allocating context they are filled at once. ``pending`` collects the
    writes to expand into the graph before anything that reads the cache.

    A graph built for one plan is reused for another of the same
    :attr:`ForwardPlan.key`: :meth:`fill` takes the new plan.
    """

    def __init__(self, cache, ctx: Context, plan) -> None:
        self.cache, self.ctx, self.plan = cache, ctx, plan
        self._key, self._n = plan.key, plan.n_batch
        self.layer: Optional[int] = None
        self.pending: list = []
        self._idx = None
        self._mask = None

    @property
    def v_trans(self) -> bool:
        """Whether the current layer's V is stored transposed (see :class:`~ggmlpy.kvcache.Causal`)."""
        return self.cache.v_trans

    def put(self, k: Tensor, v: Optional[Tensor]) -> tuple:
        """Write this batch's K and V for the current layer (a batch-size mismatch raises ValueError; ``v`` is
        None for a K-only cache, ``v_in_k``)."""
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

    def fill(self, plan=None) -> None:
        """Upload the inputs of ``plan`` (default: the plan built with), e.g. after the scheduler allocated
        the graph; ``plan`` must have this graph's :attr:`ForwardPlan.key` and batch size. The plan is not
        kept (its mask can be large; a pooled graph must not hold one)."""
        if plan is None:
            plan = self.plan
            if plan is None:
                raise GGMLValueError("fill: the plan this graph was built with was uploaded already; pass the next")
        elif plan.key != self._key or plan.n_batch != self._n:
            raise GGMLValueError(f"fill: a plan of range {plan.key} and {plan.n_batch} rows for a graph built "
                                 f"for {self._key} and {self._n}")
        if self._idx is not None:
            self._idx.set(plan.cell_ids)
        if self._mask is not None:
            self._mask.set(plan.mask)            # float16, as the tensor: one copy
        self.plan = None


class _CausalForward:
    """The per-batch methods of :class:`~ggmlpy.kvcache.Causal` (its base; see there for the whole).

    They read what ``Causal`` sets up: the cells (:attr:`cells`), the per-layer ``keys`` and ``values``,
    the sizes (``n_embd_k``, ``head_dim_k``, ``n_head_kv``...), ``padding``, ``window``, ``memory`` and
    ``v_trans``.
    """

    def forward(self, ctx: Context, plan: ForwardPlan) -> Forward:
        """A :class:`Forward` for building this batch's graph layer by layer."""
        self._check_plan(plan)
        return Forward(self, ctx, plan)

    # ------------------------------------------------------------------ plans

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
                      except_rows: Optional[Iterable[int]] = None,
                      spans: Optional[Iterable[tuple[int, int]]] = None) -> ForwardPlan:
        """Plan a batch: the cells written, visible range and mask. Changes nothing.

        ``except_rows`` are batch rows exempt from the causal rule (Ollama's
        ``SetCausal`` with ``Except``): they also see later positions of
        their own sequence, i.e. the rest of the batch. ``spans`` are
        bidirectional spans ``(first_row, end_row)`` of one sequence (an
        image's tokens, as transformers' Gemma 3 masks them): a row of a span
        also sees the later rows of its span, and nothing later. Sequence and
        window rules still apply.

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
        span_list = [] if spans is None else [(int(a), int(b)) for a, b in spans]
        for a, b in span_list:
            if not 0 <= a < b <= n:
                raise GGMLValueError(f"bidirectional span [{a}, {b}) is outside the batch of {n} rows")
        if span_list:
            except_rows = [*(except_rows or ()), *(r for a, b in span_list for r in range(a, b))]
        if n == 1 and not reserve and except_rows is None:
            if self.memory is None:
                return self._plan_one(cells, positions, seq_ids)
            return self._plan_one_window(cells, positions, seq_ids)
        cells._check_seq_array(seq_ids)
        if (positions < 0).any():
            raise GGMLValueError("positions must be >= 0")
        if reserve:
            if n > cells.n_cells:
                raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: {n})")
            cell_ids = np.arange(n, dtype=np.int64)
            mask = np.zeros((n, cells.n_cells), dtype=np.float16)
            return ForwardPlan(positions, seq_ids, cell_ids, 0, cells.n_cells, mask, True, {},
                               cells.n_cells)
        trial = cells.copy()
        trim = self._trim_positions(trial, positions, seq_ids)
        if trim:
            trial.trim_window(trim, self.memory)
        cell_ids = trial.find_free(n)
        if cell_ids is None:
            raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: {n})")
        trial.apply(cell_ids, positions, seq_ids)
        lo, hi = trial.visible_range(seq_ids, pad=self.padding)
        mask = trial.mask(positions, seq_ids, window=self.window, except_rows=except_rows, lo=lo, hi=hi,
                          dtype=np.float16)
        if self.chunk is not None:
            _mask_chunks(mask, trial.pos[lo:hi], positions, self.chunk)
        if span_list:
            # a span's rows see its own later rows, not what follows it in the batch
            cell_pos = trial.pos[lo:hi]
            for a, b in span_list:
                mask[a:b, cell_pos > positions[a:b].max()] = -np.inf
        return ForwardPlan(positions, seq_ids, cell_ids, lo, hi, mask, False, trim, cells.n_cells,
                           _base=(cells, cells._version), _after=trial)

    def _plan_one_window(self, cells: Cells, positions: np.ndarray, seq_ids: np.ndarray) -> ForwardPlan:
        # one token into a sliding-window cache: the general path's eviction (each sequence trimmed at
        # this token's position, or an idle one at its last + 1) decided from the per-sequence
        # min/max; usually nothing or one cell goes, so only then is a trial copy trimmed
        s, p = int(seq_ids[0]), int(positions[0])
        if not 0 <= s < cells._n_seq_max or p < 0:
            return self._plan_one(cells, positions, seq_ids)      # raises the usual error
        lo, hi = cells._pos_min, cells._pos_max
        at = hi.astype(np.int64) + 1
        at[s] = p
        evict = (lo >= 0) & (lo < at - self.memory)
        if not evict.any():
            return self._plan_one(cells, positions, seq_ids)
        trial = cells.copy()
        trial.trim_window({int(t): int(at[t]) for t in np.flatnonzero(evict)}, self.memory)
        plan = self._plan_one(trial, positions, seq_ids)
        trial._append_one(*plan._one)
        # committed by apply() as a general plan whose planned state is ``trial``; the trim is replayed
        # only if the cells changed in between
        trim = {int(t): int(at[t]) for t in np.flatnonzero((hi >= 0) | (np.arange(hi.size) == s))}
        return replace(plan, trim=trim, _base=(cells, cells._version), _after=trial, _one=None)

    def _plan_one(self, cells: Cells, positions: np.ndarray, seq_ids: np.ndarray) -> ForwardPlan:
        # start_forward for one token without eviction, from scalars and the current cells (no trial copy):
        # the same cell, range and mask as the general path, planned in C (_core._kv_plan_one)
        s, p = int(seq_ids[0]), int(positions[0])
        if not 0 <= s < cells._n_seq_max:
            raise GGMLValueError(f"sequence id {s} out of range [0, {cells._n_seq_max})")
        if not 0 <= p <= _INT32_MAX:
            raise GGMLValueError("positions must be >= 0" if p < 0 else "positions must be in [0, 2**31)")
        cell, lo, hi, mask = _kv_plan_one(cells._occ.view(np.uint8), cells._seq.view(np.uint8), cells._pos, s, p,
                                          self.padding, -1 if self.window is None else self.window)
        if cell < 0:
            raise KVCacheFull(f"could not find a kv cache slot (cache: {cells.n_cells} batch: 1)")
        if self.chunk is not None:
            cell_pos = cells._pos[lo:hi].astype(np.int64)
            cell_pos[cell - lo] = p                     # the token's own cell, not yet committed
            _mask_chunks(mask, cell_pos, positions, self.chunk)
        return ForwardPlan(positions, seq_ids, np.array([cell], dtype=np.int64), lo, hi, mask, False, {},
                           cells.n_cells, _base=(cells, cells._version), _one=(cell, p, s))

    def apply(self, plan: ForwardPlan) -> None:
        """Commit a plan's metadata (eviction, then the new cells); all or nothing."""
        self._stage(plan)()

    def _stage(self, plan: ForwardPlan) -> Callable[[], None]:
        """Check ``plan`` against the cells as they are; returns what commits it, which cannot fail
        (a Wrapper stages every cache's plan before committing any)."""
        self._check_plan(plan)
        base, cells = plan._base, self._cells
        if plan._one is not None and base is not None and base[0] is cells and base[1] == cells._version:
            def append() -> None:
                # a current one-token plan is committed in place, not through a copy of the cells
                object.__setattr__(plan, "_base", None)         # a plan commits once
                cells._append_one(*plan._one)
            return append
        trial = self._planned_cells(plan)

        def swap() -> None:
            if trial is not None:
                self._cells = trial
        return swap

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
        trial.apply(plan.cell_ids, plan.positions, plan.seq_ids)
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
    def _input(ctx: Context, type: Type, ne: tuple, name: str, data: np.ndarray) -> Tensor:
        t = ctx.new_tensor(type, ne, name=name)
        if ctx.no_alloc:
            t.set_input()              # allocated by the scheduler, filled by Forward.fill()
        else:
            t.set(data)
        return t

    @staticmethod
    def index_tensor(ctx: Context, plan: ForwardPlan) -> Tensor:
        """The I64 destination-row tensor ``ne = (n_batch,)``, created in ``ctx``: filled at once in an
        allocating context, marked as an input (to fill once allocated) in a ``no_alloc`` one."""
        return _CausalForward._input(ctx, Type.I64, (plan.n_batch,), "kv_idxs", plan.cell_ids)

    @staticmethod
    def mask_tensor(ctx: Context, plan: ForwardPlan, dtype=Type.F16) -> Tensor:
        """The mask tensor ``ne = (hi - lo, n_batch)``, created in ``ctx`` (filled as :meth:`index_tensor`)."""
        return _CausalForward._input(ctx, dtype, (plan.n_kv, plan.n_batch), "kv_mask", plan.mask)

    def put(self, ctx: Context, layer: int, plan: ForwardPlan, k: Tensor, v: Optional[Tensor],
            *, idx: Optional[Tensor] = None) -> tuple[Tensor, ...]:
        """Write a batch's K and V (``ne = (head_dim, n_head_kv, n_batch)``) at ``plan.cell_ids``.

        ``k`` and ``v`` must be f32 or f16. With ``v_trans`` V is scattered
        along the cell axis of a ``(1, cells, n_embd_v)`` view of the
        transposed storage. A K-only cache (``v_in_k``) takes ``v=None``: its V
        is part of K. The index tensor is made with
        :meth:`index_tensor` unless ``idx`` is given (share it between layers).
        Returns the ``set_rows`` results (K and V, or K alone); expand them into the graph.
        """
        self._check_plan(plan)
        layer = self._check_layer(layer)
        n = plan.n_batch
        if (v is None) != self.v_in_k:
            raise GGMLValueError("put: a K-only cache (v_in_k) takes v=None, its V being part of K" if self.v_in_k
                                 else "put: v is None, but this cache stores V")
        parts = (("k", k, self.n_embd_k),) if self.v_in_k else (("k", k, self.n_embd_k), ("v", v, self.n_embd_v))
        for name, t, embd in parts:
            ne = t.ne
            if ne[0] * ne[1] != embd or ne[2] * ne[3] != n:
                raise GGMLValueError(f"put: {name} ne={ne} does not hold {n} rows of {embd} "
                                 f"(expected (head_dim, n_head_kv, n_batch))")
        if idx is None:
            idx = self.index_tensor(ctx, plan)
        out = []
        stores = [(k, self.keys[layer], self.n_embd_k)]
        if not self.v_in_k:
            stores.append((v, self.values[layer], self.n_embd_v))
        for t, cache, embd in stores:
            if t.is_contiguous:
                rows = ctx.reshape(t, (embd, n))
            elif t.nb[1] == t.ne[0] * t.nb[0] == t.type.row_size(t.ne[0]) and t.ne[3] == 1:
                # each token's heads are one contiguous row, the rows strided (views of a fused
                # projection's output): set_rows reads them where they are, no copy
                rows = ctx.view(t, (embd, n), (t.nb[2],), 0)
            else:
                rows = ctx.reshape(ctx.cont(t), (embd, n))
            if self.v_trans and cache is self.values[layer]:
                # one-element rows: row i of channel j is token i's value j
                et = rows.nb[0]
                src = ctx.view(rows, (1, n, embd), (rows.nb[1], et))
                es = cache.nb[0]
                n_cells = cache.ne[0]
                dst = ctx.view(cache, (1, n_cells, embd), (es, n_cells * es))
                out.append(ctx.set_rows(dst, src, idx))
            else:
                out.append(ctx.set_rows(cache, rows, idx))
        return tuple(out)

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
        For a K-only cache (``v_in_k``) ``v`` is the same kind of view of the K storage, its first
        ``head_dim_v`` values of each head. ``mask`` is ``ne = (hi - lo, n_batch)``
        in ``mask_type``, made with :meth:`mask_tensor` unless given (share it
        between layers). The views read the cache as it is at compute time, so
        expand the :meth:`put` results into the graph first.
        """
        self._check_plan(plan)
        layer = self._check_layer(layer)
        if plan.n_kv == 0:
            raise GGMLValueError("get: empty visible range")
        views = []
        keys = self.keys[layer]
        for cache, hd in ((keys, self.head_dim_k), (keys if self.v_in_k else self.values[layer], self.head_dim_v)):
            row = cache.nb[1]
            if self.v_trans and cache is self.values[layer]:
                es = cache.nb[0]
                views.append(ctx.view(cache, (plan.n_kv, hd, self.n_head_kv),
                                      (row, hd * row), plan.lo * es))
                continue
            # a head starts every head_dim_k values (in a K-only cache, V's heads too)
            views.append(ctx.view(cache, (hd, plan.n_kv, self.n_head_kv),
                                  (row, cache.type.row_size(self.head_dim_k if self.v_in_k else hd)), plan.lo * row))
        if mask is None:
            mask = self.mask_tensor(ctx, plan, mask_type)
        return views[0], views[1], mask

