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

from ggmlpy._core import Type

from .causal import V_TRANS_TYPES, Causal, Forward, ForwardPlan, KVCacheFull
from .cells import CacheStateError, Cells, NotSupported
from .composite import Wrapper, WrapperForward, WrapperPlan
from .state import StateError

#: The cache types by llama.cpp's names (its -ctk/-ctv values): the one table the runner and the bench
#: read. Each has a ggml CPU row writer (set_rows) and, for flash attention, a K dot product and a V
#: to-float conversion.
CACHE_TYPES = {"f32": Type.F32, "f16": Type.F16, "bf16": Type.BF16, "q8_0": Type.Q8_0, "q4_0": Type.Q4_0,
               "q4_1": Type.Q4_1, "q5_0": Type.Q5_0, "q5_1": Type.Q5_1, "iq4_nl": Type.IQ4_NL}

__all__ = ["CACHE_TYPES", "V_TRANS_TYPES", "CacheStateError", "Causal", "Cells", "Forward", "ForwardPlan", "KVCacheFull", "NotSupported", "StateError", "Wrapper", "WrapperForward", "WrapperPlan"]
