# validate.pxi: one check per precondition family, shared by all ops.
# Messages read "<op>: <what> (got ..., expected ...)" and name each tensor's
# type and ne, so a failing call can be found from the message alone.

cdef inline uint64_t _bit(int t) noexcept:
    return (<uint64_t> 1) << t

# Type masks for the families ops accept (bit i = ggml_type i).
cdef uint64_t M_F32 = _bit(g.GGML_TYPE_F32)
cdef uint64_t M_F16 = _bit(g.GGML_TYPE_F16)
cdef uint64_t M_BF16 = _bit(g.GGML_TYPE_BF16)
cdef uint64_t M_FLOAT = M_F32 | M_F16 | M_BF16
cdef uint64_t M_F32_F16 = M_F32 | M_F16
cdef uint64_t M_I32 = _bit(g.GGML_TYPE_I32)
cdef uint64_t M_I64 = _bit(g.GGML_TYPE_I64)
cdef uint64_t M_IDX = M_I32 | M_I64
cdef uint64_t M_ANY = 0xFFFFFFFFFFFFFFFF


# Per-type element/block sizes, read in the hot checks without crossing into libggml.
cdef size_t _TSIZE[64]
cdef int64_t _BLCK[64]


cdef void _init_type_tables() noexcept:
    cdef int t
    for t in range(64):
        _TSIZE[t] = 0
        _BLCK[t] = 1
    for t in range(g.GGML_TYPE_COUNT):
        if _valid_type(t):
            _TSIZE[t] = g.ggml_type_size(<g.ggml_type> t)
            _BLCK[t] = g.ggml_blck_size(<g.ggml_type> t)


_init_type_tables()


cdef inline bint _is_rows_contig(g.ggml_tensor * p) noexcept:
    # Stricter than ggml_is_contiguous_rows (which waives the stride of a
    # one-element row): the CPU kernels assert nb[0] == type size regardless.
    cdef int t = p.type
    return p.nb[0] == _TSIZE[t]


cdef inline bint _is_strict_contig(g.ggml_tensor * p) noexcept:
    # Every stride exactly packed, size-1 dimensions included (ggml's own test
    # skips those, but kernels such as scale check ggml_is_padded_1d).
    cdef int t = p.type, i
    cdef size_t expect
    if p.nb[0] != _TSIZE[t]:
        return False
    expect = _TSIZE[t] * (p.ne[0] // _BLCK[t])
    for i in range(1, 4):
        if p.nb[i] != expect:
            return False
        expect *= p.ne[i]
    return True


cdef inline size_t _row_bytes(int t, int64_t ne0) noexcept:
    # ggml_row_size
    return _TSIZE[t] * (ne0 // _BLCK[t])


cdef str _ne_str(g.ggml_tensor * p):
    return f"({p.ne[0]}, {p.ne[1]}, {p.ne[2]}, {p.ne[3]})"


cdef str _desc(Tensor t):
    cdef g.ggml_tensor * p = t.ptr
    return f"{g.ggml_type_name(p.type).decode()} ne={_ne_str(p)}"


cdef str _mask_names(uint64_t mask):
    if mask == M_ANY:
        return "any type"
    names = [g.ggml_type_name(<g.ggml_type> i).decode() for i in range(g.GGML_TYPE_COUNT)
             if mask & _bit(i) and _valid_type(i)]
    return "/".join(names)


cdef inline int _arg(Tensor t, str op, str name) except -1:
    """The argument must be a live Tensor (None is rejected here; optional inputs check first)."""
    if t is None:
        raise GGMLTypeError(f"{op}: {name} must be a Tensor, got None")
    if t.gen != t.ctx.gen:
        raise ClosedError(f"{op}: {name} belongs to a context that was freed or reset")
    if t.ctx.deps:
        _deps_alive(t.ctx, op)
    return 0


cdef int _deps_alive(_ContextBase ctx, str op) except -1:
    """Every context ctx's tensors read from (transitively) is alive and was not reset since."""
    cdef _ContextBase d
    seen = set()
    todo = [ctx]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        for d, gen in (<_ContextBase> c).deps.items():
            if d.freed or d.gen != gen:
                raise ClosedError(f"{op}: tensors of this context read a context that was freed or reset since")
            if d.deps:
                todo.append(d)
    return 0


cdef int _allocs_live(_ContextBase c, str op) except -1:
    """The graph allocators that gave c's tensors memory still hold it (not freed, buffers not replaced)."""
    cdef _Allocator a
    for a, epoch in c.allocs.items():
        if a.dead:
            raise ClosedError(f"{op}: the tensor's memory came from a {type(a).__name__} that has been freed")
        if a.moving:
            raise GGMLValueError(f"{op}: the {type(a).__name__} that placed these tensors is allocating in another "
                                 f"thread (its buffers may move); try again after it returns")
        if a.epoch != epoch:
            raise ClosedError(f"{op}: the tensor's memory came from a {type(a).__name__} that has since replaced "
                              f"its buffers with larger ones (a bigger graph was allocated); build the graph again, "
                              f"or reserve the largest graph first so buffers never grow")
    return 0


cdef int _data_alive(_ContextBase ctx, str op) except -1:
    """Before touching data: ctx's and its dependencies' allocator-given memory still exists."""
    cdef _ContextBase c
    if ctx.allocs:
        _allocs_live(ctx, op)
    if ctx.deps:
        seen = set()
        todo = list(ctx.deps)
        while todo:
            c = todo.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            if c.allocs:
                _allocs_live(c, op)
            todo.extend(c.deps)
    return 0


cdef int _add_dep(_ContextBase ctx, Tensor t) except -1:
    # ctx's new tensor reads t, which lives in another context: remember that
    # context and its generation (a reset there would invalidate what ctx holds).
    cdef _ContextBase o = t.ctx
    if o is ctx or o in ctx.deps:
        return 0
    ctx.deps[o] = o.gen
    o.dependents.add(ctx)
    return 0


cdef inline int _types(Tensor t, str op, str name, uint64_t mask) except -1:
    if not (mask & _bit(t.ptr.type)):
        raise GGMLTypeError(f"{op}: {name} has type {g.ggml_type_name(t.ptr.type).decode()} "
                            f"(got {name}: {_desc(t)}, expected {_mask_names(mask)})")
    return 0


cdef inline int _same_type(Tensor a, Tensor b, str op, str an, str bn) except -1:
    if a.ptr.type != b.ptr.type:
        raise GGMLTypeError(f"{op}: {an} and {bn} must have the same type "
                            f"(got {an}: {_desc(a)}, {bn}: {_desc(b)})")
    return 0


cdef inline bint _can_repeat(g.ggml_tensor * b, g.ggml_tensor * a) noexcept:
    # ggml_can_repeat(b, a): b tiles a exactly along every dimension.
    cdef int i
    if b.ne[0] == 0 or b.ne[1] == 0 or b.ne[2] == 0 or b.ne[3] == 0:
        return a.ne[0] == 0 or a.ne[1] == 0 or a.ne[2] == 0 or a.ne[3] == 0
    for i in range(4):
        # equal or 1 is the common case, decided without a 64-bit division
        if b.ne[i] != a.ne[i] and b.ne[i] != 1 and a.ne[i] % b.ne[i] != 0:
            return False
    return True


cdef inline int _repeats(Tensor b, Tensor a, str op, str bn, str an) except -1:
    if not _can_repeat(b.ptr, a.ptr):
        raise GGMLValueError(f"{op}: {bn} must broadcast to {an} "
                             f"(got {an}: {_desc(a)}, {bn}: {_desc(b)}; expected {an}.ne[i] % {bn}.ne[i] == 0 for every i)")
    return 0


cdef inline int _same_shape(Tensor a, Tensor b, str op, str an, str bn) except -1:
    if not g.ggml_are_same_shape(a.ptr, b.ptr):
        raise GGMLValueError(f"{op}: {an} and {bn} must have the same ne "
                             f"(got {an}: {_desc(a)}, {bn}: {_desc(b)})")
    return 0


cdef inline int _nelements_eq(Tensor a, Tensor b, str op, str an, str bn) except -1:
    if g.ggml_nelements(a.ptr) != g.ggml_nelements(b.ptr):
        raise GGMLValueError(f"{op}: {an} and {bn} must have the same number of elements "
                             f"(got {an}: {_desc(a)}, {bn}: {_desc(b)})")
    return 0


cdef inline int _contig(Tensor t, str op, str name) except -1:
    if not _is_strict_contig(t.ptr):
        raise GGMLValueError(f"{op}: {name} must be contiguous (got {name}: {_desc(t)} nb={t.nb}); "
                             f"call ctx.cont({name}) first")
    return 0


cdef inline int _rows_contig(Tensor t, str op, str name) except -1:
    # Rows contiguous (nb[0] == element size): what row-wise kernels need.
    if not _is_rows_contig(t.ptr):
        raise GGMLValueError(f"{op}: {name} must have contiguous rows (got {name}: {_desc(t)} nb={t.nb}); "
                             f"call ctx.cont({name}) first")
    return 0


cdef inline int _contig1(Tensor t, str op, str name) except -1:
    if not g.ggml_is_contiguous_1(t.ptr) or not _is_rows_contig(t.ptr):
        raise GGMLValueError(f"{op}: {name} must be contiguous in dims >= 1 with contiguous rows "
                             f"(got {name}: {_desc(t)} nb={t.nb}); call ctx.cont({name}) first")
    return 0


cdef int _fail(str op, str what) except -1:
    # Callers write `if not cond: _fail(op, f"...")` so the message is only formatted on failure
    # (an eager f-string with _desc() costs microseconds per op).
    raise GGMLValueError(f"{op}: {what}")


# Integer parameters of the op methods are taken as Python objects and
# converted here: Cython's own conversion to a C int uses int(), which
# truncates 2.5 and raises a plain ValueError for NaN.
cdef int _K_INT = 0
cdef int _K_INT64 = 1
cdef int _K_SIZE = 2


cdef object _index(object v, str op, str name, int kind):
    if type(v) is not int:
        try:
            v = operator.index(v)
        except TypeError:
            raise GGMLTypeError(f"{op}: {name} must be an integer (got {v!r})") from None
    if kind == _K_INT:
        ok = -2147483648 <= v <= 2147483647
    elif kind == _K_INT64:
        ok = -9223372036854775808 <= v <= 9223372036854775807
    else:
        ok = 0 <= v <= 18446744073709551615
    if not ok:
        raise GGMLValueError(f"{op}: {name}={v} is out of range")
    return v


cdef inline int _finite(double v, str op, str name) except -1:
    if v != v or v == float("inf") or v == float("-inf"):
        raise GGMLValueError(f"{op}: {name} must be finite (got {v})")
    return 0


cdef int _ne_list(object ne, int64_t out[4], str op) except -1:
    """Parse 1..4 non-negative dimensions (ne order) into out, padding with 1."""
    cdef int n, i
    try:
        seq = tuple(ne)
    except TypeError:
        seq = (ne,)
    n = len(seq)
    if n < 1 or n > 4:
        raise GGMLValueError(f"{op}: ne must have 1 to 4 dimensions (got {seq!r})")
    for i in range(4):
        out[i] = 1
    for i in range(n):
        try:
            out[i] = seq[i]
        except (TypeError, OverflowError):
            raise GGMLTypeError(f"{op}: ne must be integers (got {seq!r})") from None
        if out[i] < 0:
            raise GGMLValueError(f"{op}: ne must be non-negative (got {seq!r})")
    _check_nelements(out, op)       # every shape from Python enters here: views and reshapes included
    return n


cdef int _check_nelements(const int64_t ne[4], str op) except -1:
    """ggml >= 0.25 asserts (aborts) unless the product of ne[0] and every ne[i] > 1 fits int64,
    even where another dimension is 0: refuse that shape first."""
    cdef int64_t cur = ne[0]
    cdef int i
    for i in range(1, 4):
        if ne[i] > 1:
            if not (INT64_MAX // ne[i] > cur):
                raise GGMLMemoryError(f"{op}: tensor of ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}) is too large "
                                      f"(its dimensions multiply past int64)")
            cur *= ne[i]
    return 0


cdef int64_t _checked_nbytes(int t, const int64_t ne[4], str op) except -1:
    """Bytes a contiguous tensor of type t and shape ne takes, with overflow checks."""
    cdef int64_t bs = g.ggml_blck_size(<g.ggml_type> t)
    cdef int64_t limit = (<int64_t> 1) << 62
    cdef int64_t total, i
    if ne[0] % bs != 0:
        raise GGMLValueError(f"{op}: ne[0]={ne[0]} must be a multiple of {g.ggml_type_name(<g.ggml_type> t).decode()}'s "
                             f"block size {bs}")
    if <double> ne[0] * _TSIZE[t] / bs > <double> limit:
        raise GGMLMemoryError(f"{op}: tensor of ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}) is too large")
    total = <int64_t> g.ggml_row_size(<g.ggml_type> t, ne[0])
    _check_nelements(ne, op)
    if <double> ne[0] * ne[1] * ne[2] * ne[3] > <double> limit:
        raise GGMLMemoryError(f"{op}: tensor of ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}) is too large (too many elements)")
    for i in range(1, 4):
        if ne[i] != 0 and total > limit // ne[i]:
            raise GGMLMemoryError(f"{op}: tensor of ne=({ne[0]}, {ne[1]}, {ne[2]}, {ne[3]}) is too large")
        total *= ne[i]
    return total
