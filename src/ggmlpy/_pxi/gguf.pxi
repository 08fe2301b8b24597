# gguf.pxi: the C side of GGUF files, through ggml's own gguf API (gguf.h).
#
# Two entry points, both private: `_gguf_read` parses a file's header (KV pairs
# and tensor table, never the tensor data) into plain Python objects and frees
# ggml's context before returning; `_gguf_meta` serializes a header for a
# writer that streams the tensor data itself. The public reader and writer
# (type inference, memory-mapped tensor data, the file itself) are
# the package ggmlpy/gguf/.
#
# gguf.cpp aborts the process (GGML_ASSERT / GGML_ABORT) instead of failing on:
#   - any getter with a key or tensor id out of range, or the wrong getter for
#     a value's type (gguf_get_arr_type on a scalar, gguf_get_arr_data on a
#     string array, gguf_get_val_str on a number ...);
#   - a setter with an empty key (the gguf_kv constructor asserts);
#   - "general.alignment" set through any setter but gguf_set_val_u32, or to a
#     value that is not a power of two;
#   - gguf_add_tensor with a name already added;
#   - (not an abort, a silent corruption) a tensor whose ne ends in a 0 after
#     ne[0]: the writer stores ggml_n_dims() dimensions, which skips it, so
#     the file claims a row of data that is not there;
#   - ggml_new_tensor with an invalid type, a row length that is not a multiple
#     of the block size, or an arena too small; ggml_init when its malloc fails.
# Every one of these is checked here first. Strings cross the API as C strings,
# so a key, value or name with an embedded NUL would be cut short silently: we
# refuse them. ggml also keeps the writer's alignment fixed at 32 whatever
# "general.alignment" says (only a file *read* takes it from the key), so a
# context for another alignment is made by parsing a tiny in-memory GGUF that
# holds just that key.

from libc.stdint cimport int8_t, int16_t, uint16_t


class GGUFError(GGMLValueError):
    """A GGUF file is not valid (truncated, corrupt, unsupported), or a GGUF
    writer was asked for something the format cannot hold."""


class GGUFValueType(enum.IntEnum):
    """The type of a GGUF metadata value (ggml's ``gguf_type``).

    ``ARRAY`` values also have an element type (any of the others but ARRAY).
    """
    UINT8 = g.GGUF_TYPE_UINT8
    INT8 = g.GGUF_TYPE_INT8
    UINT16 = g.GGUF_TYPE_UINT16
    INT16 = g.GGUF_TYPE_INT16
    UINT32 = g.GGUF_TYPE_UINT32
    INT32 = g.GGUF_TYPE_INT32
    FLOAT32 = g.GGUF_TYPE_FLOAT32
    BOOL = g.GGUF_TYPE_BOOL
    STRING = g.GGUF_TYPE_STRING
    ARRAY = g.GGUF_TYPE_ARRAY
    UINT64 = g.GGUF_TYPE_UINT64
    INT64 = g.GGUF_TYPE_INT64
    FLOAT64 = g.GGUF_TYPE_FLOAT64


# Element dtype of each fixed-size value type (BOOL is one byte, 0 or 1).
_GGUF_DTYPES = {
    g.GGUF_TYPE_UINT8: np.dtype(np.uint8), g.GGUF_TYPE_INT8: np.dtype(np.int8),
    g.GGUF_TYPE_UINT16: np.dtype(np.uint16), g.GGUF_TYPE_INT16: np.dtype(np.int16),
    g.GGUF_TYPE_UINT32: np.dtype(np.uint32), g.GGUF_TYPE_INT32: np.dtype(np.int32),
    g.GGUF_TYPE_FLOAT32: np.dtype(np.float32), g.GGUF_TYPE_BOOL: np.dtype(np.bool_),
    g.GGUF_TYPE_UINT64: np.dtype(np.uint64), g.GGUF_TYPE_INT64: np.dtype(np.int64),
    g.GGUF_TYPE_FLOAT64: np.dtype(np.float64),
}

# Inclusive integer range of each integer value type.
_GGUF_INT_RANGE = {
    g.GGUF_TYPE_UINT8: (0, 2**8 - 1), g.GGUF_TYPE_INT8: (-2**7, 2**7 - 1),
    g.GGUF_TYPE_UINT16: (0, 2**16 - 1), g.GGUF_TYPE_INT16: (-2**15, 2**15 - 1),
    g.GGUF_TYPE_UINT32: (0, 2**32 - 1), g.GGUF_TYPE_INT32: (-2**31, 2**31 - 1),
    g.GGUF_TYPE_UINT64: (0, 2**64 - 1), g.GGUF_TYPE_INT64: (-2**63, 2**63 - 1),
}

_GGUF_ALIGNMENT_KEY = "general.alignment"


# --- reading ---------------------------------------------------------------------

cdef object _gguf_str(const char * s):
    # Values come from the file as they are: invalid UTF-8 is replaced, not fatal.
    return b"" if s == NULL else (<bytes> s).decode("utf-8", "replace")


cdef object _gguf_scalar(g.gguf_context * ctx, int64_t i, int t):
    cdef const void * p
    if t == g.GGUF_TYPE_STRING:
        return _gguf_str(g.gguf_get_val_str(ctx, i))
    p = g.gguf_get_val_data(ctx, i)
    if t == g.GGUF_TYPE_UINT8: return (<const uint8_t *> p)[0]
    if t == g.GGUF_TYPE_INT8: return (<const int8_t *> p)[0]
    if t == g.GGUF_TYPE_UINT16: return (<const uint16_t *> p)[0]
    if t == g.GGUF_TYPE_INT16: return (<const int16_t *> p)[0]
    if t == g.GGUF_TYPE_UINT32: return (<const uint32_t *> p)[0]
    if t == g.GGUF_TYPE_INT32: return (<const int32_t *> p)[0]
    if t == g.GGUF_TYPE_FLOAT32: return <double> (<const float *> p)[0]
    if t == g.GGUF_TYPE_BOOL: return (<const int8_t *> p)[0] != 0
    if t == g.GGUF_TYPE_UINT64: return (<const uint64_t *> p)[0]
    if t == g.GGUF_TYPE_INT64: return (<const int64_t *> p)[0]
    if t == g.GGUF_TYPE_FLOAT64: return (<const double *> p)[0]
    raise GGUFError(f"unknown GGUF value type {t}")


cdef object _gguf_array(g.gguf_context * ctx, int64_t i, int et):
    cdef size_t n = g.gguf_get_arr_n(ctx, i), j
    cdef uint8_t[::1] dst
    if et == g.GGUF_TYPE_STRING:
        return [_gguf_str(g.gguf_get_arr_str(ctx, i, j)) for j in range(n)]
    dt = _GGUF_DTYPES.get(et)
    if dt is None:
        raise GGUFError(f"unknown GGUF array element type {et}")
    out = np.empty(n, dt)
    if n:
        dst = out.view(np.uint8)
        memcpy(&dst[0], g.gguf_get_arr_data(ctx, i), n * dt.itemsize)
    return out


def _gguf_read(path):
    """Parse a GGUF file's header with ``gguf_init_from_file`` (no tensor data).

    Returns None when ggml rejects the file (it logs why), else a dict with
    ``version``, ``alignment``, ``data_offset`` (absolute), ``kv`` (a list of
    ``(key, GGUFValueType, element GGUFValueType or None, value)`` in file order;
    numeric arrays as numpy arrays, string arrays as lists) and ``tensors`` (a
    list of ``(name, ggml type int, ne 4-tuple, offset in the data section,
    nbytes)`` in file order).
    """
    cdef bytes cpath = os.fsencode(path)
    cdef const char * c = cpath
    cdef g.gguf_init_params params
    cdef g.gguf_context * ctx
    cdef int64_t i, n
    cdef int t, et
    cdef const int64_t * ne
    params.no_alloc = True
    params.ctx = NULL
    with nogil:
        ctx = g.gguf_init_from_file(c, params)
    if ctx == NULL:
        return None
    try:
        kv = []
        n = g.gguf_get_n_kv(ctx)
        for i in range(n):
            key = _gguf_str(g.gguf_get_key(ctx, i))
            t = g.gguf_get_kv_type(ctx, i)
            if t == g.GGUF_TYPE_ARRAY:
                et = g.gguf_get_arr_type(ctx, i)
                kv.append((key, GGUFValueType.ARRAY, GGUFValueType(et), _gguf_array(ctx, i, et)))
            else:
                kv.append((key, GGUFValueType(t), None, _gguf_scalar(ctx, i, t)))
        tensors = []
        n = g.gguf_get_n_tensors(ctx)
        for i in range(n):
            ne = g.gguf_get_tensor_ne(ctx, i)
            tensors.append((_gguf_str(g.gguf_get_tensor_name(ctx, i)), <int> g.gguf_get_tensor_type(ctx, i),
                            (ne[0], ne[1], ne[2], ne[3]), g.gguf_get_tensor_offset(ctx, i),
                            g.gguf_get_tensor_size(ctx, i)))
        return {"version": g.gguf_get_version(ctx), "alignment": g.gguf_get_alignment(ctx),
                "data_offset": g.gguf_get_data_offset(ctx), "kv": kv, "tensors": tensors}
    finally:
        g.gguf_free(ctx)


# --- writing ---------------------------------------------------------------------

cdef bytes _gguf_cstr(object s, str what):
    """UTF-8 bytes of a key, value or name that ggml will see as a C string."""
    if not isinstance(s, str):
        raise GGMLTypeError(f"GGUF {what} must be a str, got {type(s).__name__}")
    try:
        b = (<str> s).encode("utf-8")
    except UnicodeEncodeError as e:
        raise GGUFError(f"GGUF {what} {s!r} is not valid Unicode ({e.reason})") from None
    if b"\0" in b:
        raise GGUFError(f"GGUF {what} {s!r} contains a NUL character, which GGUF C strings cannot hold")
    return b


cdef int _gguf_set(g.gguf_context * ctx, bytes key, int t, int et, object value) except -1:
    """One gguf_set_* call; the value is already checked (by _gguf_check_kv)."""
    cdef const char * k = key
    cdef const uint8_t[::1] raw
    cdef const char ** strs
    cdef size_t n, j
    if t == g.GGUF_TYPE_UINT8: g.gguf_set_val_u8(ctx, k, <uint8_t> value)
    elif t == g.GGUF_TYPE_INT8: g.gguf_set_val_i8(ctx, k, <int8_t> value)
    elif t == g.GGUF_TYPE_UINT16: g.gguf_set_val_u16(ctx, k, <uint16_t> value)
    elif t == g.GGUF_TYPE_INT16: g.gguf_set_val_i16(ctx, k, <int16_t> value)
    elif t == g.GGUF_TYPE_UINT32: g.gguf_set_val_u32(ctx, k, <uint32_t> value)
    elif t == g.GGUF_TYPE_INT32: g.gguf_set_val_i32(ctx, k, <int32_t> value)
    elif t == g.GGUF_TYPE_FLOAT32: g.gguf_set_val_f32(ctx, k, <float> value)
    elif t == g.GGUF_TYPE_UINT64: g.gguf_set_val_u64(ctx, k, <uint64_t> value)
    elif t == g.GGUF_TYPE_INT64: g.gguf_set_val_i64(ctx, k, <int64_t> value)
    elif t == g.GGUF_TYPE_FLOAT64: g.gguf_set_val_f64(ctx, k, <double> value)
    elif t == g.GGUF_TYPE_BOOL: g.gguf_set_val_bool(ctx, k, <bint> value)
    elif t == g.GGUF_TYPE_STRING: g.gguf_set_val_str(ctx, k, <const char *> (<bytes> value))
    elif et == g.GGUF_TYPE_STRING:
        n = len(value)
        strs = <const char **> malloc(max(n, 1) * sizeof(char *))
        if strs == NULL:
            raise GGMLMemoryError(f"GGUF: could not allocate a string array of {n} for {key!r}")
        try:
            for j in range(n):
                strs[j] = <const char *> (<bytes> value[j])
            g.gguf_set_arr_str(ctx, k, strs, n)
        finally:
            free(strs)
    else:
        raw = value.view(np.uint8)
        n = value.shape[0]
        g.gguf_set_arr_data(ctx, k, <g.gguf_type> et, &raw[0] if raw.shape[0] else NULL, n)
    return 0


def _gguf_check_kv(key, t, et, value):
    """Check one KV for _gguf_meta; returns ``(key bytes, t, et, value in C-ready form)``.

    Scalars: ints in range, floats, bools, str. Arrays: a 1-D numpy array of the
    element type's exact dtype, or a list of str.
    """
    kb = _gguf_cstr(key, "key")
    if not kb:
        raise GGUFError("GGUF keys must not be empty")
    try:
        t = GGUFValueType(t)
        et = None if t != GGUFValueType.ARRAY else GGUFValueType(et)
    except ValueError:
        raise GGUFError(f"GGUF key {key!r}: unknown value type {t!r} / element type {et!r}") from None
    if key == _GGUF_ALIGNMENT_KEY:
        if t != GGUFValueType.UINT32 or isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                value <= 0 or value >= 2**32 or value & (value - 1):
            raise GGUFError(f"GGUF key {key!r} must be a UINT32 power of two, got {value!r} as {t.name}")
    if t == GGUFValueType.ARRAY:
        if et == GGUFValueType.ARRAY:
            raise GGUFError(f"GGUF key {key!r}: arrays of arrays are not supported by ggml")
        if et == GGUFValueType.STRING:
            if isinstance(value, (str, bytes)):
                raise GGMLTypeError(f"GGUF key {key!r}: a STRING array needs a list of str, got {type(value).__name__}")
            return kb, int(t), int(et), [_gguf_cstr(s, f"string in array {key!r}") for s in value]
        dt = _GGUF_DTYPES[int(et)]
        if not isinstance(value, np.ndarray) or value.dtype != dt or value.ndim != 1:
            raise GGMLTypeError(f"GGUF key {key!r}: a {et.name} array needs a 1-D numpy array of {dt}")
        return kb, int(t), int(et), np.ascontiguousarray(value)
    if t == GGUFValueType.STRING:
        return kb, int(t), -1, _gguf_cstr(value, f"value of {key!r}")
    if t == GGUFValueType.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise GGMLTypeError(f"GGUF key {key!r}: BOOL needs a bool, got {type(value).__name__}")
        return kb, int(t), -1, bool(value)
    if t in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise GGMLTypeError(f"GGUF key {key!r}: {t.name} needs a number, got {type(value).__name__}")
        return kb, int(t), -1, float(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GGMLTypeError(f"GGUF key {key!r}: {t.name} needs an int, got {type(value).__name__}")
    lo, hi = _GGUF_INT_RANGE[int(t)]
    if not lo <= value <= hi:
        raise GGUFError(f"GGUF key {key!r}: {value} is out of range for {t.name} [{lo}, {hi}]")
    return kb, int(t), -1, int(value)


def _gguf_check_tensor(name, type, ne):
    """Check one tensor for _gguf_meta; returns ``(name bytes, type int, ne tuple, nbytes)``."""
    cdef int t
    nb = _gguf_cstr(name, "tensor name")
    if not nb:
        raise GGUFError("GGUF tensor names must not be empty")
    if len(nb) >= g.GGML_MAX_NAME:
        raise GGUFError(f"GGUF tensor name {name!r} is {len(nb)} bytes long; ggml allows at most "
                        f"{g.GGML_MAX_NAME - 1}")
    t = _as_type(type, f"GGUF tensor {name!r}")
    ne = tuple(int(x) for x in ne)
    if not 1 <= len(ne) <= g.GGML_MAX_DIMS:
        raise GGUFError(f"GGUF tensor {name!r}: ne={ne} must have 1 to {g.GGML_MAX_DIMS} dimensions")
    if any(x < 0 for x in ne):
        raise GGUFError(f"GGUF tensor {name!r}: ne={ne} has a negative dimension")
    for j in range(1, len(ne)):
        # ggml writes ggml_n_dims() dimensions, which ignores a trailing 0: the
        # file would say one row of data where there is none.
        if ne[j] == 0 and all(x <= 1 for x in ne[j + 1:]):
            raise GGUFError(f"GGUF tensor {name!r}: ne={ne} ends in a dimension of 0, which ggml's GGUF writer "
                            "drops (it writes ggml_n_dims dimensions); only ne[0] or a dimension followed by "
                            "one > 1 may be 0")
    bs = g.ggml_blck_size(<g.ggml_type> t)
    if ne[0] % bs:
        raise GGUFError(f"GGUF tensor {name!r}: row length ne[0]={ne[0]} is not a multiple of "
                        f"{type_name(t)}'s block size {bs}")
    rows = 1
    for x in ne[1:]:
        rows *= x
    nbytes = (ne[0] // bs) * g.ggml_type_size(<g.ggml_type> t) * rows
    nel = ne[0] * rows
    if nel >= 2**62 or nbytes >= 2**62:
        raise GGUFError(f"GGUF tensor {name!r}: ne={ne} is too large")
    return nb, t, ne, nbytes


cdef g.gguf_context * _gguf_ctx_for(uint32_t alignment) except NULL:
    # An empty context whose alignment is `alignment`: gguf_init_empty() is
    # always 32, and only parsing a file sets it from "general.alignment".
    cdef g.gguf_init_params params
    cdef g.gguf_context * ctx
    cdef bytes hdr
    if alignment == g.GGUF_DEFAULT_ALIGNMENT:
        ctx = g.gguf_init_empty()
    else:
        key = _GGUF_ALIGNMENT_KEY.encode()
        hdr = (b"GGUF" + int(g.GGUF_VERSION).to_bytes(4, "little") + (0).to_bytes(8, "little") +
               (1).to_bytes(8, "little") + len(key).to_bytes(8, "little") + key +
               int(g.GGUF_TYPE_UINT32).to_bytes(4, "little") + int(alignment).to_bytes(4, "little"))
        params.no_alloc = True
        params.ctx = NULL
        ctx = g.gguf_init_from_buffer(<const char *> hdr, len(hdr), params)
    if ctx == NULL or g.gguf_get_alignment(ctx) != alignment:
        g.gguf_free(ctx)
        raise GGUFError(f"GGUF: could not make a writer context with alignment {alignment}")
    return ctx


def _gguf_meta(kvs, tensors):
    """Serialize a GGUF header with ggml's writer (gguf_get_meta_data).

    ``kvs``: ``(key, GGUFValueType, element type or None, value)`` in order (a
    later key replaces an earlier one and moves to its place); ``tensors``:
    ``(name, type, ne)`` in order. Returns ``(meta bytes, alignment, [(offset
    in the data section, nbytes) per tensor])``; the header is padded to the
    alignment, so the first tensor's data starts right after it.

    Raises
    ------
    GGUFError
        An empty, NUL-holding or non-Unicode key/name/string, a value out of
        range of its type, a bad "general.alignment", a duplicate or too long
        tensor name, a bad shape or a row length that is not a whole number of
        blocks.
    """
    cdef g.gguf_context * ctx = NULL
    cdef g.ggml_context * gctx = NULL
    cdef g.ggml_init_params ip
    cdef g.ggml_tensor * tt
    cdef int64_t ne4[4]
    cdef size_t arena, msize
    cdef void * mem = NULL
    cdef uint32_t alignment = g.GGUF_DEFAULT_ALIGNMENT
    cdef int i, j
    checked = [_gguf_check_kv(*kv) for kv in kvs]
    for kb, t, et, v in checked:
        if kb == _GGUF_ALIGNMENT_KEY.encode():
            alignment = v
    specs = []
    seen = set()
    for name, type, ne in tensors:
        spec = _gguf_check_tensor(name, type, ne)
        if spec[0] in seen:
            raise GGUFError(f"GGUF: duplicate tensor name {name!r}")
        seen.add(spec[0])
        specs.append(spec)
    ctx = _gguf_ctx_for(alignment)
    try:
        for kb, t, et, v in checked:
            _gguf_set(ctx, kb, t, et, v)
        if specs:
            # The tensors are metadata only (no_alloc); our own arena, as
            # ggml_init aborts when its malloc fails.
            arena = (len(specs) + 1) * (g.ggml_tensor_overhead() + g.GGML_MEM_ALIGN)
            mem = malloc(arena)
            if mem == NULL:
                raise GGMLMemoryError(f"GGUF: could not allocate {_fmt_bytes(arena)} for tensor metadata")
            ip.mem_size = arena
            ip.mem_buffer = mem
            ip.no_alloc = True
            gctx = g.ggml_init(ip)
            if gctx == NULL:
                raise GGMLMemoryError("GGUF: ggml_init failed")
            for nb, t, ne, nbytes in specs:
                for j in range(4):
                    ne4[j] = ne[j] if j < len(ne) else 1
                tt = g.ggml_new_tensor(gctx, <g.ggml_type> t, len(ne), ne4)
                if tt == NULL:
                    raise GGMLMemoryError("GGUF: ggml_new_tensor failed")
                g.ggml_set_name(tt, <const char *> (<bytes> nb))
                g.gguf_add_tensor(ctx, tt)
        msize = g.gguf_get_meta_size(ctx)
        meta = PyBytes_FromStringAndSize(NULL, msize)
        g.gguf_get_meta_data(ctx, PyBytes_AS_STRING(meta))
        layout = [(g.gguf_get_tensor_offset(ctx, i), g.gguf_get_tensor_size(ctx, i)) for i in range(len(specs))]
        for (nb, t, ne, nbytes), (off, size) in zip(specs, layout):
            if size != nbytes:
                raise GGUFError(f"GGUF: ggml sizes tensor {nb.decode()!r} at {size} bytes, expected {nbytes}")
        return meta, g.gguf_get_alignment(ctx), layout
    finally:
        if gctx != NULL:
            g.ggml_free(gctx)
        free(mem)
        g.gguf_free(ctx)


def _gguf_can_quantize(type):
    """Raise unless ggml can quantize to ``type`` here (the check ``quantize`` makes)."""
    _quantizable(_as_type(type, "quantize"), "quantize")
