# tensor.pxi: Tensor, a handle on one ggml_tensor.
#
# Order of dimensions: ggml lists dimensions fastest-first (``ne[0]`` is the
# length of a row), numpy slowest-first. Everything that mirrors ggml (``ne``,
# ``nb``, op arguments) speaks ggml order; only the numpy bridge (``shape``,
# ``strides``, ``numpy()``, ``from_numpy``) speaks numpy order, and there the
# trailing size-1 ggml dimensions beyond ``n_dims`` are dropped.

# The DLPack ABI the exporter fills (__dlpack__).
cdef extern from "ggmlpy_dlpack.h":
    ctypedef struct ggmlpy_DLDevice:
        int device_type
        int device_id
    ctypedef struct ggmlpy_DLDataType:
        unsigned char code
        unsigned char bits
        unsigned short lanes
    ctypedef struct ggmlpy_DLTensor:
        void * data
        ggmlpy_DLDevice device
        int ndim
        ggmlpy_DLDataType dtype
        long long * shape
        long long * strides
        unsigned long long byte_offset
    ctypedef struct ggmlpy_DLManagedTensor:
        ggmlpy_DLTensor dl_tensor
        void * manager_ctx
        void (*deleter)(ggmlpy_DLManagedTensor *) noexcept

from cpython.ref cimport Py_INCREF, Py_DECREF, PyObject


cdef inline bint _buffer_is_host(g.ggml_backend_buffer * buf) noexcept:
    return g.ggml_backend_buffer_is_host(buf)


cdef inline bint _device_tensor(g.ggml_tensor * p) noexcept:
    # In a backend buffer whose memory the host cannot address directly.
    cdef g.ggml_backend_buffer * buf = p.buffer
    if buf == NULL and p.view_src != NULL:
        buf = p.view_src.buffer
    return buf != NULL and p.data != NULL and not g.ggml_backend_buffer_is_host(buf)


cdef g.ggml_backend_buffer * _repacked_buffer(g.ggml_tensor * p) noexcept:
    # The buffer of p (or of its view source) when it is one of the CPU's extra
    # buffer types (CPU_REPACK, AMX, ...), else NULL. Those are the only CPU
    # memory that is not host memory: ggml rearranges what is written there for
    # its matrix kernels, has no way to read it back (get_tensor is NULL: a call
    # would jump to address 0) and asserts that each write covers the whole tensor.
    cdef g.ggml_backend_buffer * buf = p.buffer
    cdef g.ggml_backend_buffer_type_t bt
    cdef g.ggml_backend_dev_t dev
    if buf == NULL and p.view_src != NULL:
        buf = p.view_src.buffer
    if buf == NULL:
        return NULL
    bt = g.ggml_backend_buffer_get_type(buf)
    if g.ggml_backend_buft_is_host(bt):
        return NULL
    dev = g.ggml_backend_buft_get_device(bt)
    if dev == NULL or g.ggml_backend_dev_type_of(dev) != g.GGML_BACKEND_DEVICE_TYPE_CPU:
        return NULL
    return buf


cdef int _check_repacked_write(g.ggml_tensor * p, size_t off, size_t n, str op) except -1:
    cdef g.ggml_backend_buffer * buf = _repacked_buffer(p)
    if buf == NULL:
        return 0
    what = f"{op}: tensor {p.name.decode(errors='replace')!r} is in {g.ggml_backend_buffer_name(buf).decode()} memory"
    if p.view_src != NULL:
        raise GGMLValueError(f"{what}; write the weight it views, whole")
    if off != 0 or n != g.ggml_nbytes(p):
        raise GGMLValueError(f"{what}, which is repacked as a whole: write all {g.ggml_nbytes(p)} bytes at offset 0 "
                             f"in one call (got {n} bytes at offset {off})")
    if p.extra == NULL and g.ggml_backend_buffer_name(buf) == b"CPU_REPACK":
        # ggml's repack buffer only knows how to rearrange the types and shapes its kernels take
        raise GGMLValueError(f"{what}, but CPU_REPACK has no kernels for {g.ggml_type_name(p.type).decode()} "
                             f"ne={_ne_str(p)}; place it in the CPU's own memory (Device.supports_weight tells "
                             f"which weights a buffer type takes)")
    return 0


cdef int _check_repacked_read(g.ggml_tensor * p, str op) except -1:
    cdef g.ggml_backend_buffer * buf = _repacked_buffer(p)
    if buf != NULL:
        raise GGMLValueError(f"{op}: tensor {p.name.decode(errors='replace')!r} is in "
                             f"{g.ggml_backend_buffer_name(buf).decode()} memory, rearranged for the CPU's matrix "
                             f"kernels: it cannot be read back (load weights with repack=False to read them)")
    return 0


cdef inline Tensor _wrap(_ContextBase ctx, g.ggml_tensor * p):
    cdef Tensor t = Tensor.__new__(Tensor)
    t.ptr = p
    t.ctx = ctx
    t.gen = ctx.gen
    return t


cdef _ContextBase _owner_of(_ContextBase hint, g.ggml_tensor * p):
    """The Context whose arena holds the struct at p (hint, or one it depends on)."""
    cdef _ContextBase c
    seen = set()
    todo = [hint]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if c.mem != NULL and <char *> c.mem <= <char *> p < <char *> c.mem + c.mem_size:
            return c
        todo.extend(c.deps)
    return hint


@cython.final
@cython.freelist(256)
cdef class Tensor:
    """A ggml tensor. Made by a Context (``new_tensor``, ``from_numpy``, op methods), never directly.

    ``ne``/``nb`` are in ggml order (``ne[0]`` is a row's length); ``shape``,
    ``strides`` and ``numpy()`` are in numpy order. A host tensor exposes its
    memory without copying through ``numpy()``, ``__array__``, the buffer
    protocol and ``__dlpack__``.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("Tensors are created by a Context: ctx.new_tensor(...), ctx.from_numpy(...) or an op")

    cdef int _ensure(self) except -1:
        return self._ensure_op("tensor")

    cdef int _ensure_op(self, str op) except -1:
        if self.gen != self.ctx.gen:
            raise ClosedError(f"{op}: the tensor's context has been freed or reset")
        if self.ctx.deps:
            _deps_alive(self.ctx, op)
        return 0

    cdef int _data(self, str op) except -1:
        # About to touch the data, not only the metadata: memory a graph allocator gave the tensor
        # (or a tensor it views) must still exist.
        self._ensure_op(op)
        if self.ctx.allocs or self.ctx.deps:
            _data_alive(self.ctx, op)
        return 0

    # -- metadata ------------------------------------------------------------

    @property
    def context(self):
        """The Context this tensor lives in."""
        return self.ctx

    @property
    def type(self):
        """Element type (``Type``)."""
        self._ensure()
        return Type(self.ptr.type)

    @property
    def ne(self):
        """Number of elements per dimension, ggml order, always 4 entries."""
        self._ensure()
        return (self.ptr.ne[0], self.ptr.ne[1], self.ptr.ne[2], self.ptr.ne[3])

    @property
    def nb(self):
        """Stride in bytes per dimension, ggml order (``nb[0]`` is the element or block size)."""
        self._ensure()
        return (self.ptr.nb[0], self.ptr.nb[1], self.ptr.nb[2], self.ptr.nb[3])

    @property
    def n_dims(self):
        """ggml's dimension count: the highest dimension with ne > 1 (1 for scalars)."""
        self._ensure()
        return g.ggml_n_dims(self.ptr)

    @property
    def shape(self):
        """Numpy-order shape: ``ne[:n_dims]`` reversed."""
        self._ensure()
        return _np_shape(self.ptr)

    @property
    def nelements(self):
        """Total number of elements."""
        self._ensure()
        return g.ggml_nelements(self.ptr)

    @property
    def nrows(self):
        """Number of rows (``ne[1] * ne[2] * ne[3]``)."""
        self._ensure()
        return g.ggml_nrows(self.ptr)

    @property
    def nbytes(self):
        """Bytes spanned by the data (``ggml_nbytes``)."""
        self._ensure()
        return g.ggml_nbytes(self.ptr)

    @property
    def is_contiguous(self):
        """True if every stride is exactly packed, size-1 dimensions included.

        This is the layout every op that needs a contiguous input accepts, so
        an op never rejects a tensor this property calls contiguous. ggml's own
        ``ggml_is_contiguous`` skips size-1 dimensions, but some of its
        kernels (``scale``, the norms) check their strides all the same;
        ``ctx.cont(t)`` gives a tensor for which this is True.
        """
        self._ensure()
        return bool(_is_strict_contig(self.ptr))

    @property
    def is_view(self):
        """True if the tensor is a view of another (reshape, view, permute, transpose)."""
        self._ensure()
        return self.ptr.view_src != NULL

    @property
    def is_transposed(self):
        self._ensure()
        return bool(g.ggml_is_transposed(self.ptr))

    @property
    def is_permuted(self):
        self._ensure()
        return bool(g.ggml_is_permuted(self.ptr))

    @property
    def op(self):
        """The op that computes this tensor (``Op.NONE`` for a leaf)."""
        self._ensure()
        return Op(self.ptr.op)

    @property
    def op_desc(self):
        """The op's name, or the unary / glu function's name for those ops."""
        self._ensure()
        return g.ggml_op_desc(self.ptr).decode()

    @property
    def op_params(self):
        """The op's raw parameters as 16 int32 (floats are stored bit-cast)."""
        self._ensure()
        return tuple(self.ptr.op_params[i] for i in range(16))

    @property
    def src(self):
        """The op's inputs (Tensors), up to the last non-null source."""
        self._ensure_op("src")
        out = []
        for i in range(g.GGML_MAX_SRC):
            if self.ptr.src[i] != NULL:
                while len(out) < i:
                    out.append(None)
                out.append(_wrap(_owner_of(self.ctx, self.ptr.src[i]), self.ptr.src[i]))
        return tuple(out)

    @property
    def view_src(self):
        """The tensor this one views, or None."""
        self._ensure_op("view_src")
        if self.ptr.view_src == NULL:
            return None
        return _wrap(_owner_of(self.ctx, self.ptr.view_src), self.ptr.view_src)

    @property
    def view_offs(self):
        """Byte offset of this view into ``view_src``."""
        self._ensure()
        return self.ptr.view_offs

    @property
    def data_ptr(self):
        """Address of the data (0 if none is allocated)."""
        self._ensure()
        return <uintptr_t> self.ptr.data

    @property
    def is_host(self):
        """True if the data is host memory (its context's arena or a host buffer), readable without a copy."""
        self._data("is_host")
        return self.ptr.data != NULL and not _device_tensor(self.ptr)

    @property
    def is_repacked(self):
        """True if the tensor lives in one of the CPU's extra buffer types (``CPU_REPACK``, ``AMX``...).

        Such a weight is written whole (``set``, or ``set_bytes`` of all its
        bytes at offset 0), feeds only the ops its buffer type supports
        (matrix products) and cannot be read back.
        """
        self._ensure()
        return _repacked_buffer(self.ptr) != NULL

    @property
    def buffer_type(self):
        """Name of the buffer type holding the tensor (``'CPU'``, ``'CPU_REPACK'``, ``'RPC[host:port]'``...),
        or None for a context's own memory or no memory."""
        cdef g.ggml_backend_buffer * buf
        self._ensure()
        buf = self.ptr.buffer if self.ptr.buffer != NULL or self.ptr.view_src == NULL else self.ptr.view_src.buffer
        if buf == NULL:
            return None
        return g.ggml_backend_buft_name(g.ggml_backend_buffer_get_type(buf)).decode()

    @property
    def has_data(self):
        """True if the tensor has memory (its context allocated it, or a buffer did)."""
        self._ensure()
        return self.ptr.data != NULL

    @property
    def name(self):
        """The tensor's name (at most 63 bytes of UTF-8)."""
        self._ensure()
        return g.ggml_get_name(self.ptr).decode("utf-8", "replace")

    @name.setter
    def name(self, str value):
        self._ensure()
        cdef bytes b = value.encode()
        if len(b) >= g.GGML_MAX_NAME:
            raise GGMLValueError(f"set_name: name is {len(b)} bytes, at most {g.GGML_MAX_NAME - 1} fit")
        g.ggml_set_name(self.ptr, b)

    def set_name(self, str name):
        """Set the name and return self (for chaining, like ``ggml_set_name``)."""
        self.name = name
        return self

    @property
    def flags(self):
        """ggml's tensor flags (input=1, output=2, param=4, loss=8)."""
        self._ensure()
        return self.ptr.flags

    def set_input(self):
        """Mark as a graph input: allocators place it first and never reuse its memory early.

        Only a tensor that no op computes (a leaf: ``op`` is ``NONE``) can be an input.
        """
        self._ensure()
        if self.ptr.op != g.GGML_OP_NONE:
            # ggml >= 0.25 asserts (aborts) here
            raise GGMLValueError(f"set_input: only a leaf tensor (op NONE) can be a graph input; "
                                 f"{_desc(self)} is the result of {g.ggml_op_name(self.ptr.op).decode()}")
        g.ggml_set_input(self.ptr)
        return self

    def set_output(self):
        """Mark as a graph output: allocators never overwrite it."""
        self._ensure()
        g.ggml_set_output(self.ptr)
        return self

    def set_param(self):
        """Mark as a trainable parameter."""
        self._ensure()
        if self.ptr.op != g.GGML_OP_NONE:
            raise GGMLValueError(f"set_param: only leaf tensors can be parameters (got op {self.op.name})")
        g.ggml_set_param(self.ptr)
        return self

    @property
    def is_input(self):
        self._ensure()
        return bool(self.ptr.flags & g.GGML_TENSOR_FLAG_INPUT)

    @property
    def is_output(self):
        self._ensure()
        return bool(self.ptr.flags & g.GGML_TENSOR_FLAG_OUTPUT)

    @property
    def is_param(self):
        self._ensure()
        return bool(self.ptr.flags & g.GGML_TENSOR_FLAG_PARAM)

    def __repr__(self):
        if self.gen != self.ctx.gen:
            return "<ggmlpy.Tensor (freed)>"
        name = self.name
        return (f"<ggmlpy.Tensor{' ' + repr(name) if name else ''} "
                f"{g.ggml_type_name(self.ptr.type).decode()} ne={_ne_str(self.ptr)} op={g.ggml_op_desc(self.ptr).decode()}>")

    def __eq__(self, other):
        # Two wrappers of the same ggml tensor are the same tensor.
        return isinstance(other, Tensor) and (<Tensor> other).ptr == self.ptr

    def __hash__(self):
        return hash(<uintptr_t> self.ptr)

    # -- host memory access ----------------------------------------------------

    cdef int _host(self, str op) except -1:
        self._data(op)
        if self.ptr.data == NULL and g.ggml_nelements(self.ptr) != 0:
            raise GGMLValueError(f"{op}: tensor has no data (its context is no_alloc and no buffer was allocated)")
        if self.ptr.buffer != NULL and not _buffer_is_host(self.ptr.buffer):
            raise GGMLValueError(f"{op}: tensor lives in device memory; use get()/set(), which copy")
        return 0

    def __getbuffer__(self, Py_buffer * view, int flags):
        cdef int n, i, k
        cdef g.ggml_tensor * p = self.ptr
        self._host("buffer")
        if flags & PyBUF_WRITABLE and self.readonly:
            raise BufferError("tensor is read-only")
        n = _nd(p)
        if g.ggml_is_quantized(p.type):
            # Raw blocks: the row axis (bytes) is last, rows ordered by nb[1..].
            k = 0
            for i in range(n - 1, 0, -1):
                self._shape[k] = p.ne[i]
                self._strides[k] = p.nb[i]
                k += 1
            self._shape[k] = g.ggml_row_size(p.type, p.ne[0])
            self._strides[k] = 1
            view.itemsize = 1
        else:
            for i in range(n):
                self._shape[i] = p.ne[n - 1 - i]
                self._strides[i] = p.nb[n - 1 - i]
            view.itemsize = g.ggml_type_size(p.type)
        # An empty tensor may have no data pointer; exporters want a non-NULL one.
        view.buf = p.data if p.data != NULL else <void *> &_EMPTY
        view.obj = self
        view.len = g.ggml_nbytes(p)
        view.readonly = self.readonly
        view.ndim = n
        view.format = <char *> _buffer_format(p.type) if flags & PyBUF_FORMAT else NULL
        view.shape = self._shape
        view.strides = self._strides
        view.suboffsets = NULL
        view.internal = NULL
        self.ctx.n_exports += 1

    def __releasebuffer__(self, Py_buffer * view):
        _export_done(self.ctx)

    def numpy(self, bint copy=False):
        """The tensor's memory as a numpy array, without copying (numpy order).

        F16 maps to float16, BF16 to its uint16 bit pattern, quantized types to
        raw uint8 blocks with one axis per row. Writes through the array are
        seen by ggml. ``copy=True`` returns an independent copy instead.

        Raises
        ------
        GGMLValueError
            The tensor has no host data.
        """
        self._host("numpy")
        try:
            arr = np.asarray(memoryview(self))
        except (ValueError, BufferError) as e:
            raise GGMLValueError(f"numpy: numpy cannot describe this tensor (ne={_ne_str(self.ptr)}): {e}") from None
        return arr.copy() if copy else arr

    def __array__(self, dtype=None, copy=None):
        self._ensure_op("__array__")
        native = _NP_DTYPES.get(self.ptr.type)
        if copy is False and (native is None or _device_tensor(self.ptr) or
                              (dtype is not None and np.dtype(dtype) != native)):
            raise ValueError("__array__: this tensor cannot be viewed without a copy")
        arr = self.get() if native is None or _device_tensor(self.ptr) else self.numpy(copy=bool(copy))
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def get(self):
        """A new numpy array with the tensor's values (numpy order).

        Plain types keep their dtype; BF16 and quantized types are converted
        to float32.

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> ctx.from_numpy(np.arange(3, dtype=np.int32)).get()
        array([0, 1, 2], dtype=int32)
        """
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer dst
        self._data("get")
        held = _hold(self.ctx)
        try:
            if _device_tensor(p):
                return self._device_get()
            self._host("get")
            dt = _NP_DTYPES.get(p.type)
            if dt is None:
                return self._get_converted()
            try:
                out = _np_empty(_np_shape(p), dt)
            except ValueError as e:
                raise GGMLValueError(f"get: numpy cannot hold this tensor (ne={_ne_str(p)}): {e}") from None
            if not g.ggml_is_contiguous(p):
                out[...] = self.numpy()
                return out
            PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
            try:
                _copy_bytes(dst.buf, p.data, g.ggml_nbytes(p))
            finally:
                PyBuffer_Release(&dst)
            return out
        finally:
            _unhold(held)

    cdef object _device_get(self):
        # Device memory: one ggml_backend_tensor_get into a new array.
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer dst
        cdef size_t n = g.ggml_nbytes(p)
        _check_repacked_read(p, "get")
        if not g.ggml_is_contiguous(p):
            raise GGMLValueError("get: a device tensor must be contiguous to read (use ctx.cont on the device first)")
        dt = _NP_DTYPES.get(p.type)
        raw = dt is None
        out = np.empty(n if raw else _np_shape(p), np.uint8 if raw else dt)
        if n:
            PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
            try:
                with nogil:
                    g.ggml_backend_tensor_get(p, dst.buf, 0, n)
            finally:
                PyBuffer_Release(&dst)
            _rpc_check("get")
        if raw:
            return dequantize(out, Type(p.type), p.ne[0]).reshape(_np_shape(p)) if p.type != g.GGML_TYPE_BF16 else \
                (out.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(_np_shape(p))
        return out

    cdef int _device_set(self, array) except -1:
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer src
        cdef size_t n = g.ggml_nbytes(p)
        if not g.ggml_is_contiguous(p):
            raise GGMLValueError("set: a device tensor must be contiguous to write")
        arr = np.asarray(array)
        if not _same_shape_np(arr.shape, p):
            raise GGMLValueError(f"set: shape mismatch (got array shape {arr.shape}, expected {self.shape})")
        dt = _NP_DTYPES.get(p.type)
        if dt is not None:
            if not np.can_cast(arr.dtype, dt, "same_kind"):
                raise GGMLTypeError(f"set: cannot cast {arr.dtype} to the tensor's {dt}")
            _int_range(arr, dt, p)
            data = np.ascontiguousarray(arr, dtype=dt)
        elif p.type == g.GGML_TYPE_BF16:
            f = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
            data = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)   # round to nearest even
        else:
            _quantizable(p.type, "set")
            data = np.frombuffer(quantize(np.asarray(arr, np.float32).reshape(-1, p.ne[0]), Type(p.type)), np.uint8)
        _check_repacked_write(p, 0, n, "set")
        if n:
            PyObject_GetBuffer(data, &src, PyBUF_SIMPLE)
            try:
                if <size_t> src.len != n:
                    raise GGMLValueError(f"set: {src.len} bytes for a tensor of {n}")
                with nogil:
                    g.ggml_backend_tensor_set(p, src.buf, 0, n)
            finally:
                PyBuffer_Release(&src)
            _rpc_check("set")
        return 0

    cdef object _get_converted(self):
        cdef g.ggml_tensor * p = self.ptr
        cdef const g.ggml_type_traits * tr = g.ggml_get_type_traits(p.type)
        cdef float[:, ::1] out_view
        cdef int64_t i1, i2, i3, r = 0, ne0 = p.ne[0]
        cdef char * base = <char *> p.data
        if tr.to_float == NULL:
            raise GGMLTypeError(f"get: no conversion to float32 for type {g.ggml_type_name(p.type).decode()}")
        if g.ggml_nelements(p) == 0:
            try:
                return np.empty(_np_shape(p), dtype=np.float32)
            except ValueError as e:
                raise GGMLValueError(f"get: numpy cannot hold this tensor (ne={_ne_str(p)}): {e}") from None
        out = np.empty((g.ggml_nrows(p), ne0), dtype=np.float32)
        out_view = out
        with nogil:
            for i3 in range(p.ne[3]):
                for i2 in range(p.ne[2]):
                    for i1 in range(p.ne[1]):
                        tr.to_float(base + i1 * p.nb[1] + i2 * p.nb[2] + i3 * p.nb[3], &out_view[r, 0], ne0)
                        r += 1
        return out.reshape(self.shape)

    def set(self, array):
        """Copy ``array`` (numpy order) into the tensor.

        The shape must equal ``shape`` (leading size-1 axes aside). Plain types
        need a dtype castable with numpy's 'same_kind' rule; BF16 and quantized
        tensors take float input and convert it.

        Raises
        ------
        GGMLValueError
            Shape mismatch, or no host data.
        GGMLTypeError
            The dtype cannot be cast safely.
        """
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer src
        self._data("set")
        held = _hold(self.ctx)
        try:
            if _device_tensor(p):
                self._device_set(array)
                return
            self._host("set")
            if self.readonly:
                raise GGMLValueError("set: tensor is read-only")
            # Fast path: a C-contiguous buffer of exactly the tensor's type and
            # shape into a contiguous tensor: one memcpy, no numpy calls.
            if g.ggml_is_contiguous(p) and PyObject_CheckBuffer(array):
                if PyObject_GetBuffer(array, &src, PyBUF_RECORDS_RO) == 0:
                    try:
                        if _buffer_matches(&src, p):
                            _copy_bytes(p.data, src.buf, g.ggml_nbytes(p))
                            return
                    finally:
                        PyBuffer_Release(&src)
            self._set_slow(array)
        finally:
            _unhold(held)

    def get_bytes(self, offset=0, size=None):
        """Read raw bytes (the tensor's type and layout, as stored) from byte ``offset``: ``uint8[size]``.

        The counterpart of :meth:`set_bytes`: quantized and BF16 data come out
        as stored (no conversion), host or device memory alike (device reads
        release the GIL). ``size`` None reads to the end. The tensor must be
        contiguous.

        Raises
        ------
        GGMLValueError
            Out of range, not contiguous, no memory, or repacked weights (their
            layout is the backend's own).

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> ctx.from_numpy(np.arange(3, dtype=np.int16)).get_bytes(2).tolist()
        [1, 0, 2, 0]
        """
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer dst
        cdef size_t off, n, total
        self._data("get_bytes")
        held = _hold(self.ctx)
        try:
            if not g.ggml_is_contiguous(p):
                raise GGMLValueError("get_bytes: the tensor must be contiguous")
            if p.data == NULL:
                raise GGMLValueError(f"get_bytes: tensor {p.name.decode(errors='replace')!r} has no memory")
            total = g.ggml_nbytes(p)
            off = _index(offset, "get_bytes", "offset", _K_SIZE)
            if off > total:
                raise GGMLValueError(f"get_bytes: offset {off} is past the tensor's {total} bytes")
            n = total - off if size is None else _index(size, "get_bytes", "size", _K_SIZE)
            if n > total - off:
                raise GGMLValueError(f"get_bytes: {n} bytes at offset {off} do not fit a tensor of {total} bytes")
            out = _np_empty(n, np.uint8)
            if n == 0:
                return out
            PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE)
            try:
                if _device_tensor(p):
                    _check_repacked_read(p, "get_bytes")
                    with nogil:
                        g.ggml_backend_tensor_get(p, dst.buf, off, n)
                    _rpc_check("get_bytes")
                else:
                    _copy_bytes(dst.buf, <char *> p.data + off, n)
            finally:
                PyBuffer_Release(&dst)
            return out
        finally:
            _unhold(held)

    def set_bytes(self, data, offset=0):
        """Write raw bytes (already in the tensor's type and layout) at byte ``offset``.

        For loading files: quantized and BF16 data go in as stored, host or
        device memory alike (device writes release the GIL). The tensor must
        be contiguous and the bytes must fit.

        Raises
        ------
        GGMLValueError
            Out of range, not contiguous, read-only or no memory.
        """
        cdef g.ggml_tensor * p = self.ptr
        cdef Py_buffer src
        cdef size_t off, n, total
        self._data("set_bytes")
        held = _hold(self.ctx)
        try:
            off = _index(offset, "set_bytes", "offset", _K_SIZE)
            if not g.ggml_is_contiguous(p):
                raise GGMLValueError("set_bytes: the tensor must be contiguous")
            if self.readonly:
                raise GGMLValueError("set_bytes: tensor is read-only")
            if p.data == NULL:
                raise GGMLValueError(f"set_bytes: tensor {p.name.decode(errors='replace')!r} has no memory")
            total = g.ggml_nbytes(p)
            PyObject_GetBuffer(data, &src, PyBUF_SIMPLE)
            try:
                n = <size_t> src.len
                if off > total or n > total - off:
                    raise GGMLValueError(f"set_bytes: {n} bytes at offset {off} do not fit a tensor of {total} bytes")
                if n == 0:
                    return
                if _device_tensor(p):
                    _check_repacked_write(p, off, n, "set_bytes")
                    with nogil:
                        g.ggml_backend_tensor_set(p, src.buf, off, n)
                    _rpc_check("set_bytes")
                else:
                    _copy_bytes(<char *> p.data + off, src.buf, n)
            finally:
                PyBuffer_Release(&src)
        finally:
            _unhold(held)

    cdef int _set_slow(self, array) except -1:
        cdef g.ggml_tensor * p = self.ptr
        dt = _NP_DTYPES.get(p.type)
        arr = np.asarray(array)
        if not _same_shape_np(arr.shape, p):
            raise GGMLValueError(f"set: shape mismatch (got array shape {arr.shape}, expected {self.shape}, "
                                 f"i.e. ne={_ne_str(p)} reversed)")
        if dt is not None:
            if not np.can_cast(arr.dtype, dt, "same_kind"):
                raise GGMLTypeError(f"set: cannot cast {arr.dtype} to the tensor's {dt} (type "
                                    f"{g.ggml_type_name(p.type).decode()})")
            _int_range(arr, dt, p)
            self.numpy()[...] = arr.reshape(self.shape)
            return 0
        if arr.dtype.kind not in "fiu":
            raise GGMLTypeError(f"set: {g.ggml_type_name(p.type).decode()} tensors take float data (got {arr.dtype})")
        if g.ggml_nelements(p) == 0:
            return 0
        _from_float_rows(p, np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, p.ne[0]))
        return 0

    # -- DLPack -----------------------------------------------------------------

    def __dlpack_device__(self):
        """(device type, id): (1, 0), the host."""
        self._host("__dlpack_device__")
        return (1, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export the tensor's host memory as a DLPack capsule (no copy)."""
        cdef g.ggml_tensor * p = self.ptr
        cdef ggmlpy_DLManagedTensor * m
        cdef long long * dims
        cdef int n, i
        cdef size_t esz
        self._host("__dlpack__")
        if copy:
            raise BufferError("__dlpack__: copy=True is not supported; call get() for a copy")
        code = {g.GGML_TYPE_F32: 2, g.GGML_TYPE_F16: 2, g.GGML_TYPE_F64: 2, g.GGML_TYPE_BF16: 4,
                g.GGML_TYPE_I8: 0, g.GGML_TYPE_I16: 0, g.GGML_TYPE_I32: 0, g.GGML_TYPE_I64: 0}.get(p.type)
        if code is None:
            raise BufferError(f"__dlpack__: type {g.ggml_type_name(p.type).decode()} has no DLPack dtype")
        esz = g.ggml_type_size(p.type)
        n = _nd(p)
        for i in range(n):
            if p.nb[i] % esz:
                raise BufferError("__dlpack__: strides are not a multiple of the element size")
        m = <ggmlpy_DLManagedTensor *> malloc(sizeof(ggmlpy_DLManagedTensor) + 2 * n * sizeof(long long))
        if m == NULL:
            raise MemoryError()
        dims = <long long *> (m + 1)
        for i in range(n):
            dims[i] = p.ne[n - 1 - i]
            dims[n + i] = p.nb[n - 1 - i] // esz
        m.dl_tensor.data = p.data if p.data != NULL else <void *> &_EMPTY
        m.dl_tensor.device.device_type = 1
        m.dl_tensor.device.device_id = 0
        m.dl_tensor.ndim = n
        m.dl_tensor.dtype.code = code
        m.dl_tensor.dtype.bits = 8 * esz
        m.dl_tensor.dtype.lanes = 1
        m.dl_tensor.shape = dims
        m.dl_tensor.strides = dims + n
        m.dl_tensor.byte_offset = 0
        m.manager_ctx = <void *> self
        m.deleter = _dl_deleter
        Py_INCREF(self)   # released by the deleter: the consumer keeps the tensor alive
        self.ctx.n_exports += 1
        return PyCapsule_New(m, b"dltensor", _dl_capsule_destructor)


from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyObject_CheckBuffer, PyBUF_RECORDS_RO, PyBUF_SIMPLE

_np_empty = np.empty


cdef char _EMPTY = 0


cdef int _int_range(object arr, object dt, g.ggml_tensor * p) except -1:
    # numpy's same_kind cast wraps integers silently (2**40 into i32 became 0): check the values.
    cdef object info
    if arr.dtype.kind in "iub" and dt.kind in "iu" and arr.size and not np.can_cast(arr.dtype, dt, "safe"):
        info = np.iinfo(dt)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise GGMLValueError(f"set: value {int(bad)} does not fit the tensor's "
                                 f"{g.ggml_type_name(p.type).decode()} (range {info.min}..{info.max})")
    return 0


cdef object _hold(_ContextBase ctx):
    # Mark ctx and every context it reads as busy while data is copied (copies may release the GIL):
    # another thread's free() or reset() then raises instead of pulling the memory away.
    cdef _ContextBase c
    if not ctx.deps:
        ctx.busy += 1
        return ctx
    held = []
    todo = [ctx]
    while todo:
        c = todo.pop()
        if c not in held:
            c.busy += 1
            held.append(c)
            todo.extend(c.deps)
    return held


cdef void _unhold(object held) noexcept:
    cdef _ContextBase c
    if isinstance(held, _ContextBase):
        (<_ContextBase> held).busy -= 1
        return
    for c in held:
        c.busy -= 1


cdef inline void _copy_bytes(void * dst, const void * src, size_t n) noexcept:
    # Large copies run without the GIL so other Python threads keep going.
    if n == 0:
        return
    if n > (1 << 20):
        with nogil:
            memcpy(dst, src, n)
    else:
        memcpy(dst, src, n)


cdef inline int _nd(g.ggml_tensor * p) noexcept:
    # Dimensions the numpy bridge shows: ggml_n_dims, except that a trailing 0
    # counts (ggml_n_dims treats it like 1, which would describe absent memory).
    cdef int i
    for i in range(3, 0, -1):
        if p.ne[i] != 1:
            return i + 1
    return 1


cdef tuple _np_shape(g.ggml_tensor * p):
    cdef int n = _nd(p)
    if n == 1:
        return (p.ne[0],)
    if n == 2:
        return (p.ne[1], p.ne[0])
    if n == 3:
        return (p.ne[2], p.ne[1], p.ne[0])
    return (p.ne[3], p.ne[2], p.ne[1], p.ne[0])


cdef bint _buffer_matches(Py_buffer * b, g.ggml_tensor * p) noexcept:
    """b is C-contiguous, of p's element type, with p's numpy shape (leading 1s aside)."""
    cdef const char * want = _buffer_format(p.type)
    cdef const char * fmt = b.format
    cdef Py_ssize_t expect, i, k
    cdef int n = _nd(p)
    if g.ggml_is_quantized(p.type) or p.type == g.GGML_TYPE_BF16 or fmt == NULL:
        return False
    if fmt[0] in (b'@', b'=', b'<') and fmt[1] != 0:
        fmt += 1
    if fmt[1] != 0 or b.itemsize != <Py_ssize_t> g.ggml_type_size(p.type):
        return False
    # signed integers match by width: numpy's int64 is 'l' on LP64 platforms, where I64 says 'q'
    if fmt[0] != want[0] and not (fmt[0] in b"bhilq" and want[0] in b"bhilq"):
        return False
    if b.len != <Py_ssize_t> g.ggml_nbytes(p):
        return False
    expect = b.itemsize
    for i in range(b.ndim - 1, -1, -1):
        if b.shape[i] != 1 and b.strides[i] != expect:
            return False
        expect *= b.shape[i]
    # shapes, right-aligned (numpy's last axis is ne[0]); extra leading axes must be 1
    k = 0
    for i in range(b.ndim - 1, -1, -1):
        if k < n:
            if b.shape[i] != p.ne[k]:
                return False
            k += 1
        elif b.shape[i] != 1:
            return False
    while k < n:
        if p.ne[k] != 1:
            return False
        k += 1
    return True


cdef bint _same_shape_np(tuple shape, g.ggml_tensor * p):
    # Compare numpy shape with the tensor's, ignoring leading size-1 axes on both.
    cdef int n = _nd(p), i
    dims = [p.ne[i] for i in range(n - 1, -1, -1)]
    s = list(shape)
    while s and s[0] == 1 and len(s) > 1:
        s.pop(0)
    while dims and dims[0] == 1 and len(dims) > 1:
        dims.pop(0)
    if not s:
        s = [1]
    return s == dims


cdef void _dl_deleter(ggmlpy_DLManagedTensor * m) noexcept with gil:
    cdef Tensor t = <Tensor> m.manager_ctx
    _export_done(t.ctx)
    Py_DECREF(t)
    free(m)


cdef inline void _export_done(_ContextBase ctx) noexcept:
    # An export of tensor memory ended; a context freed meanwhile goes now.
    ctx.n_exports -= 1
    if ctx.n_exports == 0 and ctx.freed:
        ctx._release()


cdef void _dl_capsule_destructor(object capsule) noexcept:
    # Called when the capsule dies; only an unconsumed capsule still owns the tensor.
    cdef ggmlpy_DLManagedTensor * m
    if PyCapsule_IsValid(capsule, b"dltensor"):
        m = <ggmlpy_DLManagedTensor *> PyCapsule_GetPointer(capsule, b"dltensor")
        m.deleter(m)


cdef int _from_float_rows(g.ggml_tensor * p, float[:, ::1] rows) except -1:
    """Convert float32 rows into p's type (BF16 or quantized), row by row."""
    cdef const g.ggml_type_traits * tr = g.ggml_get_type_traits(p.type)
    cdef int64_t i1, i2, i3, r = 0, ne0 = p.ne[0]
    cdef char * base = <char *> p.data
    cdef bint quant = g.ggml_is_quantized(p.type)
    if quant:
        _quantizable(p.type, "set")
    if p.ne[0] % g.ggml_blck_size(p.type) != 0 or p.nb[0] != g.ggml_type_size(p.type):
        raise GGMLValueError(f"set: rows of this {g.ggml_type_name(p.type).decode()} view are not whole blocks "
                             f"(got ne={_ne_str(p)}, nb[0]={p.nb[0]})")
    if not quant and tr.from_float_ref == NULL:
        raise GGMLTypeError(f"set: no conversion from float32 to {g.ggml_type_name(p.type).decode()}")
    if quant:
        _finite_for(p.type, np.asarray(rows), "set")
    with nogil:
        for i3 in range(p.ne[3]):
            for i2 in range(p.ne[2]):
                for i1 in range(p.ne[1]):
                    if quant:
                        g.ggml_quantize_chunk(p.type, &rows[r, 0], base + i1 * p.nb[1] + i2 * p.nb[2] + i3 * p.nb[3],
                                              0, 1, ne0, NULL)
                    else:
                        tr.from_float_ref(&rows[r, 0], base + i1 * p.nb[1] + i2 * p.nb[2] + i3 * p.nb[3], ne0)
                    r += 1
    return 0
