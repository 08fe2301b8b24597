"""The recurrent state cache: one fixed-size state per sequence and recurrent layer (:class:`Recurrent`).

Recurrent layers (LFM2's short convolutions, Mamba's scan, gated DeltaNet) carry a state from token to
token instead of attending over every earlier one: a convolution's last ``d_conv - 1`` inputs, a scan's
``d_state x head_dim x n_head`` matrix. :class:`Recurrent` stores, for each of its layers, a store of
such states (``ne = (values, n_rows + 1)``, F32: one row per state, the last row zeros), and
:class:`~ggmlpy.kvcache.rows.StateRows` says which row holds each sequence's (with prefix sharing by
reference and checkpoints, see there). A batch's graph reads each sequence's row (the zero row for a new
sequence), computes, and writes the new state into the row the plan chose (the same one, or a free one
when the old is shared: copy on write, inside the graph).

What a recurrent state cannot do, and what the runner does instead (llama.cpp's ``llama-memory-recurrent``,
Ollama's recurrent cache):

* it holds no history, so it cannot drop a middle range (no context shift: :meth:`Recurrent.remove`
  raises :class:`~ggmlpy.kvcache.NotSupported`, and the runner clears the sequence and computes what it
  kept again) nor its last tokens, except back to a *checkpoint*: a state the cache kept at a length the
  runner asked for (:meth:`Recurrent.want_checkpoint`; the runner asks for the end of each prompt and the
  token before it, so that the same prompt, or a conversation that goes on from it, is not computed again);
* a prefix is reused from the start of a sequence or from a checkpoint (:meth:`Recurrent.resume_point`);
* a batch must give every sequence in it the same number of consecutive rows (ggml's ``ssm_conv`` and
  ``ssm_scan`` take ``n_seqs x n_seq_tokens``): :attr:`Recurrent.split_equal` tells the runner to cut its
  micro-batches so (llama.cpp's ``split_equal``).

A hybrid model (attention layers and recurrent ones) routes its layers to a :class:`~ggmlpy.kvcache.Causal`
and a :class:`Recurrent` through a :class:`~ggmlpy.kvcache.Wrapper`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ggmlpy._core import Context, GGMLMemoryError, GGMLTypeError, GGMLValueError, Tensor, Type
from ggmlpy.memory import MemoryReport, advise_huge_pages

from .cells import CacheStateError, NotSupported, _int_array
from .forward import _LayerView
from .rows import StateRows

__all__ = ["Recurrent", "RecurrentForward", "RecurrentPlan"]


def _parts(values: int) -> int:
    """Rows a state of ``values`` is moved as. ggml's ``get_rows`` and ``set_rows`` share a copy out among
    threads by rows, so one sequence's state as one row (Mamba-2's is 768 KiB at 110M) is one thread's memcpy
    while the others wait; as up to 32 rows of at least 1024 values it is shared. The store is the same
    memory viewed with shorter rows, and each index ``r`` becomes ``r * parts + (0 .. parts - 1)``."""
    for k in (32, 16, 8, 4, 2):
        if values % k == 0 and values // k >= 1024:
            return k
    return 1


@dataclass(frozen=True)
class RecurrentPlan:
    """Where one batch's recurrent states come from and go, from :meth:`Recurrent.start_forward`.

    Attributes
    ----------
    seqs : numpy.ndarray
        ``int64[n_seqs]``: the batch's sequences, in the order their rows come.
    n_seq_tokens : int
        Rows (tokens) of each sequence; the batch is ``n_seqs x n_seq_tokens`` rows, grouped by sequence.
    src : numpy.ndarray
        ``int32[n_seqs]``: the state row each sequence reads (the zero row for a new sequence).
    dst : numpy.ndarray
        ``int64[n_seqs]``: the row it writes its new state to.
    reserve : bool
        A worst-case sizing plan: commits nothing.
    n_rows : int
        Rows of the cache the plan was made for (without the zero row).
    """

    seqs: np.ndarray
    n_seq_tokens: int
    src: np.ndarray
    dst: np.ndarray
    reserve: bool
    n_rows: int
    _base: Optional[tuple] = field(default=None, repr=False, compare=False)
    _after: Optional[StateRows] = field(default=None, repr=False, compare=False)

    @property
    def n_seqs(self) -> int:
        return int(self.seqs.size)

    @property
    def n_batch(self) -> int:
        return self.n_seqs * self.n_seq_tokens

    @property
    def key(self) -> tuple:
        """What a graph built for this plan depends on: the batch's layout."""
        return ("rs", self.n_seqs, self.n_seq_tokens)


class RecurrentForward(_LayerView):
    """One graph's view of a :class:`Recurrent`: ``set_layer(i)``, then :meth:`conv` / :meth:`scan` (or
    :meth:`get` and :meth:`put`) for that layer's states.

    The view owns the inputs: the rows read (I32, ``rs_src``) and written (I64, ``rs_dst``), shared by
    every layer, and the same rows spread for large states moved as several rows (``rs_src_4``, ...:
    :func:`_parts`); in a ``no_alloc`` context they are filled by :meth:`fill` once allocated. ``pending``
    collects the state writes, in layer order (a graph expands them first, as a :class:`~ggmlpy.kvcache.Forward`'s;
    each reads what it replaces before writing, through its inputs).
    """

    def __init__(self, cache: Recurrent, ctx: Context, plan: RecurrentPlan) -> None:
        self.cache, self.ctx, self.plan = cache, ctx, plan
        self._key = plan.key
        self.layer: Optional[int] = None
        self.pending: list = []
        # the rows read ("src", I32) and written ("dst", I64), each as indices for states moved as k rows
        self._index: dict[tuple[str, int], Tensor] = {}
        self._spreads: dict[tuple, np.ndarray] = {}

    @property
    def n_seqs(self) -> int:
        return self._key[1]

    @property
    def n_seq_tokens(self) -> int:
        return self._key[2]

    def _input(self, type_: Type, name: str, data: np.ndarray) -> Tensor:
        t = self.ctx.new_tensor(type_, (data.size,), name=name)
        if self.ctx.no_alloc:
            t.set_input()
        else:
            t.set(data)
        return t

    @staticmethod
    def _spread(rows: np.ndarray, k: int) -> np.ndarray:
        if k == 1:
            return rows
        return (rows.astype(np.int64)[:, None] * k + np.arange(k)).ravel().astype(rows.dtype)

    def _rows(self, kind: str, k: int = 1) -> Tensor:
        """The rows the plan reads (``"src"``) or writes (``"dst"``), as indices into the stores viewed as
        ``k`` rows a state (:func:`_parts`); each made once a graph, and only if the graph uses it (an input
        outside the graph gets no buffer)."""
        if (kind, k) not in self._index:
            type_ = Type.I32 if kind == "src" else Type.I64
            name = f"rs_{kind}" if k == 1 else f"rs_{kind}_{k}"
            self._index[kind, k] = self._input(type_, name, self._spread(getattr(self.plan, kind), k))
        return self._index[kind, k]

    def _store_rows(self, store: Tensor, k: int) -> Tensor:
        return self.ctx.reshape(store, (store.ne[0] // k, store.ne[1] * k))

    def get(self, name: str) -> Tensor:
        """The current layer's state ``name`` of each sequence: ``ne = (values, n_seqs)`` (F32)."""
        store = self.cache.tensor(self._need_layer(), name)
        k = _parts(store.ne[0])
        if k == 1:
            return self.ctx.get_rows(store, self._rows("src"))
        got = self.ctx.get_rows(self._store_rows(store, k), self._rows("src", k))
        return self.ctx.reshape(got, (store.ne[0], self.n_seqs))

    def put(self, name: str, new: Tensor) -> Tensor:
        """Write each sequence's new state ``name`` (``ne = (values, n_seqs)``, rows contiguous) for the
        current layer; returns the write (also in ``pending``)."""
        store = self.cache.tensor(self._need_layer(), name)
        if new.ne[0] != store.ne[0] or new.ne[1] != self.n_seqs or new.ne[2] * new.ne[3] != 1:
            raise GGMLValueError(f"recurrent state {name!r}: a new state of ne={new.ne} for {self.n_seqs} "
                                 f"sequences of {store.ne[0]} values")
        k = _parts(store.ne[0])
        if k == 1:
            w = self.ctx.set_rows(store, new, self._rows("dst"))
        else:
            new = self.ctx.reshape(new if new.is_contiguous else self.ctx.cont(new),
                                   (store.ne[0] // k, self.n_seqs * k))
            w = self.ctx.set_rows(self._store_rows(store, k), new, self._rows("dst", k))
        self.pending.append(w)
        return w

    def conv(self, x: Tensor, weight: Tensor, name: str = "conv") -> Tensor:
        """The causal depthwise convolution of ``x`` with the state ``name``, the state updated.

        ``x`` is ``ne = (channels, n_batch)`` with the batch's rows (grouped by sequence, see the class;
        the rows may be strided, a view of a wider projection) or already ``(channels, n_seq_tokens,
        n_seqs)``; F32; ``weight`` F32 ``ne = (d_conv, channels)``, the
        state's shape ``(d_conv - 1, channels)``. Each sequence's last ``d_conv - 1`` inputs (the state)
        go before its tokens, time along ``ne[0]``, as ``ssm_conv`` takes them; the last ``d_conv - 1``
        of that become the new state. Returns ``ne = (channels, n_seq_tokens, n_seqs)``, no bias.
        """
        ctx = self.ctx
        width, channels = self.cache.state_shape(name)[:2]
        t, s = self.n_seq_tokens, self.n_seqs
        if weight.ne[:2] != (width + 1, channels):
            raise GGMLValueError(f"recurrent conv {name!r}: a kernel of ne={weight.ne} for a state of "
                                 f"{width} steps of {channels} channels (expected ({width + 1}, {channels}))")
        if x.ne[0] != channels or x.ne[1] * x.ne[2] * x.ne[3] != t * s:
            raise GGMLValueError(f"recurrent conv {name!r}: x of ne={x.ne} for {s} sequences of {t} tokens of "
                                 f"{channels} channels")
        if x.ne[1:3] == (t, s):
            x3 = x
        elif x.ne[2] * x.ne[3] == 1 and x.nb[0] == 4:
            # (channels, n): rows of the batch, possibly strided (a view of a wider projection: no copy)
            x3 = ctx.view(x, (channels, t, s), (x.nb[1], x.nb[1] * t), 0)
        else:
            x3 = ctx.reshape(ctx.cont(x), (channels, t, s))
        prev = ctx.reshape(self.get(name), (width, channels, s))
        sx = ctx.concat(prev, ctx.transpose(x3), 0)                      # (width + t, channels, s), time first
        last = ctx.view(sx, (width, channels, s), (sx.nb[1], sx.nb[2]), t * sx.nb[0])
        self.put(name, ctx.reshape(ctx.cont(last), (width * channels, s)))
        return ctx.ssm_conv(sx, weight)

    def scan(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, name: str = "ssm") -> Tensor:
        """The selective scan (:meth:`~ggmlpy.Context.ssm_scan`) from the state ``name``, the state updated.

        The state's shape is ``(d_state, head_dim, n_head)``; ``x`` is ``ne = (head_dim, n_head,
        n_seq_tokens, n_seqs)``, ``dt`` ``(n_head, n_seq_tokens, n_seqs)``, ``B`` and ``C`` ``(d_state,
        n_group, n_seq_tokens, n_seqs)``. Returns ``y`` as ``x``'s shape.
        """
        ctx = self.ctx
        store = self.cache.tensor(self._need_layer(), name)
        shape = self.cache.state_shape(name)
        if len(shape) != 3 or x.ne[:2] != shape[1:] or x.ne[2:] != (self.n_seq_tokens, self.n_seqs):
            raise GGMLValueError(f"recurrent scan {name!r}: x of ne={x.ne} for a state of {shape} and {self.n_seqs} "
                                 f"sequences of {self.n_seq_tokens} tokens")
        src = self._rows("src")
        out = ctx.ssm_scan(ctx.reshape(store, (*shape, store.ne[1])), x, dt, A, B, C, src)
        n_y = math.prod(x.ne)
        y = ctx.view(out, x.ne, (4 * x.ne[0], 4 * x.ne[0] * x.ne[1], 4 * x.ne[0] * x.ne[1] * x.ne[2]), 0)
        self.put(name, ctx.view(out, (store.ne[0], self.n_seqs), (4 * store.ne[0],), 4 * n_y))
        return y

    def delta(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor, name: str = "ssm") -> Tensor:
        """The gated delta rule (:meth:`~ggmlpy.Context.gated_delta_net`) from the state ``name``, the state
        updated.

        The state's shape is ``(S_v, S_v, n_head)``; ``q`` and ``k`` are ``ne = (S_v, n_head, n_seq_tokens,
        n_seqs)`` (already one per value head), ``v`` the same, ``gate`` and ``beta`` ``(1, n_head, n_seq_tokens,
        n_seqs)``. Returns the output as ``v``'s shape.
        """
        ctx = self.ctx
        shape = self.cache.state_shape(name)
        t, s = self.n_seq_tokens, self.n_seqs
        if len(shape) != 3 or shape[0] != shape[1] or v.ne != (shape[0], shape[2], t, s):
            raise GGMLValueError(f"recurrent delta {name!r}: v of ne={v.ne} for a state of {shape} and {s} "
                                 f"sequences of {t} tokens")
        state = ctx.reshape(self.get(name), (*shape, s))
        out = ctx.gated_delta_net(q, k, v, gate, beta, state, 1)
        n_y, per = math.prod(v.ne), math.prod(shape)
        y = ctx.view(out, v.ne, (4 * v.ne[0], 4 * v.ne[0] * v.ne[1], 4 * v.ne[0] * v.ne[1] * t), 0)
        self.put(name, ctx.view(out, (per, s), (4 * per,), 4 * n_y))
        return y

    def fill(self, plan: Optional[RecurrentPlan] = None) -> None:
        """Upload the rows of ``plan`` (default: the plan built with); it must have this graph's key."""
        if plan is None:
            plan = self.plan
            if plan is None:
                raise GGMLValueError("fill: the plan this graph was built with was uploaded already; pass the next")
        elif plan.key != self._key:
            raise GGMLValueError(f"fill: a plan of layout {plan.key} for a graph built for {self._key}")
        for (kind, k), t in self._index.items():
            rows = getattr(plan, kind)
            # a graph reused step after step mostly uploads the same rows: their spread indices are kept
            key = (kind, k, rows.tobytes())
            data = self._spreads.get(key)
            if data is None:
                if len(self._spreads) >= 64:
                    self._spreads.clear()
                data = self._spreads[key] = self._spread(rows, k)
            t.set(data)
        self.plan = None


class Recurrent:
    """Recurrent states per sequence and layer (see the module docstring).

    Parameters
    ----------
    n_layers : int
        Recurrent layers this cache holds.
    states : dict of str to tuple of int
        Each state a layer keeps, by name, and its shape in ggml order: a convolution's ``(d_conv - 1,
        channels)`` (:meth:`RecurrentForward.conv`), a scan's ``(d_state, head_dim, n_head)``
        (:meth:`RecurrentForward.scan`). Stored as F32.
    checkpoints : int
        Checkpoints kept per sequence (see :class:`~ggmlpy.kvcache.rows.StateRows`): each costs one state
        of every layer per sequence.

    Attributes
    ----------
    split_equal : bool
        True: a batch must give each of its sequences the same number of consecutive rows.
    """

    split_equal = True

    def __init__(self, n_layers: int, states: dict, *, checkpoints: int = 2) -> None:
        self.n_layers = int(n_layers)
        if self.n_layers < 1:
            raise GGMLValueError(f"recurrent cache: n_layers must be >= 1, got {n_layers}")
        if not isinstance(states, dict) or not states:
            raise GGMLTypeError("recurrent cache: states must be a non-empty dict of name -> shape")
        self.states: dict[str, tuple[int, ...]] = {}
        for name, shape in states.items():
            shape = tuple(int(d) for d in shape)
            if not 1 <= len(shape) <= 3 or min(shape) < 1:
                raise GGMLValueError(f"recurrent cache: state {name!r} has shape {shape} (1 to 3 sizes, each >= 1)")
            self.states[str(name)] = shape
        if int(checkpoints) < 0:
            raise GGMLValueError(f"recurrent cache: checkpoints must be >= 0, got {checkpoints}")
        self.n_checkpoints = int(checkpoints)
        self._rows: Optional[StateRows] = None
        self._placed: Optional[list] = None
        self.tensors: list[dict[str, Tensor]] = []
        self.report = None
        self.runtime = None
        self.max_batch = 0
        #: the model layer of each of this cache's layers (set by :meth:`init`)
        self.model_layers: list[int] = list(range(self.n_layers))

    # ------------------------------------------------------------------ sizes and storage

    def state_shape(self, name: str) -> tuple[int, ...]:
        shape = self.states.get(name)
        if shape is None:
            raise GGMLValueError(f"recurrent cache: no state {name!r} (it keeps {', '.join(self.states)})")
        return shape

    @property
    def values_per_seq(self) -> int:
        """Values of one sequence's states in one layer."""
        return sum(math.prod(s) for s in self.states.values())

    @property
    def rows(self) -> StateRows:
        """The bookkeeping (do not mutate it directly)."""
        if self._rows is None:
            raise CacheStateError("recurrent cache: not initialised (call init() first) or closed")
        return self._rows

    def tensor(self, layer: int, name: str) -> Tensor:
        """Layer ``layer``'s store of state ``name``: F32 ``ne = (values, n_rows + 1)``, the last row zeros."""
        layer = self._check_layer(layer)
        self.state_shape(name)
        return self.tensors[layer][name]

    def _check_layer(self, layer: int) -> int:
        layer = int(layer)
        if not 0 <= layer < len(self.tensors):
            raise GGMLValueError(f"layer {layer} out of range [0, {len(self.tensors)})")
        return layer

    def _model_layers(self, layers) -> list:
        layers = list(range(self.n_layers)) if layers is None else [int(i) for i in layers]
        if len(layers) != self.n_layers:
            raise GGMLValueError(f"recurrent cache: {len(layers)} model layers given for a cache of {self.n_layers}")
        return layers

    def bytes_per_layer(self, n_seq_max: int) -> int:
        """Bytes of one layer's states for ``n_seq_max`` sequences (their checkpoints and the zero row included)."""
        return 4 * self.values_per_seq * (int(n_seq_max) * (1 + self.n_checkpoints) + 1)

    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement=None, layers=None) -> int:
        """Host memory this cache needs (bytes, nothing allocated): the states of layers on the CPU (all of
        them without ``placement``); nothing grows with the context."""
        layers = self._model_layers(layers)
        on_cpu = len(layers) if placement is None else sum(placement.device_of(i).type == "CPU" for i in layers)
        return on_cpu * self.bytes_per_layer(n_seq_max)

    def init(self, capacity: int, n_seq_max: int, max_batch: int, *, placement=None, report=None, runtime=None,
             layers=None) -> None:
        """Allocate the zero-filled states of every layer for ``n_seq_max`` sequences (``capacity``, the context,
        does not change their size).

        With ``placement``, each layer's states live on that layer's device and their bytes are recorded in
        ``report`` (:meth:`ggmlpy.memory.MemoryReport.add_state`); otherwise host memory. ``layers`` are the
        model layers this cache's layers are (a :class:`~ggmlpy.kvcache.Wrapper` gives each cache its own).

        Raises
        ------
        GGMLMemoryError
            A device had no room; ``.report`` has what every device needed.
        """
        if self._rows is not None:
            raise CacheStateError("recurrent cache: already initialised (close() it first)")
        capacity, n_seq_max, max_batch = int(capacity), int(n_seq_max), int(max_batch)
        if capacity < 1 or n_seq_max < 1 or max_batch < 1:
            raise GGMLValueError("capacity, n_seq_max and max_batch must be >= 1")
        model_layers = self._model_layers(layers)
        rows = StateRows(n_seq_max, self.n_checkpoints)
        ne1 = rows.n_rows + 1                    # the last row stays zero: a new sequence's state
        if placement is None:
            from ggmlpy import _core

            placement = _HostPlacement(_core.device("CPU"))
        if report is None:
            report = MemoryReport(max(model_layers) + 1)
        ctxs: dict = {}
        tensors = []
        devs = [placement.device_of(i) for i in model_layers]
        for i, dev in enumerate(devs):
            entry = ctxs.get(dev.name)
            if entry is None:
                entry = ctxs[dev.name] = (dev, Context.for_tensors(len(self.states) * self.n_layers, no_alloc=True))
            tensors.append({name: entry[1].new_tensor(Type.F32, (math.prod(shape), ne1), name=f"cache_rs_{name}_l{i}")
                            for name, shape in self.states.items()})
        self._allocate(ctxs, tensors, model_layers, devs, report)
        self.model_layers = model_layers
        self.tensors = tensors
        self.runtime = runtime
        self.max_batch = max_batch
        self._rows = rows

    def _allocate(self, ctxs: dict, tensors: list, layers: list, devs: list, report: MemoryReport) -> None:
        from ggmlpy import _core

        for m in report.devices.values():         # a new cache on the same model replaces what was recorded
            for i in layers:
                m.state.pop(i, None)
        failed = None
        for dev, ctx in ctxs.values():
            bt = dev.buffer_type()
            for i, d, ts in zip(layers, devs, tensors):
                if d == dev:
                    report.add_state(dev, i, sum(-(-bt.alloc_size(t) // bt.alignment) * bt.alignment
                                                 for t in ts.values()))
            try:
                buf = _core.alloc_ctx_tensors(ctx, bt)
            except MemoryError as e:
                report.device(dev).cache_ok = False
                failed = failed or e
                continue
            advise_huge_pages(buf)                # before the clear touches its pages
            buf.clear(0)                          # zero rows: new sequences start from them
            report.device(dev).cache_ok = True
        if failed is not None:
            for _dev, ctx in ctxs.values():
                ctx.free()
            raise GGMLMemoryError(f"recurrent cache: allocation failed ({failed})\n{report}", report)
        self._placed = [ctx for _dev, ctx in ctxs.values()]
        self.report = report

    def close(self) -> None:
        """Free the storage; the cache must be initialised again to be used. Safe twice."""
        self.tensors = []
        for ctx in self._placed or []:
            ctx.free()
        self._placed = None
        self._rows = None
        self.runtime = None

    def __repr__(self) -> str:
        rows = None if self._rows is None else self._rows.n_rows
        return (f"Recurrent(n_layers={self.n_layers}, states={self.states}, checkpoints={self.n_checkpoints}, "
                f"rows={rows})")

    # ------------------------------------------------------------------ batches

    def start_forward(self, positions, seq_ids, reserve: bool = False, **kw) -> RecurrentPlan:
        """Plan a batch: each sequence's rows must be consecutive, as many for every sequence, and continue it
        (positions ``length, length + 1, ...``). Changes nothing; :meth:`apply` commits.

        ``except_rows`` and ``spans`` (attention's mask exceptions) do not concern a recurrent state and are
        ignored. A ``reserve`` plan (sizing) is ``n`` sequences of one token when ``n <= n_seq_max``, else one
        of ``n``.

        Raises
        ------
        GGMLValueError
            A batch of another layout, a sequence out of range, or positions that do not continue the
            sequence (a recurrent state cannot go back or skip).
        """
        rows = self.rows
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        if positions.shape != seq_ids.shape:
            raise GGMLValueError(f"positions and seq_ids differ in length: {positions.size} != {seq_ids.size}")
        n = positions.size
        if n == 0:
            raise GGMLValueError("empty batch")
        if reserve:
            n_seqs, t = (n, 1) if n <= rows.n_seq_max else (1, n)
            return RecurrentPlan(np.arange(n_seqs, dtype=np.int64), t, np.full(n_seqs, rows.n_rows, np.int32),
                                 np.arange(n_seqs, dtype=np.int64), True, rows.n_rows)
        if n == 1:
            # one generation step, the hot path: the checks below from scalars
            s, p = int(seq_ids[0]), int(positions[0])
            if not 0 <= s < rows.n_seq_max:
                raise GGMLValueError(f"sequence id {s} out of range [0, {rows.n_seq_max})")
            if p != rows.length[s]:
                raise GGMLValueError(f"recurrent cache: sequence {s} holds {rows.length[s]} tokens; its rows must "
                                     f"be at positions {rows.length[s]}.. in order, got [{p}] (a recurrent state "
                                     "cannot go back or skip)")
            trial = rows.copy()
            (src,), dst = trial.advance([s], 1)
            return RecurrentPlan(seq_ids[:1], 1, np.array([rows.n_rows if src < 0 else src], np.int32),
                                 np.array(dst, np.int64), False, rows.n_rows, _base=(rows, rows.version), _after=trial)
        bad = (seq_ids < 0) | (seq_ids >= rows.n_seq_max)
        if bad.any():
            raise GGMLValueError(f"sequence id {int(seq_ids[bad][0])} out of range [0, {rows.n_seq_max})")
        starts = np.flatnonzero(np.diff(seq_ids)) + 1
        bounds = np.concatenate(([0], starts, [n]))
        lens = np.diff(bounds)
        seqs = seq_ids[bounds[:-1]]
        if lens.min() != lens.max() or np.unique(seqs).size != seqs.size:
            raise GGMLValueError(f"recurrent cache: a batch must give each sequence the same number of "
                                 f"consecutive rows (got runs of {lens.tolist()[:8]} rows of sequences "
                                 f"{seqs.tolist()[:8]}); split it (Recurrent.split_equal)")
        t = int(lens[0])
        for s, a in zip(seqs.tolist(), bounds[:-1].tolist()):
            want = rows.length[s] + np.arange(t)
            if not np.array_equal(positions[a:a + t], want):
                got = positions[a:a + t][:8].tolist()
                raise GGMLValueError(f"recurrent cache: sequence {s} holds {rows.length[s]} tokens; its rows must "
                                     f"be at positions {rows.length[s]}.. in order, got {got} (a recurrent state "
                                     "cannot go back or skip)")
        trial = rows.copy()
        src, dst = trial.advance(seqs.tolist(), t)
        src_a = np.array([rows.n_rows if r < 0 else r for r in src], np.int32)
        return RecurrentPlan(seqs, t, src_a, np.array(dst, np.int64), False, rows.n_rows,
                             _base=(rows, rows.version), _after=trial)

    def forward(self, ctx: Context, plan: RecurrentPlan) -> RecurrentForward:
        """A :class:`RecurrentForward` for building this batch's graph layer by layer."""
        self._check_plan(plan)
        return RecurrentForward(self, ctx, plan)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, RecurrentPlan):
            raise GGMLTypeError(f"plan must be a RecurrentPlan, got {type(plan).__name__}")
        if plan.n_rows != self.rows.n_rows:
            raise GGMLValueError("plan was made for a different cache")

    def apply(self, plan: RecurrentPlan) -> None:
        """Commit a plan (the rows its graph writes become the sequences' states); all or nothing."""
        self._stage(plan)()

    def _stage(self, plan: RecurrentPlan) -> Callable[[], None]:
        """Check ``plan`` against the rows as they are; returns what commits it, which cannot fail."""
        self._check_plan(plan)
        if plan.reserve:
            return lambda: None
        rows, base = self._rows, plan._base
        if base is not None and base[0] is rows and base[1] == rows.version and plan._after is not None:
            after = plan._after
        else:
            src = [-1 if r == rows.n_rows else int(r) for r in plan.src]
            after = rows.replayed(plan.seqs.tolist(), plan.n_seq_tokens, src, plan.dst.tolist())

        def swap() -> None:
            object.__setattr__(plan, "_base", None)          # a plan commits once
            self._rows = after
        return swap

    # ------------------------------------------------------------------ sequences

    def _plan_remove(self, seq: int, begin: int, end: Optional[int]):
        """Check a :meth:`remove`; returns what :meth:`StateRows.truncate` would take (raises NotSupported)."""
        rows = self.rows
        seq = rows.check_seq(seq)
        begin = max(0, int(begin))
        if end is not None and int(end) < rows.length[seq] and int(end) > begin:
            # a middle range: the later tokens would have to move down, which a state cannot
            _raise_shift(seq, begin, int(end), rows.length[seq])
        return rows.plan_truncate(seq, begin)

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Forget positions ``[begin, end)`` of ``seq`` (``end`` None: to its end): the whole sequence from 0,
        nothing past its state, or back to a checkpoint at ``begin``.

        Raises
        ------
        NotSupported
            Anything else (a middle range: a context shift; an end without a checkpoint). Nothing is changed.
        """
        self._plan_remove(seq, begin, end)
        self._rows.truncate(int(seq), max(0, int(begin)))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Let ``dst`` (cleared) share the longest state of ``src`` covering at most ``length`` tokens (its live
        state or a checkpoint; none if neither): see :meth:`resume_point` for where ``dst`` can go on from."""
        self.rows.copy_seq(src, dst, length)

    def resume_point(self, seq: int, pos: int) -> int:
        """The most tokens ``<= pos`` the sequence's states cover (live or a checkpoint), 0 for none."""
        return self.rows.resume_point(seq, pos)

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether the sequence can go on at ``pos`` (its state or a checkpoint covers exactly ``pos`` tokens)."""
        return int(pos) == 0 or self.resume_point(seq, pos) == int(pos)

    def want_checkpoint(self, seq: int, n: int) -> None:
        """Keep the sequence's state once it covers exactly ``n`` tokens (a batch must end there)."""
        self.rows.want_checkpoint(seq, n)

    def seq_pos_max(self, seq: int) -> int:
        """The last position the sequence's state covers, -1 for none."""
        return self.rows.length[self.rows.check_seq(seq)] - 1

    def seq_pos_min(self, seq: int) -> int:
        """As :meth:`seq_pos_max`: a state is one position deep."""
        return self.seq_pos_max(seq)

    def clear(self, seq: Optional[int] = None) -> None:
        """Forget one sequence (its state and checkpoints), or everything (the data is left as is)."""
        self.rows.clear(seq)

    def fragmentation(self) -> float:
        """0: states are rows of a fixed store, nothing to compact."""
        return 0.0

    def defrag(self) -> list:
        """Nothing to compact (see :meth:`fragmentation`)."""
        return []

    def save_seq(self, seq: int, file, meta: Optional[dict] = None) -> int:
        """Write the sequence's live state (every layer's) and ``meta`` to ``file``; see :mod:`ggmlpy.kvcache.state`."""
        from .state import save_seq
        return save_seq(self, seq, file, meta)

    def load_seq(self, seq: int, file, expect_meta: Optional[dict] = None, check=None) -> dict:
        """Replace the sequence's state with one from :meth:`save_seq`, validated first (nothing changes on a
        refused file); see :mod:`ggmlpy.kvcache.state`."""
        from .state import load_seq
        return load_seq(self, seq, file, expect_meta, check)


def _raise_shift(seq: int, begin: int, end: int, length: int):
    raise NotSupported(f"model does not support operation: shifting positions (a recurrent state cannot drop "
                       f"positions {begin}..{end - 1} of sequence {seq}'s {length})")


class _HostPlacement:
    """Every layer on one device (a cache made without a placement: host memory)."""

    def __init__(self, dev) -> None:
        self.dev = dev

    def device_of(self, _layer):
        return self.dev
