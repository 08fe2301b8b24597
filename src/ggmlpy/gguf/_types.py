"""The GGUF format's types: value types and their numpy dtypes, the ggml types of numpy dtypes, a tensor
table entry, and the tests of what kind a Python value is (shared by the metadata readers and the writer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggmlpy import _core
from ggmlpy._core import Type

ValueType = _core.GGUFValueType
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

_VT_DTYPE = {vt: _core._GGUF_DTYPES[int(vt)] for vt in ValueType if int(vt) in _core._GGUF_DTYPES}
_DTYPE_VT = {dt: vt for vt, dt in _VT_DTYPE.items()}
_INT_RANGE = {ValueType(k): v for k, v in _core._GGUF_INT_RANGE.items()}
_NP_TYPE = {np.dtype(np.float32): Type.F32, np.dtype(np.float16): Type.F16, np.dtype(np.float64): Type.F64,
            np.dtype(np.int8): Type.I8, np.dtype(np.int16): Type.I16, np.dtype(np.int32): Type.I32,
            np.dtype(np.int64): Type.I64}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF file's tensor table.

    Attributes
    ----------
    name : str
    type : Type
        The ggml type of the data.
    ne : tuple of int
        ggml order (``ne[0]`` is the row length), trailing 1s trimmed, at least one.
    offset : int
        Absolute offset of the data in the file.
    nbytes : int
        Size of the data in bytes.
    """

    name: str
    type: Type
    ne: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in numpy order (``ne`` reversed)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        """Number of elements."""
        n = 1
        for x in self.ne:
            n *= x
        return n


def _is_bool(v: object) -> bool:
    return isinstance(v, (bool, np.bool_))


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not _is_bool(v)


def _is_float(v: object) -> bool:
    return isinstance(v, (float, np.floating))


def _type_name_of(v: object) -> str:
    return _type_of(v).__name__


def _type_of(v: object) -> type:
    # The writer's methods take a `type=` argument, which hides the builtin there.
    return v.__class__
