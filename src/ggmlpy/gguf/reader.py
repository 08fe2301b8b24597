"""Reading a GGUF file: :class:`GGUFReader` (the header parsed by ggml, the tensor table checked against
the file, tensor data memory-mapped or copied), and the diagnosis of a file ggml refuses."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ggmlpy import _core
from ggmlpy._core import GGUFError, Type

from ._types import TensorInfo, ValueType
from .metadata import _REQUIRED, GGUFKeyError, meta_float, meta_int, meta_str


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
    files : tuple of str
        The files the tensor data is in: ``(path,)`` (a split model's reader has every shard).
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
        self.files: tuple[str, ...] = (self.path,)
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
