"""Caches made of caches: :class:`Wrapper` routes each model layer to one of several caches (a
sliding-window cache for local layers and a full one for global layers, as gemma-style models need; a
:class:`~ggmlpy.kvcache.Causal` for attention layers and a :class:`~ggmlpy.kvcache.Recurrent` for the
recurrent ones, as hybrid models need).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ggmlpy._core import Context, GGMLTypeError, GGMLValueError, Tensor

from .causal import Causal
from .recurrent import Recurrent

__all__ = ["Wrapper", "WrapperForward", "WrapperPlan", "resume_point"]


def resume_point(cache, seq: int, pos: int) -> int:
    """The most tokens ``<= pos`` a cache can go on from for ``seq``: its ``resume_point`` where it has one
    (recurrent states: a checkpoint), else ``pos`` when it can resume there and 0 when not."""
    fn = getattr(cache, "resume_point", None)
    if fn is not None:
        return int(fn(seq, pos))
    return int(pos) if int(pos) == 0 or cache.can_resume(seq, pos) else 0


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

    # a recurrent layer's (its cache a Recurrent): the state writes join ``pending`` in layer order too

    def _recurrent(self, what: str):
        part = self._current()
        if not hasattr(part, "conv"):
            raise GGMLValueError(f"{what}: layer is an attention layer (its cache is a {type(part.cache).__name__})")
        return part

    def _tracked(self, part, call):
        n = len(part.pending)
        out = call()
        self.pending.extend(part.pending[n:])
        return out

    def conv(self, x: Tensor, weight: Tensor, name: str = "conv") -> Tensor:
        """:meth:`RecurrentForward.conv <ggmlpy.kvcache.recurrent.RecurrentForward.conv>` on the layer's cache."""
        part = self._recurrent("conv")
        return self._tracked(part, lambda: part.conv(x, weight, name))

    def scan(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, name: str = "ssm") -> Tensor:
        """:meth:`RecurrentForward.scan <ggmlpy.kvcache.recurrent.RecurrentForward.scan>` on the layer's cache."""
        part = self._recurrent("scan")
        return self._tracked(part, lambda: part.scan(x, dt, A, B, C, name))

    def delta(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor, name: str = "ssm") -> Tensor:
        """:meth:`RecurrentForward.delta <ggmlpy.kvcache.recurrent.RecurrentForward.delta>` on the layer's
        cache."""
        part = self._recurrent("delta")
        return self._tracked(part, lambda: part.delta(q, k, v, gate, beta, name))

    def get_state(self, name: str) -> Tensor:
        """:meth:`RecurrentForward.get <ggmlpy.kvcache.recurrent.RecurrentForward.get>` on the layer's cache."""
        return self._recurrent("get_state").get(name)

    def put_state(self, name: str, new: Tensor) -> Tensor:
        """:meth:`RecurrentForward.put <ggmlpy.kvcache.recurrent.RecurrentForward.put>` on the layer's cache."""
        part = self._recurrent("put_state")
        return self._tracked(part, lambda: part.put(name, new))

    @property
    def n_seqs(self) -> int:
        """The batch's sequences, as its recurrent cache lays them out (:class:`RecurrentForward`)."""
        return self._layout()[0]

    @property
    def n_seq_tokens(self) -> int:
        """Rows of each sequence in the batch, as its recurrent cache lays them out."""
        return self._layout()[1]

    def _layout(self) -> tuple:
        for p in self.parts:
            if hasattr(p, "n_seq_tokens"):
                return p.n_seqs, p.n_seq_tokens
        raise GGMLValueError("this Wrapper has no recurrent cache: its batches have no sequence layout")

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
    caches : sequence of Causal or Recurrent
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
        """Initialise every cache (see :meth:`Causal.init`, :meth:`Recurrent.init`): each on the devices of the
        model layers routed to it, recorded in the report under those layers. All or nothing."""
        try:
            for k, cache in enumerate(self.caches):
                if isinstance(cache, (Causal, Recurrent)):
                    cache.init(capacity, n_seq_max, max_batch, layers=self._layers(k), **kw)
                else:
                    cache.init(capacity, n_seq_max, max_batch)
        except BaseException:
            self.close()
            raise

    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement=None) -> int:
        """The sum of the wrapped caches' :meth:`Causal.host_bytes` (each over its own layers)."""
        return sum(c.host_bytes(capacity, n_seq_max, max_batch, placement, self._layers(k))
                   if isinstance(c, (Causal, Recurrent)) else c.host_bytes(capacity, n_seq_max, max_batch)
                   for k, c in enumerate(self.caches))

    @property
    def n_checkpoints(self) -> int:
        """Checkpoints per sequence its recurrent cache keeps (0 without one)."""
        return max(getattr(c, "n_checkpoints", 0) for c in self.caches)

    @property
    def split_equal(self) -> bool:
        """Whether a batch must give each sequence as many consecutive rows (a wrapped cache says so)."""
        return any(getattr(c, "split_equal", False) for c in self.caches)

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

    def resume_point(self, seq: int, pos: int) -> int:
        """The most tokens ``<= pos`` from which every cache can go on (0 when none): each cache's own point
        (a recurrent cache's checkpoints), until they agree."""
        pos = int(pos)
        while pos > 0:
            nxt = min(resume_point(c, seq, pos) for c in self.caches)
            if nxt == pos:
                break
            pos = nxt
        return max(pos, 0)

    def want_checkpoint(self, seq: int, n: int) -> None:
        """Ask every cache that keeps checkpoints (a :class:`Recurrent`) for one at ``n`` tokens."""
        for c in self.caches:
            if hasattr(c, "want_checkpoint"):
                c.want_checkpoint(seq, n)

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Remove from every cache; checked on all first, so :class:`NotSupported` changes nothing."""
        for c in self.caches:
            c._plan_remove(seq, begin, end)
        for c in self.caches:
            c.remove(seq, begin, end)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for c in self.caches:
            c.copy_prefix(src, dst, length)

    # one file, each wrapped cache's section in order
    save_seq = Causal.save_seq
    load_seq = Causal.load_seq

    def clear(self, seq: Optional[int] = None) -> None:
        for c in self.caches:
            c.clear(seq)
