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
    every size, ``mul_mat_vec`` sends Q8_0 rows to ggml's ``vec_dot`` and refuses repacked Q4_0 and
    Q4_K weights, and so do ``mul_mat_rq4k`` and ``mul_mat_id_rq`` (ggml's layout, which has no portable
    kernel of ours), and every check the models ask before choosing a kernel
    (``_attn_decode_vectorized``, ``_attn_prefill_vectorized``, ``_geglu_vectorized``,
    ``_mul_mat_vec_vnni``, ``_mul_mat_vec_ok``, ``_mul_mat_rq4k_ok``, ``_mul_mat_id_rq_ok``) answers
    as on such a CPU.
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
    g.ggml_tensor * ggmlpy_mul_mat_vec(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x, int own_rows) nogil
    int ggmlpy_gemv_own_rows(const g.ggml_tensor * w) nogil
    int ggmlpy_gemv_path(const g.ggml_tensor * t) nogil
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
    g.ggml_tensor * ggmlpy_mul_mat_id_rq(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x,
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


cdef extern from "kernels.h":
    g.ggml_tensor * ggmlpy_mul_mat_rq4k(g.ggml_context * ctx, g.ggml_tensor * w, g.ggml_tensor * x) nogil
    int ggmlpy_rq4k_gemm_ok(const g.ggml_tensor * w) nogil
    int ggmlpy_rq4k_gemm_allow


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
    buffer (its VNNI kernels; for Q4_K the AVX2 one too); with ``allow``, set it (process-wide) and return
    the previous value. For tests and benchmarks."""
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


def _mul_mat_vec_own_rows(Tensor w):
    """Whether ``mul_mat_vec`` runs ``w``'s rows through one of ggmlpy's own VNNI row kernels (Q8_0, Q6_K;
    AVX-512 VNNI, the kernel allowed) unless ``own_rows=False`` asks for ggml's ``vec_dot`` under the
    same schedule: the weights where the two paths are measured against each other."""
    return bool(ggmlpy_gemv_own_rows(w.ptr))


def _mul_mat_vec_path(Tensor t):
    """The path ``t``, a result of ``mul_mat_vec``, was made to take: ``"vnni"`` (ggmlpy's row kernels
    where its weight's type has one), ``"dot"`` (``own_rows=False``); None for any other tensor. For
    tests."""
    cdef int p = ggmlpy_gemv_path(t.ptr)
    return None if p < 0 else "vnni" if p else "dot"


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
    memory, a type with a CPU dot kernel; or Q4_0/Q4_K repacked by ggml where this CPU has AVX-512 VNNI,
    Q4_K where it has AVX2, up to 3 vectors) for ``m`` vectors within its scratch bound. For the models'
    choice."""
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


def _mul_mat_id_rq_ok(Tensor w):
    """Whether ``Context.mul_mat_id_rq`` takes the expert stack ``w``: Q4_0 or Q4_K in ggml's repacked
    layout on a CPU with AVX-512 VNNI, or Q4_K on one with AVX2. For the models' choice."""
    return (bool(ggmlpy_gemv_repacked(w.ptr) or ggmlpy_rq4k_gemm_ok(w.ptr)) and w.ptr.ne[2] >= 1
            and w.ptr.ne[3] == 1)


def _mul_mat_rq4k_ok(Tensor w):
    """Whether ``Context.mul_mat_rq4k`` takes ``w``: a Q4_K matrix in ggml's ``CPU_REPACK`` buffer on a CPU
    with AVX2 and FMA (the kernel allowed, the portable path not forced). For the models' choice."""
    return bool(ggmlpy_rq4k_gemm_ok(w.ptr)) and w.ptr.ne[2] == 1


def _mul_mat_rq4k_allow(allow=None):
    """Whether ``Context.mul_mat_rq4k`` may run (process-wide); with ``allow``, set it and return the
    previous value. For tests and benchmarks."""
    global ggmlpy_rq4k_gemm_allow
    cdef int old = ggmlpy_rq4k_gemm_allow
    if allow is not None:
        ggmlpy_rq4k_gemm_allow = 1 if allow else 0
    return bool(old)


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


@cython.no_gc_clear
cdef class _ContextKernels(_ContextNN):
    """Op methods of Context, part 3: ggmlpy's own CPU kernels (ggml custom ops that only the CPU
    backend runs): attention of a few rows and of a prompt over a cache, matrix times a few vectors,
    GeGLU. The last base of Context (context.pxi says why it is a chain)."""

    def geglu_tanh(self, Tensor a, Tensor b=None):
        """``gelu(x1) * x2`` over the halves of each row, or with ``b`` ``gelu(a) * b``: GELU's tanh
        form (transformers' ``gelu_pytorch_tanh``) evaluated in float32 for every value.

        ggmlpy's CPU kernel (a ggml custom op: the CPU backend runs it, no other). ggml's
        :meth:`geglu` reads GELU from a float16 table one value at a time (relative errors up to
        ~5e-4, and ten times slower than its vectorised :meth:`swiglu`); this one computes
        ``x * sigmoid(2u)``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``, 16 values at a time with AVX-512
        (a 512 x 2048 prompt's rows on one thread: ~0.2 against 2.1 ms), within a few float32 ulps.

        ``a`` f32, contiguous, ``ne[0]`` even without ``b``; ``b`` f32, contiguous, ``a``'s shape.
        The result has ``ne[0] / 2`` (without ``b``) or ``a``'s shape.
        """
        cdef str op = "geglu_tanh"
        cdef int64_t n
        self._ensure_op(op)
        _arg(a, op, "a")
        _types(a, op, "a", M_F32)
        _contig(a, op, "a")
        if b is None:
            if a.ptr.ne[0] % 2:
                _fail(op, f"a.ne[0] must be even (got a: {_desc(a)})")
            n = a.ptr.ne[0] // 2
        else:
            _arg(b, op, "b")
            _types(b, op, "b", M_F32)
            _contig(b, op, "b")
            _same_shape(a, b, op, "a", "b")
            n = a.ptr.ne[0]
        self._room(op, _out_bytes(g.GGML_TYPE_F32, n, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, ggmlpy_geglu_tanh(self.ptr, a.ptr, b.ptr if b is not None else NULL), a, b)

    def attn_decode(self, Tensor q, Tensor k, Tensor v, Tensor mask=None, float scale=1.0, int n_chunks=1,
                    bint avx512=True):
        """Attention of a few query rows over a float16/float32 KV cache: ``softmax(q k^T * scale + mask) v``.

        ggmlpy's own CPU kernel for the generation step (a ggml custom op, so the CPU backend runs it):
        ggml's CPU ``flash_attn_ext`` visits the cache one position at a time, which at depth costs a
        generated token more than reading its K/V; this scores a block of positions at once, takes one
        vectorised exp and sums the V rows in float32. Same result as ``flash_attn_ext`` without
        ALiBi, soft-capping or sinks (a fully masked row gives zeros); meant for few rows (for prompts,
        ``flash_attn_ext``'s tiled kernel is faster).

        Shapes (ggml order): ``q`` f32 ``(head_dim, n_head, n_q)`` (not permuted: as RoPE returns it;
        rows contiguous, other strides free); ``k`` ``(head_dim, n_kv, n_head_kv)`` and ``v``
        ``(head_dim_v, n_kv, n_head_kv)``, f16 or f32, rows contiguous, ``n_head`` a multiple of
        ``n_head_kv``; ``mask`` f16 ``(>= n_kv, >= n_q)``, shared by the heads. ``n_chunks`` > 1 cuts
        the positions into that many pieces, done in parallel and merged by a second op (for when
        ``n_head * n_q`` is too few to keep the threads busy). Result f32 ``(head_dim_v, n_head, n_q)``
        as ``flash_attn_ext``'s.

        A cache (each cell's heads side by side) of grouped-query heads is read with AVX-512 where the
        CPU has it (``_attn_decode_avx512``: each K and V row converted once for its query heads);
        ``avx512=False`` keeps this node on the AVX2 path. The results agree to float32 rounding;
        which is faster depends on the CPU, and the runner's calibration measures both
        (:mod:`ggmlpy.models.calibrate`).
        """
        cdef str op = "attn_decode"
        cdef g.ggml_tensor * r
        self._attn_check(op, q, k, v, mask, GGMLPY_ATTN_MAX_DV)
        if not (1 <= n_chunks <= max(1, k.ptr.ne[1])):
            _fail(op, f"n_chunks must be in 1..n_kv = {k.ptr.ne[1]} (got {n_chunks})")
        if n_chunks == 1:
            self._room(op, _out_bytes(g.GGML_TYPE_F32, v.ptr.ne[0], q.ptr.ne[1], q.ptr.ne[2], 1), 1)
        else:
            self._room(op, _out_bytes(g.GGML_TYPE_F32, v.ptr.ne[0] + 2, n_chunks, q.ptr.ne[1], q.ptr.ne[2])
                       + _out_bytes(g.GGML_TYPE_F32, v.ptr.ne[0], q.ptr.ne[1], q.ptr.ne[2], 1), 2)
        r = ggmlpy_attn_decode(self.ptr, q.ptr, k.ptr, v.ptr, mask.ptr if mask is not None else NULL, scale, n_chunks,
                               1 if avx512 else 0)
        return _res(self, r, q, k, v, mask)

    def attn_prefill(self, Tensor q, Tensor k, Tensor v, Tensor mask=None, float scale=1.0, float logit_softcap=0.0):
        """Attention of a prompt's query rows over a float16/float32 KV cache: ``softmax(q k^T * scale + mask) v``.

        ggmlpy's own CPU kernel for prompts (a ggml custom op): tiles of 64 query rows of a head meet
        blocks of 64 positions as two small float32 matrix products with an online softmax between
        them; blocks the mask hides from the whole tile (a causal prompt's upper triangle) are
        skipped. ggml's CPU ``flash_attn_ext`` does a prompt row by row. Same result as
        ``flash_attn_ext`` without ALiBi or sinks (a fully masked row gives zeros), computed in
        float32 throughout (ggml rounds ``q`` to float16 for a float16 cache); ``logit_softcap``
        caps the scaled scores to ``logit_softcap * tanh(s / logit_softcap)`` before the mask, as
        ``flash_attn_ext``'s does (gemma2).

        Arguments as :meth:`attn_decode`'s (``q`` f32 ``(head_dim, n_head, n_q)``, rows contiguous;
        ``k``/``v`` f16 or f32 ``(head_dim, n_kv, n_head_kv)``; ``mask`` f16 ``(>= n_kv, >= n_q)``),
        head sizes at most 256. Result f32 ``(head_dim_v, n_head, n_q)``. Vectorised with AVX-512
        (head sizes multiples of 16, see ``_attn_prefill_vectorized``); elsewhere portable C.
        """
        cdef str op = "attn_prefill"
        cdef g.ggml_tensor * r
        self._attn_check(op, q, k, v, mask, GGMLPY_PF_MAX_D)
        if not (logit_softcap >= 0.0 and logit_softcap < float("inf")):
            _fail(op, f"logit_softcap must be 0 (none) or a positive finite cap (got {logit_softcap})")
        self._room(op, _out_bytes(g.GGML_TYPE_F32, v.ptr.ne[0], q.ptr.ne[1], q.ptr.ne[2], 1), 1)
        r = ggmlpy_attn_prefill(self.ptr, q.ptr, k.ptr, v.ptr, mask.ptr if mask is not None else NULL, scale,
                                logit_softcap)
        return _res(self, r, q, k, v, mask)

    def mul_mat_vec(self, Tensor w, Tensor x, bint own_rows=True):
        """``mul_mat(w, x)`` for a few float32 vectors: the generation step's product, ``mul_mat``'s values.

        ggmlpy's schedule for ggml's own CPU dot kernels (a ggml custom op): each thread reads one
        contiguous run of ``w``'s rows and prefetches the lines ahead of the row it is on, and
        every column of ``x`` in the same pass; ggml's ``mul_mat`` hands out small chunks of rows
        from a shared counter, so the memory system sees no long stream (measured on the 110M
        model's matrices, 2 threads: F16 1.12-1.15x, Q8_0 1.31x, Q6_K 1.47x). The vectors are
        converted to the kernel's type as ``mul_mat`` converts them, each row's dot is the type's
        ``vec_dot``: the same values. On a CPU with AVX-512 VNNI, Q8_0 rows go two at a time through
        a kernel of ggmlpy's own with ggml's arithmetic (the same values again; one thread 1.26x
        ggml's ``mul_mat`` where its ``vec_dot`` under this schedule gave 1.06x), and Q6_K rows likewise;
        ``own_rows=False`` keeps them on ggml's ``vec_dot`` under the schedule (which of the two is faster
        depends on the CPU and the row length: the runner measures both, ``_mul_mat_vec_own_rows``).

        ``w`` ``(k, n)``, 2 dimensions, rows contiguous, a type with a CPU dot kernel, plain rows in
        host memory (not a device's, nor a repacked buffer: ``is_repacked``); ``x`` f32 ``(k, m)``
        with ``1 <= m <= 4``, rows contiguous. Result f32 ``(n, m)`` as ``mul_mat``'s.

        Two repacked layouts are taken too: a Q4_0 or Q4_K ``w`` that ggml's ``CPU_REPACK`` buffer
        holds in 8-row groups (x86 with AVX2), on a CPU with AVX-512 VNNI, for ``m <= 3``. ggml's own
        kernels for them compute slower than memory delivers; ggmlpy's run the 8 rows of a block in
        512-bit VNNI passes (Q4_0 on one Zen 5 core: ~1.5x), with ggml's exact arithmetic, so again
        ``mul_mat``'s values. On a CPU with AVX2 but not VNNI a repacked Q4_K ``w`` is taken as well,
        through the same arithmetic in 256-bit registers (``mul_mat``'s values).
        """
        cdef str op = "mul_mat_vec"
        cdef g.ggml_tensor * r
        self._ensure_op(op)
        _arg(w, op, "w"); _arg(x, op, "x")
        _types(x, op, "x", M_F32)
        _rows_contig(w, op, "w"); _rows_contig(x, op, "x")
        if not (x.ptr.ne[0] == w.ptr.ne[0] and w.ptr.ne[2] == 1 and w.ptr.ne[3] == 1 and x.ptr.ne[2] == 1
                and x.ptr.ne[3] == 1 and 1 <= x.ptr.ne[1] <= GGMLPY_GEMV_MAX_COLS):
            _fail(op, f"shapes do not match (got w: {_desc(w)}, x: {_desc(x)}; expected w (k, n) and x (k, m), "
                  f"1 <= m <= {GGMLPY_GEMV_MAX_COLS}, 2 dimensions)")
        if ggmlpy_gemv_repacked(w.ptr):
            if x.ptr.ne[1] > GGMLPY_RQ4_MAX_COLS:
                _fail(op, f"a repacked w takes at most {GGMLPY_RQ4_MAX_COLS} vectors (got w: {_desc(w)}, "
                      f"x: {_desc(x)}): use mul_mat")
            _gemv_check(op, w, "w", x, x.ptr.ne[1], "mul_mat", repacked=True)
            self._room(op, _out_bytes(g.GGML_TYPE_F32, w.ptr.ne[1], x.ptr.ne[1], 1, 1), 1)
            # w is no source of the op (the CPU backend refuses custom ops on repacked tensors): _res
            # keeps its Tensor, and so its context, alive with the result
            r = ggmlpy_mul_mat_vec_rq4(self.ptr, w.ptr, x.ptr)
            return _res(self, r, w, x)
        _gemv_check(op, w, "w", x, x.ptr.ne[1], "mul_mat")
        self._room(op, _out_bytes(g.GGML_TYPE_F32, w.ptr.ne[1], x.ptr.ne[1], 1, 1), 1)
        r = ggmlpy_mul_mat_vec(self.ptr, w.ptr, x.ptr, own_rows)
        return _res(self, r, w, x)

    def mul_mat_id_vec(self, Tensor as_, Tensor b, Tensor ids):
        """``mul_mat_id(as_, b, ids)`` for at most 4 tokens: a few tokens' chosen experts, ``mul_mat_id``'s values.

        :meth:`mul_mat_vec`'s schedule for the experts: the (token, slot, row) units are cut into one
        contiguous run per thread, which streams through the rows of its experts with prefetches
        ahead, and each row's dot is ggml's kernel for the type on the vector converted as
        ``mul_mat_id`` converts it. An expert id out of range gives NaN rows instead of ggml's abort.

        ``as_`` ``(k, rows, n_expert)`` rows contiguous, plain rows in host memory, a type with a CPU
        dot kernel (or a Q4_0 or Q4_K stack ggml repacked, as :meth:`mul_mat_vec` takes it, for any token
        count: ggml's repacked ``mul_mat_id`` runs its one-vector kernel per token and slot); ``b`` f32 ``(k, 1 or n_used, n_tokens)`` rows contiguous, ``n_tokens <= 4``;
        ``ids`` i32 ``(n_used, n_tokens)``, rows contiguous (``top_k``'s view). Result f32 ``(rows, n_used, n_tokens)``.
        """
        cdef str op = "mul_mat_id_vec"
        cdef bint rq4
        self._ensure_op(op)
        _arg(as_, op, "as_"); _arg(b, op, "b"); _arg(ids, op, "ids")
        _types(b, op, "b", M_F32)
        _types(ids, op, "ids", M_I32)
        _rows_contig(as_, op, "as_"); _rows_contig(b, op, "b")
        if not (as_.ptr.ne[3] == 1 and b.ptr.ne[3] == 1 and ids.ptr.ne[2] == 1 and ids.ptr.ne[3] == 1
                and ids.ptr.ne[1] == b.ptr.ne[2] and as_.ptr.ne[0] == b.ptr.ne[0]
                and (b.ptr.ne[1] == 1 or b.ptr.ne[1] == ids.ptr.ne[0]) and 1 <= b.ptr.ne[2] <= GGMLPY_GEMV_MAX_COLS
                and ids.ptr.nb[0] == 4):
            _fail(op, f"shapes do not match (got as_: {_desc(as_)}, b: {_desc(b)}, ids: {_desc(ids)}; expected "
                  f"as_ (k, rows, n_expert), b (k, 1 or n_used, n_tokens), ids (n_used, n_tokens) with contiguous rows, "
                  f"1 <= n_tokens <= {GGMLPY_GEMV_MAX_COLS})")
        rq4 = ggmlpy_gemv_repacked(as_.ptr)
        _gemv_check(op, as_, "as_", b, b.ptr.ne[1] * b.ptr.ne[2], "mul_mat_id", repacked=rq4)
        self._room(op, _out_bytes(g.GGML_TYPE_F32, as_.ptr.ne[1], ids.ptr.ne[0], b.ptr.ne[2], 1), 1)
        if rq4:                     # as_ is no source of the op: _res keeps it alive (see mul_mat_vec)
            return _res(self, ggmlpy_mul_mat_id_vec_rq4(self.ptr, as_.ptr, b.ptr, ids.ptr), as_, b, ids)
        return _res(self, ggmlpy_mul_mat_id_vec(self.ptr, as_.ptr, b.ptr, ids.ptr), as_, b, ids)

    def mul_mat_id_rq(self, Tensor as_, Tensor b, Tensor ids):
        """``mul_mat_id(as_, b, ids)`` for any number of tokens on an expert stack ggml repacked: a prompt's experts.

        ggml's repacked ``mul_mat_id`` runs its one-vector 256-bit kernel once per token and slot, reading
        the expert's rows each time. This op sorts the (token, slot) pairs by expert, gives each thread
        a run of the sorted pairs, and runs an expert's vectors three at a time through
        :meth:`mul_mat_vec`'s AVX-512 VNNI kernel for the layout, over blocks of the expert's rows small
        enough to stay in the core's L2 cache (about 2x ggml's on 32- and 64-expert stacks, 2 threads).
        On a CPU with AVX2 but not VNNI, a Q4_K stack goes through :meth:`mul_mat_rq4k`'s kernel instead:
        a window of the expert's rows prepared once, its tokens passed over it four at a time.
        Each pair's arithmetic is the one-vector kernel's,
        on the vector quantized as ggml quantizes it: ``mul_mat_id``'s values. An expert id out of range
        gives NaN rows instead of ggml's abort.

        ``as_`` ``(k, rows, n_expert)``, a Q4_0 or Q4_K stack in ggml's ``CPU_REPACK`` buffer on a CPU with
        AVX-512 VNNI, or Q4_K on one with AVX2 (``_mul_mat_id_rq_ok``); ``b`` f32 ``(k, 1 or n_used, n_tokens)`` rows contiguous;
        ``ids`` i32 ``(n_used, n_tokens)``, rows contiguous. Result f32 ``(rows, n_used, n_tokens)``.
        """
        cdef str op = "mul_mat_id_rq"
        self._ensure_op(op)
        _arg(as_, op, "as_"); _arg(b, op, "b"); _arg(ids, op, "ids")
        _types(b, op, "b", M_F32)
        _types(ids, op, "ids", M_I32)
        _rows_contig(b, op, "b")
        if not (ggmlpy_gemv_repacked(as_.ptr) or ggmlpy_rq4k_gemm_ok(as_.ptr)):
            _fail(op, f"as_ must be a Q4_0 or Q4_K expert stack ggml repacked (CPU_REPACK) on a CPU with AVX-512 "
                  f"VNNI, or Q4_K on one with AVX2 (got as_: {_desc(as_)}, in {_buffer_name(as_.ptr)}): use mul_mat_id")
        if not (as_.ptr.ne[3] == 1 and b.ptr.ne[3] == 1 and ids.ptr.ne[2] == 1 and ids.ptr.ne[3] == 1
                and ids.ptr.ne[1] == b.ptr.ne[2] and as_.ptr.ne[0] == b.ptr.ne[0] and ids.ptr.ne[0] >= 1
                and (b.ptr.ne[1] == 1 or b.ptr.ne[1] == ids.ptr.ne[0]) and b.ptr.ne[2] >= 1 and ids.ptr.nb[0] == 4):
            _fail(op, f"shapes do not match (got as_: {_desc(as_)}, b: {_desc(b)}, ids: {_desc(ids)}; expected "
                  f"as_ (k, rows, n_expert), b (k, 1 or n_used, n_tokens), ids (n_used, n_tokens) with contiguous rows)")
        self._room(op, _out_bytes(g.GGML_TYPE_F32, as_.ptr.ne[1], ids.ptr.ne[0], b.ptr.ne[2], 1), 1)
        # as_ is no source of the op (see mul_mat_vec): _res keeps it alive
        return _res(self, ggmlpy_mul_mat_id_rq(self.ptr, as_.ptr, b.ptr, ids.ptr), as_, b, ids)

    def mul_mat_rq4k(self, Tensor w, Tensor x):
        """``mul_mat(w, x)`` for any number of tokens on a Q4_K matrix ggml repacked: a prompt's products, ``mul_mat``'s values.

        ggml's repacked kernel for AVX2 unpacks and shuffles every 8 rows' weights again for each 16
        tokens. This op has each thread unpack a window of its rows once (about 192 KiB, kept in L2)
        into the form a 256-bit integer multiply wants, then pass every token over it, four at a time.
        The tokens are quantized to Q8_K by ggml's own function and the sums folded into floats in
        ggml's order: the values of ``mul_mat`` on the same weights, bit for bit.

        ``w`` ``(k, n)`` Q4_K in ggml's ``CPU_REPACK`` buffer on a CPU with AVX2 (``_mul_mat_rq4k_ok``);
        ``x`` f32 ``(k, m)`` rows contiguous, 2 dimensions. Result f32 ``(n, m)``.
        """
        cdef str op = "mul_mat_rq4k"
        cdef int64_t out, xq
        self._ensure_op(op)
        _arg(w, op, "w"); _arg(x, op, "x")
        _types(x, op, "x", M_F32)
        _rows_contig(x, op, "x")
        if not ggmlpy_rq4k_gemm_ok(w.ptr):
            _fail(op, f"w must be a Q4_K matrix ggml repacked (CPU_REPACK) on a CPU with AVX2 (got w: {_desc(w)}, "
                  f"in {_buffer_name(w.ptr)}): use mul_mat")
        if not (x.ptr.ne[0] == w.ptr.ne[0] and w.ptr.ne[2] == 1 and x.ptr.ne[2] == 1 and x.ptr.ne[3] == 1 and x.ptr.ne[1] >= 1):
            _fail(op, f"shapes do not match (got w: {_desc(w)}, x: {_desc(x)}; expected w (k, n) and x (k, m), "
                  f"2 dimensions)")
        # two results: the tokens in the kernel's form (276 bytes per 256 values), then the product
        out = _out_bytes(g.GGML_TYPE_F32, w.ptr.ne[1], x.ptr.ne[1], 1, 1)
        xq = _out_bytes(g.GGML_TYPE_I8, w.ptr.ne[0] // 256 * 276, x.ptr.ne[1], 1, 1)
        self._room(op, -1 if out < 0 or xq < 0 else out + xq, 2)
        # w is no source of the op (see mul_mat_vec): _res keeps it alive
        return _res(self, ggmlpy_mul_mat_rq4k(self.ptr, w.ptr, x.ptr), w, x)

    cdef int _attn_check(self, str op, Tensor q, Tensor k, Tensor v, Tensor mask, int max_d) except -1:
        """attn_decode's and attn_prefill's preconditions: types, contiguous rows, matching shapes."""
        self._ensure_op(op)
        _arg(q, op, "q"); _arg(k, op, "k"); _arg(v, op, "v")
        _types(q, op, "q", M_F32)
        _types(k, op, "k", M_F32_F16)
        _types(v, op, "v", M_F32_F16)
        _rows_contig(q, op, "q"); _rows_contig(k, op, "k"); _rows_contig(v, op, "v")
        _nonzero_dims(k, op, "k", 2)
        if not (k.ptr.ne[0] == q.ptr.ne[0] and q.ptr.ne[1] % k.ptr.ne[2] == 0 and v.ptr.ne[1] == k.ptr.ne[1]
                and v.ptr.ne[2] == k.ptr.ne[2] and q.ptr.ne[3] == 1 and k.ptr.ne[3] == 1 and v.ptr.ne[3] == 1):
            _fail(op, f"shapes do not match (got q: {_desc(q)}, k: {_desc(k)}, v: {_desc(v)}; expected q (head_dim, "
                  f"n_head, n_q), k (head_dim, n_kv, n_head_kv), v (head_dim_v, n_kv, n_head_kv), n_head % n_head_kv "
                  f"== 0, 3 dimensions)")
        if not (q.ptr.ne[0] <= max_d and v.ptr.ne[0] <= max_d):
            _fail(op, f"head sizes above {max_d} are not supported (got q: {_desc(q)}, v: {_desc(v)})")
        if mask is not None:
            _arg(mask, op, "mask")
            _types(mask, op, "mask", M_F16)
            _rows_contig(mask, op, "mask")
            if not (mask.ptr.ne[0] >= k.ptr.ne[1] and mask.ptr.ne[1] >= q.ptr.ne[2] and mask.ptr.ne[2] == 1
                    and mask.ptr.ne[3] == 1):
                _fail(op, f"mask does not fit (got k: {_desc(k)}, q: {_desc(q)}, mask: {_desc(mask)}; expected "
                      f"mask (>= n_kv, >= n_q) shared by the heads)")
        return 0
