# context.pxi: Context, the arena that holds tensor metadata (and, unless
# no_alloc, tensor data).
#
# Context is one Python class built from a chain of cdef classes, one file each:
# its ~130 methods and properties are too many for one file (test_source.py caps
# a .pxi at 1500 lines), and Cython has neither partial classes nor an `include`
# inside a class body (only at module level; a compile error elsewhere).
#
#   _ContextBase  context.pxi  fields, lifetime, tensor creation; the type the
#                              rest of _core holds a context by (Tensor.ctx, ...)
#   _ContextOps     ops.pxi      op methods, in ggml.h order (part 1)
#   _ContextNN      ops_nn.pxi   convolution, pooling, padding, generators; new_graph
#   _ContextKernels kernels.pxi  ggmlpy's own CPU kernels (attn_decode, attn_prefill,
#                                mul_mat_vec, mul_mat_id_vec, geglu_tanh)
#   Context         context.pxi  the public class: its docstring, nothing more
#
# Context comes first below though its bases are defined after it (here and in
# later files): Cython sets up extension types base first, whatever their order
# in the source. _core.pxd declares the chain.

DEFAULT_MEM_SIZE = 16 * 1024 * 1024
cdef size_t _MAX_ARENA = (<size_t> 1) << 62

# Arena bytes one tensor object can take beyond its data (header, struct, padding).
cdef size_t _TENSOR_OBJ_SIZE = g.ggml_tensor_overhead() + g.GGML_MEM_ALIGN


@cython.no_gc_clear
cdef class Context(_ContextKernels):
    """A ggml context: a fixed-size arena for tensors and graphs.

    Every op method (``ctx.add(a, b)``, ``ctx.mul_mat(a, b)``...) creates its
    result in this context. Tensors keep their context alive; ``free()`` (or
    leaving a ``with`` block) releases the arena early, after which its tensors
    and graphs raise ``ClosedError`` instead of touching freed memory.

    Parameters
    ----------
    mem_size : int
        Arena size in bytes. It holds each tensor's metadata
        (``tensor_overhead()`` bytes) and, unless ``no_alloc``, its data.
    no_alloc : bool
        Create tensors without data (for backend buffers, or graphs whose
        memory a graph allocator assigns later).

    Raises
    ------
    GGMLMemoryError
        The arena could not be allocated.

    Examples
    --------
    >>> import numpy as np, ggmlpy
    >>> with ggmlpy.Context(1 << 20) as ctx:
    ...     a = ctx.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    ...     b = ctx.scale(a, 2.0)
    ...     gf = ctx.new_graph()
    ...     gf.build_forward_expand(b)
    ...     gf.compute()
    ...     b.numpy().tolist()
    [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    """


@cython.no_gc_clear
cdef class _ContextBase:
    """Fields, lifetime and tensor creation of Context (see ``Context``)."""


    def __cinit__(self, mem_size=DEFAULT_MEM_SIZE, *, bint no_alloc=False):
        cdef g.ggml_init_params params
        cdef void * mem = NULL
        cdef size_t c_size = _index(mem_size, "Context", "mem_size", _K_SIZE)
        self.deps = {}
        self.allocs = {}
        self.dependents = weakref.WeakSet()
        self.keep = []
        self.gen = 1
        if c_size > _MAX_ARENA:
            # rounding up would wrap (2**64 - 1 became a 0-byte arena); no host can hold it anyway
            raise GGMLMemoryError(f"Context: mem_size={c_size} is larger than any host allocation "
                                  f"(at most {_MAX_ARENA})")
        if c_size < g.GGML_MEM_ALIGN:
            c_size = g.GGML_MEM_ALIGN
        c_size = (c_size + 63) & ~(<size_t> 63)
        # We allocate the arena ourselves: ggml_init asserts (aborts) when its
        # own malloc fails, we raise MemoryError instead.
        if posix_memalign(&mem, 64, c_size) != 0 or mem == NULL:
            raise GGMLMemoryError(f"Context: could not allocate {_fmt_bytes(c_size)} on the host")
        params.mem_size = c_size
        params.mem_buffer = mem
        params.no_alloc = no_alloc
        self.ptr = g.ggml_init(params)
        if self.ptr == NULL:
            free(mem)
            raise GGMLMemoryError("Context: ggml_init failed")
        self.mem = mem
        self.mem_size = c_size
        self.no_alloc_ = no_alloc
        _debug_count("Context", 1)

    def __dealloc__(self):
        self._release()

    cdef void _release(self) noexcept:
        if self.ptr != NULL:
            g.ggml_free(self.ptr)
            self.ptr = NULL
            free(self.mem)
            self.mem = NULL
            _debug_count_nogil(0)

    cdef int _invalidate_dependents(self) except -1:
        # Tensors of other contexts that read this one's now point at freed or
        # reused memory: make them stale too (and whatever reads them).
        cdef _ContextBase d
        for d in list(self.dependents):
            if d.deps.pop(self, None) is not None:
                d.gen += 1
                if d.ptr != NULL:
                    # tensors made so far may read this context: never hand them out again
                    d.stale_below = g.ggml_used_mem(d.ptr)
                d._invalidate_dependents()
        self.dependents.clear()
        return 0

    cdef int _ensure(self) except -1:
        if self.freed:
            raise ClosedError("context: it has been freed")
        return 0

    cdef int _refuse_busy(self, str op) except -1:
        # Another thread computes (or copies device data) over this context's tensors with the GIL
        # released; freeing or resetting the arena under it would be a use-after-free.
        if self.busy > 0:
            raise GGMLValueError(f"{op}: a graph that uses this context is being computed (or its tensors copied) "
                                 f"in another thread; wait for it to finish or cancel it first")
        return 0

    cdef int _ensure_op(self, str op) except -1:
        if self.freed:
            raise ClosedError(f"{op}: the context has been freed")
        if self.allocating:
            # ggml walks the arena's object list while it allocates: appending to it now would race
            raise GGMLValueError(f"{op}: the context's tensors are being allocated (alloc_ctx_tensors) in another "
                                 f"thread; create tensors after it returns")
        return 0

    cdef int _room(self, str op, int64_t data_bytes, int n_tensors) except -1:
        # ggml_new_object asserts when the arena is full; check first. Each
        # object needs its header + tensor struct + data, padded to the alignment.
        cdef size_t need = n_tensors * _TENSOR_OBJ_SIZE
        self._ensure_op(op)
        if data_bytes < 0:
            raise GGMLValueError(f"{op}: the result would have more than 2**62 bytes or elements")
        if not self.no_alloc_:
            need += data_bytes
        if g.ggml_used_mem(self.ptr) + need <= self.mem_size:
            return 0
        else:
            raise GGMLMemoryError(
                f"{op}: context out of memory (needs {_fmt_bytes(need)}, "
                f"{_fmt_bytes(self.mem_size - g.ggml_used_mem(self.ptr))} free of {_fmt_bytes(self.mem_size)}); "
                f"create the Context with a larger mem_size")

    @staticmethod
    def for_tensors(int n_tensors, size_t data_bytes=0, *, int graph_size=0, bint no_alloc=False):
        """A Context sized for ``n_tensors`` tensors, ``data_bytes`` of data and one graph.

        Examples
        --------
        >>> ctx = Context.for_tensors(8, no_alloc=True)
        >>> ctx.no_alloc
        True
        """
        cdef size_t size = n_tensors * (g.ggml_tensor_overhead() + g.GGML_MEM_ALIGN) + data_bytes
        if graph_size:
            size += g.ggml_graph_overhead_custom(graph_size, False) + g.GGML_MEM_ALIGN
        return Context(size + 256, no_alloc=no_alloc)

    # -- lifetime ------------------------------------------------------------

    def free(self):
        """Free the arena now. Its tensors and graphs raise ``ClosedError`` afterwards.

        Memory still exported (numpy views, memoryviews, DLPack capsules of its
        tensors) stays valid: the arena is released when the last export ends.
        """
        if self.freed:
            return
        self._refuse_busy("free")
        self.freed = True
        self.gen += 1
        self.keep = []
        self.allocs = {}
        self._invalidate_dependents()
        if self.n_exports == 0:
            self._release()

    close = free

    def __enter__(self):
        self._ensure()
        return self

    def __exit__(self, *exc):
        self.free()
        return False

    def reset(self):
        """Forget every tensor and graph in the arena but keep its memory (``ggml_reset``)."""
        self._ensure()
        self._refuse_busy("reset")
        if self.n_exports:
            raise GGMLValueError(f"reset: {self.n_exports} numpy/buffer views of this context's tensors are alive; "
                                 f"new tensors would reuse their memory")
        g.ggml_reset(self.ptr)
        self.gen += 1
        self.stale_below = 0
        self.allocs = {}
        self._invalidate_dependents()

    @property
    def closed(self):
        """True once ``free()`` was called."""
        return self.freed

    # -- inspection ----------------------------------------------------------

    @property
    def used_mem(self):
        """Bytes of the arena in use."""
        self._ensure()
        return g.ggml_used_mem(self.ptr)

    @property
    def free_mem(self):
        """Bytes of the arena still free."""
        self._ensure()
        return self.mem_size - g.ggml_used_mem(self.ptr)

    @property
    def no_alloc(self):
        """Whether new tensors get no data (settable)."""
        self._ensure()
        return bool(g.ggml_get_no_alloc(self.ptr))

    @no_alloc.setter
    def no_alloc(self, bint value):
        self._ensure()
        g.ggml_set_no_alloc(self.ptr, value)
        self.no_alloc_ = value

    @property
    def max_tensor_size(self):
        """Bytes of the largest tensor in the arena."""
        self._ensure()
        return g.ggml_get_max_tensor_size(self.ptr)

    @property
    def n_tensors(self):
        """Number of tensors in the arena."""
        cdef int n = 0
        cdef g.ggml_tensor * p
        self._ensure()
        p = g.ggml_get_first_tensor(self.ptr)
        while p != NULL:
            n += 1
            p = g.ggml_get_next_tensor(self.ptr, p)
        return n

    def tensors(self):
        """All tensors of the arena, in creation order."""
        cdef g.ggml_tensor * p
        self._ensure()
        out = []
        p = g.ggml_get_first_tensor(self.ptr)
        while p != NULL:
            if self._fresh(p):
                out.append(_wrap(self, p))
            p = g.ggml_get_next_tensor(self.ptr, p)
        return out

    cdef bint _fresh(self, g.ggml_tensor * p) noexcept:
        return <size_t> (<char *> p - <char *> self.mem) >= self.stale_below

    def get_tensor(self, str name):
        """The tensor named ``name``, or None."""
        self._ensure()
        cdef bytes b = name.encode()
        cdef g.ggml_tensor * p = g.ggml_get_first_tensor(self.ptr)
        while p != NULL:
            if self._fresh(p) and p.name == b:
                return _wrap(self, p)
            p = g.ggml_get_next_tensor(self.ptr, p)
        return None

    def __repr__(self):
        if self.freed:
            return "<ggmlpy.Context (freed)>"
        return (f"<ggmlpy.Context {_fmt_bytes(g.ggml_used_mem(self.ptr))} used of {_fmt_bytes(self.mem_size)}"
                f"{', no_alloc' if g.ggml_get_no_alloc(self.ptr) else ''}>")

    # -- tensor creation -----------------------------------------------------

    def new_tensor(self, type, ne, *, name=None):
        """A new tensor of ``type`` with dimensions ``ne`` (ggml order: ``ne[0]`` is a row).

        Parameters
        ----------
        type : Type or str
            Element type; quantized types need ``ne[0]`` to be a multiple of the block size.
        ne : sequence of 1 to 4 int
            Dimensions in ggml order (the reverse of numpy's shape).
        name : str, optional

        Raises
        ------
        GGMLValueError
            Bad dimensions or block size.
        GGMLMemoryError
            The context has no room.

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> t = ctx.new_tensor(Type.F32, (3, 2))
        >>> t.ne, t.shape
        ((3, 2, 1, 1), (2, 3))
        """
        cdef int64_t c_ne[4]
        cdef int t = _as_type(type, "new_tensor")
        cdef int n = _ne_list(ne, c_ne, "new_tensor")
        self._ensure_op("new_tensor")
        cdef int64_t nbytes = _checked_nbytes(t, c_ne, "new_tensor")
        self._room("new_tensor", nbytes, 1)
        cdef Tensor out = _wrap(self, g.ggml_new_tensor(self.ptr, <g.ggml_type> t, n, c_ne))
        if name is not None:
            out.name = name
        return out

    def new_tensor_1d(self, type, ne0, *, name=None):
        """A new 1-d tensor; see ``new_tensor``."""
        ne0 = _index(ne0, "new_tensor_1d", "ne0", _K_INT64)
        return self.new_tensor(type, (ne0,), name=name)

    def new_tensor_2d(self, type, ne0, ne1, *, name=None):
        """A new 2-d tensor (``ne0`` columns, ``ne1`` rows); see ``new_tensor``."""
        ne0 = _index(ne0, "new_tensor_2d", "ne0", _K_INT64)
        ne1 = _index(ne1, "new_tensor_2d", "ne1", _K_INT64)
        return self.new_tensor(type, (ne0, ne1), name=name)

    def new_tensor_3d(self, type, ne0, ne1, ne2, *, name=None):
        """A new 3-d tensor; see ``new_tensor``."""
        ne0 = _index(ne0, "new_tensor_3d", "ne0", _K_INT64)
        ne1 = _index(ne1, "new_tensor_3d", "ne1", _K_INT64)
        ne2 = _index(ne2, "new_tensor_3d", "ne2", _K_INT64)
        return self.new_tensor(type, (ne0, ne1, ne2), name=name)

    def new_tensor_4d(self, type, ne0, ne1, ne2, ne3, *, name=None):
        """A new 4-d tensor; see ``new_tensor``."""
        ne0 = _index(ne0, "new_tensor_4d", "ne0", _K_INT64)
        ne1 = _index(ne1, "new_tensor_4d", "ne1", _K_INT64)
        ne2 = _index(ne2, "new_tensor_4d", "ne2", _K_INT64)
        ne3 = _index(ne3, "new_tensor_4d", "ne3", _K_INT64)
        return self.new_tensor(type, (ne0, ne1, ne2, ne3), name=name)

    def dup_tensor(self, Tensor src not None):
        """A new tensor with the type and ne of ``src`` (data not copied)."""
        _arg(src, "dup_tensor", "src")
        return self.new_tensor(src.ptr.type, src.ne)

    def from_numpy(self, array, type=None, *, name=None):
        """A new tensor holding a copy of ``array``.

        The tensor's ``ne`` is the reverse of the array's shape; the copy is
        always contiguous (strided input is gathered). ``type`` defaults to
        the array's dtype; a quantized ``type`` (or F16/BF16 for float input)
        converts the float32 data.

        Raises
        ------
        GGMLTypeError
            The dtype has no ggml type and no ``type`` was given.
        GGMLValueError
            More than 4 dimensions, or a row length that is not a multiple of
            the quantized type's block size.

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> t = ctx.from_numpy(np.ones((2, 4), dtype=np.float32))
        >>> t.type.name, t.ne, t.shape
        ('F32', (4, 2, 1, 1), (2, 4))
        """
        self._ensure()
        if g.ggml_get_no_alloc(self.ptr):
            raise GGMLValueError("from_numpy: the context is no_alloc, so its tensors have no data to copy into")
        arr = np.asarray(array)
        if arr.ndim > 4:
            raise GGMLValueError(f"from_numpy: at most 4 dimensions (got shape {arr.shape})")
        if type is None:
            try:
                t = _FROM_NP[arr.dtype]
            except KeyError:
                if arr.dtype.kind in "fiub":
                    raise GGMLTypeError(f"from_numpy: no ggml type for dtype {arr.dtype}; pass type=") from None
                raise GGMLTypeError(f"from_numpy: unsupported dtype {arr.dtype}") from None
        else:
            t = _as_type(type, "from_numpy")
        shape = arr.shape if arr.ndim else (1,)
        out = self.new_tensor(t, tuple(reversed(shape)), name=name)
        out.set(arr.reshape(shape))
        return out
