"""Caches made of caches, and the cache of position-independent K/V.

:class:`Wrapper` routes each model layer to one of several caches (a
sliding-window cache for local layers and a full one for global layers, as
gemma-style models need); :class:`Encoder` stores K/V computed once per input
(cross-attention over image features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ggmlpy._core import Context, GGMLTypeError, GGMLValueError, Tensor, Type, tensor_overhead

from .causal import Causal, _LayerView
from .cells import _INT32_MAX, CacheStateError, NotSupported, _int_array

__all__ = ["Encoder", "EncoderForward", "EncoderPlan", "Wrapper", "WrapperForward", "WrapperPlan"]


@dataclass(frozen=True)
class WrapperPlan:
    """One plan per wrapped cache, from :meth:`Wrapper.start_forward`."""

    plans: tuple

    def __getitem__(self, i: int):
        return self.plans[i]

    def __len__(self) -> int:
        return len(self.plans)

    @property
    def key(self) -> tuple:
        """The wrapped plans' keys (what a graph built for this plan depends on)."""
        return tuple(p.key for p in self.plans)


class WrapperForward:
    """One graph's view of a :class:`Wrapper`: one forward per wrapped cache, each layer routed to its own.

    ``pending`` holds the cache writes in the order they were put, i.e. in model layer order, whichever
    cache each went to: a graph expands them first, and a layer's K/V (computed from the earlier layers'
    reads of the cache) must come after those layers' writes, or those reads see the cells unwritten.
    """

    def __init__(self, wrapper: Wrapper, ctx: Context, plan: WrapperPlan) -> None:
        wrapper._check_plan(plan)
        self.wrapper = wrapper
        self.parts = [c.forward(ctx, p) for c, p in zip(wrapper.caches, plan.plans)]
        self._part = None
        self.pending: list = []

    @property
    def v_trans(self) -> bool:
        return self._current().v_trans

    def _current(self):
        if self._part is None:
            raise GGMLValueError("call set_layer(i) first")
        return self._part

    def set_layer(self, layer: int) -> WrapperForward:
        _cache, local = self.wrapper.route(layer)
        self._part = self.parts[self.wrapper.layer_to_cache[int(layer)]].set_layer(local)
        return self

    def put(self, k: Tensor, v: Tensor) -> tuple:
        out = self._current().put(k, v)
        self.pending.extend(out)
        return out

    def get(self) -> tuple:
        return self._current().get()

    def fill(self, plan: Optional[WrapperPlan] = None) -> None:
        for i, f in enumerate(self.parts):
            f.fill(None if plan is None else plan.plans[i])


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

    def _layers(self, k: int) -> list:
        """The model layers routed to cache ``k``, in order."""
        return [i for i, c in enumerate(self.layer_to_cache) if c == k]

    def init(self, capacity: int, n_seq_max: int, max_batch: int, **kw) -> None:
        """Initialise every cache (see :meth:`Causal.init`): each on the devices of the model layers routed
        to it, recorded in the report under those layers. All or nothing."""
        try:
            for k, cache in enumerate(self.caches):
                if isinstance(cache, Causal):
                    cache.init(capacity, n_seq_max, max_batch, layers=self._layers(k), **kw)
                else:
                    cache.init(capacity, n_seq_max, max_batch)
        except BaseException:
            self.close()
            raise

    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement=None) -> int:
        """The sum of the wrapped caches' :meth:`Causal.host_bytes` (each over its own layers)."""
        return sum(c.host_bytes(capacity, n_seq_max, max_batch, placement, self._layers(k))
                   if isinstance(c, Causal) else c.host_bytes(capacity, n_seq_max, max_batch)
                   for k, c in enumerate(self.caches))

    def seq_pos_max(self, seq: int) -> int:
        """The highest position any wrapped cache holds for ``seq`` (-1: none)."""
        return max(c.seq_pos_max(seq) for c in self.caches)

    def fragmentation(self) -> float:
        """The most fragmented wrapped cache's :meth:`Causal.fragmentation`."""
        return max(c.fragmentation() for c in self.caches)

    def defrag(self) -> list:
        """Compact every wrapped cache; the moves of each, in order."""
        return [c.defrag() for c in self.caches]

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, WrapperPlan) or len(plan) != len(self.caches):
            raise GGMLTypeError("plan must be a WrapperPlan from this Wrapper")

    def forward(self, ctx: Context, plan: WrapperPlan) -> WrapperForward:
        """A :class:`WrapperForward` for building this batch's graph layer by layer."""
        return WrapperForward(self, ctx, plan)

    def start_forward(self, positions, seq_ids, reserve: bool = False, **kw) -> WrapperPlan:
        """Plan the batch on every cache; changes nothing (an error leaves nothing to unwind)."""
        return WrapperPlan(tuple(c.start_forward(positions, seq_ids, reserve, **kw)
                                 for c in self.caches))

    def apply(self, plan: WrapperPlan) -> None:
        """Commit every cache's plan; all or nothing."""
        self._check_plan(plan)
        for commit in [c._stage(p) for c, p in zip(self.caches, plan.plans)]:
            commit()

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

    # one file, each wrapped cache's section in order (an Encoder among them raises NotSupported)
    save_seq = Causal.save_seq
    load_seq = Causal.load_seq

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

    @property
    def key(self) -> tuple:
        return ()


class EncoderForward(_LayerView):
    """One graph's view of an :class:`Encoder`: no inputs of its own (no cell_ids, no mask)."""

    v_trans = False

    def __init__(self, cache: Encoder, ctx: Context, plan: EncoderPlan) -> None:
        self.cache, self.ctx, self.plan = cache, ctx, plan
        self.layer: Optional[int] = None
        self.pending: list = []

    def put(self, k: Tensor, v: Tensor) -> tuple:
        out = self.cache.put(self.ctx, self._need_layer(), self.plan, k, v)
        self.pending.extend(out)
        return out

    def get(self) -> tuple:
        return self.cache.get(self.ctx, self._need_layer(), self.plan)

    def fill(self, plan=None) -> None:
        if plan is not None:
            self.plan = plan          # an EncoderPlan is small: no mask


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

    def host_bytes(self, capacity: int = 1, n_seq_max: int = 1, max_batch: int = 1) -> int:
        """0: the storage is sized by the first :meth:`put` (the encoder's output), not by the context."""
        return 0

    def seq_pos_max(self, seq: int) -> int:
        """-1: the stored K/V belong to no position."""
        return -1

    def fragmentation(self) -> float:
        """0: there are no cells."""
        return 0.0

    def defrag(self) -> list:
        return []

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

    def forward(self, ctx: Context, plan: EncoderPlan) -> EncoderForward:
        return EncoderForward(self, ctx, plan)

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

    def _stage(self, plan) -> Callable[[], None]:
        if not isinstance(plan, EncoderPlan):
            raise GGMLTypeError(f"plan must be an EncoderPlan, got {type(plan).__name__}")
        return lambda: self.apply(plan)

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
