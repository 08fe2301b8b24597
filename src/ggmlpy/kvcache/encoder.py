"""The cache of a non-causal encoder (BERT and its kin): nothing kept, each micro-batch attends over itself.

An embedding or reranking model reads each input once, whole, with every token seeing every other token of
its sequence (llama.cpp's ``build_attn_inp_no_cache``: no KV cache for these architectures). :class:`Encoder`
gives such a model the cache protocol the runner speaks, with no storage behind it:

* :meth:`Encoder.start_forward` plans a micro-batch: the mask lets a row see the rows of its own sequence, and
  nothing else (no causal rule, no other sequence); it checks that each sequence starts at position 0 in this
  micro-batch (a non-causal input cannot be continued later: there is nothing to continue from) and that every
  position is below the model's bound (learned position embeddings have that many rows);
* one graph's view (:class:`EncoderForward`) hands back this batch's own K and V as attention reads them
  (``ne = (head_dim, n, n_head_kv)``, views of the projections, nothing copied) with the mask, which it owns
  as an input;
* every sequence operation (remove, copy, clear) has nothing to do; :meth:`Encoder.seq_pos_max` is always
  -1, so a runner's next input to a sequence starts at position 0 again; saving a sequence is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ggmlpy._core import Context, GGMLTypeError, GGMLValueError, Tensor, Type

from .cells import CacheStateError, NotSupported, _int_array

__all__ = ["Encoder", "EncoderForward", "EncoderPlan"]


@dataclass(frozen=True)
class EncoderPlan:
    """One micro-batch through an :class:`Encoder`: its rows and their mask.

    Attributes
    ----------
    positions, seq_ids : numpy.ndarray
        ``int64[n_batch]``.
    mask : numpy.ndarray
        ``float16[n_batch, n_batch]`` (numpy order): 0 where row ``i`` sees row ``j`` (the same sequence),
        ``-inf`` elsewhere; the graph's tensor is ``ne = (n_batch, n_batch)``.
    reserve : bool
        A worst-case sizing plan.
    """

    positions: np.ndarray
    seq_ids: np.ndarray
    mask: np.ndarray
    reserve: bool = False

    @property
    def n_batch(self) -> int:
        return int(self.positions.size)

    @property
    def n_kv(self) -> int:
        """Rows attended over: the micro-batch itself."""
        return self.n_batch

    @property
    def key(self) -> tuple:
        """What a graph built for this plan depends on besides the batch size: nothing."""
        return ()


class EncoderForward:
    """One graph's view of an :class:`Encoder`: ``set_layer(i)``, ``put(k, v)``, ``get()``, as a cache's.

    ``put`` keeps the layer's K and V (``ne = (head_dim, n_head_kv, n)``) in the graph; ``get`` returns them
    as attention reads a cache, ``ne = (head_dim, n, n_head_kv)`` (permuted views), with the mask
    ``ne = (n, n)`` F16, one input shared by every layer. ``pending`` is empty: nothing is written.
    """

    v_trans = False

    def __init__(self, cache: Encoder, ctx: Context, plan: EncoderPlan) -> None:
        self.cache, self.ctx, self.plan = cache, ctx, plan
        self._n = plan.n_batch
        self.layer: Optional[int] = None
        self.pending: list = []
        self._kv: Optional[tuple] = None
        self._mask: Optional[Tensor] = None

    def set_layer(self, layer: int) -> EncoderForward:
        self.layer = self.cache._check_layer(layer)
        self._kv = None
        return self

    def put(self, k: Tensor, v: Tensor) -> tuple:
        if self.layer is None:
            raise GGMLValueError("call set_layer(i) first")
        for name, t in (("k", k), ("v", v)):
            if t.ne[2] != self._n or t.ne[3] != 1:
                raise GGMLValueError(f"put: {name} ne={t.ne} does not hold the batch's {self._n} rows "
                                     "(expected (head_dim, n_head_kv, n_batch))")
        self._kv = (k, v)
        return ()

    def get(self) -> tuple:
        """``(k, v, mask)`` of the current layer: this batch's K and V, ``ne = (head_dim, n, n_head_kv)``."""
        if self._kv is None:
            raise GGMLValueError("get: put(k, v) this layer's K and V first")
        if self._mask is None:
            self._mask = self.ctx.new_tensor(Type.F16, (self._n, self._n), name="kq_mask")
            if self.ctx.no_alloc:
                self._mask.set_input()        # filled by fill() once the scheduler allocated it
            else:
                self._mask.set(self.plan.mask)
        k, v = self._kv
        return self.ctx.permute(k, 0, 2, 1, 3), self.ctx.permute(v, 0, 2, 1, 3), self._mask

    def fill(self, plan: Optional[EncoderPlan] = None) -> None:
        """Upload the mask of ``plan`` (default: the plan built with); the plan is not kept."""
        if plan is None:
            plan = self.plan
            if plan is None:
                raise GGMLValueError("fill: the plan this graph was built with was uploaded already; pass the next")
        elif plan.n_batch != self._n:
            raise GGMLValueError(f"fill: a plan of {plan.n_batch} rows for a graph built for {self._n}")
        if self._mask is not None:
            self._mask.set(plan.mask)
        self.plan = None


class Encoder:
    """The cache protocol for a non-causal encoder, with nothing stored (see the module docstring).

    Parameters
    ----------
    n_layers : int
        The model's layers (``set_layer`` checks against it).
    n_pos : int, optional
        Positions must be below this (a model with learned position embeddings has that many rows); None:
        no bound beyond the context.
    causal : bool
        A row sees only the rows of its sequence at its position or before (a file whose
        ``attention.causal`` is true; llama.cpp builds that mask the same way). Default False.
    """

    def __init__(self, n_layers: int, n_pos: Optional[int] = None, causal: bool = False) -> None:
        self.n_layers = int(n_layers)
        if self.n_layers < 1:
            raise GGMLValueError("n_layers must be >= 1")
        self.n_pos = None if n_pos is None else int(n_pos)
        self.causal = bool(causal)
        self.n_seq_max = 0
        self.max_batch = 0
        self.report = None
        self._ready = False

    # ------------------------------------------------------------------ lifecycle

    def init(self, capacity: int, n_seq_max: int, max_batch: int, **kw) -> None:
        """Record the sizes; nothing is allocated (``placement``, ``report``, ``runtime`` are accepted and
        unused: there is no storage to place or report)."""
        if self._ready:
            raise CacheStateError("encoder cache: already initialised")
        if int(n_seq_max) < 1 or int(max_batch) < 1 or int(capacity) < 1:
            raise GGMLValueError(f"encoder cache: capacity, n_seq_max and max_batch must be >= 1 (got {capacity}, "
                                 f"{n_seq_max}, {max_batch})")
        self.capacity, self.n_seq_max, self.max_batch = int(capacity), int(n_seq_max), int(max_batch)
        self.report = kw.get("report")
        self._ready = True

    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement=None) -> int:
        """Host memory a worst-case micro-batch needs: its F16 mask (and the plan's copy of it)."""
        return 2 * 2 * int(max_batch) ** 2

    def close(self) -> None:
        self._ready = False

    def _check_ready(self) -> None:
        if not self._ready:
            raise CacheStateError("encoder cache: not initialised (call init() first) or closed")

    def _check_layer(self, layer: int) -> int:
        layer = int(layer)
        if not 0 <= layer < self.n_layers:
            raise GGMLValueError(f"layer {layer} out of range [0, {self.n_layers})")
        return layer

    def _check_seq(self, seq: int) -> int:
        self._check_ready()
        seq = int(seq)
        if not 0 <= seq < self.n_seq_max:
            raise GGMLValueError(f"sequence id {seq} out of range [0, {self.n_seq_max})")
        return seq

    # ------------------------------------------------------------------ a micro-batch

    def start_forward(self, positions, seq_ids, reserve: bool = False, **kw) -> EncoderPlan:
        """Plan a micro-batch: its mask (each row sees its own sequence's rows). Changes nothing.

        ``except_rows`` and ``spans`` (a causal cache's exceptions) are accepted and have nothing to add:
        every row already sees its whole sequence.

        Raises
        ------
        GGMLValueError
            An empty batch, lengths that differ, a sequence id out of range, a negative position or one at
            or past the bound ``n_pos``, or a sequence whose first row here is not at position 0 (its earlier
            rows were in another micro-batch, which a non-causal encoder cannot see: an input must fit one
            micro-batch, ``n_ubatch``).
        """
        self._check_ready()
        positions = _int_array(positions, "positions")
        seq_ids = _int_array(seq_ids, "seq_ids")
        n = positions.size
        if n == 0:
            raise GGMLValueError("empty batch")
        if seq_ids.shape != positions.shape:
            raise GGMLValueError(f"positions and seq_ids differ in length: {positions.size} != {seq_ids.size}")
        if n > self.max_batch:
            raise GGMLValueError(f"encoder cache: a batch of {n} rows, more than the {self.max_batch} it was "
                                 "initialised for")
        if reserve:
            return EncoderPlan(positions, seq_ids, np.zeros((n, n), np.float16), True)
        if seq_ids.min() < 0 or seq_ids.max() >= self.n_seq_max:
            bad = int(seq_ids[(seq_ids < 0) | (seq_ids >= self.n_seq_max)][0])
            raise GGMLValueError(f"sequence id {bad} out of range [0, {self.n_seq_max})")
        if positions.min() < 0:
            raise GGMLValueError("positions must be >= 0")
        if self.n_pos is not None and positions.max() >= self.n_pos:
            raise GGMLValueError(f"position {int(positions.max())} is past the model's {self.n_pos} positions "
                                 "(an input is at most that long)")
        seqs = np.unique(seq_ids)
        starts = np.array([positions[seq_ids == s].min() for s in seqs])
        if starts.any():
            s = int(seqs[np.flatnonzero(starts)[0]])
            raise GGMLValueError(f"encoder: sequence {s} starts at position {int(starts[starts > 0][0])} in this "
                                 "micro-batch, but a non-causal encoder keeps nothing between micro-batches: "
                                 "each input must be whole in one (at most n_ubatch tokens)")
        see = seq_ids[:, None] == seq_ids[None, :]
        if self.causal:
            see &= positions[None, :] <= positions[:, None]
        mask = np.where(see, np.float16(0), np.float16(-np.inf))
        return EncoderPlan(positions, seq_ids, mask.astype(np.float16, copy=False))

    def forward(self, ctx: Context, plan: EncoderPlan) -> EncoderForward:
        """A :class:`EncoderForward` for building this batch's graph layer by layer."""
        self._check_plan(plan)
        return EncoderForward(self, ctx, plan)

    def apply(self, plan: EncoderPlan) -> None:
        """Nothing to commit (the plan is checked)."""
        self._check_plan(plan)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, EncoderPlan):
            raise GGMLTypeError(f"plan must be an EncoderPlan from this cache, got {type(plan).__name__}")

    # ------------------------------------------------------------------ sequences: nothing is kept

    def seq_pos_max(self, seq: int) -> int:
        """-1: an encoder holds nothing (a sequence's next input starts at position 0)."""
        self._check_seq(seq)
        return -1

    def can_resume(self, seq: int, pos: int) -> bool:
        """Only from the start: nothing is kept to resume from."""
        self._check_seq(seq)
        return int(pos) == 0

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Nothing to remove."""
        self._check_seq(seq)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Nothing to share (a copied prefix would have to be computed again anyway)."""
        self._check_seq(src)
        self._check_seq(dst)

    def clear(self, seq: Optional[int] = None) -> None:
        if seq is not None:
            self._check_seq(seq)

    def fragmentation(self) -> float:
        return 0.0

    def defrag(self) -> list:
        return []

    def save_seq(self, seq: int, file, meta: Optional[dict] = None) -> int:
        raise NotSupported("save_seq: a non-causal encoder keeps no state to save")

    def load_seq(self, seq: int, file, expect_meta: Optional[dict] = None, check=None) -> dict:
        raise NotSupported("load_seq: a non-causal encoder keeps no state to load")
