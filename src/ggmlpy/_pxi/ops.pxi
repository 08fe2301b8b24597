# ops.pxi: _ContextOps, the op methods of Context, in the order of ggml.h: a
# base of Context, which context.pxi defines (see there why it is made of
# several classes).
#
# Each method validates (validate.pxi), checks the context has room, calls
# ggml, and wraps the result. The type and layout rules are those of the CPU
# kernels in the pinned ggml (a combination the kernels do not implement is
# rejected here, not at compute time), plus every GGML_ASSERT of the builder.

cdef uint64_t M_ELT = M_FLOAT          # element-wise kernels (unary_op)
cdef uint64_t M_NOVEC = (_bit(g.GGML_TYPE_I8) | _bit(g.GGML_TYPE_I16) | M_I32 | M_I64 |
                         _bit(g.GGML_TYPE_F64))


cdef uint64_t _mask_vec_dot():
    # Types with a CPU dot product: the plain floats and the quantized types
    # except the intermediate Q8_1 / Q8_K (which have no vec_dot).
    cdef uint64_t m = 0
    cdef int t
    for t in range(g.GGML_TYPE_COUNT):
        if not _valid_type(t):
            continue
        if M_NOVEC & _bit(t):
            continue
        name = g.ggml_type_name(<g.ggml_type> t).decode()
        if name in ("q8_1", "q8_K"):
            continue
        m |= _bit(t)
    return m


cdef uint64_t _mask_quant_from_float():
    # Quantized types ggml can quantize without an importance matrix.
    cdef uint64_t m = 0
    cdef int t
    for t in range(g.GGML_TYPE_COUNT):
        if _valid_type(t) and g.ggml_is_quantized(<g.ggml_type> t) and not g.ggml_quantize_requires_imatrix(<g.ggml_type> t):
            if g.ggml_get_type_traits(<g.ggml_type> t).from_float_ref != NULL:
                name = g.ggml_type_name(<g.ggml_type> t).decode()
                if name not in ("q8_1", "q8_K"):
                    m |= _bit(t)
    return m


cdef uint64_t _mask_quantize():
    # Types ggml_quantize_chunk implements without an importance matrix.
    cdef uint64_t m = 0
    cdef int t
    for t in range(g.GGML_TYPE_COUNT):
        if _valid_type(t) and g.ggml_is_quantized(<g.ggml_type> t) and not g.ggml_quantize_requires_imatrix(<g.ggml_type> t):
            if g.ggml_type_name(<g.ggml_type> t).decode() not in ("q8_1", "q8_K"):
                m |= _bit(t)
    return m


cdef uint64_t M_VEC_DOT = _mask_vec_dot()
cdef uint64_t M_QUANTIZE = _mask_quantize()              # quantized types the host can encode
cdef uint64_t M_QUANT = M_VEC_DOT & ~M_FLOAT
cdef uint64_t M_QUANT_W = _mask_quant_from_float()       # quantized types we can write
cdef uint64_t M_GET_ROWS = M_FLOAT | M_I32 | M_QUANT
cdef uint64_t M_REPEAT = M_F32 | M_I32 | M_F16 | M_BF16 | _bit(g.GGML_TYPE_I16)


cdef inline int64_t _out_bytes(int t, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) noexcept:
    # Bytes of a contiguous result, or -1 when its size or element count would
    # not fit (ggml computes both in 64 bits and would wrap).
    cdef double elems = <double> ne0 * <double> ne1 * <double> ne2 * <double> ne3
    if ne0 < 0 or ne1 < 0 or ne2 < 0 or ne3 < 0 or elems * _TSIZE[t] > 4.0e18:
        return -1
    # ggml >= 0.25 asserts that ne0 times every ne[i] > 1 fits int64, even where another ne is 0
    cdef double nonzero = <double> ne0 * (<double> ne1 if ne1 > 1 else 1.0) * (<double> ne2 if ne2 > 1 else 1.0) \
        * (<double> ne3 if ne3 > 1 else 1.0)
    if nonzero > 4.0e18:
        return -1
    return <int64_t> _row_bytes(t, ne0) * ne1 * ne2 * ne3


cdef inline Tensor _res(_ContextBase ctx, g.ggml_tensor * p, Tensor a, Tensor b=None, Tensor c=None, Tensor d=None):
    # Wrap an op's result; record cross-context reads so the inputs' contexts
    # outlive this one (and graphs can check they are still alive).
    if a.ctx is not ctx:
        _add_dep(ctx, a)
    if b is not None and b.ctx is not ctx:
        _add_dep(ctx, b)
    if c is not None and c.ctx is not ctx:
        _add_dep(ctx, c)
    if d is not None and d.ctx is not ctx:
        _add_dep(ctx, d)
    cdef Tensor t = Tensor.__new__(Tensor)
    t.ptr = p
    t.ctx = ctx
    t.gen = ctx.gen
    return t


cdef inline Tensor _res2(_ContextBase ctx, g.ggml_tensor * p, Tensor a, Tensor b):
    # _res for two inputs, the binary ops' hot path
    if a.ctx is not ctx:
        _add_dep(ctx, a)
    if b.ctx is not ctx:
        _add_dep(ctx, b)
    cdef Tensor t = Tensor.__new__(Tensor)
    t.ptr = p
    t.ctx = ctx
    t.gen = ctx.gen
    return t


cdef inline int _room_like(_ContextBase ctx, str op, Tensor a) except -1:
    return _fast_room(ctx, op, _out_bytes(a.ptr.type, a.ptr.ne[0], a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]))


cdef inline int _fast_room(_ContextBase ctx, str op, int64_t data_bytes) except -1:
    # The common case of _ContextBase._room for one tensor, without the method call.
    cdef size_t need = _TENSOR_OBJ_SIZE
    if ctx.allocating:
        return ctx._room(op, data_bytes, 1)      # which raises
    if data_bytes >= 0 and not ctx.no_alloc_:
        need += <size_t> data_bytes
    if data_bytes >= 0 and g.ggml_used_mem(ctx.ptr) + need <= ctx.mem_size:
        return 0
    return ctx._room(op, data_bytes, 1)


cdef int _binary(_ContextBase ctx, Tensor a, Tensor b, str op) except -1:
    # add/sub/mul/div on the CPU: (F32,F32), (F16,F16|F32), (BF16,BF16|F32);
    # a's rows contiguous; b tiles a. The common case is checked inline.
    cdef g.ggml_tensor * pa
    cdef g.ggml_tensor * pb
    if ctx.freed:
        ctx._ensure_op(op)
    _arg(a, op, "a")
    _arg(b, op, "b")
    pa = a.ptr
    pb = b.ptr
    if not (M_FLOAT & _bit(pa.type)) or not (
            pb.type == pa.type or (pb.type == g.GGML_TYPE_F32 and pa.type != g.GGML_TYPE_F32)):
        raise GGMLTypeError(f"{op}: unsupported types (got a: {_desc(a)}, b: {_desc(b)}; expected a f32/f16/bf16 "
                            f"and b of a's type, or b f32)")
    if not _can_repeat(pb, pa):
        _repeats(b, a, op, "b", "a")
    if not _is_rows_contig(pa):
        _rows_contig(a, op, "a")
    if not _is_rows_contig(pb):
        _rows_contig(b, op, "b")
    return _fast_room(ctx, op, _out_bytes(pa.type, pa.ne[0], pa.ne[1], pa.ne[2], pa.ne[3]))


cdef int _unary(_ContextBase ctx, Tensor a, str op, uint64_t mask, int layout) except -1:
    # layout -1: any strides; 0: rows contiguous; 1: contiguous in dims >= 1; 2: fully contiguous
    ctx._ensure_op(op)
    _arg(a, op, "a")
    _types(a, op, "a", mask)
    if layout == 0:
        _rows_contig(a, op, "a")
    elif layout == 1:
        _contig1(a, op, "a")
    elif layout == 2:
        _contig(a, op, "a")
    return _room_like(ctx, op, a)


cdef int _glu_op(int o, object given, str op) except -1:
    # SWIGLU_OAI and SWIGLU_CLAMP read parameters (alpha, limit) only their own ggml constructors set
    if not (0 <= o < g.GGML_GLU_OP_COUNT and o != g.GGML_GLU_OP_SWIGLU_OAI and o != g.GGML_GLU_OP_SWIGLU_CLAMP):
        _fail(op, f"op must be a GluOp other than SWIGLU_OAI and SWIGLU_CLAMP (got {given!r})")
    return 0


cdef int _eps(float eps, str op) except -1:
    if not (eps >= 0.0):
        raise GGMLValueError(f"{op}: eps must be >= 0 (got {eps})")
    return 0


cdef int _nonzero_dims(Tensor a, str op, str name, int first) except -1:
    # Dimensions ggml divides by must not be zero (integer division: SIGFPE).
    cdef int i
    for i in range(first, 4):
        if a.ptr.ne[i] == 0:
            raise GGMLValueError(f"{op}: {name}.ne[{i}] must be > 0 (got {name}: {_desc(a)})")
    return 0


# C helpers of the op methods (ggmlpy_ops.h says why each exists).
cdef extern from "ggmlpy_ops.h":
    bint ggmlpy_permute_ok(const g.ggml_tensor * a) noexcept nogil

cdef int _view_bounds(Tensor a, const int64_t ne[4], const size_t nb[4], size_t offset, str op) except -1:
    """A view (ne, nb, offset) of a must stay inside a's root tensor."""
    cdef g.ggml_tensor * root = a.ptr.view_src if a.ptr.view_src != NULL else a.ptr
    cdef size_t base = a.ptr.view_offs + offset
    cdef int64_t bs = g.ggml_blck_size(a.ptr.type)
    cdef size_t last
    cdef int64_t dense
    cdef int i
    for i in range(4):
        if ne[i] < 0:
            raise GGMLValueError(f"{op}: ne must be non-negative (got ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}))")
    if ne[0] % bs:
        raise GGMLValueError(f"{op}: ne[0]={ne[0]} must be a multiple of the block size {bs} of "
                             f"{g.ggml_type_name(a.ptr.type).decode()}")
    if ne[0] == 0 or ne[1] == 0 or ne[2] == 0 or ne[3] == 0:
        return 0
    if offset > (<size_t> 1) << 62:
        raise GGMLValueError(f"{op}: offset {offset} is out of range")
    last = base + g.ggml_row_size(a.ptr.type, ne[0])
    for i in range(1, 4):
        if nb[i] > (<size_t> 1) << 50:
            raise GGMLValueError(f"{op}: stride nb[{i}]={nb[i]} is out of range")
        last += (ne[i] - 1) * nb[i]
    if last > g.ggml_nbytes(root):
        raise GGMLValueError(
            f"{op}: view reaches byte {last} of a tensor of {g.ggml_nbytes(root)} bytes "
            f"(got a: {_desc(a)}, view ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}), nb=({nb[0]}, {nb[1]}, {nb[2]}, {nb[3]}), "
            f"offset={offset})")
    # ggml's own check: the view's *contiguous* size from its offset fits the root.
    dense = _out_bytes(a.ptr.type, ne[0], ne[1], ne[2], ne[3])
    if dense < 0 or <size_t> dense + base > g.ggml_nbytes(root):
        raise GGMLValueError(
            f"{op}: a view of ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}) needs {dense} contiguous bytes from offset "
            f"{base}, more than the {g.ggml_nbytes(root)} bytes of the tensor it views (got a: {_desc(a)})")
    return 0


cdef int _cpy_ok(Tensor a, g.ggml_tensor * dst, int dst_type, str op) except -1:
    """The CPU copy kernels' (src type, dst type, layout) rules."""
    cdef int st = a.ptr.type
    cdef const g.ggml_type_traits * tr
    if g.ggml_nelements(a.ptr) == 0:
        return 0
    if st == dst_type:
        if g.ggml_is_quantized(<g.ggml_type> st) and not g.ggml_is_contiguous(a.ptr) and (
                dst == NULL or not g.ggml_are_same_shape(a.ptr, dst) or not g.ggml_is_contiguous_rows(a.ptr)):
            raise GGMLValueError(f"{op}: a non-contiguous quantized source must keep its shape (got a: {_desc(a)})")
        return 0
    if (M_FLOAT & _bit(st)) and (M_FLOAT & _bit(dst_type)):
        return 0
    if (st == g.GGML_TYPE_F32 and dst_type == g.GGML_TYPE_I32) or (st == g.GGML_TYPE_I32 and dst_type == g.GGML_TYPE_F32):
        return 0
    if (M_FLOAT & _bit(st)) and (M_QUANT_W & _bit(dst_type)):
        if a.ptr.nb[0] != g.ggml_type_size(a.ptr.type):
            raise GGMLValueError(f"{op}: quantizing needs a source with contiguous rows (got a: {_desc(a)} nb={a.nb})")
        if dst != NULL and not g.ggml_is_contiguous(dst):
            raise GGMLValueError(f"{op}: a quantized destination must be contiguous")
        if dst != NULL and dst.ne[0] != a.ptr.ne[0]:
            raise GGMLValueError(f"{op}: quantizing needs equal row lengths (got a.ne[0]={a.ptr.ne[0]}, "
                                 f"destination ne[0]={dst.ne[0]})")
        return 0
    if (M_QUANT & _bit(st)) and dst_type == g.GGML_TYPE_F32:
        tr = g.ggml_get_type_traits(<g.ggml_type> st)
        if tr.to_float != NULL and a.ptr.nb[0] == g.ggml_type_size(a.ptr.type) and (
                dst == NULL or g.ggml_is_contiguous(dst) or dst.ne[0] % g.ggml_blck_size(<g.ggml_type> st) == 0):
            return 0
    raise GGMLTypeError(f"{op}: the CPU backend cannot copy {g.ggml_type_name(<g.ggml_type> st).decode()} to "
                        f"{g.ggml_type_name(<g.ggml_type> dst_type).decode()} (got a: {_desc(a)}; supported: between "
                        f"f32/f16/bf16, f32<->i32, float -> quantized, quantized -> f32, and any type to itself)")




@cython.no_gc_clear
cdef class _ContextOps(_ContextBase):
    """Op methods of Context, part 1 (arithmetic, reductions, layout, attention)."""

    # -- element-wise arithmetic ---------------------------------------------

    def dup(self, Tensor a):
        """A contiguous copy of ``a`` (same type and ne)."""
        _unary(self, a, "dup", M_ANY, -1)
        _cpy_ok(a, NULL, a.ptr.type, "dup")
        return _res(self, g.ggml_dup(self.ptr, a.ptr), a)

    def add(self, Tensor a, Tensor b):
        """``a + b``, with ``b`` broadcast over ``a`` (ggml's rule: ``a.ne[i] % b.ne[i] == 0``).

        Types: ``a`` f32, f16 or bf16; ``b`` of ``a``'s type, or f32. The
        result has ``a``'s type and ne.

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> a = ctx.from_numpy(np.ones((2, 3), np.float32))
        >>> b = ctx.from_numpy(np.arange(3, dtype=np.float32))
        >>> c = ctx.add(a, b)
        >>> gf = ctx.new_graph(); gf.build_forward_expand(c); gf.compute(1)
        >>> c.numpy().tolist()
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
        """
        _binary(self, a, b, "add")
        return _res2(self, g.ggml_add(self.ptr, a.ptr, b.ptr), a, b)

    def add_inplace(self, Tensor a, Tensor b):
        """``a += b`` as a graph node (the result is a view of ``a``)."""
        _binary(self, a, b, "add_inplace")
        return _res(self, g.ggml_add_inplace(self.ptr, a.ptr, b.ptr), a, b)

    def sub(self, Tensor a, Tensor b):
        """``a - b`` with broadcasting; types as for ``add``."""
        _binary(self, a, b, "sub")
        return _res2(self, g.ggml_sub(self.ptr, a.ptr, b.ptr), a, b)

    def mul(self, Tensor a, Tensor b):
        """``a * b`` element-wise with broadcasting; types as for ``add``."""
        _binary(self, a, b, "mul")
        return _res2(self, g.ggml_mul(self.ptr, a.ptr, b.ptr), a, b)

    def div(self, Tensor a, Tensor b):
        """``a / b`` with broadcasting; types as for ``add``."""
        _binary(self, a, b, "div")
        return _res2(self, g.ggml_div(self.ptr, a.ptr, b.ptr), a, b)

    def add_id(self, Tensor a, Tensor b, Tensor ids):
        """``a[:, i1, i2] += b[:, ids[i1, i2]]`` (MoE bias); all f32, ids i32."""
        self._ensure_op("add_id")
        _arg(a, "add_id", "a"); _arg(b, "add_id", "b"); _arg(ids, "add_id", "ids")
        _types(a, "add_id", "a", M_F32); _types(b, "add_id", "b", M_F32); _types(ids, "add_id", "ids", M_I32)
        _rows_contig(a, "add_id", "a"); _rows_contig(b, "add_id", "b")
        if not (a.ptr.ne[0] == b.ptr.ne[0] and a.ptr.ne[1] == ids.ptr.ne[0] and a.ptr.ne[2] == ids.ptr.ne[1]):
            _fail("add_id", f"shapes do not match (got a: {_desc(a)}, b: {_desc(b)}, ids: {_desc(ids)}; expected "
                  f"a.ne[0] == b.ne[0], a.ne[1] == ids.ne[0], a.ne[2] == ids.ne[1])")
        _room_like(self, "add_id", a)
        return _res(self, g.ggml_add_id(self.ptr, a.ptr, b.ptr, ids.ptr), a, b, ids)

    def scale(self, Tensor a, float s):
        """``a * s`` (f32, contiguous)."""
        _unary(self, a, "scale", M_F32, 2)
        return _res(self, g.ggml_scale(self.ptr, a.ptr, s), a)

    def scale_bias(self, Tensor a, float s, float b):
        """``a * s + b`` (f32, contiguous)."""
        _unary(self, a, "scale_bias", M_F32, 2)
        return _res(self, g.ggml_scale_bias(self.ptr, a.ptr, s, b), a)

    def sqr(self, Tensor a):
        """``a ** 2`` (f32/f16/bf16)."""
        _unary(self, a, "sqr", M_ELT, 0)
        return _res(self, g.ggml_sqr(self.ptr, a.ptr), a)

    def sqrt(self, Tensor a):
        """``sqrt(a)`` (f32/f16/bf16)."""
        _unary(self, a, "sqrt", M_ELT, 0)
        return _res(self, g.ggml_sqrt(self.ptr, a.ptr), a)

    def log(self, Tensor a):
        """``log(a)`` (f32/f16/bf16)."""
        _unary(self, a, "log", M_ELT, 0)
        return _res(self, g.ggml_log(self.ptr, a.ptr), a)

    def sin(self, Tensor a):
        """``sin(a)`` (f32/f16/bf16)."""
        _unary(self, a, "sin", M_ELT, 0)
        return _res(self, g.ggml_sin(self.ptr, a.ptr), a)

    def cos(self, Tensor a):
        """``cos(a)`` (f32/f16/bf16)."""
        _unary(self, a, "cos", M_ELT, 0)
        return _res(self, g.ggml_cos(self.ptr, a.ptr), a)

    # -- reductions ---------------------------------------------------------------

    def sum(self, Tensor a):
        """Sum of all elements, as a 1-element tensor of ``a``'s type."""
        _unary(self, a, "sum", M_ELT, 2)
        self._room("sum", 8, 1)
        return _res(self, g.ggml_sum(self.ptr, a.ptr), a)

    def sum_rows(self, Tensor a):
        """Sum of each row: ne ``(1, ne1, ne2, ne3)`` (f32)."""
        _unary(self, a, "sum_rows", M_F32, 0)
        # the result can be larger than a (empty rows): room for it, not for a
        self._room("sum_rows", _out_bytes(g.GGML_TYPE_F32, 1, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_sum_rows(self.ptr, a.ptr), a)

    def mean(self, Tensor a):
        """Mean of each row: ne ``(1, ne1, ne2, ne3)`` (f32)."""
        _unary(self, a, "mean", M_F32, 2)
        self._room("mean", _out_bytes(g.GGML_TYPE_F32, 1, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_mean(self.ptr, a.ptr), a)

    def argmax(self, Tensor a):
        """Index of the largest element of each row of a matrix: i32, ne ``(ne1,)``."""
        _unary(self, a, "argmax", M_F32, 2)
        if not (a.ptr.ne[2] == 1 and a.ptr.ne[3] == 1):
            _fail("argmax", f"a must be a matrix (got a: {_desc(a)})")
        self._room("argmax", _out_bytes(g.GGML_TYPE_I32, a.ptr.ne[1], 1, 1, 1), 1)
        return _res(self, g.ggml_argmax(self.ptr, a.ptr), a)

    def count_equal(self, Tensor a, Tensor b):
        """Number of equal elements of two i32 tensors (at most 2-d), as an i64 scalar."""
        self._ensure_op("count_equal")
        _arg(a, "count_equal", "a"); _arg(b, "count_equal", "b")
        _types(a, "count_equal", "a", M_I32); _types(b, "count_equal", "b", M_I32)
        _same_shape(a, b, "count_equal", "a", "b")
        _contig(a, "count_equal", "a"); _contig(b, "count_equal", "b")
        if not (a.ptr.ne[2] == 1 and a.ptr.ne[3] == 1):
            _fail("count_equal", f"inputs must be at most 2-d (got a: {_desc(a)})")
        self._room("count_equal", 8, 1)
        return _res(self, g.ggml_count_equal(self.ptr, a.ptr, b.ptr), a, b)

    def cumsum(self, Tensor a):
        """Cumulative sum along each row (f32)."""
        _unary(self, a, "cumsum", M_F32, 0)
        return _res(self, g.ggml_cumsum(self.ptr, a.ptr), a)

    def argsort(self, Tensor a, order=SortOrder.ASC):
        """Indices that sort each row (i32, same ne as ``a``); ``a`` f32 contiguous."""
        cdef int o = _index(order, "argsort", "order", _K_INT)
        _unary(self, a, "argsort", M_F32, 2)
        if not (o == g.GGML_SORT_ORDER_ASC or o == g.GGML_SORT_ORDER_DESC):
            _fail("argsort", f"order must be ASC or DESC (got {order!r})")
        if not (a.ptr.ne[0] <= 2147483647):
            _fail("argsort", "rows must have fewer than 2**31 elements")
        self._room("argsort", _out_bytes(g.GGML_TYPE_I32, a.ptr.ne[0], a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_argsort(self.ptr, a.ptr, <g.ggml_sort_order> o), a)

    def top_k(self, Tensor a, k):
        """Indices of the ``k`` largest elements of each row (i32, ne ``(k, ne1, ne2, ne3)``, unordered)."""
        k = _index(k, "top_k", "k", _K_INT)
        _unary(self, a, "top_k", M_F32, 2)
        if not (0 <= k <= a.ptr.ne[0]):
            _fail("top_k", f"k must be in [0, a.ne[0]] (got k={k}, a: {_desc(a)})")
        self._room("top_k", _out_bytes(g.GGML_TYPE_I32, k, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_top_k(self.ptr, a.ptr, k), a)

    def clamp(self, Tensor a, float min, float max):
        """Clamp to ``[min, max]`` (f32/f16): a new tensor; ``a`` is left as it is (ggml >= 0.25)."""
        _unary(self, a, "clamp", M_F32_F16, 2)
        return _res(self, g.ggml_clamp(self.ptr, a.ptr, min, max), a)

    # -- repeat / concat ---------------------------------------------------------------

    def repeat(self, Tensor a, Tensor b):
        """Tile ``a`` to ``b``'s ne (``b.ne[i] % a.ne[i] == 0``); only ``b``'s shape is used."""
        self._ensure_op("repeat")
        _arg(a, "repeat", "a"); _arg(b, "repeat", "b")
        _types(a, "repeat", "a", M_REPEAT)
        _rows_contig(a, "repeat", "a")
        _repeats(a, b, "repeat", "a", "b")
        if not (g.ggml_nelements(a.ptr) > 0 or g.ggml_nelements(b.ptr) == 0):
            _fail("repeat", "cannot tile an empty tensor")
        self._room("repeat", _out_bytes(a.ptr.type, b.ptr.ne[0], b.ptr.ne[1], b.ptr.ne[2], b.ptr.ne[3]), 1)
        return _res(self, g.ggml_repeat(self.ptr, a.ptr, b.ptr), a, b)

    def repeat_4d(self, Tensor a, ne0, ne1, ne2, ne3):
        """Tile ``a`` to ne ``(ne0, ne1, ne2, ne3)`` (each a multiple of ``a.ne[i]``)."""
        ne0 = _index(ne0, "repeat_4d", "ne0", _K_INT64)
        ne1 = _index(ne1, "repeat_4d", "ne1", _K_INT64)
        ne2 = _index(ne2, "repeat_4d", "ne2", _K_INT64)
        ne3 = _index(ne3, "repeat_4d", "ne3", _K_INT64)
        cdef int64_t ne[4]
        self._ensure_op("repeat_4d")
        _arg(a, "repeat_4d", "a")
        _types(a, "repeat_4d", "a", M_REPEAT)
        _rows_contig(a, "repeat_4d", "a")
        ne[0] = ne0; ne[1] = ne1; ne[2] = ne2; ne[3] = ne3
        for i in range(4):
            if not (ne[i] >= 0 and ((a.ptr.ne[i] > 0 and ne[i] % a.ptr.ne[i] == 0) or ne[i] == 0)):
                _fail("repeat_4d", f"target ne=({ne0}, {ne1}, {ne2}, {ne3}) must be multiples of a.ne (got a: {_desc(a)})")
        self._room("repeat_4d", _out_bytes(a.ptr.type, ne0, ne1, ne2, ne3), 1)
        return _res(self, g.ggml_repeat_4d(self.ptr, a.ptr, ne0, ne1, ne2, ne3), a)

    def concat(self, Tensor a, Tensor b, dim):
        """Join ``a`` and ``b`` along ggml dimension ``dim`` (0..3); other dimensions must match."""
        dim = _index(dim, "concat", "dim", _K_INT)
        cdef int64_t ne[4]
        self._ensure_op("concat")
        _arg(a, "concat", "a"); _arg(b, "concat", "b")
        if not (0 <= dim < 4):
            _fail("concat", f"dim must be in [0, 4) (got {dim})")
        _same_type(a, b, "concat", "a", "b")
        for i in range(4):
            if i != dim:
                if not (a.ptr.ne[i] == b.ptr.ne[i]):
                    _fail("concat", f"ne[{i}] must match (got a: {_desc(a)}, b: {_desc(b)}, dim={dim})")
            ne[i] = a.ptr.ne[i] + (b.ptr.ne[i] if i == dim else 0)
        if g.ggml_is_quantized(a.ptr.type):
            _rows_contig(a, "concat", "a"); _rows_contig(b, "concat", "b")
        self._room("concat", _out_bytes(a.ptr.type, ne[0], ne[1], ne[2], ne[3]), 1)
        return _res(self, g.ggml_concat(self.ptr, a.ptr, b.ptr, dim), a, b)

    # -- unary functions -----------------------------------------------------------

    def abs(self, Tensor a):
        """``|a|`` (f32/f16/bf16)."""
        _unary(self, a, "abs", M_ELT, 0)
        return _res(self, g.ggml_abs(self.ptr, a.ptr), a)

    def sgn(self, Tensor a):
        """``sign(a)`` (f32/f16/bf16)."""
        _unary(self, a, "sgn", M_ELT, 0)
        return _res(self, g.ggml_sgn(self.ptr, a.ptr), a)

    def neg(self, Tensor a):
        """``-a`` (f32/f16/bf16)."""
        _unary(self, a, "neg", M_ELT, 0)
        return _res(self, g.ggml_neg(self.ptr, a.ptr), a)

    def step(self, Tensor a):
        """``1 if a > 0 else 0`` (f32/f16/bf16)."""
        _unary(self, a, "step", M_ELT, 0)
        return _res(self, g.ggml_step(self.ptr, a.ptr), a)

    def tanh(self, Tensor a):
        """``tanh(a)`` (f32/f16/bf16)."""
        _unary(self, a, "tanh", M_ELT, 0)
        return _res(self, g.ggml_tanh(self.ptr, a.ptr), a)

    def elu(self, Tensor a):
        """``a if a > 0 else exp(a) - 1`` (f32/f16/bf16)."""
        _unary(self, a, "elu", M_ELT, 0)
        return _res(self, g.ggml_elu(self.ptr, a.ptr), a)

    def relu(self, Tensor a):
        """``max(a, 0)`` (f32/f16/bf16)."""
        _unary(self, a, "relu", M_ELT, 0)
        return _res(self, g.ggml_relu(self.ptr, a.ptr), a)

    def leaky_relu(self, Tensor a, float negative_slope=0.01):
        """``a if a > 0 else negative_slope * a`` (f32/f16)."""
        _unary(self, a, "leaky_relu", M_F32_F16, 1)
        return _res(self, g.ggml_leaky_relu(self.ptr, a.ptr, negative_slope, False), a)

    def sigmoid(self, Tensor a):
        """``1 / (1 + exp(-a))`` (f32/f16/bf16)."""
        _unary(self, a, "sigmoid", M_ELT, 0)
        return _res(self, g.ggml_sigmoid(self.ptr, a.ptr), a)

    def gelu(self, Tensor a):
        """GELU, tanh approximation (f32/f16)."""
        _unary(self, a, "gelu", M_F32_F16, 0)
        return _res(self, g.ggml_gelu(self.ptr, a.ptr), a)

    def gelu_erf(self, Tensor a):
        """GELU with the exact erf (f32/f16)."""
        _unary(self, a, "gelu_erf", M_F32_F16, 0)
        return _res(self, g.ggml_gelu_erf(self.ptr, a.ptr), a)

    def gelu_quick(self, Tensor a):
        """``a * sigmoid(1.702 a)`` (f32/f16)."""
        _unary(self, a, "gelu_quick", M_F32_F16, 0)
        return _res(self, g.ggml_gelu_quick(self.ptr, a.ptr), a)

    def silu(self, Tensor a):
        """``a * sigmoid(a)`` (f32/f16)."""
        _unary(self, a, "silu", M_F32_F16, 0)
        return _res(self, g.ggml_silu(self.ptr, a.ptr), a)

    def hardswish(self, Tensor a):
        """``a * relu6(a + 3) / 6`` (f32/f16/bf16)."""
        _unary(self, a, "hardswish", M_ELT, 0)
        return _res(self, g.ggml_hardswish(self.ptr, a.ptr), a)

    def hardsigmoid(self, Tensor a):
        """``relu6(a + 3) / 6`` (f32/f16/bf16)."""
        _unary(self, a, "hardsigmoid", M_ELT, 0)
        return _res(self, g.ggml_hardsigmoid(self.ptr, a.ptr), a)

    def exp(self, Tensor a):
        """``exp(a)`` (f32/f16/bf16)."""
        _unary(self, a, "exp", M_ELT, 0)
        return _res(self, g.ggml_exp(self.ptr, a.ptr), a)

    def expm1(self, Tensor a):
        """``exp(a) - 1`` (f32/f16/bf16)."""
        _unary(self, a, "expm1", M_ELT, 0)
        return _res(self, g.ggml_expm1(self.ptr, a.ptr), a)

    def softplus(self, Tensor a):
        """``log(1 + exp(a))`` (f32/f16/bf16)."""
        _unary(self, a, "softplus", M_ELT, 0)
        return _res(self, g.ggml_softplus(self.ptr, a.ptr), a)

    def floor(self, Tensor a):
        """``floor(a)`` (f32/f16/bf16)."""
        _unary(self, a, "floor", M_ELT, 0)
        return _res(self, g.ggml_floor(self.ptr, a.ptr), a)

    def ceil(self, Tensor a):
        """``ceil(a)`` (f32/f16/bf16)."""
        _unary(self, a, "ceil", M_ELT, 0)
        return _res(self, g.ggml_ceil(self.ptr, a.ptr), a)

    def round(self, Tensor a):
        """Round half away from zero (f32/f16/bf16)."""
        _unary(self, a, "round", M_ELT, 0)
        return _res(self, g.ggml_round(self.ptr, a.ptr), a)

    def trunc(self, Tensor a):
        """Round towards zero (f32/f16/bf16)."""
        _unary(self, a, "trunc", M_ELT, 0)
        return _res(self, g.ggml_trunc(self.ptr, a.ptr), a)

    # -- gated linear units -----------------------------------------------------------

    def glu(self, Tensor a, op, bint swapped=False):
        """Gated unit over the two halves of each row: ``f(x1) * x2`` (``f(x2) * x1`` if swapped).

        ``op`` is a ``GluOp`` (REGLU, GEGLU, SWIGLU, GEGLU_ERF, GEGLU_QUICK);
        ``a`` f32/f16, ``ne[0]`` even; the result has ``ne[0] / 2``.
        """
        cdef int o = _index(op, "glu", "op", _K_INT)
        _unary(self, a, "glu", M_F32_F16, 1)
        _glu_op(o, op, "glu")
        if not (a.ptr.ne[0] % 2 == 0):
            _fail("glu", f"a.ne[0] must be even (got a: {_desc(a)})")
        return _res(self, g.ggml_glu(self.ptr, a.ptr, <g.ggml_glu_op> o, swapped), a)

    def glu_split(self, Tensor a, Tensor b, op):
        """Gated unit of two tensors: ``f(a) * b`` (same type f32/f16 and ne)."""
        cdef int o = _index(op, "glu_split", "op", _K_INT)
        _unary(self, a, "glu_split", M_F32_F16, 1)
        _arg(b, "glu_split", "b")
        _same_type(a, b, "glu_split", "a", "b")
        _same_shape(a, b, "glu_split", "a", "b")
        _contig1(b, "glu_split", "b")
        _glu_op(o, op, "glu_split")
        return _res(self, g.ggml_glu_split(self.ptr, a.ptr, b.ptr, <g.ggml_glu_op> o), a, b)

    def reglu(self, Tensor a):
        """``relu(x1) * x2`` over the halves of each row."""
        return self.glu(a, g.GGML_GLU_OP_REGLU)

    def geglu(self, Tensor a):
        """``gelu(x1) * x2`` over the halves of each row."""
        return self.glu(a, g.GGML_GLU_OP_GEGLU)

    def swiglu(self, Tensor a):
        """``silu(x1) * x2`` over the halves of each row."""
        return self.glu(a, g.GGML_GLU_OP_SWIGLU)

    def geglu_erf(self, Tensor a):
        return self.glu(a, g.GGML_GLU_OP_GEGLU_ERF)

    def geglu_quick(self, Tensor a):
        return self.glu(a, g.GGML_GLU_OP_GEGLU_QUICK)

    def reglu_split(self, Tensor a, Tensor b):
        """``relu(a) * b``."""
        return self.glu_split(a, b, g.GGML_GLU_OP_REGLU)

    def geglu_split(self, Tensor a, Tensor b):
        """``gelu(a) * b``."""
        return self.glu_split(a, b, g.GGML_GLU_OP_GEGLU)

    def swiglu_split(self, Tensor a, Tensor b):
        """``silu(a) * b`` (the llama feed-forward gate)."""
        return self.glu_split(a, b, g.GGML_GLU_OP_SWIGLU)

    def swiglu_oai(self, Tensor a, Tensor b, float alpha, float limit):
        """gpt-oss's clamped SwiGLU of ``a`` (gate) and ``b`` (f32)."""
        _unary(self, a, "swiglu_oai", M_F32, 1)
        _arg(b, "swiglu_oai", "b")
        _same_type(a, b, "swiglu_oai", "a", "b")
        _same_shape(a, b, "swiglu_oai", "a", "b")
        _contig1(b, "swiglu_oai", "b")
        return _res(self, g.ggml_swiglu_oai(self.ptr, a.ptr, b.ptr, alpha, limit), a, b)

    # -- normalization -------------------------------------------------------------------

    def norm(self, Tensor a, float eps=1e-5):
        """``(a - mean) / sqrt(var + eps)`` over each row (f32)."""
        _unary(self, a, "norm", M_F32, 0)
        _eps(eps, "norm")
        return _res(self, g.ggml_norm(self.ptr, a.ptr, eps), a)

    def rms_norm(self, Tensor a, float eps=1e-5):
        """``a / sqrt(mean(a**2) + eps)`` over each row (f32)."""
        _unary(self, a, "rms_norm", M_F32, 0)
        _eps(eps, "rms_norm")
        return _res(self, g.ggml_rms_norm(self.ptr, a.ptr, eps), a)

    def group_norm(self, Tensor a, n_groups, float eps=1e-6):
        """Normalize ``n_groups`` groups of channels (``ne[2]``) over ``ne[0] x ne[1]`` (f32)."""
        n_groups = _index(n_groups, "group_norm", "n_groups", _K_INT)
        _unary(self, a, "group_norm", M_F32, 0)
        _eps(eps, "group_norm")
        if not (n_groups > 0):
            _fail("group_norm", f"n_groups must be > 0 (got {n_groups})")
        return _res(self, g.ggml_group_norm(self.ptr, a.ptr, n_groups, eps), a)

    def l2_norm(self, Tensor a, float eps=1e-12):
        """``a / max(||a||, eps)`` over each row (f32)."""
        _unary(self, a, "l2_norm", M_F32, 0)
        _eps(eps, "l2_norm")
        return _res(self, g.ggml_l2_norm(self.ptr, a.ptr, eps), a)

    # -- matrix products ----------------------------------------------------------------

    def mul_mat(self, Tensor a, Tensor b, prec=None):
        """Matrix product ``b @ a.T`` in numpy terms: result ne ``(a.ne[1], b.ne[1], b.ne[2], b.ne[3])``, f32.

        ``a`` (the weights) may be any float or quantized type with a CPU dot
        product; ``b`` must be f32 (or ``a``'s type for f16/bf16). ``a`` is
        broadcast over ``b``'s dims 2 and 3. ``prec=Prec.F32`` asks backends to
        accumulate in f32.

        Raises
        ------
        GGMLValueError
            ``a.ne[0] != b.ne[0]``, no broadcast, transposed inputs.
        GGMLTypeError
            Unsupported types.

        Examples
        --------
        >>> ctx = Context(1 << 20)
        >>> w = ctx.from_numpy(np.array([[1, 0], [0, 2], [1, 1]], np.float32))   # 3 outputs x 2 inputs
        >>> x = ctx.from_numpy(np.array([[3, 4]], np.float32))                  # 1 token
        >>> y = ctx.mul_mat(w, x); gf = ctx.new_graph(); gf.build_forward_expand(y); gf.compute(1)
        >>> y.ne, y.numpy().tolist()                # one token: ggml's n_dims drops the size-1 dim
        ((3, 1, 1, 1), [3.0, 8.0, 7.0])
        """
        cdef int p = 0 if prec is None else _index(prec, "mul_mat", "prec", _K_INT)
        self._ensure_op("mul_mat")
        _arg(a, "mul_mat", "a"); _arg(b, "mul_mat", "b")
        _types(a, "mul_mat", "a", M_VEC_DOT)
        if not (b.ptr.type == g.GGML_TYPE_F32 or (b.ptr.type == a.ptr.type and (M_F16 | M_BF16) & _bit(a.ptr.type))):
            raise GGMLTypeError(f"mul_mat: b must be f32 (or a's type for f16/bf16 a) (got a: {_desc(a)}, b: {_desc(b)})")
        if not (p == g.GGML_PREC_DEFAULT or p == g.GGML_PREC_F32):
            _fail("mul_mat", f"prec must be a Prec (got {prec!r})")
        if not (a.ptr.ne[0] == b.ptr.ne[0]):
            _fail("mul_mat", f"a.ne[0] must equal b.ne[0] (got a: {_desc(a)}, b: {_desc(b)})")
        _nonzero_dims(a, "mul_mat", "a", 2)
        if not (b.ptr.ne[2] % a.ptr.ne[2] == 0 and b.ptr.ne[3] % a.ptr.ne[3] == 0):
            _fail("mul_mat", f"a must broadcast over b in dims 2 and 3 (got a: {_desc(a)}, b: {_desc(b)}; expected b.ne[2] % a.ne[2] == 0 "
                  f"and b.ne[3] % a.ne[3] == 0)")
        if not (a.ptr.nb[0] == g.ggml_type_size(a.ptr.type) and a.ptr.nb[0] <= a.ptr.nb[1]):
            _fail("mul_mat", f"a must not be transposed (got a: {_desc(a)} nb={a.nb}); call ctx.cont(a)")
        if not (b.ptr.nb[0] == g.ggml_type_size(b.ptr.type)):
            _fail("mul_mat", f"b must have contiguous rows (got b: {_desc(b)} nb={b.nb}); call ctx.cont(b)")
        self._room("mul_mat", _out_bytes(g.GGML_TYPE_F32, a.ptr.ne[1], b.ptr.ne[1], b.ptr.ne[2], b.ptr.ne[3]), 1)
        cdef g.ggml_tensor * r = g.ggml_mul_mat(self.ptr, a.ptr, b.ptr)
        if p:
            g.ggml_mul_mat_set_prec(r, <g.ggml_prec> p)
        return _res(self, r, a, b)

    def mul_mat_id(self, Tensor as_, Tensor b, Tensor ids):
        """Mixture-of-experts product: for each token, ``b`` times the experts ``as_[:, :, ids]``.

        ``as_`` ne ``(n_embd, n_ff, n_expert)``, ``b`` ne ``(n_embd, n_used or 1, n_tokens)`` f32,
        ``ids`` i32 ne ``(n_used, n_tokens)``; result f32 ne ``(n_ff, n_used, n_tokens)``.
        Expert ids are checked to be in range before each compute.
        """
        self._ensure_op("mul_mat_id")
        _arg(as_, "mul_mat_id", "as_"); _arg(b, "mul_mat_id", "b"); _arg(ids, "mul_mat_id", "ids")
        _types(as_, "mul_mat_id", "as_", M_VEC_DOT)
        if not (b.ptr.type == g.GGML_TYPE_F32 or (b.ptr.type == as_.ptr.type and (M_F16 | M_BF16) & _bit(as_.ptr.type))):
            raise GGMLTypeError(f"mul_mat_id: b must be f32 (got as_: {_desc(as_)}, b: {_desc(b)})")
        _types(ids, "mul_mat_id", "ids", M_I32)
        if not (as_.ptr.ne[3] == 1 and b.ptr.ne[3] == 1 and ids.ptr.ne[2] == 1 and ids.ptr.ne[3] == 1 and ids.ptr.ne[1] == b.ptr.ne[2] and as_.ptr.ne[0] == b.ptr.ne[0] and b.ptr.ne[1] > 0 and ids.ptr.ne[0] % b.ptr.ne[1] == 0 and as_.ptr.ne[2] > 0):
            _fail("mul_mat_id", f"shapes do not match (got as_: {_desc(as_)}, b: {_desc(b)}, ids: {_desc(ids)}; expected "
                  f"as_.ne[0] == b.ne[0], ids.ne[1] == b.ne[2], ids.ne[0] % b.ne[1] == 0, 3-d as_ and b, 2-d ids)")
        if not (as_.ptr.nb[0] == g.ggml_type_size(as_.ptr.type) and as_.ptr.nb[0] <= as_.ptr.nb[1]):
            _fail("mul_mat_id", f"as_ must have contiguous rows and not be transposed (got as_: {_desc(as_)})")
        _rows_contig(b, "mul_mat_id", "b")
        self._room("mul_mat_id", _out_bytes(g.GGML_TYPE_F32, as_.ptr.ne[1], ids.ptr.ne[0], b.ptr.ne[2], 1), 1)
        return _res(self, g.ggml_mul_mat_id(self.ptr, as_.ptr, b.ptr, ids.ptr), as_, b, ids)

    def out_prod(self, Tensor a, Tensor b):
        """Outer product summed over ``ne[1]``: ``a @ b.T`` in ggml terms, f32 ne ``(a.ne[0], b.ne[0], b.ne[2], b.ne[3])``."""
        self._ensure_op("out_prod")
        _arg(a, "out_prod", "a"); _arg(b, "out_prod", "b")
        _types(a, "out_prod", "a", M_F32 | M_F16 | M_QUANT)
        _types(b, "out_prod", "b", M_F32)
        if not (a.ptr.ne[1] == b.ptr.ne[1]):
            _fail("out_prod", f"a.ne[1] must equal b.ne[1] (got a: {_desc(a)}, b: {_desc(b)})")
        _nonzero_dims(a, "out_prod", "a", 2)
        if a.ptr.type == g.GGML_TYPE_F32:
            if not (b.ptr.ne[2] % a.ptr.ne[2] == 0 and b.ptr.ne[3] % a.ptr.ne[3] == 0):
                _fail("out_prod", f"a must broadcast over b in dims 2 and 3 (got a: {_desc(a)}, b: {_desc(b)})")
        else:
            if not (b.ptr.ne[2] == a.ptr.ne[2] and b.ptr.ne[3] == a.ptr.ne[3]):
                _fail("out_prod", f"for non-f32 a, dims 2 and 3 must match (got a: {_desc(a)}, b: {_desc(b)})")
        if not (a.ptr.nb[0] == g.ggml_type_size(a.ptr.type) and a.ptr.nb[0] <= a.ptr.nb[1]):
            _fail("out_prod", f"a must have contiguous rows and not be transposed (got a: {_desc(a)})")
        self._room("out_prod", _out_bytes(g.GGML_TYPE_F32, a.ptr.ne[0], b.ptr.ne[0], b.ptr.ne[2], b.ptr.ne[3]), 1)
        return _res(self, g.ggml_out_prod(self.ptr, a.ptr, b.ptr), a, b)

    # -- set / copy / layout ----------------------------------------------------------------

    def cpy(self, Tensor a, Tensor b):
        """Copy ``a`` into ``b`` (converting the type) as a graph node; returns a view of ``b``."""
        self._ensure_op("cpy")
        _arg(a, "cpy", "a"); _arg(b, "cpy", "b")
        _nelements_eq(a, b, "cpy", "a", "b")
        _cpy_ok(a, b.ptr, b.ptr.type, "cpy")
        self._room("cpy", 0, 1)
        return _res(self, g.ggml_cpy(self.ptr, a.ptr, b.ptr), a, b)

    def cast(self, Tensor a, type):
        """A new tensor with ``a``'s values converted to ``type``."""
        cdef int t = _as_type(type, "cast")
        self._ensure_op("cast")
        _arg(a, "cast", "a")
        if not (a.ptr.ne[0] % g.ggml_blck_size(<g.ggml_type> t) == 0):
            _fail("cast", f"a.ne[0] must be a multiple of the block size of {type_name(t)} (got a: {_desc(a)})")
        _cpy_ok(a, NULL, t, "cast")
        self._room("cast", _out_bytes(t, a.ptr.ne[0], a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_cast(self.ptr, a.ptr, <g.ggml_type> t), a)

    def cont(self, Tensor a, ne=None):
        """A contiguous copy of ``a``, optionally reshaped to ``ne`` (1 to 4 dims, same element count)."""
        cdef int64_t c_ne[4]
        _unary(self, a, "cont", M_ANY, -1)
        _cpy_ok(a, NULL, a.ptr.type, "cont")
        if ne is None:
            return _res(self, g.ggml_cont(self.ptr, a.ptr), a)
        _ne_list(ne, c_ne, "cont")
        if not (c_ne[0] * c_ne[1] * c_ne[2] * c_ne[3] == g.ggml_nelements(a.ptr)):
            _fail("cont", f"ne={tuple(ne)} has a different number of elements than a ({_desc(a)})")
        if not (c_ne[0] % g.ggml_blck_size(a.ptr.type) == 0):
            _fail("cont", "ne[0] must be a multiple of the block size")
        if g.ggml_is_quantized(a.ptr.type):
            _contig(a, "cont", "a")
        return _res(self, g.ggml_cont_4d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_ne[2], c_ne[3]), a)

    def cont_1d(self, Tensor a, ne0):
        ne0 = _index(ne0, "cont_1d", "ne0", _K_INT64)
        return self.cont(a, (ne0,))

    def cont_2d(self, Tensor a, ne0, ne1):
        ne0 = _index(ne0, "cont_2d", "ne0", _K_INT64)
        ne1 = _index(ne1, "cont_2d", "ne1", _K_INT64)
        return self.cont(a, (ne0, ne1))

    def cont_3d(self, Tensor a, ne0, ne1, ne2):
        ne0 = _index(ne0, "cont_3d", "ne0", _K_INT64)
        ne1 = _index(ne1, "cont_3d", "ne1", _K_INT64)
        ne2 = _index(ne2, "cont_3d", "ne2", _K_INT64)
        return self.cont(a, (ne0, ne1, ne2))

    def cont_4d(self, Tensor a, ne0, ne1, ne2, ne3):
        ne0 = _index(ne0, "cont_4d", "ne0", _K_INT64)
        ne1 = _index(ne1, "cont_4d", "ne1", _K_INT64)
        ne2 = _index(ne2, "cont_4d", "ne2", _K_INT64)
        ne3 = _index(ne3, "cont_4d", "ne3", _K_INT64)
        return self.cont(a, (ne0, ne1, ne2, ne3))

    def reshape(self, Tensor a, ne):
        """A view of contiguous ``a`` with dimensions ``ne`` (1 to 4, ggml order, same element count)."""
        cdef int64_t c_ne[4]
        cdef int n
        self._ensure_op("reshape")
        _arg(a, "reshape", "a")
        n = _ne_list(ne, c_ne, "reshape")
        _contig(a, "reshape", "a")
        if not (c_ne[0] * c_ne[1] * c_ne[2] * c_ne[3] == g.ggml_nelements(a.ptr)):
            _fail("reshape", f"ne={tuple(ne)} has a different number of elements than a ({_desc(a)})")
        if not (c_ne[0] % g.ggml_blck_size(a.ptr.type) == 0):
            _fail("reshape", "ne[0] must be a multiple of the block size")
        self._room("reshape", 0, 1)
        if n == 1:
            r = g.ggml_reshape_1d(self.ptr, a.ptr, c_ne[0])
        elif n == 2:
            r = g.ggml_reshape_2d(self.ptr, a.ptr, c_ne[0], c_ne[1])
        elif n == 3:
            r = g.ggml_reshape_3d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_ne[2])
        else:
            r = g.ggml_reshape_4d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_ne[2], c_ne[3])
        return _res(self, r, a)

    def reshape_1d(self, Tensor a, ne0):
        ne0 = _index(ne0, "reshape_1d", "ne0", _K_INT64)
        return self.reshape(a, (ne0,))

    def reshape_2d(self, Tensor a, ne0, ne1):
        ne0 = _index(ne0, "reshape_2d", "ne0", _K_INT64)
        ne1 = _index(ne1, "reshape_2d", "ne1", _K_INT64)
        return self.reshape(a, (ne0, ne1))

    def reshape_3d(self, Tensor a, ne0, ne1, ne2):
        ne0 = _index(ne0, "reshape_3d", "ne0", _K_INT64)
        ne1 = _index(ne1, "reshape_3d", "ne1", _K_INT64)
        ne2 = _index(ne2, "reshape_3d", "ne2", _K_INT64)
        return self.reshape(a, (ne0, ne1, ne2))

    def reshape_4d(self, Tensor a, ne0, ne1, ne2, ne3):
        ne0 = _index(ne0, "reshape_4d", "ne0", _K_INT64)
        ne1 = _index(ne1, "reshape_4d", "ne1", _K_INT64)
        ne2 = _index(ne2, "reshape_4d", "ne2", _K_INT64)
        ne3 = _index(ne3, "reshape_4d", "ne3", _K_INT64)
        return self.reshape(a, (ne0, ne1, ne2, ne3))

    def view(self, Tensor a, ne, nb=None, offset=0):
        """A view of ``a``: dimensions ``ne``, byte strides ``nb[1:]`` (default: contiguous), byte ``offset``.

        The whole view (every element it can reach) must lie inside ``a``'s
        memory; ``ne[0]`` keeps ``a``'s row layout (``nb[0]`` is the element size).
        """
        offset = _index(offset, "view", "offset", _K_SIZE)
        cdef int64_t c_ne[4]
        cdef size_t c_nb[4]
        cdef int n, i
        self._ensure_op("view")
        _arg(a, "view", "a")
        n = _ne_list(ne, c_ne, "view")
        c_nb[0] = g.ggml_type_size(a.ptr.type)
        c_nb[1] = g.ggml_row_size(a.ptr.type, c_ne[0]) if c_ne[0] % g.ggml_blck_size(a.ptr.type) == 0 else 0
        c_nb[2] = c_nb[1] * c_ne[1]
        c_nb[3] = c_nb[2] * c_ne[2]
        if nb is not None:
            nbs = tuple(nb)
            if not (len(nbs) == n - 1):
                _fail("view", f"nb must give the {n - 1} strides nb[1..{n - 1}] (got {nbs!r})")
            for i in range(n - 1):
                if not (nbs[i] >= 0):
                    _fail("view", f"strides must be non-negative (got {nbs!r})")
                c_nb[i + 1] = nbs[i]
            for i in range(n, 4):
                c_nb[i] = c_nb[i - 1] * c_ne[i - 1]
        _view_bounds(a, c_ne, c_nb, offset, "view")
        self._room("view", 0, 1)
        if n == 1:
            r = g.ggml_view_1d(self.ptr, a.ptr, c_ne[0], offset)
        elif n == 2:
            r = g.ggml_view_2d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_nb[1], offset)
        elif n == 3:
            r = g.ggml_view_3d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_ne[2], c_nb[1], c_nb[2], offset)
        else:
            r = g.ggml_view_4d(self.ptr, a.ptr, c_ne[0], c_ne[1], c_ne[2], c_ne[3], c_nb[1], c_nb[2], c_nb[3], offset)
        return _res(self, r, a)

    def view_1d(self, Tensor a, ne0, offset=0):
        """``ne0`` consecutive elements of ``a`` from byte ``offset``."""
        ne0 = _index(ne0, "view_1d", "ne0", _K_INT64)
        offset = _index(offset, "view_1d", "offset", _K_SIZE)
        return self.view(a, (ne0,), None, offset)

    def view_2d(self, Tensor a, ne0, ne1, nb1, offset=0):
        """``ne1`` rows of ``ne0`` elements, ``nb1`` bytes apart, from byte ``offset``."""
        ne0 = _index(ne0, "view_2d", "ne0", _K_INT64)
        ne1 = _index(ne1, "view_2d", "ne1", _K_INT64)
        nb1 = _index(nb1, "view_2d", "nb1", _K_SIZE)
        offset = _index(offset, "view_2d", "offset", _K_SIZE)
        return self.view(a, (ne0, ne1), (nb1,), offset)

    def view_3d(self, Tensor a, ne0, ne1, ne2, nb1, nb2, offset=0):
        ne0 = _index(ne0, "view_3d", "ne0", _K_INT64)
        ne1 = _index(ne1, "view_3d", "ne1", _K_INT64)
        ne2 = _index(ne2, "view_3d", "ne2", _K_INT64)
        nb1 = _index(nb1, "view_3d", "nb1", _K_SIZE)
        nb2 = _index(nb2, "view_3d", "nb2", _K_SIZE)
        offset = _index(offset, "view_3d", "offset", _K_SIZE)
        return self.view(a, (ne0, ne1, ne2), (nb1, nb2), offset)

    def view_4d(self, Tensor a, ne0, ne1, ne2, ne3,
                nb1, nb2, nb3, offset=0):
        ne0 = _index(ne0, "view_4d", "ne0", _K_INT64)
        ne1 = _index(ne1, "view_4d", "ne1", _K_INT64)
        ne2 = _index(ne2, "view_4d", "ne2", _K_INT64)
        ne3 = _index(ne3, "view_4d", "ne3", _K_INT64)
        nb1 = _index(nb1, "view_4d", "nb1", _K_SIZE)
        nb2 = _index(nb2, "view_4d", "nb2", _K_SIZE)
        nb3 = _index(nb3, "view_4d", "nb3", _K_SIZE)
        offset = _index(offset, "view_4d", "offset", _K_SIZE)
        return self.view(a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)

    def permute(self, Tensor a, axis0, axis1, axis2, axis3):
        """A view where source dimension ``i`` becomes dimension ``axis_i`` (a permutation of 0..3)."""
        axis0 = _index(axis0, "permute", "axis0", _K_INT)
        axis1 = _index(axis1, "permute", "axis1", _K_INT)
        axis2 = _index(axis2, "permute", "axis2", _K_INT)
        axis3 = _index(axis3, "permute", "axis3", _K_INT)
        self._ensure_op("permute")
        _arg(a, "permute", "a")
        axes = (axis0, axis1, axis2, axis3)
        if not (sorted(axes) == [0, 1, 2, 3]):
            _fail("permute", f"axes must be a permutation of 0..3 (got {axes})")
        if not (ggmlpy_permute_ok(a.ptr)):
            _fail("permute", f"ggml's permute keeps ne and nb in 32-bit ints (got a: {_desc(a)} nb={a.nb})")
        self._room("permute", 0, 1)
        return _res(self, g.ggml_permute(self.ptr, a.ptr, axis0, axis1, axis2, axis3), a)

    def transpose(self, Tensor a):
        """A view with dimensions 0 and 1 swapped."""
        self._ensure_op("transpose")
        _arg(a, "transpose", "a")
        self._room("transpose", 0, 1)
        return _res(self, g.ggml_transpose(self.ptr, a.ptr), a)

    def get_rows(self, Tensor a, Tensor b):
        """Rows of ``a`` picked by the i32 indices ``b``: ne ``(a.ne[0], b.ne[0], b.ne[1], b.ne[2])``.

        The result is f32 (i32 for i32 ``a``); quantized rows are dequantized.
        Indices are checked to be in ``[0, a.ne[1])`` before each compute.
        """
        self._ensure_op("get_rows")
        _arg(a, "get_rows", "a"); _arg(b, "get_rows", "b")
        _types(a, "get_rows", "a", M_GET_ROWS)
        _types(b, "get_rows", "b", M_I32)
        _rows_contig(a, "get_rows", "a")
        if not (a.ptr.ne[2] == b.ptr.ne[1] and a.ptr.ne[3] == b.ptr.ne[2] and b.ptr.ne[3] == 1):
            _fail("get_rows", f"shapes do not match (got a: {_desc(a)}, b: {_desc(b)}; expected a.ne[2] == b.ne[1], "
                  f"a.ne[3] == b.ne[2], b.ne[3] == 1)")
        t = g.GGML_TYPE_I32 if a.ptr.type == g.GGML_TYPE_I32 else g.GGML_TYPE_F32
        self._room("get_rows", _out_bytes(t, a.ptr.ne[0], b.ptr.ne[0], b.ptr.ne[1], b.ptr.ne[2]), 1)
        return _res(self, g.ggml_get_rows(self.ptr, a.ptr, b.ptr), a, b)

    def set_rows(self, Tensor a, Tensor b, Tensor c):
        """Write the rows of ``b`` into ``a`` at the row indices ``c`` (i32/i64); returns a view of ``a``.

        ``a`` may be f32, f16, bf16 or a quantized type (rows are converted);
        ``b`` f32 or f16. ``c`` ne ``(b.ne[1], ...)`` broadcast over ``b``'s dims 2, 3.
        Indices are checked to be in ``[0, a.ne[1])`` before each compute.
        """
        self._ensure_op("set_rows")
        _arg(a, "set_rows", "a"); _arg(b, "set_rows", "b"); _arg(c, "set_rows", "c")
        _types(a, "set_rows", "a", M_FLOAT | M_QUANT_W)
        _types(b, "set_rows", "b", M_F32_F16)
        _types(c, "set_rows", "c", M_IDX)
        _nonzero_dims(c, "set_rows", "c", 1)
        if not (a.ptr.ne[0] == b.ptr.ne[0] and a.ptr.ne[2] == b.ptr.ne[2] and a.ptr.ne[3] == b.ptr.ne[3] and b.ptr.ne[1] == c.ptr.ne[0] and b.ptr.ne[2] % c.ptr.ne[1] == 0 and b.ptr.ne[3] % c.ptr.ne[2] == 0 and c.ptr.ne[3] == 1):
            _fail("set_rows", f"shapes do not match (got a: {_desc(a)}, b: {_desc(b)}, c: {_desc(c)}; expected a.ne[0] == b.ne[0], "
                  f"a.ne[2:] == b.ne[2:], b.ne[1] == c.ne[0], b.ne[2] % c.ne[1] == 0, b.ne[3] % c.ne[2] == 0)")
        _rows_contig(a, "set_rows", "a"); _rows_contig(b, "set_rows", "b")
        if g.ggml_is_quantized(a.ptr.type):
            _contig(a, "set_rows", "a")
        self._room("set_rows", 0, 1)
        return _res(self, g.ggml_set_rows(self.ptr, a.ptr, b.ptr, c.ptr), a, b, c)

    def diag(self, Tensor a):
        """A square matrix with the row ``a`` on its diagonal (f32)."""
        _unary(self, a, "diag", M_F32, 0)
        if not (a.ptr.ne[1] == 1):
            _fail("diag", f"a must be a row (ne[1] == 1) (got a: {_desc(a)})")
        self._room("diag", _out_bytes(g.GGML_TYPE_F32, a.ptr.ne[0], a.ptr.ne[0], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_diag(self.ptr, a.ptr), a)

    def diag_mask_inf(self, Tensor a, n_past):
        """Set ``a[i, j] = -inf`` where ``j > n_past + i`` (causal mask; f32, contiguous)."""
        n_past = _index(n_past, "diag_mask_inf", "n_past", _K_INT)
        _unary(self, a, "diag_mask_inf", M_F32, 2)
        if not (n_past >= 0):
            _fail("diag_mask_inf", f"n_past must be >= 0 (got {n_past})")
        return _res(self, g.ggml_diag_mask_inf(self.ptr, a.ptr, n_past), a)

    def diag_mask_zero(self, Tensor a, n_past):
        """Set ``a[i, j] = 0`` where ``j > n_past + i`` (f32, contiguous)."""
        n_past = _index(n_past, "diag_mask_zero", "n_past", _K_INT)
        _unary(self, a, "diag_mask_zero", M_F32, 2)
        if not (n_past >= 0):
            _fail("diag_mask_zero", f"n_past must be >= 0 (got {n_past})")
        return _res(self, g.ggml_diag_mask_zero(self.ptr, a.ptr, n_past), a)

    # -- attention ---------------------------------------------------------------------

    def soft_max(self, Tensor a):
        """Softmax over each row (f32, contiguous)."""
        return self.soft_max_ext(a, None, 1.0, 0.0)

    def soft_max_ext(self, Tensor a, Tensor mask=None, float scale=1.0, float max_bias=0.0, Tensor sinks=None):
        """``softmax(a * scale + mask (+ ALiBi slope))`` over each row, with optional attention sinks.

        ``mask`` f16/f32 contiguous with ``ne[0] == a.ne[0]``, ``ne[1] >= a.ne[1]``,
        broadcast over dims 2 and 3. ``max_bias > 0`` (ALiBi) needs a mask.
        ``sinks`` f32 ne ``(a.ne[2],)``: one extra logit per head.
        """
        _unary(self, a, "soft_max_ext", M_F32, 2)
        if mask is not None:
            _arg(mask, "soft_max_ext", "mask")
            _types(mask, "soft_max_ext", "mask", M_F32_F16)
            _contig(mask, "soft_max_ext", "mask")
            _nonzero_dims(mask, "soft_max_ext", "mask", 2)
            if not (mask.ptr.ne[0] == a.ptr.ne[0] and mask.ptr.ne[1] >= a.ptr.ne[1] and a.ptr.ne[2] % mask.ptr.ne[2] == 0 and a.ptr.ne[3] % mask.ptr.ne[3] == 0):
                _fail("soft_max_ext", f"mask does not fit a (got a: {_desc(a)}, mask: {_desc(mask)}; expected mask.ne[0] == a.ne[0], "
                      f"mask.ne[1] >= a.ne[1], a.ne[2] % mask.ne[2] == 0, a.ne[3] % mask.ne[3] == 0)")
        if not (not (max_bias > 0) or mask is not None):
            _fail("soft_max_ext", "max_bias > 0 (ALiBi) needs a mask")
        if not (max_bias == max_bias):
            _fail("soft_max_ext", "max_bias must not be NaN")
        if sinks is not None:
            _arg(sinks, "soft_max_ext", "sinks")
            _types(sinks, "soft_max_ext", "sinks", M_F32)
            if not (sinks.ptr.ne[0] == a.ptr.ne[2]):
                _fail("soft_max_ext", f"sinks.ne[0] must equal a.ne[2] (got a: {_desc(a)}, "
                      f"sinks: {_desc(sinks)})")
        cdef g.ggml_tensor * r = g.ggml_soft_max_ext(self.ptr, a.ptr, mask.ptr if mask is not None else NULL, scale, max_bias)
        if sinks is not None:
            g.ggml_soft_max_add_sinks(r, sinks.ptr)
        if sinks is not None and sinks.ctx is not self:
            _add_dep(self, sinks)
        return _res(self, r, a, mask)

    def rope_ext(self, Tensor a, Tensor pos, Tensor freq_factors=None, *, n_dims, mode=0,
                 n_ctx_orig=0, float freq_base=10000.0, float freq_scale=1.0, float ext_factor=0.0,
                 float attn_factor=1.0, float beta_fast=32.0, float beta_slow=1.0):
        """Rotary position embedding of the first ``n_dims`` of each row of ``a``.

        ``a`` ne ``(head_dim, n_head, n_tokens, ...)`` f32/f16; ``pos`` i32 ne
        ``(n_tokens,)``; ``mode`` ``RopeType.NORMAL`` (adjacent pairs, llama) or
        ``NEOX`` (halves). YaRN: ``ext_factor``, ``attn_factor``, ``beta_*``,
        ``n_ctx_orig``; ``freq_factors`` f32 ``(n_dims/2,)`` divides the frequencies.
        """
        n_dims = _index(n_dims, "rope_ext", "n_dims", _K_INT)
        mode = _index(mode, "rope_ext", "mode", _K_INT)
        n_ctx_orig = _index(n_ctx_orig, "rope_ext", "n_ctx_orig", _K_INT)
        return self._rope("rope_ext", a, pos, freq_factors, n_dims, None, mode, n_ctx_orig, freq_base, freq_scale,
                          ext_factor, attn_factor, beta_fast, beta_slow)

    def rope_multi(self, Tensor a, Tensor pos, Tensor freq_factors=None, *, n_dims, sections, mode,
                   n_ctx_orig=0, float freq_base=10000.0, float freq_scale=1.0, float ext_factor=0.0,
                   float attn_factor=1.0, float beta_fast=32.0, float beta_slow=1.0):
        """Multi-section RoPE (M-RoPE / vision): ``pos`` has 4 positions per token (ne ``4 * a.ne[2]``)."""
        n_dims = _index(n_dims, "rope_multi", "n_dims", _K_INT)
        mode = _index(mode, "rope_multi", "mode", _K_INT)
        n_ctx_orig = _index(n_ctx_orig, "rope_multi", "n_ctx_orig", _K_INT)
        return self._rope("rope_multi", a, pos, freq_factors, n_dims, sections, mode, n_ctx_orig, freq_base, freq_scale,
                          ext_factor, attn_factor, beta_fast, beta_slow)

    def _rope(self, str op, Tensor a, Tensor pos, Tensor ff, n_dims, sections, mode, n_ctx_orig,
              float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow):
        n_dims = _index(n_dims, op, "n_dims", _K_INT)
        mode = _index(mode, op, "mode", _K_INT)
        n_ctx_orig = _index(n_ctx_orig, op, "n_ctx_orig", _K_INT)
        cdef int sec[4]
        cdef bint multi = sections is not None
        _unary(self, a, op, M_F32_F16, 0)
        _arg(pos, op, "pos")
        _types(pos, op, "pos", M_I32)
        if not (pos.ptr.ne[1] == 1 and pos.ptr.ne[2] == 1 and pos.ptr.ne[3] == 1):
            _fail(op, f"pos must be a vector (got pos: {_desc(pos)})")
        if multi:
            if not (mode in (g.GGML_ROPE_TYPE_MROPE, g.GGML_ROPE_TYPE_VISION, g.GGML_ROPE_TYPE_IMROPE)):
                _fail(op, f"mode must be MROPE, VISION or IMROPE (got {mode})")
            secs = tuple(sections)
            if not (len(secs) == 4 and all(s >= 0 for s in secs) and any(s > 0 for s in secs[:3])):
                _fail(op, f"sections must be 4 non-negative ints, one of the first three > 0 (got {secs!r})")
            if not (sum(secs) <= a.ptr.ne[0]):
                _fail(op, f"sum(sections) must be <= a.ne[0] (got {secs!r}, a: {_desc(a)})")
            for i in range(4):
                sec[i] = secs[i]
            if not (pos.ptr.ne[0] == 4 * a.ptr.ne[2]):
                _fail(op, f"pos must have 4 * a.ne[2] entries (got a: {_desc(a)}, pos: {_desc(pos)})")
            if mode == g.GGML_ROPE_TYPE_VISION:
                if not (n_dims * 2 == a.ptr.ne[0]):
                    _fail(op, f"VISION mode needs n_dims == a.ne[0] / 2 (got n_dims={n_dims})")
        else:
            if not (mode == g.GGML_ROPE_TYPE_NORMAL or mode == g.GGML_ROPE_TYPE_NEOX):
                _fail(op, f"mode must be RopeType.NORMAL or NEOX (got {mode}); use rope_multi for M-RoPE")
            if not (pos.ptr.ne[0] == a.ptr.ne[2]):
                _fail(op, f"pos.ne[0] must equal a.ne[2] (got a: {_desc(a)}, pos: {_desc(pos)})")
        if not (0 < n_dims <= a.ptr.ne[0] and n_dims % 2 == 0):
            _fail(op, f"n_dims must be even and in (0, a.ne[0]] (got n_dims={n_dims}, a: {_desc(a)})")
        if not (freq_base > 0 and freq_scale > 0):
            _fail(op, f"freq_base and freq_scale must be > 0 (got {freq_base}, {freq_scale})")
        if ff is not None:
            _arg(ff, op, "freq_factors")
            _types(ff, op, "freq_factors", M_F32)
            if not (ff.ptr.ne[0] >= n_dims // 2):
                _fail(op, f"freq_factors needs at least n_dims/2 entries (got {_desc(ff)})")
            _rows_contig(ff, op, "freq_factors")
        if multi:
            r = g.ggml_rope_multi(self.ptr, a.ptr, pos.ptr, ff.ptr if ff is not None else NULL, n_dims, sec, mode,
                                  n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)
        else:
            r = g.ggml_rope_ext(self.ptr, a.ptr, pos.ptr, ff.ptr if ff is not None else NULL, n_dims, mode,
                                n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)
        return _res(self, r, a, pos, ff)

    def flash_attn_ext(self, Tensor q, Tensor k, Tensor v, Tensor mask=None, float scale=1.0, float max_bias=0.0,
                       float logit_softcap=0.0, prec=None, Tensor sinks=None):
        """Fused attention ``softmax(q k^T * scale + mask) v``.

        Shapes (ggml order): ``q`` ``(head_dim, n_q, n_head, n_seq)`` f32;
        ``k`` ``(head_dim, n_kv, n_head_kv, n_seq)``; ``v`` ``(head_dim_v, n_kv, n_head_kv, n_seq)``;
        ``mask`` f16 ``(>= n_kv, >= n_q, 1 or divisor of n_head, ...)``. The result is
        f32 ``(head_dim_v, n_head, n_q, n_seq)`` (heads and tokens swapped).
        ``k`` and ``v`` may be f32, f16, bf16 or quantized (the cache types).
        """
        cdef int p = 0 if prec is None else _index(prec, "flash_attn_ext", "prec", _K_INT)
        self._ensure_op("flash_attn_ext")
        _arg(q, "flash_attn_ext", "q"); _arg(k, "flash_attn_ext", "k"); _arg(v, "flash_attn_ext", "v")
        _types(q, "flash_attn_ext", "q", M_F32)
        _types(k, "flash_attn_ext", "k", M_VEC_DOT)
        _types(v, "flash_attn_ext", "v", M_VEC_DOT)
        _rows_contig(q, "flash_attn_ext", "q"); _rows_contig(k, "flash_attn_ext", "k"); _rows_contig(v, "flash_attn_ext", "v")
        _nonzero_dims(k, "flash_attn_ext", "k", 2)
        if not (k.ptr.ne[0] == q.ptr.ne[0] and q.ptr.ne[2] % k.ptr.ne[2] == 0 and q.ptr.ne[3] == k.ptr.ne[3] and q.ptr.ne[3] == v.ptr.ne[3] and v.ptr.ne[1] == k.ptr.ne[1] and v.ptr.ne[2] == k.ptr.ne[2]):
            _fail("flash_attn_ext", f"shapes do not match (got q: {_desc(q)}, k: {_desc(k)}, v: {_desc(v)}; expected "
                  f"k.ne[0] == q.ne[0], q.ne[2] % k.ne[2] == 0, v.ne[1:3] == k.ne[1:3], equal ne[3])")
        if mask is not None:
            _arg(mask, "flash_attn_ext", "mask")
            _types(mask, "flash_attn_ext", "mask", M_F16)
            _contig(mask, "flash_attn_ext", "mask")
            _nonzero_dims(mask, "flash_attn_ext", "mask", 2)
            if not (mask.ptr.ne[0] >= k.ptr.ne[1] and mask.ptr.ne[1] >= q.ptr.ne[1] and q.ptr.ne[2] % mask.ptr.ne[2] == 0 and q.ptr.ne[3] % mask.ptr.ne[3] == 0):
                _fail("flash_attn_ext", f"mask does not fit (got q: {_desc(q)}, k: {_desc(k)}, mask: {_desc(mask)}; expected mask.ne[0] >= "
                      f"k.ne[1], mask.ne[1] >= q.ne[1], q.ne[2] % mask.ne[2] == 0, q.ne[3] % mask.ne[3] == 0)")
        if not (not (max_bias > 0) or mask is not None):
            _fail("flash_attn_ext", "max_bias > 0 (ALiBi) needs a mask")
        if not (p == g.GGML_PREC_DEFAULT or p == g.GGML_PREC_F32):
            _fail("flash_attn_ext", f"prec must be a Prec (got {prec!r})")
        if sinks is not None:
            _arg(sinks, "flash_attn_ext", "sinks")
            _types(sinks, "flash_attn_ext", "sinks", M_F32)
            if not (sinks.ptr.ne[0] == q.ptr.ne[2]):
                _fail("flash_attn_ext", f"sinks.ne[0] must equal q.ne[2] (got {_desc(sinks)})")
        self._room("flash_attn_ext", _out_bytes(g.GGML_TYPE_F32, v.ptr.ne[0], q.ptr.ne[2], q.ptr.ne[1], q.ptr.ne[3]), 1)
        cdef g.ggml_tensor * r = g.ggml_flash_attn_ext(self.ptr, q.ptr, k.ptr, v.ptr,
                                                       mask.ptr if mask is not None else NULL, scale, max_bias, logit_softcap)
        if p:
            g.ggml_flash_attn_ext_set_prec(r, <g.ggml_prec> p)
        if sinks is not None:
            g.ggml_flash_attn_ext_add_sinks(r, sinks.ptr)
        if sinks is not None and sinks.ctx is not self:
            _add_dep(self, sinks)
        return _res(self, r, q, k, v, mask)
