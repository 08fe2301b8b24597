# cython: language_level=3, boundscheck=False, cdivision=True
# cython: embedsignature=True, embedsignature.format=python
"""ggmlpy._core: the compiled binding over ggml.

Everything here mirrors ggml's C API (names without the ``ggml_`` prefix, same
argument order, ggml's ``ne`` order of dimensions) and checks each precondition
before the C call, so that a mistake made from Python raises an exception
instead of reaching ggml's ``GGML_ASSERT`` (which aborts the process).
"""

cimport cython
cimport ggmlpy._ggml as g
from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t, INT64_MAX, INT64_MIN
from libc.stdlib cimport malloc, free
from cpython.pythread cimport PyThread_type_lock, PyThread_allocate_lock, PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void ** memptr, size_t alignment, size_t size)
from libc.string cimport memcpy, memset, strlen, strncpy

import enum
import logging
import operator
import os
import sys
import weakref

import numpy as np

include "_pxi/errors.pxi"        # exceptions, status/alloc checks, abort and log hooks
_install_hooks()                 # before any other module-level code calls ggml
include "_pxi/types.pxi"         # Type/Op/... enums and type traits
include "_pxi/debug.pxi"         # live-object counters
include "_pxi/validate.pxi"      # precondition checks shared by every op
include "_pxi/context.pxi"       # Context: the arena tensors live in; fields, lifetime, tensor creation
include "_pxi/tensor.pxi"        # Tensor: metadata, numpy bridge, buffer protocol, DLPack
include "_pxi/ops.pxi"           # Context's op methods (base _ContextOps), in ggml.h order
include "_pxi/ops_nn.pxi"        # Context's op methods, part 2 (base _ContextNN): conv, pool, pad, generators; new_graph
include "_pxi/kernels.pxi"       # ggmlpy's own CPU kernels (base _ContextKernels): ops, switches, the models' checks
include "_pxi/graph.pxi"         # Graph build and CPU compute
include "_pxi/backend.pxi"       # devices, backends, buffer types, buffers, graph allocator
include "_pxi/sched.pxi"         # scheduler, RPC
include "_pxi/quants.pxi"        # quantize / dequantize
include "_pxi/system.pxi"        # versions, CPU features, devices
include "_pxi/gguf.pxi"          # GGUF files through gguf.h (reader/writer in ggmlpy.gguf)
include "_pxi/kvplan.pxi"        # the KV cache's masks and one-token plan (ggmlpy.kvcache)

