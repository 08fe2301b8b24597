"""What every model is to the layers above it: the :class:`Model` protocol, the graph it builds, and the
registry of architectures.

A model (in the spirit of Ollama's ``model.Model`` and llama.cpp's ``llm_graph``/``create_memory``):

* reads its hyperparameters from GGUF metadata and places and loads its weights;
* **owns its cache recipe**: :meth:`Model.new_cache` returns the cache its layers need (a
  :class:`~ggmlpy.kvcache.Causal`, a :class:`~ggmlpy.kvcache.Wrapper` of window and full caches, an
  encoder cache), not yet allocated; the runner sizes it with ``cache.init(...)`` and never names a
  cache class;
* builds a forward graph from a cache plan (:meth:`Model.build`). The cache owns its inputs: the
  model asks ``cache.forward(ctx, plan)`` for the per-layer K/V writes and views and the mask; the
  :class:`BuiltGraph` fills the token, position and output-row inputs and has the cache fill its own.

Architectures register themselves by ``general.architecture`` (:func:`register`);
:func:`ggmlpy.models.load_model` picks the class from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from ggmlpy._core import Context, GGMLValueError, Graph, Tensor
from ggmlpy.kvcache import Cache

__all__ = ["ARCHITECTURES", "BuiltGraph", "Cache", "Model", "UnknownArchitecture", "model_class", "register"]


class UnknownArchitecture(GGMLValueError):
    """The file's ``general.architecture`` has no model class (or uses a variant the class cannot build)."""


@dataclass
class BuiltGraph:
    """One forward graph and its inputs (fill them after the scheduler allocated the graph).

    ``memory`` is the cache's view for this graph (``cache.forward(ctx, plan)``): it owns the
    cache's inputs (destination rows, mask) and fills them from a plan.
    """

    ctx: Context
    graph: Graph
    tokens: Tensor
    positions: Tensor
    memory: Any
    out_ids: Tensor
    output: Tensor           # logits (n_vocab, n_out) or hidden states (n_embd, n_out) for embeddings
    n_tokens: int
    n_out: int
    key: tuple = ()
    embd: Optional[Tensor] = None        # input embeddings of some rows (an image's), ne = (n_embd, k)
    embd_rows: Optional[Tensor] = None   # which rows they replace, I64 ne = (k,)
    #: ``(node, device)``: nodes the scheduler must compute on that device (:meth:`Runtime.pin`)
    pins: list = field(default_factory=list)

    def set_inputs(self, tokens, positions, plan, out_ids, embd=None) -> None:
        """Fill the inputs: token ids, positions, the output rows, the cache's own from ``plan``, and for
        a graph with input embeddings ``embd = (values (k, n_embd) float32, rows (k,))``."""
        self.tokens.set(np.asarray(tokens, dtype=np.int32))
        self.positions.set(np.asarray(positions, dtype=np.int32))
        self.memory.fill(plan)
        self.out_ids.set(np.asarray(out_ids, dtype=np.int32))
        if self.embd is not None:
            if embd is None:
                raise GGMLValueError("set_inputs: this graph takes input embeddings; none given")
            self.embd.set(np.ascontiguousarray(embd[0], dtype=np.float32))
            self.embd_rows.set(np.asarray(embd[1], dtype=np.int64))

    def free(self) -> None:
        self.ctx.free()


@runtime_checkable
class Model(Protocol):
    """What the runner and the benchmark need of a model (see the module docstring)."""

    config: Any              # the architecture's hyperparameters (``n_layer``, ``eos_token_ids`` ...)
    placement: Any           # ggmlpy.backend.Placement: the device of each layer
    report: Any              # ggmlpy.memory.MemoryReport: weights per device and layer
    n_vocab: int
    desc: str                # llama-bench's model description, e.g. "llama 110M F16"
    size: int
    n_params: int
    loaded: bool

    def new_cache(self, type_k, type_v, *, flash_attn: bool = True) -> Cache: ...
    def build(self, cache: Cache, plan: Any, n_tokens: int, n_out: int, *, flash_attn: bool = False,
              embeddings: bool = False) -> BuiltGraph: ...
    def graph_size(self) -> int: ...
    def load(self, progress: Optional[Callable[[int, int], None]] = None, check_tensors: bool = False,
             **kw) -> None: ...
    def close(self) -> None: ...


#: ``general.architecture`` -> model class; filled by :func:`register`.
ARCHITECTURES: dict[str, type] = {}


def register(*archs: str) -> Callable[[type], type]:
    """Class decorator: the class builds these ``general.architecture`` values."""
    def deco(cls: type) -> type:
        for a in archs:
            if a in ARCHITECTURES and ARCHITECTURES[a] is not cls:
                raise GGMLValueError(f"architecture {a!r} is registered twice ({ARCHITECTURES[a].__name__}, "
                                     f"{cls.__name__})")
            ARCHITECTURES[a] = cls
        return cls
    return deco


def model_class(arch: object, path: str = "") -> type:
    """The class registered for ``arch`` (the file's ``general.architecture``).

    Raises
    ------
    UnknownArchitecture
        No architecture in the file, or none registered under that name.
    """
    if not isinstance(arch, str):
        raise UnknownArchitecture(f"{path}: no general.architecture in the file")
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise UnknownArchitecture(f"{path}: architecture {arch!r} is not supported "
                                  f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls
