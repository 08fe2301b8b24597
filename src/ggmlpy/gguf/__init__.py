"""GGUF files: read and write them through ggml's own gguf API.

GGUF is the file format of llama.cpp and ggml: a header of typed key/value
metadata and a table of tensors (name, ggml type, shape, offset), then the
tensor data, each tensor aligned (32 bytes unless ``general.alignment`` says
otherwise). The header is parsed and serialized by ggml (``gguf.h``), so what
ggmlpy reads and writes is what llama.cpp reads and writes.

Reading::

    from ggmlpy import gguf
    with gguf.GGUFReader("model.gguf") as r:
        arch = r.get("general.architecture")
        for t in r.tensors:                  # TensorInfo(name, type, ne, offset, nbytes)
            a = r.tensor_data(t.name)        # read-only, memory-mapped, no copy
            b = r.tensor_data(t.name, copy=True)   # a private copy (no SIGBUS if the file is truncated later)

Writing::

    with gguf.GGUFWriter("out.gguf", arch="llama") as w:
        w.add("llama.block_count", 2)                      # INT32
        w.add("llama.context_length", 4096, gguf.ValueType.UINT32)
        w.add("tokenizer.ggml.tokens", ["<s>", "</s>"])   # STRING array
        w.add_tensor("token_embd.weight", emb, type="Q8_0")  # quantized on write
    # the file appears (renamed from out.gguf.tmp) when the block ends

Order of dimensions: ``TensorInfo.ne`` is ggml's order (``ne[0]`` is the row
length), trimmed of trailing 1s (ggml writes ``ggml_n_dims`` dimensions and
does not keep more), at least one; ``TensorInfo.shape`` and the arrays of
``tensor_data`` / ``add_tensor`` are numpy order (reversed).

Limits of the format as ggml implements it: keys, string values and tensor
names are C strings (no NUL characters), tensor names are at most 63 bytes,
arrays do not nest. A string read from a file is decoded as UTF-8 with
invalid bytes replaced, and ends at its first NUL.

This package's face re-exports every public name; one module per job behind it:
:mod:`~ggmlpy.gguf.reader` (:class:`GGUFReader`), :mod:`~ggmlpy.gguf.writer` (:class:`GGUFWriter`),
:mod:`~ggmlpy.gguf.metadata` (typed, checked values and the errors naming a key),
:mod:`~ggmlpy.gguf.data` (:func:`open_data`, :class:`MappedFile`: tensor data in bulk) and
``_types`` (:data:`ValueType`, :class:`TensorInfo`, the dtype tables).
"""

from __future__ import annotations

# Besides __all__, this face keeps the names read through it: Type (gguf.Type, the ggml types) and
# _REQUIRED (weights.py's "no default", as meta_int takes it).
from ggmlpy._core import GGUFError, Type  # noqa: F401

from ._types import ALIGNMENT_KEY, DEFAULT_ALIGNMENT, TensorInfo, ValueType
from .data import MappedFile, open_data
from .metadata import (
           _REQUIRED,  # noqa: F401
           GGUFKeyError,
           MetadataError,
           MetadataTypeError,
           meta_float,
           meta_int,
           meta_str,
)
from .reader import GGUFReader
from .writer import GGUFWriter

__all__ = ["ALIGNMENT_KEY", "DEFAULT_ALIGNMENT", "GGUFError", "GGUFKeyError", "GGUFReader", "GGUFWriter", "MappedFile",
           "MetadataError", "MetadataTypeError", "TensorInfo", "ValueType", "meta_float", "meta_int", "meta_str",
           "open_data"]
