"""The causal K/V cache (Ollama's ``Causal``): per-layer K/V storage over :class:`~ggmlpy.kvcache.cells.Cells`.

A :class:`Causal` plans a batch (:meth:`Causal.start_forward`: the cells written, the
visible cell range, the mask), builds the graph pieces that write and read
its tensors, and commits the metadata with :meth:`Causal.apply` once the
graph exists. Removing a middle range shifts the later keys through the
model's ``shift_fn``; :meth:`Causal.defrag` compacts the live cells.

This module holds the cache's storage (K/V on the layers' devices, its sizes, its lifetime) and its
maintenance (remove with a key shift, defragmentation, the sequence operations); the per-batch half (the
plan and its commit, the graph's writes and views: ``_CausalForward``) and :class:`ForwardPlan`,
:class:`Forward` and :class:`KVCacheFull` are in :mod:`ggmlpy.kvcache.forward`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from ggmlpy._core import (
    Context,
    GGMLMemoryError,
    GGMLTypeError,
    GGMLValueError,
    Tensor,
    Type,
    graph_overhead,
    is_quantized,
    tensor_overhead,
)
from ggmlpy.memory import MemoryReport, advise_huge_pages

from .cells import _INT32_MAX, CacheStateError, Cells, NotSupported
from .forward import Forward, ForwardPlan, KVCacheFull, _CausalForward

__all__ = ["V_TRANS_TYPES", "Causal", "Forward", "ForwardPlan", "KVCacheFull"]

#: V types the ``mul_mat`` path can store transposed (one element per row: no quantized blocks).
V_TRANS_TYPES = (Type.F32, Type.F16, Type.BF16)


class Causal(_CausalForward):
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
    v_in_k : bool
        Store K only, and read V as the first ``head_dim_v`` values of each K head (llama.cpp's K-only
        cache: DeepSeek's multi-head latent attention keeps the compressed latent and the RoPE part of
        each token in one row, and its value is that latent). ``n_embd_v`` must be at most ``n_embd_k``;
        V has K's type (``dtype_v`` must be None or ``dtype``); not with ``v_trans``. :meth:`put` then
        takes ``v=None`` and writes K only; no V tensors exist (:attr:`values` is empty).
    chunk : int, optional
        Chunked attention (Llama 4's local layers, llama.cpp's ``LLAMA_SWA_TYPE_CHUNKED``): a token at
        position ``p`` sees only the positions of its own chunk, ``[p - p % chunk, p]``. Not with ``window``.
        Earlier chunks are masked, and evicted as a sliding window's cells are: each sequence keeps its last
        ``chunk`` positions (``chunk + 1`` with several sequences), which hold every position its next token's
        chunk needs, and the cache is sized as a window cache of that memory (llama.cpp's chunked cache keeps
        the current chunk and sizes so too); :meth:`can_resume` then asks for the last ``chunk`` positions.
    memory : int, optional
        With ``window``: keep ``memory`` positions (``>= window``) per
        sequence for prefix reuse while the mask still uses ``window``
        (Ollama's ``NewSWAMemCache``, which its gpt-oss uses). None or 0 means ``window``.
    shift_fn : callable, optional
        The model's key shift, ``shift_fn(ctx, layer, k, offsets) -> Tensor``:
        ``k`` is ``ne = (head_dim_k, n_head_kv, n)`` (F32/F16; F32 for a
        quantized cache) and ``offsets`` an I32 ``ne = (n,)`` of position
        deltas, typically ``ctx.rope_ext(k, offsets, n_dims=..., mode=...,
        freq_base=...)`` with the model's RoPE settings. ``layer`` is the
        model layer (:attr:`model_layers`: the cache's own layer index, unless
        ``init(layers=...)`` maps them, as a :class:`Wrapper` does), so a model
        whose layers rotate differently (gemma3's local and global RoPE bases)
        shifts each with its own settings. Without it
        :meth:`remove` of a middle range raises :class:`NotSupported`.
    """

    def __init__(self, n_layers: int, n_embd_k: int, n_embd_v: int, dtype=Type.F16, *,
                 window: Optional[int] = None, padding: int = 1, n_head_kv: int = 1,
                 shift_fn: Optional[Callable[[Context, int, Tensor, Tensor], Tensor]] = None,
                 v_trans: bool = False, memory: Optional[int] = None, dtype_v=None, v_in_k: bool = False,
                 chunk: Optional[int] = None) -> None:
        self.n_layers = int(n_layers)
        self.n_embd_k = int(n_embd_k)
        self.n_embd_v = int(n_embd_v)
        self.dtype = Type(dtype)
        self.dtype_v = self.dtype if dtype_v is None else Type(dtype_v)
        self.n_head_kv = int(n_head_kv)
        self.v_in_k = bool(v_in_k)
        if self.v_in_k and (self.dtype_v != self.dtype or v_trans or self.n_embd_v > self.n_embd_k):
            raise GGMLValueError(f"v_in_k: V is read from K's rows, so it needs n_embd_v <= n_embd_k (got "
                                 f"{self.n_embd_v} > {self.n_embd_k})" if self.n_embd_v > self.n_embd_k else
                                 "v_in_k: V is read from K's rows: it has K's type (dtype_v None or dtype) and "
                                 "cannot be stored transposed (v_trans)")
        if self.n_layers < 1 or self.n_embd_k < 1 or self.n_embd_v < 1:
            raise GGMLValueError("n_layers, n_embd_k and n_embd_v must be >= 1")
        if self.n_head_kv < 1 or self.n_embd_k % self.n_head_kv or self.n_embd_v % self.n_head_kv:
            raise GGMLValueError(f"n_head_kv {self.n_head_kv} must divide n_embd_k and n_embd_v")
        if window is not None and int(window) < 0:
            raise GGMLValueError(f"window must be >= 0, got {window}")
        # Ollama: window 0 means unlimited.
        self.window = None if not window else int(window)
        if chunk is not None and (int(chunk) < 1 or self.window is not None):
            raise GGMLValueError(f"chunk must be >= 1 and without a window, got chunk {chunk}, window {window}")
        self.chunk = None if chunk is None else int(chunk)
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
        self.runtime = None
        #: The model layer of each of this cache's layers (set by :meth:`init`; ``shift_fn`` receives these).
        self.model_layers: list[int] = list(range(self.n_layers))

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

    def init(self, capacity: int, n_seq_max: int, max_batch: int, *, placement=None, report=None,
             runtime=None, layers=None) -> None:
        """Size the cache and allocate zero-filled K/V for every layer.

        ``capacity`` is per sequence. Cells: ``n_seq_max * capacity`` for an
        unlimited cache, ``n_seq_max * memory + max_batch`` with a sliding
        window or chunks, rounded up to ``padding``. ``memory`` is the ``memory``
        option (default the window, or the chunk), at least ``window + 1`` with several
        sequences, and unlimited when that reaches ``capacity``.

        With ``placement`` (a :class:`ggmlpy.backend.Placement`), each layer's
        K/V live in a buffer on that layer's device and their bytes are
        recorded in ``report`` (a :class:`ggmlpy.memory.MemoryReport`) as
        cache; otherwise they are host memory. Shift and defragmentation
        compute through ``runtime`` (a :class:`ggmlpy.backend.Runtime` over the
        cache's devices), so they run wherever the cache lives; without one
        they run on the host, and a cache in device memory raises
        :class:`NotSupported` for them (the caller clears and re-processes).
        ``layers`` are the model layers this cache's layers are (default ``0 .. n_layers - 1``; a
        :class:`Wrapper` gives each cache the layers routed to it): they pick the devices and the
        report's rows, and are the layers ``shift_fn`` is called with (:attr:`model_layers`).

        Raises
        ------
        GGMLMemoryError
            A device had no room; ``.report`` has what every device needed.
        """
        if self._ctx is not None:
            raise CacheStateError("kv cache: already initialised (close() it first)")
        capacity, n_seq_max, max_batch = int(capacity), int(n_seq_max), int(max_batch)
        model_layers = self._model_layers(layers)
        n, self.memory = self._size(capacity, n_seq_max, max_batch)
        self.model_layers = model_layers
        self.runtime = runtime
        self.max_batch = max_batch
        k_row = self.dtype.row_size(self.n_embd_k)
        v_row = self._v_row_bytes()
        size = self.n_layers * ((k_row + v_row) * n + 2 * (tensor_overhead() + 64))
        v_ne = (n, self.n_embd_v) if self.v_trans else (self.n_embd_v, n)
        if placement is not None:
            self._init_placed(n, v_ne, placement, report, model_layers)
            self._cells = Cells(n, n_seq_max)
            return
        ctx = Context(size + 1024, no_alloc=False)
        keys, values = [], []
        zeros_k = np.zeros((n, self.n_embd_k), dtype=np.float32)
        zeros_v = None if self.v_in_k else np.zeros(v_ne[::-1], dtype=np.float32)
        for i in range(self.n_layers):
            k = ctx.new_tensor(self.dtype, (self.n_embd_k, n), name=f"cache_k_l{i}")
            k.set(zeros_k)
            keys.append(k)
            if not self.v_in_k:
                v = ctx.new_tensor(self.dtype_v, v_ne, name=f"cache_v_l{i}")
                v.set(zeros_v)
                values.append(v)
        self._ctx = ctx
        self.keys, self.values = keys, values
        self._cells = Cells(n, n_seq_max)

    def _size(self, capacity: int, n_seq_max: int, max_batch: int) -> tuple[int, Optional[int]]:
        """``(cells, memory)`` that :meth:`init` would use (see there)."""
        if capacity < 1 or n_seq_max < 1 or max_batch < 1:
            raise GGMLValueError("capacity, n_seq_max and max_batch must be >= 1")
        # a chunked cache keeps the last `chunk` positions: every position of the current chunk
        memory = self.memory_size or self.window or self.chunk
        if memory is not None and n_seq_max > 1:
            # keep the stop token so a conversation can resume
            memory = max(memory, (self.window or self.chunk) + 1)
        if memory is not None and memory >= capacity:
            memory = None
        n = n_seq_max * capacity if memory is None else n_seq_max * memory + max_batch
        return -(-n // self.padding) * self.padding, memory

    def cells_needed(self, capacity: int, n_seq_max: int, max_batch: int) -> int:
        """Cells :meth:`init` would allocate for these arguments (nothing is allocated)."""
        return self._size(int(capacity), int(n_seq_max), int(max_batch))[0]

    def _model_layers(self, layers) -> list:
        layers = list(range(self.n_layers)) if layers is None else [int(i) for i in layers]
        if len(layers) != self.n_layers:
            raise GGMLValueError(f"kv cache: {len(layers)} model layers given for a cache of {self.n_layers}")
        return layers

    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement=None, layers=None) -> int:
        """Host memory this cache needs at these sizes (an upper estimate, in bytes; nothing is allocated).

        The attention mask of a batch of ``max_batch`` is ``max_batch x cells`` float16, built on the host
        (C loops write the array that is uploaded); every batch plans on a copy of the cells' metadata
        (position and sequence flags per cell); and the K/V of layers on the CPU (all of them without
        ``placement``) are host memory too. ``layers`` as for :meth:`init`.
        """
        n = self.cells_needed(capacity, n_seq_max, max_batch)
        mask = int(max_batch) * n * 2
        meta = 2 * n * (4 + int(n_seq_max))
        layers = self._model_layers(layers)
        on_cpu = len(layers) if placement is None else sum(placement.device_of(i).type == "CPU" for i in layers)
        return mask + meta + on_cpu * n * (self.dtype.row_size(self.n_embd_k) + self._v_row_bytes())

    def _v_row_bytes(self) -> int:
        """Bytes of one cell's V as stored apart from K (0 for a K-only cache: ``v_in_k``)."""
        return 0 if self.v_in_k else self.dtype_v.row_size(self.n_embd_v)

    def _init_placed(self, n: int, v_ne, placement, report, layers: list) -> None:
        # One no_alloc context and one buffer per device, as the weights do.
        from ggmlpy import _core

        if report is None:
            report = MemoryReport(placement.n_layers)
        ctxs: dict = {}
        keys, values = [], []
        devs = [placement.device_of(i) for i in layers]
        for i, dev in enumerate(devs):
            ctx = ctxs.get(dev.name)
            if ctx is None:
                ctx = ctxs[dev.name] = (dev, Context.for_tensors(2 * self.n_layers, no_alloc=True))
            keys.append(ctx[1].new_tensor(self.dtype, (self.n_embd_k, n), name=f"cache_k_l{i}"))
            if not self.v_in_k:
                values.append(ctx[1].new_tensor(self.dtype_v, v_ne, name=f"cache_v_l{i}"))
        failed = None
        # this cache replaces what an earlier one on the same model recorded, on whatever device that was
        # (a runner without KV offload keeps on the CPU the layers an earlier one kept on their devices)
        for m in report.devices.values():
            for i in layers:
                m.cache.pop(i, None)
        for i, dev in zip(layers, devs):
            report.device(dev).cache[i] = 0
        for dev, ctx in ctxs.values():
            bt = dev.buffer_type()
            for j, (i, d) in enumerate(zip(layers, devs)):
                if d == dev:
                    stored = (keys[j],) if self.v_in_k else (keys[j], values[j])
                    report.add_cache(dev, i, sum(-(-bt.alloc_size(t) // bt.alignment) * bt.alignment for t in stored))
            try:
                buf = _core.alloc_ctx_tensors(ctx, bt)
            except MemoryError as e:
                report.device(dev).cache_ok = False
                failed = failed or e
                continue
            advise_huge_pages(buf)                # before the clear touches its pages
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

    def _require_maintainable(self, what: str) -> None:
        if self.runtime is None and not all(t.is_host for t in (*self.keys, *self.values)):
            raise NotSupported(f"{what} of a cache in device memory needs the runtime of its devices "
                               "(init(..., runtime=...))")

    def _maintain(self, nodes: int, host_bytes: int, build: Callable[[Context, object], list]) -> None:
        """Build and compute one maintenance graph (shift, defragmentation) over the stored K/V.

        ``build(ctx, gf)`` expands the graph and returns its inputs as ``(tensor, data)`` pairs. With a
        runtime the graph is allocated and computed by its scheduler, on the devices holding the cache;
        without one it computes on the host in a context of ``host_bytes``.
        """
        rt = self.runtime
        if rt is None:
            with Context(graph_overhead(nodes) + host_bytes) as ctx:
                gf = ctx.new_graph(nodes)
                for t, data in build(ctx, gf):
                    t.set(data)
                gf.compute(1)
            return
        with Context.for_tensors(nodes, graph_size=nodes, no_alloc=True) as ctx:
            gf = ctx.new_graph(nodes)
            inputs = build(ctx, gf)
            for t, _ in inputs:
                t.set_input()
            rt.run(gf, lambda: [t.set(data) for t, data in inputs])

    def bytes_per_layer(self) -> int:
        """Bytes of K plus V storage of one layer."""
        return self.keys[0].nbytes + (self.values[0].nbytes if self.values else 0) if self.keys else 0

    def close(self) -> None:
        """Free the storage; the cache must be initialised again to be used."""
        self.keys, self.values = [], []
        for ctx in getattr(self, "_placed", None) or ([self._ctx] if self._ctx is not None else []):
            ctx.free()
        self._placed = None
        self._ctx = None
        self._cells = None
        self.runtime = None

    def __repr__(self) -> str:
        n = None if self._cells is None else self._cells.n_cells
        return (f"Causal(n_layers={self.n_layers}, n_embd_k={self.n_embd_k}, n_embd_v={self.n_embd_v}, "
                f"dtype={self.dtype.name}{'' if self.dtype_v == self.dtype else '/' + self.dtype_v.name}, "
                f"window={self.window}{'' if self.chunk is None else f', chunk={self.chunk}'}, cells={n})")

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
            self._require_maintainable("shifting positions")
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
        # Room (on the host path) for the offsets and, per layer, a few f32 copies of the chunk plus
        # whatever tensors shift_fn creates.
        per_layer = 3 * 4 * n * self.n_embd_k + 16 * (tensor_overhead() + 64)

        def build(ctx, gf):
            pos = ctx.new_tensor(Type.I32, (n,), name="kv_shift_offsets")
            # in the graph even when no layer reads it (Llama 4's NoPE layers keep their keys), so it is allocated
            gf.build_forward_expand(pos)
            for layer, cache in enumerate(self.keys):
                row = cache.nb[1]
                view = ctx.view(cache, (hd, self.n_head_kv, n), (self.dtype.row_size(hd), row), start * row)
                src = ctx.cast(view, Type.F32) if quantized else view
                out = self.shift_fn(ctx, self.model_layers[layer], src, pos)
                if not isinstance(out, Tensor):
                    raise GGMLTypeError(f"shift_fn must return a Tensor, got {type(out).__name__}")
                gf.build_forward_expand(ctx.cpy(out, view))
            return [(pos, offsets)]

        self._maintain(nodes, self.n_layers * per_layer + 4 * n + 4096, build)

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

        Quantized K or V in device memory move through the host instead (read,
        then written, a move at a time): ggml's Vulkan backend copies a view of
        quantized rows to the wrong place (0.25.3: a q8_0 view of rows 5-6 onto
        rows 1-2 overwrote row 0 and left row 2), and a graph that is wrong on
        one backend is not worth the few moves a defragmentation makes.
        """
        cells = self.cells
        moves = cells.defrag_plan()
        if not moves:
            return moves
        self._require_maintainable("defragmentation")
        if self.runtime is not None:           # a graph must fit the scheduler
            max_nodes = min(int(max_nodes), self.runtime.graph_size // 2)
        tensors = (*self.keys, *self.values)
        by_host = [t for t in tensors if not t.is_host and is_quantized(t.type)
                   and not (self.v_trans and any(t is v for v in self.values))]
        in_graph = [t for t in tensors if not any(t is h for h in by_host)]
        for t in by_host:                          # rows are whole blocks: plain byte ranges
            row = t.nb[1]
            for src, dst, n in moves:
                t.set_bytes(t.get_bytes(src * row, n * row), dst * row)
        per_move = 3 * len(in_graph)
        batch = max(1, (int(max_nodes) - 2 * self.n_layers) // max(per_move, 1))
        for i in range(0, len(moves) if in_graph else 0, batch):
            group = moves[i:i + batch]
            nodes = len(group) * per_move + 2 * self.n_layers + 16

            def build(ctx, gf, group=group):
                for src, dst, n in group:
                    for t in in_graph:
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
                return []

            self._maintain(nodes, (nodes + 16) * (tensor_overhead() + 64) + 4096, build)
        cells.apply_defrag(moves)
        return moves

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` share the first ``length`` positions of ``src`` (metadata only)."""
        self.cells.copy_prefix(src, dst, length)

    def save_seq(self, seq: int, file, meta: Optional[dict] = None) -> int:
        """Write what ``seq`` holds (every wrapped cache's, for a Wrapper) and ``meta`` to ``file`` (a path
        or binary file object); returns the bytes written. See :mod:`ggmlpy.kvcache.state`."""
        from .state import save_seq
        return save_seq(self, seq, file, meta)

    def load_seq(self, seq: int, file, expect_meta: Optional[dict] = None, check=None) -> dict:
        """Replace what ``seq`` holds with a state from :meth:`save_seq`, validated first (``StateError`` or
        ``KVCacheFull``, nothing changed; ``check(meta, positions)`` may refuse it too); returns its meta.
        See :mod:`ggmlpy.kvcache.state`."""
        from .state import load_seq
        return load_seq(self, seq, file, expect_meta, check)

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos`` from the stored cells.

        Every position the next token can see before ``pos`` must be stored:
        ``[0, pos)``, or only the last ``window`` of them when the cache
        evicts (sliding window with limited memory, as Ollama's ``CanResume``).
        Unlike Ollama (which answers False there when the oldest positions
        were evicted), ``pos == 0`` is always resumable: it needs no history.
        """
        return self.cells.can_resume(seq, pos, window=None if self.memory is None else self.window or self.chunk)

    def seq_pos_min(self, seq: int) -> int:
        return self.cells.seq_pos_min(seq)

    def seq_pos_max(self, seq: int) -> int:
        return self.cells.seq_pos_max(seq)

    def clear(self, seq: Optional[int] = None) -> None:
        """Drop one sequence, or everything (the K/V data is left as is)."""
        self.cells.clear(seq)
