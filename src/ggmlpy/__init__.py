"""ggmlpy: Python bindings for ggml.

Low-level tensor scripting over ggml's C API (``Context``, ``Tensor``,
``Graph`` and every op a transformer needs), with every precondition checked in
the binding so mistakes raise Python exceptions instead of aborting.

Running models: ``ggmlpy.open(path)`` loads a GGUF model and starts a :class:`Runner` over it (use it in a
``with`` block); ``runner.generate(prompt, max_tokens=..., temperature=..., stream=...)`` and
``runner.chat(messages, ...)`` generate. ``load_model``, ``Runner``, ``SamplingParams`` and the request
types are here too; they are imported on first use, so ``import ggmlpy`` loads only the core.

Order of dimensions
-------------------
Functions that mirror ggml take and return ggml's ``ne`` order, where
``ne[0]`` is the fastest-moving dimension (the length of a row):
``ctx.mul_mat(a, b)`` gives ``ne = (a.ne[1], b.ne[1], ...)``. Only the numpy
bridge speaks numpy order: ``Tensor.shape``, ``Tensor.numpy()`` and
``Context.from_numpy()``.
"""

from typing import TYPE_CHECKING

# First: a CUDA build finds its CUDA libraries before _core loads (see _libs).
import ggmlpy._libs  # noqa: F401
from ggmlpy._core import (
    Backend,
    BackendUnavailable,
    Buffer,
    BufferType,
    BufferUsage,
    ClosedError,
    ComputeAborted,
    ComputeFailed,
    Context,
    Device,
    Gallocr,
    GGMLError,
    GGMLMemoryError,
    GGMLTypeError,
    GGMLValueError,
    GluOp,
    Graph,
    Op,
    PoolOp,
    Prec,
    RopeType,
    RPCError,
    RPCTimeoutError,
    ScaleMode,
    Scheduler,
    SortOrder,
    Status,
    Tensor,
    TriType,
    Type,
    UnaryOp,
    alloc_ctx_tensors,
    backend_init,
    blck_size,
    dequantize,
    device,
    devices,
    graph_overhead,
    is_quantized,
    quantize,
    row_size,
    rpc_add_server,
    rpc_get_timeout,
    rpc_set_timeout,
    rpc_start_server,
    set_log_level,
    tensor_overhead,
    type_name,
    type_size,
)
from ggmlpy._system import cpu_variant, ggml_commit, ggml_version, system_info
from ggmlpy._version import __version__

if TYPE_CHECKING:            # what type checkers and IDEs see of the names imported on first use
    from ggmlpy.api import open  # noqa: F401 (not in __all__: see there)
    from ggmlpy.defaults import DEFAULTS
    from ggmlpy.load import load_model
    from ggmlpy.runner import (
        Completion,
        DoneReason,
        Handle,
        InputTooLong,
        RequestTimeout,
        Runner,
        RunnerError,
        Stream,
        TokenEvent,
    )
    from ggmlpy.sampling import SamplingParams

#: The Python layers' names a first script needs, by the module that defines each: imported on first use
#: (a module ``__getattr__``), so that ``import ggmlpy`` stays the core alone.
_LAZY = {
    "open": "ggmlpy.api",
    "load_model": "ggmlpy.load",
    "Completion": "ggmlpy.runner", "DoneReason": "ggmlpy.runner", "Handle": "ggmlpy.runner",
    "InputTooLong": "ggmlpy.runner", "RequestTimeout": "ggmlpy.runner", "Runner": "ggmlpy.runner",
    "RunnerError": "ggmlpy.runner", "Stream": "ggmlpy.runner", "TokenEvent": "ggmlpy.runner",
    "SamplingParams": "ggmlpy.sampling",
    "DEFAULTS": "ggmlpy.defaults",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ggmlpy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value             # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backend", "Buffer", "BufferType", "BufferUsage", "Device", "Gallocr", "Scheduler", "alloc_ctx_tensors",
    "backend_init", "cpu_variant", "device", "devices", "rpc_add_server", "rpc_start_server",
    "RPCError", "RPCTimeoutError", "rpc_get_timeout", "rpc_set_timeout",
    "BackendUnavailable", "ClosedError", "ComputeAborted", "ComputeFailed", "Context", "GGMLError",
    "GGMLMemoryError", "GGMLTypeError", "GGMLValueError", "GluOp", "Graph", "Op", "PoolOp", "Prec",
    "RopeType", "ScaleMode", "SortOrder", "Status", "Tensor", "TriType", "Type", "UnaryOp",
    "__version__", "blck_size", "dequantize", "ggml_commit", "ggml_version", "graph_overhead",
    "is_quantized", "quantize", "row_size", "set_log_level", "system_info", "tensor_overhead",
    "type_name", "type_size",
    # the Python layers (imported on first use); not "open", which a star import would make shadow the builtin
    "DEFAULTS", "Completion", "DoneReason", "Handle", "InputTooLong", "RequestTimeout", "Runner", "RunnerError",
    "SamplingParams", "Stream", "TokenEvent", "load_model",
]
