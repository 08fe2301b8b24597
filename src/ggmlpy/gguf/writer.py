"""Writing a GGUF file: :class:`GGUFWriter` (metadata through ggml's gguf API with its value types inferred
and checked, tensor data converted or quantized a slice at a time and streamed, the file replaced whole)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ggmlpy import _core
from ggmlpy._core import GGMLError, GGMLTypeError, GGUFError, Type
from ggmlpy._files import replacing

from ._types import (
    _DTYPE_VT,
    _INT_RANGE,
    _NP_TYPE,
    _VT_DTYPE,
    ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT,
    ValueType,
    _is_bool,
    _is_float,
    _is_int,
    _type_name_of,
    _type_of,
)
from .split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, split_path

_CHUNK_BYTES = 16 << 20     # float32 input converted per step when a writer encodes a tensor


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
            data = self.data
            if callable(data):      # made now, one tensor at a time (add_tensor's lazy form)
                data = data()
                data = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)) \
                    if isinstance(data, np.ndarray) else memoryview(data).cast("B")
            yield data
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

    With ``split_max_tensors`` or ``split_max_bytes`` it writes a split set as llama.cpp's
    ``gguf-split`` does (see :mod:`ggmlpy.gguf.split`): ``PREFIX-00001-of-0000N.gguf`` ... where
    ``PREFIX`` is ``path`` without ``.gguf``; the tensors in order, a new shard after every
    ``split_max_tensors`` of them, or before the tensor that would take a shard's tensor data (each
    tensor padded to the alignment) over ``split_max_bytes`` (a larger tensor gets a shard of its own,
    where gguf-split stops); every metadata key in the first shard, and ``split.no``, ``split.count``,
    ``split.tensors.count`` in each. One shard is still named ``-00001-of-00001``, as gguf-split names it.

    Parameters
    ----------
    path : str or os.PathLike
    arch : str, optional
        Sets ``general.architecture`` (as the first key).
    split_max_tensors, split_max_bytes : int, optional
        Write a split set (one of the two), with at most this many tensors, or bytes of tensor data, per
        shard.

    Raises
    ------
    GGUFError
        From any method, for a value the format cannot hold (see each method).
    """

    def __init__(self, path: str | os.PathLike, arch: str | None = None, *, split_max_tensors: int | None = None,
                 split_max_bytes: int | None = None) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self._kv: dict[str, tuple[ValueType, ValueType | None, Any]] = {}
        self._tensors: dict[str, _Pending] = {}
        self._written = False
        if split_max_tensors is not None and split_max_bytes is not None:
            raise GGUFError(f"{self.path}: split_max_tensors or split_max_bytes, not both (as gguf-split's "
                            "--split-max-tensors and --split-max-size)")
        for what, v in (("split_max_tensors", split_max_tensors), ("split_max_bytes", split_max_bytes)):
            if v is not None and (not _is_int(v) or int(v) < 1):
                raise GGUFError(f"{self.path}: {what} must be a whole number of at least 1 (got {v!r})")
        self.split_max_tensors = None if split_max_tensors is None else int(split_max_tensors)
        self.split_max_bytes = None if split_max_bytes is None else int(split_max_bytes)
        #: the files written (one; a split set's shards in order)
        self.paths: list[str] = []
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

    def add_from(self, reader, key: str) -> None:
        """Copy metadata ``key`` from a :class:`~ggmlpy.gguf.GGUFReader`, with its GGUF type (an array with
        its element type), as a tool that rewrites a file (``write_split``, a file with a vocabulary added)
        keeps every key as it was."""
        t = reader.kv_type(key)
        if t == ValueType.ARRAY:
            self.add_array(key, reader.metadata[key], reader.arr_type(key))
        else:
            self.add(key, reader.metadata[key], t)

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
          ``row_size(type, ne[0]) * ne[1] * ...``. ``data`` may also be a
          callable returning such data: it is called when ``write()`` reaches
          the tensor, so a file larger than memory is made one tensor at a
          time (a wrong size is then a GGUFError from ``write()``).

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
            if callable(data):
                self._tensors[name] = _Pending(name, t, ne, nbytes, data, True)
                return
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
        if callable(data):
            raise GGMLTypeError(f"{what}: data made by a callable needs ne= and type= (its shape and encoding)")
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
        """Write the file (once): header via ggml, then each tensor's data, aligned; or the split set's
        shards (``self.paths`` lists what was written).

        Raises
        ------
        GGUFError
            Already written; or the header could not be made.
        OSError
            The file could not be written; no partial file is left behind (nor any shard of a set).
        """
        self._check_open()
        pending = list(self._tensors.values())
        kv = [(k, t, et, v) for k, (t, et, v) in self._kv.items()]
        if self.split_max_tensors is None and self.split_max_bytes is None:
            self._write_file(self.path, kv, pending)
            self.paths = [self.path]
            self._written = True
            return
        shards = self._shards(pending)
        prefix = self.path[:-len(".gguf")] if self.path.endswith(".gguf") else self.path
        kv = [e for e in kv if e[0] not in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)]
        written: list[str] = []
        try:
            for no, part in enumerate(shards):
                keys = [(SPLIT_NO, ValueType.UINT16, None, no), (SPLIT_COUNT, ValueType.UINT16, None, len(shards)),
                        (SPLIT_TENSORS_COUNT, ValueType.INT32, None, len(pending))]
                path = split_path(prefix, no, len(shards))
                self._write_file(path, (kv if no == 0 else []) + keys, part)
                written.append(path)
        except BaseException:
            for path in written:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        self.paths = written
        self._written = True

    def _shards(self, pending: list[_Pending]) -> list[list[_Pending]]:
        """The tensors of each shard (gguf-split's rule; see the class docstring)."""
        alignment = int(self._kv[ALIGNMENT_KEY][2]) if ALIGNMENT_KEY in self._kv else DEFAULT_ALIGNMENT
        shards: list[list[_Pending]] = [[]]
        size = 0
        for i, p in enumerate(pending):
            n = p.nbytes + (-p.nbytes % alignment)
            if self.split_max_tensors is not None:
                new = i > 0 and i % self.split_max_tensors == 0
            else:
                new = bool(shards[-1]) and size + n > self.split_max_bytes
            if new:
                shards.append([])
                size = 0
            shards[-1].append(p)
            size += n
        if len(shards) > 0xFFFF:
            raise GGUFError(f"{self.path}: {len(shards)} shards; split.count is a UINT16 (at most 65535)")
        return shards

    def _write_file(self, path: str, kv: list, pending: list[_Pending]) -> None:
        meta, alignment, layout = _core._gguf_meta(kv, [(p.name, p.type, p.ne) for p in pending])
        with replacing(path) as tmp, open(tmp, "wb") as f:
            f.write(meta)
            base = len(meta)
            for p, (off, nbytes) in zip(pending, layout):
                if f.tell() != base + off or nbytes != p.nbytes:
                    raise GGUFError(f"{path}: tensor {p.name!r} would be written at {f.tell()}, but ggml "
                                    f"placed it at {base + off} ({nbytes} bytes)")
                n = 0
                for piece in p.pieces():
                    mv = memoryview(piece).cast("B")
                    f.write(mv)
                    n += mv.nbytes
                if n != nbytes:
                    raise GGUFError(f"{path}: tensor {p.name!r} encoded to {n} bytes, expected {nbytes}")
                f.write(b"\0" * (-nbytes % alignment))

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> bool:
        if exc_type is None and not self._written:
            self.write()
        return False

    def __repr__(self) -> str:
        return f"GGUFWriter({self.path!r}, {len(self._kv)} keys, {len(self._tensors)} tensors)"


def write_split(src: str | os.PathLike, path: str | os.PathLike, *, max_tensors: int | None = None,
                max_bytes: int | None = None) -> list[str]:
    """Write the model in ``src`` again as a split set (llama.cpp's ``gguf-split --split``): every
    metadata key and tensor as they are (the data copied, not re-encoded), in shards of at most
    ``max_tensors`` tensors or ``max_bytes`` bytes of tensor data, named after ``path`` (``model.gguf``
    gives ``model-00001-of-0000N.gguf`` ...); see :class:`GGUFWriter`. Returns the shards' paths.

    Examples
    --------
    >>> import os, tempfile
    >>> from ggmlpy import gguf
    >>> from ggmlpy.models.synthetic import write_synthetic
    >>> d = tempfile.mkdtemp()
    >>> src = write_synthetic(os.path.join(d, "tiny.gguf"), "tiny")
    >>> [os.path.basename(p) for p in gguf.write_split(src, os.path.join(d, "split.gguf"), max_tensors=8)]
    ['split-00001-of-00003.gguf', 'split-00002-of-00003.gguf', 'split-00003-of-00003.gguf']
    """
    from .reader import GGUFReader

    with GGUFReader(src) as r:
        w = GGUFWriter(path, split_max_tensors=max_tensors, split_max_bytes=max_bytes)
        for key in r.metadata:
            w.add_from(r, key)
        for t in r.tensors:
            w.add_tensor(t.name, r.tensor_data(t.name), type=t.type, ne=t.ne)
        w.write()
    return w.paths
