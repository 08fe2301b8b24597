# ggmlpy's own CPU kernels (ggml custom ops; the Context methods are in ops.pxi; the C is in _c/kernels,
# built as libggmlpy_c): their declarations (kernels.h), the
# process-wide switches benchmarks and tests turn, and the checks the models ask before choosing them.

cdef extern from "kernels.h":
    int ggmlpy_kernels_portable


def _kernels_force_portable(force=None):
    """Whether every own kernel is forced onto its portable path (process-wide); with ``force``, set
    it and return the previous value. For tests and benchmarks: a CPU with AVX2, AVX-512 and VNNI
    then runs what a CPU without them runs, so one machine tests both paths.

    Forced, ``attn_decode``, ``attn_prefill`` and ``geglu_tanh`` run their portable C loops for
    every size, ``mul_mat_vec`` sends Q8_0 rows to ggml's ``vec_dot`` and refuses repacked Q4_0
    weights (ggml's layout, which has no portable kernel of ours), and every check the models ask
    before choosing a kernel (``_attn_decode_vectorized``, ``_attn_prefill_vectorized``,
    ``_geglu_vectorized``, ``_mul_mat_vec_vnni``, ``_mul_mat_vec_ok``) answers as on such a CPU.
    The per-kernel switches (``_attn_prefill_allow_vector``, ``_geglu_allow_vector``,
    ``_mul_mat_vec_q8``, ``_mul_mat_vec_repacked``) keep their values. ggml's own kernels (the
    ``vec_dot`` of each type) are the CPU variant's and do not change.

    Examples
    --------
    >>> old = _kernels_force_portable(True)
    >>> _attn_prefill_vectorized(64, 64)
    False
    >>> _kernels_force_portable(old)
    True
    """
    global ggmlpy_kernels_portable
    cdef bint old = ggmlpy_kernels_portable
    if force is not None:
        ggmlpy_kernels_portable = 1 if force else 0
    return old

cdef extern from "kernels.h":
    g.ggml_tensor * ggmlpy_attn_decode(g.ggml_context * ctx, g.ggml_tensor * q, g.ggml_tensor * k, g.ggml_tensor * v,
                                       g.ggml_tensor * mask, float scale, int n_chunks, int avx512) nogil
    int GGMLPY_ATTN_MAX_DV
    int ggmlpy_attn_use_avx2(int64_t dk, int64_t dv) nogil
    int ggmlpy_attn_use_avx512(int64_t dk, int64_t dv) nogil
    int ggmlpy_attn_allow_512
    int64_t ggmlpy_attn_pfd

cdef extern from "kernels.h":
    g.ggml_tensor * ggmlpy_mul_mat_vec(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x) nogil
    g.ggml_tensor * ggmlpy_mul_mat_id_vec(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x,
                                          g.ggml_tensor * ids) nogil
    int GGMLPY_GEMV_MAX_COLS
    int64_t ggmlpy_gemv_pfd
    size_t ggmlpy_gemv_scratch(g.ggml_type type, int64_t k, int64_t m) nogil
    size_t GGMLPY_GEMV_SCRATCH
    int ggmlpy_gemv_readable(const g.ggml_tensor * w) nogil
    g.ggml_tensor * ggmlpy_mul_mat_vec_rq4(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x) nogil
    g.ggml_tensor * ggmlpy_mul_mat_id_vec_rq4(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x,
                                              g.ggml_tensor * ids) nogil
    int ggmlpy_gemv_repacked(const g.ggml_tensor * w) nogil
    int ggmlpy_gemv_vnni() nogil
    int ggmlpy_q8_allow
    int64_t ggmlpy_q8_pfd
    int GGMLPY_RQ4_MAX_COLS
    int ggmlpy_rq4_allow
    int64_t ggmlpy_rq4_pfd
    int ggmlpy_rq4k_allow
    int64_t ggmlpy_rq4k_pfd
    int ggmlpy_q6k_allow
    int ggmlpy_gemv_pf_level
    int64_t ggmlpy_q6k_pfd


def _mul_mat_vec_prefetch(distance=None, kernel="dot"):
    """The bytes ahead that one of ``mul_mat_vec``'s kernels prefetches (0: none): ``"dot"`` (ggml's
    dot kernels under ggmlpy's schedule), ``"q8_0"`` and ``"q6_k"`` (the VNNI row-pair kernels),
    ``"q4_0_repacked"`` or ``"q4_k_repacked"``; with ``distance``, set it (process-wide) and return the
    previous value. For benchmarks."""
    global ggmlpy_gemv_pfd, ggmlpy_q8_pfd, ggmlpy_rq4_pfd, ggmlpy_rq4k_pfd, ggmlpy_q6k_pfd
    kinds = ("dot", "q8_0", "q4_0_repacked", "q4_k_repacked", "q6_k")
    if kernel not in kinds:
        raise GGMLValueError(f"_mul_mat_vec_prefetch: kernel {kernel!r}: expected one of {', '.join(kinds)}")
    cdef int64_t old = (ggmlpy_gemv_pfd, ggmlpy_q8_pfd, ggmlpy_rq4_pfd, ggmlpy_rq4k_pfd, ggmlpy_q6k_pfd)[kinds.index(kernel)]
    if distance is not None:
        if not 0 <= distance <= 1 << 16:
            raise GGMLValueError(f"_mul_mat_vec_prefetch: distance {distance} outside [0, 65536]")
        if kernel == "dot":
            ggmlpy_gemv_pfd = distance
        elif kernel == "q8_0":
            ggmlpy_q8_pfd = distance
        elif kernel == "q4_0_repacked":
            ggmlpy_rq4_pfd = distance
        elif kernel == "q4_k_repacked":
            ggmlpy_rq4k_pfd = distance
        else:
            ggmlpy_q6k_pfd = distance
    return old


cdef str _buffer_name(const g.ggml_tensor * p):
    cdef g.ggml_backend_buffer * buf = p.buffer if p.buffer != NULL or p.view_src == NULL else p.view_src.buffer
    return "its context's memory" if buf == NULL else g.ggml_backend_buffer_name(buf).decode()


cdef size_t _gemv_scratch(Tensor w, int64_t n_vectors) noexcept:
    # bytes the vectors take in w's dot type; (size_t) -1 where the type has no CPU dot kernel
    return ggmlpy_gemv_scratch(w.ptr.type, w.ptr.ne[0], n_vectors)


def _mul_mat_vec_repacked(allow=None, type="Q4_0"):
    """Whether ``mul_mat_vec`` takes weights of ``type`` (``"Q4_0"`` or ``"Q4_K"``) in the CPU's repack
    buffer (its VNNI kernels); with ``allow``, set it (process-wide) and return the previous value. For
    tests and benchmarks."""
    global ggmlpy_rq4_allow, ggmlpy_rq4k_allow
    if type not in ("Q4_0", "Q4_K"):
        raise GGMLValueError(f"_mul_mat_vec_repacked: type must be 'Q4_0' or 'Q4_K' (got {type!r})")
    cdef int old = ggmlpy_rq4_allow if type == "Q4_0" else ggmlpy_rq4k_allow
    if allow is not None:
        if type == "Q4_0":
            ggmlpy_rq4_allow = 1 if allow else 0
        else:
            ggmlpy_rq4k_allow = 1 if allow else 0
    return bool(old)


def _mul_mat_vec_vnni():
    """Whether this CPU runs ``mul_mat_vec``'s VNNI kernels (AVX-512 with VNNI, the portable path not
    forced: ``_kernels_force_portable``): the one for repacked Q4_0 weights, and the one for Q8_0
    rows."""
    return bool(ggmlpy_gemv_vnni())


def _mul_mat_vec_prefetch_level(level=None):
    """The cache level ``mul_mat_vec``'s prefetches fill (0: L1, 1: L2); with ``level``, set it
    (process-wide) and return the previous value. For benchmarks."""
    global ggmlpy_gemv_pf_level
    cdef int old = ggmlpy_gemv_pf_level
    if level is not None:
        if level not in (0, 1):
            raise GGMLValueError(f"_mul_mat_vec_prefetch_level: level must be 0 or 1 (got {level!r})")
        ggmlpy_gemv_pf_level = level
    return old


def _mul_mat_vec_q6_k(allow=None):
    """Whether ``mul_mat_vec`` runs Q6_K weights through its VNNI kernel where the CPU has it (else
    ggml's ``vec_dot`` under its schedule); with ``allow``, set it (process-wide) and return the
    previous value. For tests and benchmarks."""
    global ggmlpy_q6k_allow
    cdef int old = ggmlpy_q6k_allow
    if allow is not None:
        ggmlpy_q6k_allow = 1 if allow else 0
    return bool(old)


def _mul_mat_vec_q8(allow=None):
    """Whether ``mul_mat_vec`` runs Q8_0 weights through its VNNI kernel where the CPU has it (else
    ggml's ``vec_dot`` under its schedule); with ``allow``, set it (process-wide) and return the
    previous value. For tests and benchmarks."""
    global ggmlpy_q8_allow
    cdef int old = ggmlpy_q8_allow
    if allow is not None:
        ggmlpy_q8_allow = 1 if allow else 0
    return bool(old)


def _mul_mat_vec_ok(Tensor w, int64_t m):
    """Whether ``Context.mul_mat_vec`` takes the weight ``w`` (2 dimensions, plain rows in host
    memory, a type with a CPU dot kernel; or Q4_0 repacked by ggml where this CPU has AVX-512 VNNI,
    up to 3 vectors) for ``m`` vectors within its scratch bound. For the models' choice."""
    if ggmlpy_gemv_repacked(w.ptr):
        return 1 <= m <= GGMLPY_RQ4_MAX_COLS and w.ptr.ne[2] == 1 and _gemv_scratch(w, m) <= GGMLPY_GEMV_SCRATCH
    return (1 <= m <= GGMLPY_GEMV_MAX_COLS and w.ptr.ne[2] == 1 and w.ptr.ne[3] == 1 and ggmlpy_gemv_readable(w.ptr)
            and _gemv_scratch(w, m) <= GGMLPY_GEMV_SCRATCH)


def _mul_mat_id_vec_ok(Tensor w, int64_t n_vectors):
    """The same for ``Context.mul_mat_id_vec`` and the expert stack ``w`` (3 dimensions) with
    ``n_vectors`` input vectors (``b.ne[1] * b.ne[2]``); a repacked Q4_0 stack for any count."""
    return (n_vectors >= 1 and w.ptr.ne[3] == 1
            and (ggmlpy_gemv_readable(w.ptr) or ggmlpy_gemv_repacked(w.ptr))
            and _gemv_scratch(w, n_vectors) <= GGMLPY_GEMV_SCRATCH)


cdef int _gemv_check(str op, Tensor w, str name, Tensor b, int64_t n_vectors, str instead,
                     bint repacked=False) except -1:
    # mul_mat_vec's and mul_mat_id_vec's checks of the weight: readable rows (or a layout the op has a
    # kernel for: repacked), a dot kernel, the scratch
    cdef size_t scratch
    if not repacked and not ggmlpy_gemv_readable(w.ptr):
        _fail(op, f"{name} must be plain rows in host memory (got {name}: {_desc(w)}, in {_buffer_name(w.ptr)}): "
              f"use {instead}")
    scratch = _gemv_scratch(w, n_vectors)
    if scratch == <size_t> -1:
        raise GGMLTypeError(f"{op}: {name} has type {g.ggml_type_name(w.ptr.type).decode()}, which has no CPU dot "
                            f"kernel (got {name}: {_desc(w)})")
    if scratch > GGMLPY_GEMV_SCRATCH:
        _fail(op, f"the vectors take {scratch} bytes in {name}'s dot type, above {GGMLPY_GEMV_SCRATCH} (got {name}: "
              f"{_desc(w)}, b: {_desc(b)}): use {instead}")
    return 0


cdef extern from "kernels.h":
    g.ggml_tensor * ggmlpy_attn_prefill(g.ggml_context * ctx, g.ggml_tensor * q, g.ggml_tensor * k,
                                        g.ggml_tensor * v, g.ggml_tensor * mask, float scale, float softcap) nogil
    int GGMLPY_PF_MAX_D
    int ggmlpy_pf_vectorized(int64_t dk, int64_t dv) nogil
    int ggmlpy_pf_allow_vector


def _attn_decode_prefetch(distance=None):
    """The cells ahead that ``attn_decode``'s vectorised kernel prefetches (0: none); with
    ``distance``, set it (process-wide) and return the previous value. For benchmarks."""
    global ggmlpy_attn_pfd
    cdef int64_t old = ggmlpy_attn_pfd
    if distance is not None:
        if not 0 <= distance <= 64:
            raise GGMLValueError(f"_attn_decode_prefetch: distance {distance} outside [0, 64]")
        ggmlpy_attn_pfd = distance
    return old


def _attn_prefill_vectorized(int64_t head_dim_k, int64_t head_dim_v):
    """Whether ``Context.attn_prefill`` runs its AVX-512 kernel for these head sizes on this CPU
    (x86 with AVX-512F and FMA; sizes multiples of 16; neither ``_attn_prefill_allow_vector(False)``
    nor ``_kernels_force_portable(True)``). Elsewhere it is correct but scalar, slower than ggml's
    flash attention, and the models do not choose it."""
    return bool(ggmlpy_pf_vectorized(head_dim_k, head_dim_v))


def _attn_prefill_allow_vector(allow=None):
    """Whether ``attn_prefill`` may use its vectorised kernel (process-wide; ``False`` forces the
    portable one, for tests); with ``allow``, set it and return the previous value."""
    global ggmlpy_pf_allow_vector
    cdef bint old = ggmlpy_pf_allow_vector
    if allow is not None:
        ggmlpy_pf_allow_vector = 1 if allow else 0
    return old


def _attn_decode_allow_avx512(allow=None):
    """Whether ``attn_decode`` may read a cache of grouped-query heads with its AVX-512 kernel (each
    K and V row converted once for a kv head's query heads) where the CPU has AVX-512F and the head
    sizes are multiples of 16; ``False`` leaves the AVX2 one. With ``allow``, set it (process-wide)
    and return the previous value. For tests and benchmarks (``bench/attention.py --avx2``)."""
    global ggmlpy_attn_allow_512
    cdef bint old = ggmlpy_attn_allow_512
    if allow is not None:
        ggmlpy_attn_allow_512 = 1 if allow else 0
    return old


def _attn_decode_avx512(int64_t head_dim_k, int64_t head_dim_v):
    """Whether ``attn_decode`` reads a cache (every head of a cell side by side) with its AVX-512
    kernel for these head sizes on this CPU, where the heads are grouped (several query heads per
    kv head; without groups the AVX2 kernel runs)."""
    return bool(ggmlpy_attn_use_avx512(head_dim_k, head_dim_v))


def _attn_decode_vectorized(int64_t head_dim_k, int64_t head_dim_v):
    """Whether ``Context.attn_decode`` runs its vectorised kernel for these head sizes on this CPU
    (x86 with AVX2, FMA and F16C; sizes multiples of 8; not ``_kernels_force_portable(True)``).
    Elsewhere it is correct but scalar, slower than ggml's flash attention, and the models do not
    choose it."""
    return bool(ggmlpy_attn_use_avx2(head_dim_k, head_dim_v))


cdef extern from "kernels.h":
    g.ggml_tensor * ggmlpy_geglu_tanh(g.ggml_context * ctx, g.ggml_tensor * a, g.ggml_tensor * b) nogil
    int ggmlpy_glu_allow_vector
    int ggmlpy_glu_vectorized() nogil


def _geglu_allow_vector(allow=None):
    """Whether ``geglu_tanh`` runs its AVX-512 loop where the CPU has it (else the portable one); with
    ``allow``, set it (process-wide) and return the previous value. For tests."""
    global ggmlpy_glu_allow_vector
    cdef int old = ggmlpy_glu_allow_vector
    if allow is not None:
        ggmlpy_glu_allow_vector = 1 if allow else 0
    return bool(old)


def _geglu_vectorized():
    """Whether ``geglu_tanh`` runs vectorised here (x86 with AVX-512; neither ``_geglu_allow_vector(False)``
    nor ``_kernels_force_portable(True)``)."""
    return bool(ggmlpy_glu_vectorized())
