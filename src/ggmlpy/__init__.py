"""ggmlpy: Python bindings for ggml.

Low-level tensor scripting over ggml's C API (``Context``, ``Tensor``,
``Graph`` and every op a transformer needs), with every precondition checked in
the binding so mistakes raise Python exceptions instead of aborting.

Order of dimensions
-------------------
Functions that mirror ggml take and return ggml's ``ne`` order, where
``ne[0]`` is the fastest-moving dimension (the length of a row):
``ctx.mul_mat(a, b)`` gives ``ne = (a.ne[1], b.ne[1], ...)``. Only the numpy
bridge speaks numpy order: ``Tensor.shape``, ``Tensor.numpy()`` and
``Context.from_numpy()``.
"""

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
]
