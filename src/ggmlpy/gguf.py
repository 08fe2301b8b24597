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
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggmlpy import _core
from ggmlpy._core import GGMLError, GGMLTypeError, GGUFError, Type
from ggmlpy._files import replacing

__all__ = ["ALIGNMENT_KEY", "DEFAULT_ALIGNMENT", "GGUFError", "GGUFKeyError", "GGUFReader", "GGUFWriter", "MappedFile",
           "MetadataError", "MetadataTypeError", "TensorInfo", "ValueType", "meta_float", "meta_int", "meta_str",
           "open_data"]

ValueType = _core.GGUFValueType
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

_VT_DTYPE = {vt: _core._GGUF_DTYPES[int(vt)] for vt in ValueType if int(vt) in _core._GGUF_DTYPES}
_DTYPE_VT = {dt: vt for vt, dt in _VT_DTYPE.items()}
_INT_RANGE = {ValueType(k): v for k, v in _core._GGUF_INT_RANGE.items()}
_NP_TYPE = {np.dtype(np.float32): Type.F32, np.dtype(np.float16): Type.F16, np.dtype(np.float64): Type.F64,
            np.dtype(np.int8): Type.I8, np.dtype(np.int16): Type.I16, np.dtype(np.int32): Type.I32,
            np.dtype(np.int64): Type.I64}
_CHUNK_BYTES = 16 << 20     # float32 input converted per step when a writer encodes a tensor


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


# --- typed metadata ----------------------------------------------------------------

class GGUFKeyError(KeyError, GGMLError):
    """A metadata key or tensor name the file does not have (``reader[key]``, ``tensor_info``...)."""


class MetadataError(GGUFError):
    """A metadata value of a GGUF file is missing, malformed or out of range.

    The message names the file and the key; both are also attributes.

    Attributes
    ----------
    path : str
    key : str
    """

    def __init__(self, path: str, key: str, message: str) -> None:
        super().__init__(f"{path}: metadata {key!r}: {message}" if path else f"metadata {key!r}: {message}")
        self.path = path
        self.key = key


class MetadataTypeError(MetadataError, GGMLTypeError):
    """A metadata value has the wrong type (a string where a number is needed, a float for a count...).

    Both a :class:`MetadataError` (so a ``ValueError``) and a ``TypeError``.
    """


_REQUIRED: Any = object()


def _meta_raw(md: Any, key: str, default: Any, path: str, per_layer: bool) -> Any:
    """The value of ``key``, or ``default`` (``_REQUIRED``: raise). A per-layer array gives its one value."""
    if key not in md:
        if default is _REQUIRED:
            raise MetadataError(path, key, "is missing")
        return default
    v = md[key]
    if isinstance(v, (np.ndarray, list)):
        if not per_layer:
            raise MetadataTypeError(path, key, f"expected a single value, got an array of {len(v)}")
        if len(v) == 0:
            raise MetadataError(path, key, "is an empty array")
        first = v[0]
        # per-layer arrays (llama.cpp allows them for head counts ...) are supported only when uniform
        if any(x != first for x in v[1:]):
            raise MetadataError(path, key, f"per-layer values differ ({_short(v)}); not supported")
        v = first.item() if isinstance(first, np.generic) else first
    return v


def _short(v: Any) -> str:
    items = list(v[:6])
    return "[" + ", ".join(repr(x.item() if isinstance(x, np.generic) else x) for x in items) + \
        (", ...]" if len(v) > 6 else "]")


def meta_int(md: Any, key: str, default: Any = _REQUIRED, *, lo: int | None = None, hi: int | None = None,
             path: str = "", per_layer: bool = False) -> Any:
    """Integer metadata value ``md[key]``, checked.

    Parameters
    ----------
    md : mapping
        Metadata as :attr:`GGUFReader.metadata` holds it.
    key : str
    default
        Returned when the key is absent (unchecked); without it an absent key raises.
    lo, hi : int, optional
        Inclusive bounds.
    path : str
        The file, for the message.
    per_layer : bool
        Accept an array of identical integers (one per layer) and return its value.

    Raises
    ------
    MetadataError
        Missing, out of ``[lo, hi]``, or a per-layer array whose values differ.
    MetadataTypeError
        Not an integer (bools, floats and strings are refused, not converted).
    """
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, per_layer)
    if not _is_int(v):
        raise MetadataTypeError(path, key, f"expected an integer, got {_type_name_of(v)} {v!r:.80}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise MetadataError(path, key, f"{v} is out of range [{lo if lo is not None else '-inf'}, "
                                       f"{hi if hi is not None else 'inf'}]")
    return v


def meta_float(md: Any, key: str, default: Any = _REQUIRED, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, path: str = "", per_layer: bool = False) -> Any:
    """Finite real metadata value ``md[key]`` (integers are accepted), checked.

    As :func:`meta_int`; NaN and infinities are always refused, ``lo_open``
    makes the lower bound exclusive (``lo=0, lo_open=True``: strictly positive).
    """
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, per_layer)
    if not (_is_int(v) or _is_float(v)):
        raise MetadataTypeError(path, key, f"expected a number, got {_type_name_of(v)} {v!r:.80}")
    v = float(v)
    if not np.isfinite(v):
        raise MetadataError(path, key, f"{v} is not a finite number")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        raise MetadataError(path, key, f"{v:g} is out of range {'(' if lo_open else '['}"
                                       f"{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]")
    return v


def meta_str(md: Any, key: str, default: Any = _REQUIRED, *, path: str = "") -> Any:
    """String metadata value ``md[key]``; :class:`MetadataTypeError` if it is not a string."""
    if key not in md and default is not _REQUIRED:
        return default
    v = _meta_raw(md, key, default, path, False)
    if not isinstance(v, str):
        raise MetadataTypeError(path, key, f"expected a string, got {_type_name_of(v)} {v!r:.80}")
    return v


# --- reading ---------------------------------------------------------------------

class _ThreadLogCapture(logging.Filter):
    """Holds back this thread's records to the ``ggmlpy`` logger (ggml's log)."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread in (self.thread, None):
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def _ggml_log_captured() -> Iterator[_ThreadLogCapture]:
    logger = logging.getLogger("ggmlpy")
    cap = _ThreadLogCapture()
    logger.addFilter(cap)
    try:
        yield cap
    finally:
        logger.removeFilter(cap)


def _diagnose(path: str, head: bytes, size: int, messages: list[str]) -> str:
    if size < 4:
        why = f"the file is {size} bytes long, too short for a GGUF header"
    elif head[:4] != b"GGUF":
        why = f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')"
    elif size < 24:
        why = f"truncated GGUF header ({size} bytes)"
    else:
        version = int.from_bytes(head[4:8], "little")
        if version & 0xFFFF == 0 and version:
            why = f"GGUF version {version:#x}: a big-endian file, which this machine cannot read"
        elif version not in (2, 3):
            why = f"unsupported GGUF version {version} (ggml reads 2 and 3)"
        else:
            why = "not a valid GGUF file (truncated or corrupt)"
    detail = "; ".join(m.split(": ", 1)[-1] for m in messages if m)
    return f"{path}: {why}" + (f" [ggml: {detail}]" if detail else "")


class GGUFReader:
    """Read a GGUF file: its metadata, its tensor table and (memory-mapped) its tensor data.

    The header is parsed by ggml (``gguf_init_from_file``) when the reader is
    made, and the tensor table is checked against the file: the tensors must
    tile the data section (each starts where the one before ends, padded to the
    alignment) and the file must end where the last one does, so a tensor count
    that is too small or a file truncated before opening is an error here.
    The tensor data is mapped read-only on the first ``tensor_data`` call and
    not copied (``tensor_data(name, copy=True)`` reads a copy instead; see its
    warning about files truncated while mapped). Also a context manager;
    ``close()`` unmaps the file (arrays already returned keep their mapping
    alive). Typed, checked metadata: :meth:`get_int`, :meth:`get_float`,
    :meth:`get_str`.

    Parameters
    ----------
    path : str or os.PathLike

    Attributes
    ----------
    path : str
    version : int
        GGUF version (2 or 3).
    alignment : int
        Alignment of the tensor data (``general.alignment``, default 32).
    data_offset : int
        Absolute file offset of the data section.
    file_size : int
    metadata : dict
        Every key/value in file order: str, int, float (FLOAT32 values are
        exact float32s), bool; numeric and bool arrays as 1-D numpy arrays of
        the element type; string arrays as ``list[str]``.
    tensors : list of TensorInfo
        In file order.

    Raises
    ------
    FileNotFoundError, PermissionError, IsADirectoryError
        As ``open`` does.
    GGUFError
        Not a GGUF file, an unsupported version, a corrupt or truncated header
        (with ggml's reason), a tensor of a type this build does not know,
        tensor data that would lie past the end of the file, or bytes after
        the last tensor that no tensor describes.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fsdecode(os.fspath(path))
        with open(self.path, "rb") as f:
            head = f.read(24)
            self.file_size = os.fstat(f.fileno()).st_size
        with _ggml_log_captured() as cap:
            info = _core._gguf_read(self.path)
        if info is None:
            raise GGUFError(_diagnose(self.path, head, self.file_size, [r.getMessage() for r in cap.records]))
        logger = logging.getLogger("ggmlpy")
        for rec in cap.records:          # warnings on a file that loaded: pass them on
            logger.handle(rec)
        self.version: int = info["version"]
        self.alignment: int = info["alignment"]
        self.data_offset: int = info["data_offset"]
        self.metadata: dict[str, Any] = {}
        self._types: dict[str, tuple[ValueType, ValueType | None]] = {}
        for key, t, et, value in info["kv"]:
            self.metadata[key] = value
            self._types[key] = (t, et)
        self.tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        for name, t, ne4, off, nbytes in info["tensors"]:
            try:
                ty = Type(t)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {t}, unknown to this build") from None
            n = 4
            while n > 1 and ne4[n - 1] == 1:
                n -= 1
            ti = TensorInfo(name, ty, tuple(ne4[:n]), self.data_offset + off, nbytes)
            if ti.offset + ti.nbytes > self.file_size:
                raise GGUFError(f"{self.path}: tensor {name!r} data [{ti.offset}, {ti.offset + ti.nbytes}) lies "
                                f"past the end of the file ({self.file_size} bytes): the file is truncated")
            self.tensors.append(ti)
            self._by_name[name] = ti
        self._check_layout()
        self._mm: np.memmap | None = None
        self._closed = False

    def _check_layout(self) -> None:
        """The tensor table must tile the data section: each tensor starts where the one before it ends
        (padded to the alignment) and the file ends where the last one does (padding allowed).

        ggml checks the first rule while parsing; the second catches a header whose tensor count is too
        small (ggml then takes the last tensor's info for data, and every weight moves) and data appended
        to a file. A tensor re-typed to a type of the same size (F16 as BF16) cannot be seen here; the
        model loader checks that the data looks like its type.
        """
        end = self.data_offset
        a = self.alignment
        for ti in self.tensors:
            if ti.offset != end:
                raise GGUFError(f"{self.path}: tensor {ti.name!r} starts at {ti.offset}, but the tensor before it "
                                f"ends (padded to {a}) at {end}: the tensor table is corrupt")
            end = ti.offset + ti.nbytes
            end += -end % a if ti is not self.tensors[-1] else 0
        if self.file_size > end + (-end % a):      # the last tensor (or the header) may be padded
            extra = self.file_size - end
            what = (f"the last tensor {self.tensors[-1].name!r} ends at {end}" if self.tensors else
                    f"the file has no tensors and its data section starts at {self.data_offset}")
            raise GGUFError(f"{self.path}: {what}, but the file has {extra} more bytes ({self.file_size} in all) that "
                            "no tensor describes: the tensor count or a tensor's size is wrong (or data was appended)")

    # metadata
    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if the file has no such key."""
        return self.metadata.get(key, default)

    def kv_type(self, key: str) -> ValueType:
        """The ValueType of ``key`` (``ValueType.ARRAY`` for arrays; see ``arr_type``)."""
        try:
            return self._types[key][0]
        except KeyError:
            raise GGUFKeyError(f"{self.path} has no metadata key {key!r}") from None

    def arr_type(self, key: str) -> ValueType | None:
        """The element ValueType of the array ``key``; None if ``key`` is not an array."""
        try:
            return self._types[key][1]
        except KeyError:
            raise GGUFKeyError(f"{self.path} has no metadata key {key!r}") from None

    # tensors
    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def tensor_info(self, name: str) -> TensorInfo:
        """The TensorInfo of tensor ``name``; KeyError naming the file if there is none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise GGUFKeyError(f"{self.path} has no tensor {name!r} ({len(self.tensors)} tensors)") from None

    def tensor_data(self, name: str, copy: bool = False) -> np.ndarray:
        """The data of tensor ``name``: a read-only view of the mapped file, or with ``copy=True`` a copy.

        F32, F16, F64, I8, I16, I32 and I64 data is a typed array of shape
        ``TensorInfo.shape`` (numpy order); BF16 and quantized data is uint8 of
        shape ``(rows..., row_size_bytes)``, i.e. ``shape`` with its last axis
        replaced by the row's size in bytes (decode it with
        ``ggmlpy.dequantize(data, type, ne0)``).

        Parameters
        ----------
        name : str
        copy : bool
            False (default): no copy; the array is a view of a memory map of the
            file. True: the bytes are read (the file is opened again by its path)
            into a new writable array that does not depend on the file afterwards;
            if the file was replaced since the reader opened it, this reads the
            new file at the old offsets.

        Warnings
        --------
        A memory-mapped array reads the file when it is used. If the file is
        truncated or replaced in place while such an array (or a view of it)
        exists, touching the missing pages kills the process with SIGBUS;
        Python cannot catch that. The size is checked when the reader is made
        and on each call, not at every access. Use ``copy=True`` for files that
        another process may rewrite, or for data kept long after reading.

        Raises
        ------
        KeyError
            No such tensor.
        GGUFError
            The reader is closed, or the file has shrunk since it was opened.
        """
        ti = self.tensor_info(name)
        end = ti.offset + ti.nbytes
        if copy:
            if self._closed:
                raise GGUFError(f"{self.path}: the reader is closed")
            raw = np.empty(ti.nbytes, np.uint8)
            with open(self.path, "rb", buffering=0) as f:
                n = f.seek(ti.offset)
                got = 0
                view = memoryview(raw)
                while n == ti.offset and got < ti.nbytes:
                    k = f.readinto(view[got:])
                    if not k:
                        break
                    got += k
            if got != ti.nbytes:
                raise GGUFError(f"{self.path}: tensor {name!r} data [{ti.offset}, {end}) lies past the end of the "
                                f"file ({ti.offset + got} bytes): it was truncated after opening")
        else:
            mm = self._map()
            if end > mm.shape[0] or os.stat(self.path).st_size < end:
                raise GGUFError(f"{self.path}: tensor {name!r} data [{ti.offset}, {end}) lies past the end of the "
                                f"file ({min(mm.shape[0], os.stat(self.path).st_size)} bytes): it was truncated "
                                "after opening")
            raw = np.asarray(mm[ti.offset:end])
        dt = ti.type.numpy_dtype
        if dt is not None:
            return raw.view(dt).reshape(ti.shape)
        return raw.reshape(ti.shape[:-1] + (ti.type.row_size(ti.ne[0]),))

    # typed metadata
    def get_int(self, key: str, default: Any = _REQUIRED, *, lo: int | None = None, hi: int | None = None,
                per_layer: bool = False) -> Any:
        """Integer value of ``key``, checked; see :func:`meta_int` (errors name the key and this file)."""
        return meta_int(self.metadata, key, default, lo=lo, hi=hi, path=self.path, per_layer=per_layer)

    def get_float(self, key: str, default: Any = _REQUIRED, *, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False, per_layer: bool = False) -> Any:
        """Finite real value of ``key``, checked; see :func:`meta_float`."""
        return meta_float(self.metadata, key, default, lo=lo, hi=hi, lo_open=lo_open, path=self.path,
                          per_layer=per_layer)

    def get_str(self, key: str, default: Any = _REQUIRED) -> Any:
        """String value of ``key``; see :func:`meta_str`."""
        return meta_str(self.metadata, key, default, path=self.path)

    def _map(self) -> np.memmap:
        if self._closed:
            raise GGUFError(f"{self.path}: the reader is closed")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def close(self) -> None:
        """Drop the file mapping; ``tensor_data`` raises afterwards (metadata stays)."""
        self._mm = None
        self._closed = True

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"GGUFReader({self.path!r}, version={self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


# --- reading tensor data in bulk -------------------------------------------------

class MappedFile(io.RawIOBase):
    """A read-only, seekable file object that reads through a memory map of the file.

    ``read``/``readinto`` copy from the mapping, so the data comes from the
    page cache by page faults rather than by ``read(2)`` calls: llama.cpp's
    ``mmap`` load mode for weights that are copied into their buffers. The
    mapping lives until :meth:`close`.

    Warnings
    --------
    Touching a page past the end of a file that shrank after it was mapped
    kills the process with SIGBUS, which Python cannot catch. The file's size
    is checked before every read (a read past the current end raises
    :class:`GGUFError`), which leaves only a truncation *during* one read's
    copy; read files that another process may rewrite with ``open_data(path,
    mmap=False)``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.name = os.fspath(path)
        self._f = open(self.name, "rb", buffering=0)
        try:
            self._size = os.fstat(self._f.fileno()).st_size
            # mmap refuses an empty file; there is nothing to read from one anyway
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self._size else None
        except BaseException:
            self._f.close()
            raise
        self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        self._pos = 0
        if self._mm is not None and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            with contextlib.suppress(OSError):       # a hint for readahead, nothing depends on it
                self._mm.madvise(mmap.MADV_SEQUENTIAL)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"seek: invalid whence {whence}")
        if base + offset < 0:
            raise ValueError(f"seek: negative position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def readinto(self, b) -> int:
        self._checkClosed()
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), self._size - self._pos))
        if n and os.fstat(self._f.fileno()).st_size < self._pos + n:
            raise GGUFError(f"{self.name}: the file shrank below {self._pos + n} bytes while it was mapped "
                            "(rewritten by another process?); not reading it")
        dst[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            if self._mm is not None:
                self._mm.close()
            self._f.close()
        super().close()


def open_data(path: str | os.PathLike, mmap: bool = False) -> io.RawIOBase:
    """A binary file object for reading tensor data: a plain unbuffered file, or a :class:`MappedFile`.

    Both offer ``seek``, ``read`` and ``readinto`` and close with ``with``.
    """
    return MappedFile(path) if mmap else open(os.fspath(path), "rb", buffering=0)


# --- writing ---------------------------------------------------------------------

def _is_bool(v: object) -> bool:
    return isinstance(v, (bool, np.bool_))


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not _is_bool(v)


def _is_float(v: object) -> bool:
    return isinstance(v, (float, np.floating))


def _int_type(key: str, lo: int, hi: int) -> ValueType:
    for vt in (ValueType.INT32, ValueType.INT64, ValueType.UINT64):
        a, b = _INT_RANGE[vt]
        if a <= lo and hi <= b:
            return vt
    raise GGUFError(f"GGUF key {key!r}: integer {lo if lo < -2**63 else hi} does not fit in INT64 or UINT64")


def _elem_type_of(key: str, values: Any) -> ValueType:
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "U":
            return ValueType.STRING
        vt = _DTYPE_VT.get(values.dtype)
        if vt is not None:
            return vt
        if values.dtype.kind != "O":
            raise GGMLTypeError(f"GGUF key {key!r}: numpy dtype {values.dtype} has no GGUF element type")
        values = values.tolist()
    values = list(values)
    if not values:
        raise GGMLTypeError(f"GGUF key {key!r}: an empty array needs an explicit element type "
                            "(add_array(key, [], ValueType.X))")
    if all(isinstance(v, str) for v in values):
        return ValueType.STRING
    if all(_is_bool(v) for v in values):
        return ValueType.BOOL
    if all(_is_int(v) for v in values):
        return _int_type(key, min(int(v) for v in values), max(int(v) for v in values))
    if all(_is_int(v) or _is_float(v) for v in values):
        return ValueType.FLOAT32
    kinds = sorted({type(v).__name__ for v in values})
    raise GGMLTypeError(f"GGUF key {key!r}: cannot infer one element type for an array of {', '.join(kinds)}")


def _array_value(key: str, values: Any, et: ValueType) -> Any:
    """``values`` as the element type wants them: list[str] or a 1-D numpy array."""
    if isinstance(values, (str, bytes)):
        raise GGMLTypeError(f"GGUF key {key!r}: an array needs a sequence, got {type(values).__name__}")
    if et == ValueType.STRING:
        out = values.tolist() if isinstance(values, np.ndarray) else list(values)
        for v in out:
            if not isinstance(v, str):
                raise GGMLTypeError(f"GGUF key {key!r}: a STRING array holds str only, got {type(v).__name__}")
        return out
    dt = _VT_DTYPE[et]
    if isinstance(values, np.ndarray):
        arr = values
        if arr.ndim != 1:
            raise GGUFError(f"GGUF key {key!r}: arrays are 1-D, got shape {arr.shape}")
        if arr.dtype.kind == "O":
            values = arr.tolist()
    if not isinstance(values, np.ndarray):
        values = list(values)
        if et == ValueType.BOOL:
            bad = [v for v in values if not _is_bool(v)]
        elif et in _INT_RANGE:
            bad = [v for v in values if not _is_int(v)]
        else:
            bad = [v for v in values if not (_is_int(v) or _is_float(v))]
        if bad:
            raise GGMLTypeError(f"GGUF key {key!r}: {et.name} array cannot hold {bad[0]!r}")
        if et in _INT_RANGE:
            lo, hi = _INT_RANGE[et]
            out_of = [v for v in values if not lo <= int(v) <= hi]
            if out_of:
                raise GGUFError(f"GGUF key {key!r}: {int(out_of[0])} is out of range for {et.name} [{lo}, {hi}]")
            return np.array([int(v) for v in values], dtype=dt).reshape(-1)
        return np.array(values, dtype=dt).reshape(-1)
    kind = arr.dtype.kind
    if et == ValueType.BOOL:
        if kind != "b":
            raise GGMLTypeError(f"GGUF key {key!r}: a BOOL array needs a numpy bool array, got {arr.dtype}")
    elif et in _INT_RANGE:
        if kind not in "iu":
            raise GGMLTypeError(f"GGUF key {key!r}: an {et.name} array needs integers, got {arr.dtype}")
        lo, hi = _INT_RANGE[et]
        if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
            raise GGUFError(f"GGUF key {key!r}: values [{int(arr.min())}, {int(arr.max())}] are out of range "
                            f"for {et.name} [{lo}, {hi}]")
    elif kind not in "iuf":
        raise GGMLTypeError(f"GGUF key {key!r}: a {et.name} array needs numbers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dt)


def _value_type(t: Any, key: str) -> ValueType:
    try:
        return ValueType(t)
    except ValueError:
        raise GGUFError(f"GGUF key {key!r}: {t!r} is not a ValueType") from None


def _as_ggml_type(type: Any, what: str) -> Type:
    if isinstance(type, Type):
        return type
    if isinstance(type, str):
        try:
            return Type[type.upper()]
        except KeyError:
            raise GGUFError(f"{what}: unknown ggml type {type!r} "
                            f"(expected one of {', '.join(Type.__members__)})") from None
    if _is_int(type):
        try:
            return Type(int(type))
        except ValueError:
            raise GGUFError(f"{what}: {int(type)} is not a ggml type of this build") from None
    try:
        return _NP_TYPE[np.dtype(type)]
    except (KeyError, TypeError):
        raise GGMLTypeError(f"{what}: expected a ggml Type or its name, got {type!r}") from None


class _Pending:
    """A tensor waiting for GGUFWriter.write: its source and how to encode it."""

    __slots__ = ("name", "type", "ne", "nbytes", "data", "raw")

    def __init__(self, name: str, type: Type, ne: tuple[int, ...], nbytes: int, data: Any, raw: bool) -> None:
        self.name, self.type, self.ne, self.nbytes, self.data, self.raw = name, type, ne, nbytes, data, raw

    def pieces(self) -> Iterator[Any]:
        """The encoded bytes, in pieces of bounded size (buffers)."""
        if self.raw:
            yield self.data
            return
        arr, t = self.data, self.type
        if arr.size == 0:
            return
        if t.numpy_dtype is not None and arr.dtype == t.numpy_dtype:
            yield np.ascontiguousarray(arr)
            return
        ne0 = self.ne[0]
        rows = arr.reshape(-1, ne0)
        step = max(1, _CHUNK_BYTES // (4 * ne0))
        for r in range(0, rows.shape[0], step):
            block = rows[r:r + step]
            if t.numpy_dtype is not None:
                yield np.ascontiguousarray(block, dtype=t.numpy_dtype)
            elif t == Type.BF16:
                yield _to_bf16(block)
            else:
                yield _core.quantize(block, t)


def _to_bf16(block: np.ndarray) -> np.ndarray:
    # ggml's rounding: nearest even, NaN kept NaN (quiet bit set).
    u = np.ascontiguousarray(block, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


class GGUFWriter:
    """Write a GGUF file: metadata through ggml's gguf API, tensor data streamed.

    Add metadata (``add``, ``add_array``) and tensors (``add_tensor``) in any
    order, then ``write()`` -- or use the writer as a context manager, which
    writes when the block ends without an exception. The header is serialized
    by ggml; the tensor data is then written tensor by tensor (converted or
    quantized a slice at a time), each padded to the alignment, into
    ``path + ".tmp"``, which is renamed to ``path`` only once complete.

    Tensor data is read when ``write()`` runs, not when it is added.

    Parameters
    ----------
    path : str or os.PathLike
    arch : str, optional
        Sets ``general.architecture`` (as the first key).

    Raises
    ------
    GGUFError
        From any method, for a value the format cannot hold (see each method).
    """

    def __init__(self, path: str | os.PathLike, arch: str | None = None) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self._kv: dict[str, tuple[ValueType, ValueType | None, Any]] = {}
        self._tensors: dict[str, _Pending] = {}
        self._written = False
        if arch is not None:
            self.add("general.architecture", arch, ValueType.STRING)

    def _check_open(self) -> None:
        if self._written:
            raise GGUFError(f"{self.path}: this GGUFWriter has already written its file")

    def _put(self, key: str, t: ValueType, et: ValueType | None, value: Any) -> None:
        _core._gguf_check_kv(key, t, et, value)       # raises now rather than at write()
        self._kv.pop(key, None)                       # a replaced key moves to the end, as in ggml
        self._kv[key] = (t, et, value)

    def add(self, key: str, value: Any, type: ValueType | int | None = None) -> None:
        """Set metadata ``key`` (a later call with the same key replaces it).

        Without ``type`` it is inferred: bool -> BOOL; int -> INT32, or INT64,
        or UINT64 if it needs to (``general.alignment``: UINT32); float ->
        FLOAT32; str -> STRING; list, tuple or numpy array -> ARRAY (see
        ``add_array``). With ``type`` the value is checked against it (ints
        must be in range; ``ValueType.ARRAY`` infers the element type).

        Raises
        ------
        GGUFError
            Empty key, NUL in the key or a string, int out of range,
            ``general.alignment`` not a power-of-two UINT32.
        GGMLTypeError
            A value of the wrong kind for ``type``, or one with no GGUF type.
        """
        self._check_open()
        if type is not None:
            t = _value_type(type, key)
            if t == ValueType.ARRAY:
                self.add_array(key, value)
                return
            if t in _INT_RANGE and _is_int(value):
                value = int(value)
            elif t in (ValueType.FLOAT32, ValueType.FLOAT64) and (_is_int(value) or _is_float(value)):
                value = float(value)
            elif t == ValueType.BOOL and _is_bool(value):
                value = bool(value)
            self._put(key, t, None, value)
            return
        if _is_bool(value):
            self._put(key, ValueType.BOOL, None, bool(value))
        elif _is_int(value):
            v = int(value)
            self._put(key, ValueType.UINT32 if key == ALIGNMENT_KEY else _int_type(key, v, v), None, v)
        elif _is_float(value):
            self._put(key, ValueType.FLOAT32, None, float(value))
        elif isinstance(value, str):
            self._put(key, ValueType.STRING, None, value)
        elif isinstance(value, (list, tuple, np.ndarray)):
            self.add_array(key, value)
        else:
            raise GGMLTypeError(f"GGUF key {key!r}: no GGUF type for a {_type_name_of(value)} "
                                "(bytes must be decoded to str first)")

    def add_array(self, key: str, values: Any, elem_type: ValueType | int | None = None) -> None:
        """Set metadata ``key`` to an array of ``elem_type``.

        ``values``: a sequence or a 1-D numpy array (of strings for STRING).
        Without ``elem_type`` it is inferred from a numpy array's dtype, else
        from the Python values: all str -> STRING, all bool -> BOOL, all int ->
        INT32 / INT64 / UINT64 (the narrowest that holds them all), ints and
        floats -> FLOAT32. Integers are checked against the element type's
        range; floats are never truncated into an integer type.

        Raises
        ------
        GGUFError
            Values out of range, a nested array, a multi-dimensional array.
        GGMLTypeError
            Values of the wrong kind, or an empty array without ``elem_type``.
        """
        self._check_open()
        et = _elem_type_of(key, values) if elem_type is None else _value_type(elem_type, key)
        if et == ValueType.ARRAY:
            raise GGUFError(f"GGUF key {key!r}: arrays of arrays are not supported by ggml")
        self._put(key, ValueType.ARRAY, et, _array_value(key, values, et))

    def add_tensor(self, name: str, data: Any, type: Type | str | None = None,
                   ne: tuple[int, ...] | list[int] | None = None) -> None:
        """Add a tensor.

        Two forms:

        * ``data`` a numpy array in numpy order (shape = reversed ``ne``, at
          most 4 dimensions); ``type`` defaults to the array's own type
          (float32 -> F32, float16 -> F16, float64 -> F64, int8/16/32/64 ->
          I8/I16/I32/I64). Another ``type`` converts: to F32/F16/F64 and the
          integer types with numpy (floats are never cast to integers), to
          BF16 rounding to nearest even, to a quantized type with
          ``ggmlpy.quantize`` (whose row length must be a multiple of the block
          size).
        * ``ne`` given: ``data`` is already encoded in ``type`` (bytes, a
          buffer, or a numpy array whose bytes are used); its size must be
          ``row_size(type, ne[0]) * ne[1] * ...``.

        Raises
        ------
        GGUFError
            Duplicate or empty name, a name over 63 bytes or with a NUL, an
            unknown type name, more than 4 dimensions, a row length that is not
            a multiple of the block size, raw data of the wrong size.
        GGMLTypeError
            Data that is not numeric, a dtype with no ggml type and no
            ``type``, floats into an integer type, a type ggml cannot quantize to.
        """
        self._check_open()
        if not isinstance(name, str):
            raise GGMLTypeError(f"GGUF tensor names are str, got {_type_name_of(name)}")
        if name in self._tensors:
            raise GGUFError(f"GGUF tensor {name!r} was already added (tensor names must be unique)")
        what = f"GGUF tensor {name!r}"
        if ne is not None:
            ne = tuple(int(x) for x in ne)
            if type is None:
                if isinstance(data, np.ndarray) and data.dtype in _NP_TYPE:
                    type = _NP_TYPE[data.dtype]
                else:
                    raise GGMLTypeError(f"{what}: raw data with ne= needs type=")
            t = _as_ggml_type(type, what)
            _, _, ne, nbytes = _core._gguf_check_tensor(name, t, ne)
            if isinstance(data, np.ndarray):
                buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            else:
                try:
                    buf = memoryview(data).cast("B")
                except TypeError:
                    raise GGMLTypeError(f"{what}: raw data must be bytes or a buffer, got "
                                        f"{_type_name_of(data)}") from None
            if buf.nbytes != nbytes:
                rows = nbytes // t.row_size(ne[0]) if ne[0] and t.row_size(ne[0]) else 0
                raise GGUFError(f"{what}: {buf.nbytes} bytes of raw {t.name} data, but ne={ne} takes {nbytes} "
                                f"bytes ({rows} rows of {t.row_size(ne[0])} bytes)")
            self._tensors[name] = _Pending(name, t, ne, nbytes, buf, True)
            return
        arr = np.asarray(data)
        if arr.dtype.kind not in "iuf":
            raise GGMLTypeError(f"{what}: data must be a numeric numpy array, got dtype {arr.dtype}")
        if arr.ndim > 4:
            raise GGUFError(f"{what}: {arr.ndim} dimensions (shape {arr.shape}); ggml tensors have at most 4")
        if type is None:
            if arr.dtype not in _NP_TYPE:
                raise GGMLTypeError(f"{what}: numpy dtype {arr.dtype} has no ggml type; give type=")
            t = _NP_TYPE[arr.dtype]
        else:
            t = _as_ggml_type(type, what)
        shape_ne = tuple(reversed(arr.shape)) or (1,)
        if t.is_quantized:
            try:
                _core._gguf_can_quantize(t)
            except GGMLError as e:
                raise _type_of(e)(f"{what}: {e}") from None
        elif t.numpy_dtype is not None and t.numpy_dtype.kind in "iu" and arr.dtype.kind == "f":
            raise GGMLTypeError(f"{what}: will not truncate {arr.dtype} data to {t.name}; convert it first")
        elif t.numpy_dtype is None and t != Type.BF16:
            raise GGMLTypeError(f"{what}: cannot encode numpy data as {t.name}; pass encoded bytes with ne=")
        _, _, ne_, nbytes = _core._gguf_check_tensor(name, t, shape_ne)
        self._tensors[name] = _Pending(name, t, ne_, nbytes, arr, False)

    def write(self) -> None:
        """Write the file (once): header via ggml, then each tensor's data, aligned.

        Raises
        ------
        GGUFError
            Already written; or the header could not be made.
        OSError
            The file could not be written; no partial file is left behind.
        """
        self._check_open()
        pending = list(self._tensors.values())
        meta, alignment, layout = _core._gguf_meta(
            [(k, t, et, v) for k, (t, et, v) in self._kv.items()], [(p.name, p.type, p.ne) for p in pending])
        with replacing(self.path) as tmp, open(tmp, "wb") as f:
            f.write(meta)
            base = len(meta)
            for p, (off, nbytes) in zip(pending, layout):
                if f.tell() != base + off or nbytes != p.nbytes:
                    raise GGUFError(f"{self.path}: tensor {p.name!r} would be written at {f.tell()}, but ggml "
                                    f"placed it at {base + off} ({nbytes} bytes)")
                n = 0
                for piece in p.pieces():
                    mv = memoryview(piece).cast("B")
                    f.write(mv)
                    n += mv.nbytes
                if n != nbytes:
                    raise GGUFError(f"{self.path}: tensor {p.name!r} encoded to {n} bytes, expected {nbytes}")
                f.write(b"\0" * (-nbytes % alignment))
        self._written = True

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> bool:
        if exc_type is None and not self._written:
            self.write()
        return False

    def __repr__(self) -> str:
        return f"GGUFWriter({self.path!r}, {len(self._kv)} keys, {len(self._tensors)} tensors)"


def _type_name_of(v: object) -> str:
    return _type_of(v).__name__


def _type_of(v: object) -> type:
    # The methods take a `type=` argument, which hides the builtin there.
    return v.__class__
