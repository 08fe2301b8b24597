"""KV caches: cell bookkeeping, the causal cache, and caches made of caches.

* :mod:`~ggmlpy.kvcache.cells`: :class:`Cells`, which position of which
  sequences each cache row (cell) holds: numpy bookkeeping, no tensors;
* :mod:`~ggmlpy.kvcache.causal`: :class:`Causal`, per-layer K/V storage on
  the layers' devices, batch plans (:class:`ForwardPlan`), masks, shift and
  defragmentation;
* :mod:`~ggmlpy.kvcache.composite`: :class:`Wrapper` (layers routed to
  several caches, for interleaved sliding-window models; an encoder's cache,
  K/V stored once per input, comes back with the first encoder-decoder model);
* :mod:`~ggmlpy.kvcache.state`: save and load one sequence's K/V
  (``cache.save_seq`` / ``cache.load_seq``, :class:`StateError`).

A model makes the cache it needs (``model.new_cache(...)``); the runner never
names a cache class.
"""

from __future__ import annotations

from .causal import V_TRANS_TYPES, Causal, Forward, ForwardPlan, KVCacheFull
from .cells import CacheStateError, Cells, NotSupported
from .composite import Wrapper, WrapperForward, WrapperPlan
from .state import StateError

__all__ = ["V_TRANS_TYPES", "CacheStateError", "Causal", "Cells", "Forward", "ForwardPlan", "KVCacheFull", "NotSupported", "StateError", "Wrapper", "WrapperForward", "WrapperPlan"]
