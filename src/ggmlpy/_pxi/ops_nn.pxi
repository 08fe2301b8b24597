# ops_nn.pxi: _ContextNN, Context's op methods of ggml.h, part 2 (convolution,
# pooling, resizing, padding, generators) and graph creation; kernels.pxi adds
# ggmlpy's own ops on top, and context.pxi defines Context (see there why it is
# made of several classes).


cdef int64_t _conv_out(int64_t ins, int64_t ks, int64_t s, int64_t p, int64_t d) noexcept:
    # in 64 bits: 2 * p and d * (ks - 1) overflow a C int for large parameters
    return (ins + 2 * p - d * (ks - 1) - 1) // s + 1


cdef int _conv_params(str op, int s0, int s1, int p0, int p1, int d0, int d1) except -1:
    if not (s0 > 0 and s1 > 0):
        _fail(op, f"strides must be > 0 (got s0={s0}, s1={s1})")
    if not (0 <= p0 < (1 << 30) and 0 <= p1 < (1 << 30)):
        _fail(op, f"padding must be in [0, 2**30) (got p0={p0}, p1={p1}; ggml doubles it in a C int)")
    if not (d0 > 0 and d1 > 0):
        _fail(op, f"dilation must be > 0 (got d0={d0}, d1={d1})")
    return 0


@cython.no_gc_clear
cdef class _ContextNN(_ContextOps):
    """Op methods of Context, part 2 (convolution, pooling, resizing, padding, generators) and graph creation."""

    # -- convolution ------------------------------------------------------------------

    def im2col(self, Tensor a, Tensor b, s0, s1, p0, p1, d0, d1, bint is_2D=True,
               dst_type=Type.F16):
        """Unfold ``b``'s patches for the kernel shape of ``a`` (see ggml.h); ``dst_type`` f16 or f32."""
        s0 = _index(s0, "im2col", "s0", _K_INT)
        s1 = _index(s1, "im2col", "s1", _K_INT)
        p0 = _index(p0, "im2col", "p0", _K_INT)
        p1 = _index(p1, "im2col", "p1", _K_INT)
        d0 = _index(d0, "im2col", "d0", _K_INT)
        d1 = _index(d1, "im2col", "d1", _K_INT)
        cdef int t = _as_type(dst_type, "im2col")
        cdef int64_t OW, OH
        self._ensure_op("im2col")
        _arg(a, "im2col", "a"); _arg(b, "im2col", "b")
        _nonzero_dims(a, "im2col", "a", 0); _nonzero_dims(b, "im2col", "b", 0)
        _conv_params("im2col", s0, s1 if is_2D else 1, p0, p1 if is_2D else 0, d0, d1 if is_2D else 1)
        if t == g.GGML_TYPE_F32:
            _types(b, "im2col", "b", M_F32)
        elif t == g.GGML_TYPE_F16:
            _types(b, "im2col", "b", M_F32_F16)
        else:
            raise GGMLTypeError(f"im2col: dst_type must be F16 or F32 (got {type_name(t)})")
        _contig(b, "im2col", "b")
        if is_2D:
            if not (a.ptr.ne[2] == b.ptr.ne[2]):
                _fail("im2col", f"channels differ (got a: {_desc(a)}, b: {_desc(b)}; expected a.ne[2] == b.ne[2])")
            OH = _conv_out(b.ptr.ne[1], a.ptr.ne[1], s1, p1, d1)
            if not (OH > 0):
                _fail("im2col", f"the kernel does not fit the input height (got a: {_desc(a)}, b: {_desc(b)})")
        else:
            if not (b.ptr.ne[1] == a.ptr.ne[1] and b.ptr.ne[3] == 1):
                _fail("im2col", f"channels differ (got a: {_desc(a)}, b: {_desc(b)}; expected a.ne[1] == b.ne[1], b.ne[3] == 1)")
            OH = b.ptr.ne[2]
        OW = _conv_out(b.ptr.ne[0], a.ptr.ne[0], s0, p0, d0)
        if not (OW > 0):
            _fail("im2col", f"the kernel does not fit the input width (got a: {_desc(a)}, b: {_desc(b)})")
        self._room("im2col", _out_bytes(t, a.ptr.ne[0] * a.ptr.ne[1] * (a.ptr.ne[2] if is_2D else 1), OW, OH,
                                        b.ptr.ne[3] if is_2D else 1), 1)
        return _res(self, g.ggml_im2col(self.ptr, a.ptr, b.ptr, s0, s1, p0, p1, d0, d1, is_2D, <g.ggml_type> t), a, b)

    def conv_1d(self, Tensor a, Tensor b, s0=1, p0=0, d0=1):
        """1-d convolution: kernel ``a`` ne ``(K, IC, OC)`` f32/f16 over ``b`` ne ``(L, IC, N)``; f32 ``(OL, OC, N)``.

        Built from im2col and mul_mat like ``ggml_conv_1d``, but with the batch
        axis put back in place: ggml's own composition labels its
        ``[OC][N][OL]`` result as ``(OL, OC, N)``, which is wrong for ``N > 1``.
        """
        s0 = _index(s0, "conv_1d", "s0", _K_INT)
        p0 = _index(p0, "conv_1d", "p0", _K_INT)
        d0 = _index(d0, "conv_1d", "d0", _K_INT)
        cdef int64_t OL, N, OC, K, IC
        self._ensure_op("conv_1d")
        _arg(a, "conv_1d", "a"); _arg(b, "conv_1d", "b")
        _nonzero_dims(a, "conv_1d", "a", 0); _nonzero_dims(b, "conv_1d", "b", 0)
        _types(a, "conv_1d", "a", M_F32_F16); _types(b, "conv_1d", "b", M_F32_F16)
        _contig(a, "conv_1d", "a"); _contig(b, "conv_1d", "b")
        _conv_params("conv_1d", s0, 1, p0, 0, d0, 1)
        if not (a.ptr.ne[3] == 1 and b.ptr.ne[1] == a.ptr.ne[1] and b.ptr.ne[3] == 1):
            _fail("conv_1d", f"shapes do not match (got a: {_desc(a)}, b: {_desc(b)}; expected a.ne[1] == b.ne[1] input channels)")
        K, IC, OC, N = a.ptr.ne[0], a.ptr.ne[1], a.ptr.ne[2], b.ptr.ne[2]
        OL = _conv_out(b.ptr.ne[0], K, s0, p0, d0)
        if not (OL > 0):
            _fail("conv_1d", f"the kernel does not fit the input (got a: {_desc(a)}, b: {_desc(b)})")
        # im2col (f16), 2 reshapes, mul_mat, reshape, permute, cont
        self._room("conv_1d", _out_bytes(g.GGML_TYPE_F16, K * IC, OL, N, 1)
                   + 2 * _out_bytes(g.GGML_TYPE_F32, OL, OC, N, 1), 7)
        cols = self.im2col(a, b, s0, 0, p0, 0, d0, 0, False, Type.F16)      # ne (K*IC, OL, N)
        y = self.mul_mat(self.reshape_2d(cols, K * IC, OL * N), self.reshape_2d(a, K * IC, OC))  # ne (OL*N, OC)
        return self.cont(self.permute(self.reshape_3d(y, OL, N, OC), 0, 2, 1, 3))              # ne (OL, OC, N)

    def conv_2d(self, Tensor a, Tensor b, s0=1, s1=1, p0=0, p1=0, d0=1, d1=1):
        """2-d convolution: kernel ``a`` ne ``(KW, KH, IC, OC)`` f32/f16 over ``b`` ne ``(W, H, IC, N)``; f32 ``(OW, OH, OC, N)``."""
        s0 = _index(s0, "conv_2d", "s0", _K_INT)
        s1 = _index(s1, "conv_2d", "s1", _K_INT)
        p0 = _index(p0, "conv_2d", "p0", _K_INT)
        p1 = _index(p1, "conv_2d", "p1", _K_INT)
        d0 = _index(d0, "conv_2d", "d0", _K_INT)
        d1 = _index(d1, "conv_2d", "d1", _K_INT)
        cdef int64_t OW, OH
        self._ensure_op("conv_2d")
        _arg(a, "conv_2d", "a"); _arg(b, "conv_2d", "b")
        _nonzero_dims(a, "conv_2d", "a", 0); _nonzero_dims(b, "conv_2d", "b", 0)
        _types(a, "conv_2d", "a", M_F32_F16); _types(b, "conv_2d", "b", M_F32_F16)
        _contig(a, "conv_2d", "a"); _contig(b, "conv_2d", "b")
        _conv_params("conv_2d", s0, s1, p0, p1, d0, d1)
        if not (a.ptr.ne[2] == b.ptr.ne[2]):
            _fail("conv_2d", f"input channels differ (got a: {_desc(a)}, b: {_desc(b)})")
        OW = _conv_out(b.ptr.ne[0], a.ptr.ne[0], s0, p0, d0)
        OH = _conv_out(b.ptr.ne[1], a.ptr.ne[1], s1, p1, d1)
        if not (OW > 0 and OH > 0):
            _fail("conv_2d", f"the kernel does not fit the input (got a: {_desc(a)}, b: {_desc(b)})")
        self._room("conv_2d", _out_bytes(g.GGML_TYPE_F16, a.ptr.ne[0] * a.ptr.ne[1] * a.ptr.ne[2], OW, OH, b.ptr.ne[3])
                   + 2 * _out_bytes(g.GGML_TYPE_F32, OW, OH, a.ptr.ne[3], b.ptr.ne[3]), 7)
        return _res(self, g.ggml_conv_2d(self.ptr, a.ptr, b.ptr, s0, s1, p0, p1, d0, d1), a, b)

    def conv_transpose_1d(self, Tensor a, Tensor b, s0=1, p0=0, d0=1):
        """Transposed 1-d convolution: kernel ``a`` ne ``(K, OC, IC)`` f32/f16, input ``b`` ne ``(L, IC)`` f32."""
        s0 = _index(s0, "conv_transpose_1d", "s0", _K_INT)
        p0 = _index(p0, "conv_transpose_1d", "p0", _K_INT)
        d0 = _index(d0, "conv_transpose_1d", "d0", _K_INT)
        self._ensure_op("conv_transpose_1d")
        _arg(a, "conv_transpose_1d", "a"); _arg(b, "conv_transpose_1d", "b")
        _nonzero_dims(a, "conv_transpose_1d", "a", 0); _nonzero_dims(b, "conv_transpose_1d", "b", 0)
        _types(a, "conv_transpose_1d", "a", M_F32_F16); _types(b, "conv_transpose_1d", "b", M_F32)
        _contig(a, "conv_transpose_1d", "a"); _contig(b, "conv_transpose_1d", "b")
        if not (s0 > 0):
            _fail("conv_transpose_1d", f"stride must be > 0 (got {s0})")
        if not (p0 == 0 and d0 == 1):
            _fail("conv_transpose_1d", f"ggml supports only p0=0, d0=1 (got p0={p0}, d0={d0})")
        if not (b.ptr.ne[2] == 1 and b.ptr.ne[3] == 1 and a.ptr.ne[2] == b.ptr.ne[1] and a.ptr.ne[3] == 1):
            _fail("conv_transpose_1d", f"shapes do not match (got a: {_desc(a)}, b: {_desc(b)}; expected a.ne[2] == b.ne[1], 2-d b)")
        self._room("conv_transpose_1d", _out_bytes(g.GGML_TYPE_F32, (b.ptr.ne[0] - 1) * s0 + a.ptr.ne[0], a.ptr.ne[1], 1, 1), 1)
        return _res(self, g.ggml_conv_transpose_1d(self.ptr, a.ptr, b.ptr, s0, p0, d0), a, b)

    def pool_1d(self, Tensor a, op, k0, s0, p0=0):
        """Max or average pooling over each row (``PoolOp``); f32/f16 in, f32 out."""
        k0 = _index(k0, "pool_1d", "k0", _K_INT)
        s0 = _index(s0, "pool_1d", "s0", _K_INT)
        p0 = _index(p0, "pool_1d", "p0", _K_INT)
        cdef int o = _index(op, "pool_1d", "op", _K_INT)
        cdef int64_t n
        _unary(self, a, "pool_1d", M_F32_F16, 2)
        if not (o == g.GGML_OP_POOL_MAX or o == g.GGML_OP_POOL_AVG):
            _fail("pool_1d", f"op must be PoolOp.MAX or AVG (got {op!r})")
        if not (k0 > 0 and s0 > 0 and p0 >= 0):
            _fail("pool_1d", f"k0 and s0 must be > 0 and p0 >= 0 (got {k0}, {s0}, {p0})")
        n = (a.ptr.ne[0] + 2 * <int64_t> p0 - k0) // s0 + 1
        if not (n > 0 and a.ptr.ne[0] + 2 * <int64_t> p0 >= k0):
            _fail("pool_1d", f"the window does not fit (got a: {_desc(a)}, k0={k0})")
        self._room("pool_1d", _out_bytes(g.GGML_TYPE_F32, n, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_pool_1d(self.ptr, a.ptr, <g.ggml_op_pool> o, k0, s0, p0), a)

    def pool_2d(self, Tensor a, op, k0, k1, s0, s1, p0=0, p1=0):
        """Max or average pooling over ``ne[0] x ne[1]`` planes; f32/f16 in, f32 out."""
        k0 = _index(k0, "pool_2d", "k0", _K_INT)
        k1 = _index(k1, "pool_2d", "k1", _K_INT)
        s0 = _index(s0, "pool_2d", "s0", _K_INT)
        s1 = _index(s1, "pool_2d", "s1", _K_INT)
        p0 = _index(p0, "pool_2d", "p0", _K_INT)
        p1 = _index(p1, "pool_2d", "p1", _K_INT)
        cdef int o = _index(op, "pool_2d", "op", _K_INT)
        cdef int64_t n0, n1
        _unary(self, a, "pool_2d", M_F32_F16, 2)
        if not (o == g.GGML_OP_POOL_MAX or o == g.GGML_OP_POOL_AVG):
            _fail("pool_2d", f"op must be PoolOp.MAX or AVG (got {op!r})")
        if not (k0 > 0 and k1 > 0 and s0 > 0 and s1 > 0 and p0 >= 0 and p1 >= 0):
            _fail("pool_2d", "kernel sizes and strides must be > 0, padding >= 0")
        n0 = (a.ptr.ne[0] + 2 * <int64_t> p0 - k0) // s0 + 1
        n1 = (a.ptr.ne[1] + 2 * <int64_t> p1 - k1) // s1 + 1
        if not (n0 > 0 and n1 > 0 and a.ptr.ne[0] + 2 * <int64_t> p0 >= k0 and a.ptr.ne[1] + 2 * <int64_t> p1 >= k1):
            _fail("pool_2d", f"the window does not fit (got a: {_desc(a)}, k=({k0}, {k1}))")
        self._room("pool_2d", _out_bytes(g.GGML_TYPE_F32, n0, n1, a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_pool_2d(self.ptr, a.ptr, <g.ggml_op_pool> o, k0, k1, s0, s1, p0, p1), a)

    def upscale(self, Tensor a, scale_factor, mode=ScaleMode.NEAREST):
        """Scale dims 0 and 1 by an integer factor (f32)."""
        scale_factor = _index(scale_factor, "upscale", "scale_factor", _K_INT)
        if not (scale_factor >= 1):
            _fail("upscale", f"scale_factor must be >= 1 (got {scale_factor})")
        self._ensure_op("upscale")
        _arg(a, "upscale", "a")
        return self.interpolate(a, a.ptr.ne[0] * scale_factor, a.ptr.ne[1] * scale_factor, a.ptr.ne[2], a.ptr.ne[3], mode)

    def interpolate(self, Tensor a, ne0, ne1, ne2, ne3, mode=ScaleMode.NEAREST):
        """Resize to ne ``(ne0, ne1, ne2, ne3)`` (f32); ``mode`` a ScaleMode, optionally | ALIGN_CORNERS."""
        ne0 = _index(ne0, "interpolate", "ne0", _K_INT64)
        ne1 = _index(ne1, "interpolate", "ne1", _K_INT64)
        ne2 = _index(ne2, "interpolate", "ne2", _K_INT64)
        ne3 = _index(ne3, "interpolate", "ne3", _K_INT64)
        cdef uint32_t m = _index(mode, "interpolate", "mode", _K_INT)
        _unary(self, a, "interpolate", M_F32, 0)
        _nonzero_dims(a, "interpolate", "a", 0)
        if not ((m & 0xFF) <= g.GGML_SCALE_MODE_BICUBIC and (m & ~(<uint32_t> 0x1FF)) == 0):
            _fail("interpolate", f"mode must be NEAREST, BILINEAR or BICUBIC, optionally | ALIGN_CORNERS (got {mode!r})")
        if not (ne0 > 0 and ne1 > 0 and ne2 > 0 and ne3 > 0):
            _fail("interpolate", f"target ne must be > 0 (got ({ne0}, {ne1}, {ne2}, {ne3}))")
        self._room("interpolate", _out_bytes(g.GGML_TYPE_F32, ne0, ne1, ne2, ne3), 1)
        return _res(self, g.ggml_interpolate(self.ptr, a.ptr, ne0, ne1, ne2, ne3, m), a)

    def pad(self, Tensor a, p0=0, p1=0, p2=0, p3=0):
        """Append ``p_i`` zeros at the end of dimension ``i`` (f32)."""
        p0 = _index(p0, "pad", "p0", _K_INT)
        p1 = _index(p1, "pad", "p1", _K_INT)
        p2 = _index(p2, "pad", "p2", _K_INT)
        p3 = _index(p3, "pad", "p3", _K_INT)
        return self.pad_ext(a, 0, p0, 0, p1, 0, p2, 0, p3)

    def pad_ext(self, Tensor a, lp0=0, rp0=0, lp1=0, rp1=0, lp2=0, rp2=0, lp3=0, rp3=0):
        """Zero padding before (``lp``) and after (``rp``) each dimension (f32)."""
        lp0 = _index(lp0, "pad_ext", "lp0", _K_INT)
        rp0 = _index(rp0, "pad_ext", "rp0", _K_INT)
        lp1 = _index(lp1, "pad_ext", "lp1", _K_INT)
        rp1 = _index(rp1, "pad_ext", "rp1", _K_INT)
        lp2 = _index(lp2, "pad_ext", "lp2", _K_INT)
        rp2 = _index(rp2, "pad_ext", "rp2", _K_INT)
        lp3 = _index(lp3, "pad_ext", "lp3", _K_INT)
        rp3 = _index(rp3, "pad_ext", "rp3", _K_INT)
        _unary(self, a, "pad_ext", M_F32, 0)
        pads = (lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3)
        if not (all(p >= 0 for p in pads)):
            _fail("pad_ext", f"padding must be >= 0 (got {pads})")
        self._room("pad_ext", _out_bytes(g.GGML_TYPE_F32, a.ptr.ne[0] + lp0 + rp0, a.ptr.ne[1] + lp1 + rp1,
                                         a.ptr.ne[2] + lp2 + rp2, a.ptr.ne[3] + lp3 + rp3), 1)
        return _res(self, g.ggml_pad_ext(self.ptr, a.ptr, lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3), a)

    def pad_reflect_1d(self, Tensor a, p0, p1):
        """Reflection padding of each row (f32, contiguous), ``0 <= p < ne[0]``."""
        p0 = _index(p0, "pad_reflect_1d", "p0", _K_INT)
        p1 = _index(p1, "pad_reflect_1d", "p1", _K_INT)
        _unary(self, a, "pad_reflect_1d", M_F32, 2)
        if not (0 <= p0 < a.ptr.ne[0] and 0 <= p1 < a.ptr.ne[0]):
            _fail("pad_reflect_1d", f"padding must be in [0, a.ne[0]) (got p0={p0}, p1={p1}, a: {_desc(a)})")
        self._room("pad_reflect_1d", _out_bytes(g.GGML_TYPE_F32, a.ptr.ne[0] + p0 + p1, a.ptr.ne[1], a.ptr.ne[2], a.ptr.ne[3]), 1)
        return _res(self, g.ggml_pad_reflect_1d(self.ptr, a.ptr, p0, p1), a)

    def roll(self, Tensor a, shift0=0, shift1=0, shift2=0, shift3=0):
        """Rotate elements along each dimension (like numpy.roll), ``|shift_i| < ne[i]`` (f32)."""
        shift0 = _index(shift0, "roll", "shift0", _K_INT)
        shift1 = _index(shift1, "roll", "shift1", _K_INT)
        shift2 = _index(shift2, "roll", "shift2", _K_INT)
        shift3 = _index(shift3, "roll", "shift3", _K_INT)
        _unary(self, a, "roll", M_F32, 0)
        shifts = (shift0, shift1, shift2, shift3)
        for i in range(4):
            if not (-a.ptr.ne[i] < shifts[i] < a.ptr.ne[i]):
                _fail("roll", f"|shift{i}| must be < ne[{i}] (got {shifts}, a: {_desc(a)})")
        return _res(self, g.ggml_roll(self.ptr, a.ptr, shift0, shift1, shift2, shift3), a)

    def tri(self, Tensor a, type=TriType.LOWER_DIAG):
        """Keep one triangle of a square f32 matrix, zero the rest (``TriType``)."""
        cdef int t = _index(type, "tri", "type", _K_INT)
        _unary(self, a, "tri", M_F32, 2)
        if not (0 <= t <= 3):
            _fail("tri", f"type must be a TriType (got {type!r})")
        if not (a.ptr.ne[0] == a.ptr.ne[1]):
            _fail("tri", f"a must be square (got a: {_desc(a)})")
        return _res(self, g.ggml_tri(self.ptr, a.ptr, <g.ggml_tri_type> t), a)

    def fill(self, Tensor a, float c):
        """A tensor like ``a`` filled with ``c`` (f32/f16, contiguous)."""
        _unary(self, a, "fill", M_F32_F16, 2)
        return _res(self, g.ggml_fill(self.ptr, a.ptr, c), a)

    def arange(self, float start, float stop, float step=1.0):
        """``[start, stop)`` in steps of ``step`` (f32, 1-d)."""
        cdef double n
        self._ensure_op("arange")
        _finite(start, "arange", "start"); _finite(stop, "arange", "stop"); _finite(step, "arange", "step")
        if not (stop > start and step > 0):
            _fail("arange", f"needs stop > start and step > 0 (got {start}, {stop}, {step})")
        n = (stop - start) / step
        if not (n < 2.0 ** 40):
            _fail("arange", f"too many elements ({n:.0f})")
        self._room("arange", 4 * (<int64_t> n + 1), 1)
        return _wrap(self, g.ggml_arange(self.ptr, start, stop, step))

    def timestep_embedding(self, Tensor timesteps, dim, max_period=10000):
        """Sinusoidal embeddings of 1-d f32 ``timesteps``: f32 ne ``(dim, n)``."""
        dim = _index(dim, "timestep_embedding", "dim", _K_INT)
        max_period = _index(max_period, "timestep_embedding", "max_period", _K_INT)
        _unary(self, timesteps, "timestep_embedding", M_F32, 2)
        if not (dim > 0 and max_period > 0):
            _fail("timestep_embedding", f"dim and max_period must be > 0 (got {dim}, {max_period})")
        if not (timesteps.ptr.ne[1] == 1 and timesteps.ptr.ne[2] == 1 and timesteps.ptr.ne[3] == 1):
            _fail("timestep_embedding", f"timesteps must be 1-d (got {_desc(timesteps)})")
        self._room("timestep_embedding", _out_bytes(g.GGML_TYPE_F32, dim + (dim % 2), timesteps.ptr.ne[0], 1, 1), 1)
        return _res(self, g.ggml_timestep_embedding(self.ptr, timesteps.ptr, dim, max_period), timesteps)

    # -- state-space models -------------------------------------------------------------

    def ssm_conv(self, Tensor sx, Tensor c):
        """Depthwise causal convolution of each sequence (Mamba's conv1d, LFM2's short convolution).

        ``sx`` f32 ne ``(d_conv - 1 + n_t, d_inner, n_seqs)``: per sequence and channel, the ``d_conv - 1``
        previous inputs (the conv state) followed by the ``n_t`` new ones, time along ``ne[0]`` (dims 0 and 1
        packed); ``c`` f32 contiguous ne ``(d_conv, d_inner)``, one kernel per channel. Result f32 ne
        ``(d_inner, n_t, n_seqs)``: ``out[s, t, i] = sum_k sx[s, i, t + k] * c[i, k]`` (numpy order), no bias.
        """
        cdef int64_t d_conv, n_t
        self._ensure_op("ssm_conv")
        _arg(sx, "ssm_conv", "sx"); _arg(c, "ssm_conv", "c")
        _types(sx, "ssm_conv", "sx", M_F32); _types(c, "ssm_conv", "c", M_F32)
        _nonzero_dims(sx, "ssm_conv", "sx", 0); _nonzero_dims(c, "ssm_conv", "c", 0)
        _contig(c, "ssm_conv", "c")
        if not (sx.ptr.nb[0] == 4 and sx.ptr.nb[1] == sx.ptr.ne[0] * 4):
            _fail("ssm_conv", f"sx must be packed in dims 0 and 1 (got sx: {_desc(sx)} nb={sx.nb}); "
                  f"call ctx.cont(sx) first")
        if not (sx.ptr.ne[3] == 1 and c.ptr.ne[2] == 1 and c.ptr.ne[3] == 1):
            _fail("ssm_conv", f"sx must be 3-d and c 2-d (got sx: {_desc(sx)}, c: {_desc(c)})")
        d_conv = c.ptr.ne[0]
        n_t = sx.ptr.ne[0] - d_conv + 1
        if not (sx.ptr.ne[1] == c.ptr.ne[1] and n_t >= 1):
            _fail("ssm_conv", f"shapes do not match (got sx: {_desc(sx)}, c: {_desc(c)}; expected sx.ne[1] == "
                  f"c.ne[1] channels and sx.ne[0] >= c.ne[0], the state plus at least one input)")
        self._room("ssm_conv", _out_bytes(g.GGML_TYPE_F32, c.ptr.ne[1], n_t, sx.ptr.ne[2], 1), 1)
        return _res(self, g.ggml_ssm_conv(self.ptr, sx.ptr, c.ptr), sx, c)

    def ssm_scan(self, Tensor s, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor ids, K=1):
        """The selective scan of Mamba (``A`` ne ``(d_state, n_head)``) and Mamba-2 (``A`` ne ``(1, n_head)``).

        Per sequence ``j`` and head ``h``, from the state ``s[ids[j]]`` and for each token ``t`` in order:
        ``d = softplus(dt[t, h])``, ``state = state * exp(d * A[h]) + B[t, g] * (x[t, h] * d)``,
        ``y[t, h] = state @ C[t, g]`` (``g`` the head's group: ``h // (n_head / n_group)``), no skip term.

        Parameters
        ----------
        s : Tensor
            f32 contiguous ne ``(d_state, head_dim, n_head, n_rows)``: a store of states; ``ids`` picks them.
        x : Tensor
            f32 ne ``(head_dim, n_head, n_seq_tokens, n_seqs)``, dims 0 and 1 packed.
        dt : Tensor
            f32 contiguous ne ``(n_head, n_seq_tokens, n_seqs)``, before softplus.
        A : Tensor
            f32 contiguous ne ``(1, n_head)`` or ``(d_state, n_head)`` (then ``K`` must be 1).
        B, C : Tensor
            f32 ne ``(d_state, n_group, n_seq_tokens, n_seqs)``, dims 0 and 1 packed; ``n_group`` divides ``n_head``.
        ids : Tensor
            i32 ne ``(n_seqs,)``: the row of ``s`` each sequence starts from, in ``[0, n_rows)`` (checked before
            each compute).
        K : int
            States kept per sequence: the final one, then (``K > 1``) those 1 .. ``K - 1`` tokens back.

        Returns
        -------
        Tensor
            f32, 1-d: ``y`` (``head_dim * n_head * n_seq_tokens * n_seqs`` values, laid out as ``x`` packed)
            followed by ``K`` blocks of ``n_seqs`` states (``d_state * head_dim * n_head`` values each), slot
            ``k`` holding each sequence's state ``k`` tokens before its last (unwritten where ``k >=
            n_seq_tokens``).
        """
        K = _index(K, "ssm_scan", "K", _K_INT64)
        cdef int64_t d_state, head_dim, n_head, n_tok, n_seqs, n_group
        cdef double total
        cdef Tensor t
        cdef tuple args = (("s", s), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("ids", ids))
        self._ensure_op("ssm_scan")
        for name, t in args:
            _arg(t, "ssm_scan", name)
            _types(t, "ssm_scan", name, M_I32 if name == "ids" else M_F32)
            _nonzero_dims(t, "ssm_scan", name, 0)
        for name, t in (("s", s), ("dt", dt), ("A", A), ("ids", ids)):
            _contig(t, "ssm_scan", name)
        for name, t in (("x", x), ("B", B), ("C", C)):
            if not (t.ptr.nb[0] == 4 and t.ptr.nb[1] == t.ptr.ne[0] * 4):
                _fail("ssm_scan", f"{name} must be packed in dims 0 and 1 (got {name}: {_desc(t)} nb={t.nb}); "
                      f"call ctx.cont({name}) first")
        if not (1 <= K <= 2147483647):
            _fail("ssm_scan", f"K must be in [1, 2**31) (got {K})")
        d_state, head_dim, n_head = s.ptr.ne[0], x.ptr.ne[0], x.ptr.ne[1]
        n_tok, n_seqs, n_group = x.ptr.ne[2], x.ptr.ne[3], B.ptr.ne[1]
        if not (s.ptr.ne[1] == head_dim and s.ptr.ne[2] == n_head):
            _fail("ssm_scan", f"s must be ne (d_state, head_dim, n_head, n_rows) for x's heads (got s: {_desc(s)}, "
                  f"x: {_desc(x)})")
        if not (dt.ptr.ne[0] == n_head and dt.ptr.ne[1] == n_tok and dt.ptr.ne[2] == n_seqs and dt.ptr.ne[3] == 1):
            _fail("ssm_scan", f"dt must be ne (n_head, n_seq_tokens, n_seqs) (got dt: {_desc(dt)}, x: {_desc(x)})")
        if not (A.ptr.ne[1] == n_head and A.ptr.ne[2] == 1 and A.ptr.ne[3] == 1 and A.ptr.ne[0] in (1, d_state)):
            _fail("ssm_scan", f"A must be ne (1, n_head) or (d_state, n_head) (got A: {_desc(A)}, s: {_desc(s)})")
        if not (A.ptr.ne[0] == 1 or K == 1):
            _fail("ssm_scan", f"K > 1 needs Mamba-2's A of ne (1, n_head) (got A: {_desc(A)}, K={K})")
        if not (g.ggml_are_same_shape(B.ptr, C.ptr) and B.ptr.ne[0] == d_state and B.ptr.ne[2] == n_tok
                and B.ptr.ne[3] == n_seqs and n_head % n_group == 0):
            _fail("ssm_scan", f"B and C must both be ne (d_state, n_group, n_seq_tokens, n_seqs), n_group dividing "
                  f"n_head (got B: {_desc(B)}, C: {_desc(C)}, x: {_desc(x)})")
        if not (ids.ptr.ne[0] == n_seqs and ids.ptr.ne[1] == 1 and ids.ptr.ne[2] == 1 and ids.ptr.ne[3] == 1):
            _fail("ssm_scan", f"ids must be ne (n_seqs,) (got ids: {_desc(ids)}, x: {_desc(x)})")
        total = <double> g.ggml_nelements(x.ptr) + <double> K * d_state * head_dim * n_head * n_seqs
        if not (total < 4.0e18 / 4):
            _fail("ssm_scan", f"the result would hold {total:.3g} values")
        self._room("ssm_scan", _out_bytes(g.GGML_TYPE_F32, <int64_t> total, 1, 1, 1), 1)
        cdef Tensor out = _res(self, g.ggml_ssm_scan(self.ptr, s.ptr, x.ptr, dt.ptr, A.ptr, B.ptr, C.ptr, ids.ptr, K),
                               s, x, dt, A)
        for t in (B, C, ids):
            if t.ctx is not self:
                _add_dep(self, t)
        return out

    def gated_delta_net(self, Tensor q, Tensor k, Tensor v, Tensor gate, Tensor beta, Tensor state, K=1):
        """The gated delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5; Kimi's KDA with a per-channel gate).

        Per sequence and value head ``h`` (query/key head ``h % H_k``), from the state ``S`` (``S_v x S_v``)
        and for each token in order: ``S = S * exp(gate)`` (``gate`` scalar per head, or per key channel: row ``i``
        scaled by ``exp(gate[i])``), ``d = beta * (v - S^T k)``, ``S = S + outer(k, d)``,
        ``out = S^T q / sqrt(S_v)``. ``q`` and ``k`` are used as given (the model L2-normalises them first).

        Parameters
        ----------
        q, k : Tensor
            f32 ne ``(S_v, H_k, n_tokens, n_seqs)``, rows contiguous (``nb[0] == 4``); ``H_k`` divides ``H``.
        v : Tensor
            f32 ne ``(S_v, H, n_tokens, n_seqs)``, rows contiguous.
        gate : Tensor
            ggml's ``g``: f32 contiguous ne ``(1, H, n_tokens, n_seqs)`` (the log of the decay) or
            ``(S_v, H, n_tokens, n_seqs)``.
        beta : Tensor
            f32 contiguous ne ``(1, H, n_tokens, n_seqs)``: the write strength (after the sigmoid).
        state : Tensor
            f32 contiguous ne ``(S_v, S_v, H, n_seqs)``: each sequence's initial state, stored transposed
            (``state[s, h, j, i]`` in numpy order is ``S[i][j]``).
        K : int
            States kept per sequence: the final one, then (``K > 1``) those 1 .. ``K - 1`` tokens back.

        Returns
        -------
        Tensor
            f32 ne ``(S_v * H, n_tokens * n_seqs + K * S_v * n_seqs)``: the outputs (laid out as ``v`` packed),
            then ``K`` blocks of every sequence's state (slot ``k`` holding the state ``k`` tokens before the
            last; unwritten where ``k >= n_tokens``).
        """
        K = _index(K, "gated_delta_net", "K", _K_INT64)
        cdef int64_t S_v, H, n_tok, n_seqs
        cdef double total
        cdef Tensor t
        cdef tuple args = (("q", q), ("k", k), ("v", v), ("gate", gate), ("beta", beta), ("state", state))
        self._ensure_op("gated_delta_net")
        for name, t in args:
            _arg(t, "gated_delta_net", name)
            _types(t, "gated_delta_net", name, M_F32)
            _nonzero_dims(t, "gated_delta_net", name, 0)
        for name, t in (("gate", gate), ("beta", beta), ("state", state)):
            _contig(t, "gated_delta_net", name)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.ptr.nb[0] != 4:
                _fail("gated_delta_net", f"{name} must have contiguous rows (got {name}: {_desc(t)} nb={t.nb}); "
                      f"call ctx.cont({name}) first")
        if not (1 <= K <= 2147483647):
            _fail("gated_delta_net", f"K must be in [1, 2**31) (got {K})")
        S_v, H, n_tok, n_seqs = v.ptr.ne[0], v.ptr.ne[1], v.ptr.ne[2], v.ptr.ne[3]
        # the kernel reads S_v values of q and k per head and maps value head h to key head h % H_k
        if not (g.ggml_are_same_shape(q.ptr, k.ptr) and q.ptr.ne[0] == S_v and H % q.ptr.ne[1] == 0
                and q.ptr.ne[2] == n_tok and q.ptr.ne[3] == n_seqs):
            _fail("gated_delta_net", f"q and k must both be ne (S_v, H_k, n_tokens, n_seqs) with H_k dividing v's "
                  f"heads (got q: {_desc(q)}, k: {_desc(k)}, v: {_desc(v)})")
        if not (gate.ptr.ne[0] in (1, S_v) and gate.ptr.ne[1] == H and gate.ptr.ne[2] == n_tok
                and gate.ptr.ne[3] == n_seqs):
            _fail("gated_delta_net", f"gate must be ne (1, H, n_tokens, n_seqs) or (S_v, H, n_tokens, n_seqs) "
                  f"(got gate: {_desc(gate)}, v: {_desc(v)})")
        if not (beta.ptr.ne[0] == 1 and beta.ptr.ne[1] == H and beta.ptr.ne[2] == n_tok and beta.ptr.ne[3] == n_seqs):
            _fail("gated_delta_net", f"beta must be ne (1, H, n_tokens, n_seqs) (got beta: {_desc(beta)}, "
                  f"v: {_desc(v)})")
        if not (state.ptr.ne[0] == S_v and state.ptr.ne[1] == S_v and state.ptr.ne[2] == H
                and state.ptr.ne[3] == n_seqs):
            _fail("gated_delta_net", f"state must be ne (S_v, S_v, H, n_seqs) (got state: {_desc(state)}, "
                  f"v: {_desc(v)})")
        total = <double> g.ggml_nelements(v.ptr) + <double> K * S_v * S_v * H * n_seqs
        if not (total < 4.0e18 / 4):
            _fail("gated_delta_net", f"the result would hold {total:.3g} values")
        self._room("gated_delta_net", _out_bytes(g.GGML_TYPE_F32, S_v * H, n_tok * n_seqs + K * S_v * n_seqs, 1, 1), 1)
        cdef Tensor out = _res(self, g.ggml_gated_delta_net(self.ptr, q.ptr, k.ptr, v.ptr, gate.ptr, beta.ptr,
                                                             state.ptr, K), q, k, v, gate)
        for t in (beta, state):
            if t.ctx is not self:
                _add_dep(self, t)
        return out

    # -- graphs ---------------------------------------------------------------------------

    def new_graph(self, size=g.GGML_DEFAULT_GRAPH_SIZE, bint grads=False):
        """A new empty graph of at most ``size`` nodes (and ``size`` leafs), allocated in this context.

        Raises
        ------
        GGMLMemoryError
            The context has no room for the graph (it needs ``graph_overhead(size, grads)`` bytes).
        """
        size = _index(size, "new_graph", "size", _K_SIZE)
        cdef size_t need
        self._ensure_op("new_graph")
        if not (0 < size <= 1 << 30):
            _fail("new_graph", f"size must be in [1, 2**30] (got {size})")
        need = g.ggml_graph_overhead_custom(size, grads) + g.GGML_MEM_ALIGN
        if g.ggml_used_mem(self.ptr) + need > self.mem_size:
            raise GGMLMemoryError(f"new_graph: context out of memory (a graph of size {size} needs {_fmt_bytes(need)}, "
                                  f"{_fmt_bytes(self.mem_size - g.ggml_used_mem(self.ptr))} free); "
                                  f"add graph_overhead(size) to the Context's mem_size")
        cdef Graph gr = Graph.__new__(Graph)
        gr.ptr = g.ggml_new_graph_custom(self.ptr, size, grads)
        gr.ctx = self
        gr.gen = self.gen
        gr.serial = _next_graph_serial()
        gr.ctxs = []
        gr.index_checks = []
        gr._note_ctx(self)
        gr.own_ndeps = len(self.deps)
        _debug_count("Graph", 1)
        return gr
