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

Split models (llama.cpp's ``gguf-split`` format: ``model-00001-of-00003.gguf`` ...)::

    with gguf.GGUFWriter("model.gguf", arch="llama", split_max_tensors=128) as w:
        ...                                  # writes model-00001-of-0000N.gguf ...
    gguf.write_split("model.gguf", "split.gguf", max_tensors=8)   # an existing file, as gguf-split does
    r = gguf.open_reader("model-00001-of-00003.gguf")   # a GGUFSplitReader over every shard

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
:mod:`~ggmlpy.gguf.data` (:func:`open_data`, :class:`MappedFile`, :class:`ConcatFile`: tensor data in bulk),
:mod:`~ggmlpy.gguf.split` (:func:`open_reader`, :class:`GGUFSplitReader`: split models) and
``_types`` (:data:`ValueType`, :class:`TensorInfo`, the dtype tables).
"""

from __future__ import annotations

# Besides __all__, this face keeps the names read through it: Type (gguf.Type, the ggml types) and
# _REQUIRED (weights.py's "no default", as meta_int takes it).
from ggmlpy._core import GGUFError, Type  # noqa: F401

from ._types import ALIGNMENT_KEY, DEFAULT_ALIGNMENT, TensorInfo, ValueType
from .data import ConcatFile, MappedFile, open_data
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
from .split import (
           SPLIT_COUNT,
           SPLIT_NO,
           SPLIT_TENSORS_COUNT,
           GGUFSplitReader,
           open_reader,
           parse_split_name,
           split_path,
           split_paths,
)
from .writer import GGUFWriter, write_split

__all__ = ["ALIGNMENT_KEY", "DEFAULT_ALIGNMENT", "SPLIT_COUNT", "SPLIT_NO", "SPLIT_TENSORS_COUNT", "ConcatFile",
           "GGUFError", "GGUFKeyError", "GGUFReader", "GGUFSplitReader", "GGUFWriter", "MappedFile", "MetadataError",
           "MetadataTypeError", "TensorInfo", "ValueType", "meta_float", "meta_int", "meta_str", "open_data",
           "open_reader", "parse_split_name", "split_path", "split_paths", "write_split"]
