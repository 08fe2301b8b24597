"""KV caches: cell bookkeeping, the causal cache, and caches made of caches.

* :mod:`~ggmlpy.kvcache.cells`: :class:`Cells`, which position of which
  sequences each cache row (cell) holds: numpy bookkeeping, no tensors;
* :mod:`~ggmlpy.kvcache.causal`: :class:`Causal`, per-layer K/V storage on
  the layers' devices, shift and defragmentation;
* :mod:`~ggmlpy.kvcache.forward`: a batch through a :class:`Causal`: its plan
  (:class:`ForwardPlan`: cells, visible range, mask) and commit, and one
  graph's view of the cache (:class:`Forward`);
* :mod:`~ggmlpy.kvcache.recurrent`: :class:`Recurrent`, one fixed-size state
  per sequence and recurrent layer (short convolutions, Mamba scans), with
  prefix sharing and checkpoints (:mod:`~ggmlpy.kvcache.rows`:
  :class:`StateRows`, its bookkeeping); it cannot shift or cut its history;
* :mod:`~ggmlpy.kvcache.composite`: :class:`Wrapper` (layers routed to
  several caches, for interleaved sliding-window models and for hybrid
  models of attention and recurrent layers; an encoder's cache, K/V stored
  once per input, comes back with the first encoder-decoder model);
* :mod:`~ggmlpy.kvcache.encoder`: :class:`Encoder`, the cache of a
  non-causal encoder (BERT): nothing stored, each micro-batch attends over
  itself, one sequence seeing only its own rows;
* :mod:`~ggmlpy.kvcache.state`: save and load one sequence's K/V and states
  (``cache.save_seq`` / ``cache.load_seq``, :class:`StateError`).

A model makes the cache it needs (``model.new_cache(...)``); the runner never
names a cache class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol, runtime_checkable

from ggmlpy._core import Context, Type

from .causal import V_TRANS_TYPES, Causal
from .cells import CacheStateError, Cells, NotSupported
from .composite import Wrapper, WrapperForward, WrapperPlan, resume_point
from .encoder import Encoder, EncoderForward, EncoderPlan
from .forward import Forward, ForwardPlan, KVCacheFull
from .recurrent import Recurrent, RecurrentForward, RecurrentPlan
from .rows import StateRows
from .state import StateError


@runtime_checkable
class Cache(Protocol):
    """What the runner calls on the cache a model made (``model.new_cache``; Ollama's ``kvcache.Cache``).
    :class:`Causal`, :class:`Recurrent` and :class:`Wrapper`, and for encoders :class:`Encoder`.

    A cache may also have ``split_equal`` (true: a batch gives each sequence as many consecutive rows, as a
    recurrent state needs; the runner cuts its micro-batches so), ``resume_point(seq, pos)`` (the most tokens
    ``<= pos`` it can go on from, where that is not simply ``pos`` or 0: a recurrent cache's checkpoints) and
    ``want_checkpoint(seq, n)`` (keep the sequence's state at ``n`` tokens)."""

    # Allocate room for capacity cells per sequence, n_seq_max sequences, max_batch tokens per batch
    # (on the devices of the model's layers; the memory report gets what each took).
    def init(self, capacity: int, n_seq_max: int, max_batch: int, **kw) -> None: ...
    # What init would take in host memory (before trying it: the runner's check of the host's room).
    def host_bytes(self, capacity: int, n_seq_max: int, max_batch: int, placement: Any = None) -> int: ...
    # Find cells for a batch's tokens (position and sequences each); a plan, nothing written yet.
    # reserve: a worst-case plan for sizing graphs, no cells taken.
    def start_forward(self, positions, seq_ids, reserve: bool = False) -> Any: ...
    # A graph's view of the cache for a plan: per layer the K/V writes and views, the mask; it fills
    # its own inputs.
    def forward(self, ctx: Context, plan: Any) -> Any: ...
    # The plan's cells now hold its tokens (after the graph ran).
    def apply(self, plan: Any) -> None: ...
    # Forget positions [begin, end) of a sequence (end None: to its end).
    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None: ...
    # Let dst share src's first length positions (prefix reuse across sequences).
    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...
    # Whether a sequence can go on from pos (a window cache may have dropped what pos needs).
    def can_resume(self, seq: int, pos: int) -> bool: ...
    # The highest position a sequence holds, -1 for none.
    def seq_pos_max(self, seq: int) -> int: ...
    # One sequence's K/V and meta to a file; bytes written.
    def save_seq(self, seq: int, file: Any, meta: Optional[dict] = None) -> int: ...
    # A sequence back from a file, checked all first (nothing changes on a refused file); its meta.
    def load_seq(self, seq: int, file: Any, expect_meta: Optional[dict] = None,
                 check: Optional[Callable[[dict, list], None]] = None) -> dict: ...
    # 1 - used / (last live cell + 1): how much of the span in use is holes (0 when compact).
    def fragmentation(self) -> float: ...
    # Compact the live cells to the front, moving their K/V rows; the moves made (runs of cells).
    def defrag(self) -> list: ...
    # Forget one sequence, or everything (seq None).
    def clear(self, seq: Optional[int] = None) -> None: ...
    # Free the buffers; safe twice.
    def close(self) -> None: ...


#: The cache types by llama.cpp's names (its -ctk/-ctv values): the one table the runner and the bench
#: read. Each has a ggml CPU row writer (set_rows) and, for flash attention, a K dot product and a V
#: to-float conversion.
CACHE_TYPES = {"f32": Type.F32, "f16": Type.F16, "bf16": Type.BF16, "q8_0": Type.Q8_0, "q4_0": Type.Q4_0,
               "q4_1": Type.Q4_1, "q5_0": Type.Q5_0, "q5_1": Type.Q5_1, "iq4_nl": Type.IQ4_NL}

__all__ = ["CACHE_TYPES", "V_TRANS_TYPES", "Cache", "CacheStateError", "Causal", "Cells", "Encoder",
           "EncoderForward", "EncoderPlan", "Forward", "ForwardPlan", "KVCacheFull", "NotSupported", "Recurrent",
           "RecurrentForward", "RecurrentPlan", "resume_point", "StateError", "StateRows", "Wrapper",
           "WrapperForward", "WrapperPlan"]
