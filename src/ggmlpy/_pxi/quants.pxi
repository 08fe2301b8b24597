# quants.pxi: quantize / dequantize numpy data with ggml's reference codecs.


cdef int _quantizable(int t, str op) except -1:
    # ggml_quantize_chunk implements only some types: the intermediate Q8_1 /
    # Q8_K have no quantizer there (it aborts), and the i-quants need an
    # importance matrix.
    if g.ggml_quantize_requires_imatrix(<g.ggml_type> t):
        raise GGMLValueError(f"{op}: {type_name(t)} needs an importance matrix to quantize")
    if not (M_QUANTIZE & _bit(t)):
        raise GGMLTypeError(f"{op}: ggml cannot quantize to {type_name(t)}")
    return 0


cdef int _finite_for(int t, object rows, str op) except -1:
    # The i-quants search a grid for every block and abort ("not on grid") on NaN or infinity;
    # the other quantizers pass non-finite values through.
    if type_name(t).startswith("iq") and rows.size and not np.isfinite(rows).all():
        raise GGMLValueError(f"{op}: {type_name(t)} cannot quantize NaN or infinite values")
    return 0


def quantize(array, type):
    """Quantize float rows to ``type``; returns the raw blocks as ``bytes``.

    ``array`` is read as float32 rows (its last axis is a row, numpy order);
    the row length must be a multiple of the type's block size.

    Raises
    ------
    GGMLValueError
        Row length not a multiple of the block size, or a type that needs an
        importance matrix.
    GGMLTypeError
        ``type`` is not a quantized type (use ``astype`` for plain types).

    Examples
    --------
    >>> raw = quantize(np.ones((2, 32), np.float32), Type.Q8_0)
    >>> len(raw) == 2 * Type.Q8_0.row_size(32)
    True
    """
    cdef int t = _as_type(type, "quantize")
    cdef const float[:, ::1] rows            # const: a read-only array (a memory map) is accepted
    cdef int64_t n_rows, n_per_row
    cdef size_t nbytes
    if not g.ggml_is_quantized(<g.ggml_type> t):
        raise GGMLTypeError(f"quantize: {type_name(t)} is not a quantized type")
    _quantizable(t, "quantize")
    arr = np.ascontiguousarray(array, dtype=np.float32)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    n_per_row = arr.shape[arr.ndim - 1]
    if n_per_row % g.ggml_blck_size(<g.ggml_type> t):
        raise GGMLValueError(f"quantize: row length {n_per_row} is not a multiple of {type_name(t)}'s block size "
                             f"{g.ggml_blck_size(<g.ggml_type> t)}")
    rows = arr.reshape(-1, n_per_row) if arr.size else np.zeros((0, max(n_per_row, 1)), np.float32)
    n_rows = rows.shape[0] if arr.size else 0
    _finite_for(t, rows, "quantize")
    nbytes = g.ggml_row_size(<g.ggml_type> t, n_per_row) * n_rows
    out = PyBytes_FromStringAndSize(NULL, nbytes)
    cdef char * dst = PyBytes_AS_STRING(out)
    if n_rows:
        with nogil:
            g.ggml_quantize_chunk(<g.ggml_type> t, &rows[0, 0], dst, 0, n_rows, n_per_row, NULL)
    return out


def dequantize(data, type=None, ne0=None):
    """Convert raw blocks (``bytes``/buffer, or a Tensor) to a float32 array.

    For raw data give ``type`` and the row length ``ne0``; the result has shape
    ``(n_rows, ne0)``. For a Tensor this is ``tensor.get()``.

    Raises
    ------
    GGMLValueError
        The byte count is not a whole number of rows.
    """
    cdef int t
    cdef const uint8_t[::1] raw
    cdef float[:, ::1] out_v
    cdef const g.ggml_type_traits * tr
    cdef size_t rs
    cdef int64_t n_rows, r, n
    if isinstance(data, Tensor):
        return data.get()
    if type is None or ne0 is None:
        raise GGMLTypeError("dequantize: raw data needs type= and ne0=")
    t = _as_type(type, "dequantize")
    n = ne0
    tr = g.ggml_get_type_traits(<g.ggml_type> t)
    if tr.to_float == NULL:
        raise GGMLTypeError(f"dequantize: no conversion from {type_name(t)} to float32")
    if n <= 0 or n % g.ggml_blck_size(<g.ggml_type> t):
        raise GGMLValueError(f"dequantize: ne0={n} must be a positive multiple of the block size "
                             f"{g.ggml_blck_size(<g.ggml_type> t)}")
    raw = memoryview(data).cast("B")
    rs = g.ggml_row_size(<g.ggml_type> t, n)
    if raw.shape[0] % rs:
        raise GGMLValueError(f"dequantize: {raw.shape[0]} bytes is not a whole number of {rs}-byte rows "
                             f"of {n} {type_name(t)} elements")
    n_rows = raw.shape[0] // rs
    out = np.empty((n_rows, n), dtype=np.float32)
    out_v = out
    if n_rows:
        with nogil:
            for r in range(n_rows):
                tr.to_float(&raw[r * rs], &out_v[r, 0], n)
    return out
