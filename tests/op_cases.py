"""The table of op cases checked against numpy by test_core_ops.py.

Each ``OpCase`` names an op and a variant (shape, broadcasting, layout of the
inputs, parameters), the test dtypes it runs in, and a tolerance per dtype.
Its ``build(ctx, rng, dtype)`` creates the inputs in ``ctx``, applies the op
and returns ``(out, expected)``:

* ``out`` is the ggml tensor to compute;
* ``expected`` is either a numpy array (the reference, in numpy order; it is
  compared with ``out`` read as a 4-d array, so ``out.ne`` is checked too) or
  a callable ``check(actual4)`` that makes its own assertions (top_k compares
  index sets, the q8_0 round trip checks a per-block error bound, views also
  read the view itself).

Input layouts (``make_input``): every op is run on contiguous inputs and,
where the binding accepts it, on non-contiguous views made with
``ctx.permute`` (rows contiguous, dims 1 and 2 swapped in memory) and
``ctx.view`` (rows of a wider tensor, at a column offset); ops that need fully
contiguous input run on a contiguous view at a byte offset and on
``cont(transpose(...))``.

Tolerances are ``|actual - expected| <= atol + rtol * |expected|`` against a
float64 numpy reference computed from the exact values the inputs hold (after
rounding to f16 where the inputs are f16):

* F32 arithmetic (add, mul, sqr, ...): one f32 rounding, rtol 1e-6.
* F32 transcendental (exp, log, tanh, sigmoid, silu, softmax ...): rtol 1e-5.
* F16 results: one f16 rounding of the result is 2**-11 relative, rtol 1e-3.
* gelu / gelu_quick / geglu: ggml looks the value up in a table indexed by the
  input rounded to f16 and stores the f16 result, so ~1e-3 relative, 1e-3 abs.
* Reductions and matrix products: accumulated rounding, tolerances stated per case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from helpers import assert_close, ggml_axis, ne_of, np_permute, np_view, result4, store, to4

from ggmlpy import GluOp, PoolOp, Prec, RopeType, ScaleMode, SortOrder, Type


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


EXACT = Tol(0.0, 0.0)
F32_ARITH = Tol(1e-7, 1e-6)
F32_TRANS = Tol(1e-6, 1e-5)
F16_ELT = Tol(1e-5, 1e-3)
GELU_TABLE = Tol(1e-3, 2e-3)


def tols(f32: Tol = EXACT, f16: Optional[Tol] = None) -> dict:
    return {"f32": f32, "f16": f16 if f16 is not None else f32, None: f32}


@dataclass(frozen=True)
class OpCase:
    op: str
    variant: str
    build: Callable
    dtypes: tuple = ("f32",)
    tol: dict = field(default_factory=lambda: tols())
    #: expected ggml type of ``out``: "same" (the case dtype), a Type, or None (not checked)
    out_type: object = "same"
    #: set to a reason to mark the case xfail(strict=True)
    xfail: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.op}-{self.variant}"


CASES: list = []


def case(op, variant, build, dtypes=("f32",), tol=None, out_type="same", xfail=None):
    # shapes in variant names read "2x3x16" (no spaces or parentheses in test ids)
    variant = variant.replace(", ", "x").replace(",", "").replace("(", "").replace(")", "")
    CASES.append(OpCase(op, variant, build, tuple(dtypes), tol if tol is not None else tols(),
                        out_type, xfail))


F32_F16 = ("f32", "f16")
FIXED = (None,)


# -- random inputs -----------------------------------------------------------------------


def randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def uniform(rng, lo, hi, shape):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def nonzero(rng, shape):
    """Values with |x| in [0.5, 2] and random sign (safe divisors)."""
    return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape)).astype(np.float32)


def make_input(ctx, x, dtype, layout="contig"):
    """A tensor holding ``x`` (numpy order) stored as ``dtype``, laid out as ``layout``.

    Returns ``(tensor, 4-d float64 values)``. Layouts:

    * ``contig``: a plain contiguous tensor.
    * ``permuted``: ``ctx.permute(base, 0, 2, 1, 3)`` of a tensor holding ``x`` with
      dims 1 and 2 swapped: rows contiguous, dims 1/2 not.
    * ``strided``: ``ctx.view`` of the rows of ``x`` placed at a column offset inside
      wider rows (nb[1] > row size); rows contiguous, contiguous in dims >= 1 w.r.t. nb[1].
    * ``offset``: a contiguous ``ctx.view`` into a larger 1-d tensor at a byte offset.
    * ``transposed``: ``ctx.cont(ctx.transpose(base))`` (contiguous, made by ops).
    """
    xs = to4(store(x, dtype))
    vals = xs.astype(np.float64)
    if layout == "contig":
        return ctx.from_numpy(store(x, dtype)), vals
    if layout == "permuted":
        base = ctx.from_numpy(np.ascontiguousarray(xs.transpose(0, 2, 1, 3)))
        return ctx.permute(base, 0, 2, 1, 3), vals
    if layout == "strided":
        d0, off, extra = xs.shape[3], 2, 3
        wide = np.zeros(xs.shape[:3] + (d0 + off + extra,), dtype=xs.dtype)
        wide[..., off:off + d0] = xs
        base = ctx.from_numpy(wide)
        return ctx.view(base, ne_of(xs), base.nb[1:], off * xs.itemsize), vals
    if layout == "offset":
        off = 5
        flat = np.zeros(xs.size + off + 3, dtype=xs.dtype)
        flat[off:off + xs.size] = xs.reshape(-1)
        base = ctx.from_numpy(flat)
        return ctx.view(base, ne_of(xs), None, off * xs.itemsize), vals
    if layout == "transposed":
        base = ctx.from_numpy(np.ascontiguousarray(np.swapaxes(xs, 2, 3)))
        return ctx.cont(ctx.transpose(base)), vals
    raise ValueError(layout)


ROWS = ("permuted", "strided")        # extra layouts for ops that need contiguous rows only
CONTIG1 = ("strided",)                # ... contiguous in dims >= 1 (leaky_relu, glu)
CONTIG = ("offset", "transposed")     # ... fully contiguous input

SHAPES = [(33,), (4, 17), (2, 3, 16)]
VIEW_SHAPE = (2, 3, 5, 16)            # numpy shape used for the non-contiguous layouts


# -- element-wise binary ops ---------------------------------------------------------------

BINARY = {
    "add": (np.add, "randn"),
    "sub": (np.subtract, "randn"),
    "mul": (np.multiply, "randn"),
    "div": (np.divide, "nonzero"),
}


def _binary_build(op, a_shape, b_shape, a_layout="contig", b_layout="contig", b_f32=False):
    ref, kind = BINARY[op]

    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, a_shape), dtype, a_layout)
        bx = nonzero(rng, b_shape) if kind == "nonzero" else randn(rng, b_shape)
        b, bv = make_input(ctx, bx, "f32" if b_f32 else dtype, b_layout)
        reps = tuple(n // m for n, m in zip(av.shape, bv.shape))
        return getattr(ctx, op)(a, b), ref(av, np.tile(bv, reps))
    return build


for _op in BINARY:
    _tol = tols(F32_ARITH, F16_ELT)
    for _shape in SHAPES + [(2, 3, 4, 8)]:
        case(_op, f"same{_shape}", _binary_build(_op, _shape, _shape), F32_F16, _tol)
    # numpy-style broadcasting (size-1 dims of b, incl. b.ne[0] == 1) ...
    case(_op, "bcast_rows", _binary_build(_op, (3, 5, 16), (16,)), F32_F16, _tol)
    case(_op, "bcast_dims13", _binary_build(_op, (2, 3, 4, 8), (1, 3, 1, 8)), F32_F16, _tol)
    case(_op, "bcast_ne0", _binary_build(_op, (2, 3, 4, 8), (2, 1, 4, 1)), F32_F16, _tol)
    # ... and ggml's tiling rule (a.ne[i] % b.ne[i] == 0)
    case(_op, "tile", _binary_build(_op, (4, 6), (2, 3)), F32_F16, _tol)
    # non-contiguous views
    case(_op, "permuted_a_strided_b",
         _binary_build(_op, VIEW_SHAPE, VIEW_SHAPE, "permuted", "strided"), F32_F16, _tol)
    case(_op, "strided_a_bcast_permuted_b",
         _binary_build(_op, VIEW_SHAPE, (1, 3, 5, 16), "strided", "permuted"), F32_F16, _tol)
    # f16 a with f32 b (result f16)
    case(_op, "f32_b", _binary_build(_op, (3, 4, 16), (4, 16), b_f32=True), ("f16",), _tol)


# -- scale -------------------------------------------------------------------------------------

def _scale_build(shape, layout, s=0.37, bias=None):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        sf = float(np.float32(s))
        if bias is None:
            return ctx.scale(a, s), av * sf
        return ctx.scale_bias(a, s, bias), av * sf + float(np.float32(bias))
    return build


for _shape in SHAPES:
    case("scale", f"{_shape}", _scale_build(_shape, "contig"), tol=tols(F32_ARITH))
for _layout in CONTIG:
    case("scale", _layout, _scale_build(VIEW_SHAPE, _layout, -2.5), tol=tols(F32_ARITH))
case("scale", "bias", _scale_build((4, 17), "contig", 0.37, 1.25), tol=tols(F32_ARITH))


# -- element-wise unary ops ------------------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_quick(x):
    return x * _sigmoid(1.702 * x)


def _silu(x):
    return x * _sigmoid(x)


def _relu(x):
    return np.maximum(x, 0.0)


# name -> (method call, reference, input domain (lo, hi) or "randn", f32 tol, f16 tol (None: f32 only), layouts)
UNARY = {
    "sqr": (lambda c, a: c.sqr(a), np.square, "randn", F32_ARITH, F16_ELT, ROWS),
    "sqrt": (lambda c, a: c.sqrt(a), np.sqrt, (0.0, 10.0), F32_ARITH, F16_ELT, ROWS),
    "exp": (lambda c, a: c.exp(a), np.exp, (-4.0, 4.0), F32_TRANS, F16_ELT, ROWS),
    "log": (lambda c, a: c.log(a), np.log, (0.05, 20.0), F32_TRANS, F16_ELT, ROWS),
    "abs": (lambda c, a: c.abs(a), np.abs, "randn", EXACT, EXACT, ROWS),
    "neg": (lambda c, a: c.neg(a), np.negative, "randn", EXACT, EXACT, ROWS),
    "step": (lambda c, a: c.step(a), lambda x: (x > 0).astype(np.float64), "randn", EXACT, EXACT, ROWS),
    "relu": (lambda c, a: c.relu(a), _relu, "randn", EXACT, EXACT, ROWS),
    "leaky_relu": (lambda c, a: c.leaky_relu(a, 0.1), lambda x: np.where(x > 0, x, x * float(np.float32(0.1))),
                   "randn", F32_ARITH, F16_ELT, CONTIG1),
    "gelu": (lambda c, a: c.gelu(a), _gelu_tanh, (-6.0, 6.0), GELU_TABLE, GELU_TABLE, ROWS),
    "gelu_quick": (lambda c, a: c.gelu_quick(a), _gelu_quick, (-6.0, 6.0), GELU_TABLE, GELU_TABLE, ROWS),
    "silu": (lambda c, a: c.silu(a), _silu, (-6.0, 6.0), F32_TRANS, F16_ELT, ROWS),
    "tanh": (lambda c, a: c.tanh(a), np.tanh, (-4.0, 4.0), F32_TRANS, F16_ELT, ROWS),
    "sigmoid": (lambda c, a: c.sigmoid(a), _sigmoid, (-8.0, 8.0), F32_TRANS, F16_ELT, ROWS),
}


def _unary_build(name, shape, layout):
    call, ref, dom, _, _, _ = UNARY[name]

    def build(ctx, rng, dtype):
        x = randn(rng, shape) if dom == "randn" else uniform(rng, dom[0], dom[1], shape)
        if dom == "randn":
            x.reshape(-1)[::7] = 0.0          # exact zeros: step(0) = 0, relu(0) = 0, ...
        a, av = make_input(ctx, x, dtype, layout)
        return call(ctx, a), ref(av)
    return build


for _name, (_, _, _, _t32, _t16, _layouts) in UNARY.items():
    for _shape in SHAPES:
        case(_name, f"{_shape}", _unary_build(_name, _shape, "contig"), F32_F16, tols(_t32, _t16))
    for _layout in _layouts:
        case(_name, _layout, _unary_build(_name, VIEW_SHAPE, _layout), F32_F16, tols(_t32, _t16))


def _clamp_build(shape, layout):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        lo, hi = -0.5, 0.75
        return ctx.clamp(a, lo, hi), np.clip(av, lo, hi)
    return build


for _shape in SHAPES:
    case("clamp", f"{_shape}", _clamp_build(_shape, "contig"), F32_F16)
case("clamp", "offset", _clamp_build(VIEW_SHAPE, "offset"), F32_F16)


# -- reductions ------------------------------------------------------------------------------

def _sum_build(shape, layout):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, uniform(rng, 0.0, 1.0, shape), dtype, layout)
        return ctx.sum(a), np.array(av.sum())
    return build


for _shape in [(100,), (7, 33), (2, 3, 4, 5)]:
    case("sum", f"{_shape}", _sum_build(_shape, "contig"), F32_F16, tols(Tol(1e-5, 1e-6), F16_ELT))
for _layout in CONTIG:
    case("sum", _layout, _sum_build(VIEW_SHAPE, _layout), F32_F16, tols(Tol(1e-5, 1e-6), F16_ELT))


def _rowred_build(op, shape, layout):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        if op == "sum_rows":
            return ctx.sum_rows(a), av.sum(axis=-1, keepdims=True)
        if op == "mean":
            return ctx.mean(a), av.mean(axis=-1, keepdims=True)
        return ctx.cumsum(a), np.cumsum(av, axis=-1)
    return build


for _op, _layouts in (("sum_rows", ROWS), ("mean", CONTIG), ("cumsum", ROWS)):
    for _shape in [(5,), (3, 17), (2, 3, 40)]:
        case(_op, f"{_shape}", _rowred_build(_op, _shape, "contig"), tol=tols(Tol(1e-5, 1e-5)))
    for _layout in _layouts:
        case(_op, _layout, _rowred_build(_op, VIEW_SHAPE, _layout), tol=tols(Tol(1e-5, 1e-5)))


def _argmax_build(shape, layout):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        return ctx.argmax(a), np.argmax(av.reshape(-1, av.shape[-1]), axis=-1).astype(np.int32)
    return build


for _shape in [(5, 17), (1, 64), (9, 3)]:
    case("argmax", f"{_shape}", _argmax_build(_shape, "contig"), out_type=Type.I32)
case("argmax", "transposed", _argmax_build((6, 11), "transposed"), out_type=Type.I32)


def _argsort_build(shape, order, layout="contig"):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        key = av if order == SortOrder.ASC else -av
        return ctx.argsort(a, order), np.argsort(key, axis=-1, kind="stable").astype(np.int32)
    return build


for _order in (SortOrder.ASC, SortOrder.DESC):
    for _shape in [(16,), (5, 33), (2, 3, 10)]:
        case("argsort", f"{_order.name}{_shape}", _argsort_build(_shape, _order), out_type=Type.I32)
    case("argsort", f"{_order.name}-offset", _argsort_build((3, 4, 9), _order, "offset"), out_type=Type.I32)


def _top_k_build(shape, k, layout="contig"):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        rows = av.reshape(-1, av.shape[-1])
        want = np.argsort(-rows, axis=-1, kind="stable")[:, :k]

        def check(actual):
            assert actual.shape == av.shape[:3] + (k,), f"top_k: shape {actual.shape}"
            got = actual.reshape(-1, k)
            for r in range(rows.shape[0]):
                assert sorted(got[r].tolist()) == sorted(want[r].tolist()), \
                    f"top_k row {r}: got {sorted(got[r].tolist())}, expected {sorted(want[r].tolist())}"
        return ctx.top_k(a, k), check
    return build


for _shape, _k in [((4, 20), 5), ((3, 2, 64), 1), ((2, 37), 37), ((3, 100), 10)]:
    case("top_k", f"{_shape}k{_k}", _top_k_build(_shape, _k), out_type=Type.I32)
case("top_k", "offset", _top_k_build((3, 4, 9), 4, "offset"), out_type=Type.I32)


def _count_equal_build(shape):
    def build(ctx, rng, dtype):
        x = rng.integers(0, 3, shape).astype(np.int32)
        y = rng.integers(0, 3, shape).astype(np.int32)
        return (ctx.count_equal(ctx.from_numpy(x), ctx.from_numpy(y)),
                np.array([np.count_nonzero(x == y)], dtype=np.int64))
    return build


for _shape in [(50,), (7, 13)]:
    case("count_equal", f"{_shape}", _count_equal_build(_shape), FIXED, out_type=Type.I64)


# -- gated linear units --------------------------------------------------------------------

GLU_REF = {
    GluOp.REGLU: (_relu, tols(F32_ARITH, F16_ELT)),
    GluOp.GEGLU: (_gelu_tanh, tols(GELU_TABLE, GELU_TABLE)),
    GluOp.SWIGLU: (_silu, tols(F32_TRANS, F16_ELT)),
}


def _glu_build(op, swapped, shape, layout, method=None):
    f = GLU_REF[op][0]

    def build(ctx, rng, dtype):
        a, av = make_input(ctx, uniform(rng, -5, 5, shape), dtype, layout)
        h = av.shape[-1] // 2
        x1, x2 = av[..., :h], av[..., h:]
        exp = f(x2) * x1 if swapped else f(x1) * x2
        if method is not None:
            return getattr(ctx, method)(a), exp
        return ctx.glu(a, op, swapped=swapped), exp
    return build


def _glu_split_build(op, shape, layout, method=None):
    f = GLU_REF[op][0]

    def build(ctx, rng, dtype):
        a, av = make_input(ctx, uniform(rng, -5, 5, shape), dtype, layout)
        b, bv = make_input(ctx, uniform(rng, -5, 5, shape), dtype, "contig")
        out = getattr(ctx, method)(a, b) if method is not None else ctx.glu_split(a, b, op)
        return out, f(av) * bv
    return build


for _op, (_f, _tol) in GLU_REF.items():
    _n = _op.name.lower()
    for _swapped in (False, True):
        _sw = "swapped" if _swapped else "plain"
        case(_n, f"{_sw}(4, 32)", _glu_build(_op, _swapped, (4, 32), "contig"), F32_F16, _tol)
        case(_n, f"{_sw}(2, 3, 16)", _glu_build(_op, _swapped, (2, 3, 16), "contig"), F32_F16, _tol)
        case(_n, f"{_sw}-strided", _glu_build(_op, _swapped, VIEW_SHAPE, "strided"), F32_F16, _tol)
    case(_n, "method", _glu_build(_op, False, (3, 24), "contig", method=_n), F32_F16, _tol)
    case(_n, "split(4, 16)", _glu_split_build(_op, (4, 16), "contig"), F32_F16, _tol)
    case(_n, "split-strided", _glu_split_build(_op, VIEW_SHAPE, "strided"), F32_F16, _tol)
    case(_n, "split-method", _glu_split_build(_op, (2, 3, 8), "contig", method=f"{_n}_split"), F32_F16, _tol)


# -- normalization -----------------------------------------------------------------------------

def _norm_ref(op, x, eps):
    if op == "norm":
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps)
    if op == "rms_norm":
        return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps)
    return x / np.maximum(np.sqrt((x ** 2).sum(axis=-1, keepdims=True)), eps)


def _norm_build(op, shape, layout, eps):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape, 2.0) + 0.5, dtype, layout)
        return getattr(ctx, op)(a, eps), _norm_ref(op, av, float(np.float32(eps)))
    return build


for _op, _eps in (("norm", 1e-5), ("rms_norm", 1e-6), ("l2_norm", 1e-12)):
    for _shape in [(64,), (5, 33), (2, 3, 16)]:
        case(_op, f"{_shape}", _norm_build(_op, _shape, "contig", _eps), tol=tols(Tol(1e-5, 1e-5)))
    for _layout in ROWS:
        case(_op, _layout, _norm_build(_op, VIEW_SHAPE, _layout, _eps), tol=tols(Tol(1e-5, 1e-5)))
case("rms_norm", "large_eps", _norm_build("rms_norm", (3, 8), "contig", 0.5), tol=tols(Tol(1e-5, 1e-5)))


def _group_norm_ref(x4, n_groups, eps):
    # ggml: channels (numpy axis 1) in groups of ceil(C / n_groups); the last may be shorter or empty
    out = np.empty_like(x4)
    c = x4.shape[1]
    per = -(-c // n_groups)
    for g0 in range(0, c, per):
        blk = x4[:, g0:g0 + per]
        mu = blk.mean(axis=(1, 2, 3), keepdims=True)
        var = ((blk - mu) ** 2).mean(axis=(1, 2, 3), keepdims=True)
        out[:, g0:g0 + per] = (blk - mu) / np.sqrt(var + eps)
    return out


def _group_norm_build(shape, n_groups, layout, eps=1e-6):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape, 1.5) + 0.3, dtype, layout)
        return ctx.group_norm(a, n_groups, eps), _group_norm_ref(av, n_groups, float(np.float32(eps)))
    return build


case("group_norm", "C6g3", _group_norm_build((2, 6, 5, 4), 3, "contig"), tol=tols(Tol(1e-5, 1e-5)))
case("group_norm", "C6g4_uneven", _group_norm_build((2, 6, 5, 4), 4, "contig"), tol=tols(Tol(1e-5, 1e-5)))
case("group_norm", "C8g1", _group_norm_build((1, 8, 3, 7), 1, "contig"), tol=tols(Tol(1e-5, 1e-5)))
case("group_norm", "permuted", _group_norm_build(VIEW_SHAPE, 2, "permuted"), tol=tols(Tol(1e-5, 1e-5)))


# -- matrix products -----------------------------------------------------------------------------

def _mm_ref(a4, b4):
    """ggml mul_mat: out[i3, i2] = b[i3, i2] @ a[i3 // r3, i2 // r2].T (a broadcast by division)."""
    r3, r2 = b4.shape[0] // a4.shape[0], b4.shape[1] // a4.shape[1]
    ar = np.repeat(np.repeat(a4, r3, axis=0), r2, axis=1)
    return b4 @ np.swapaxes(ar, -1, -2)


def _mul_mat_build(a_shape, b_shape, a_layout="contig", b_layout="contig", prec=None, b_same=False):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, a_shape), dtype, a_layout)
        b, bv = make_input(ctx, randn(rng, b_shape), dtype if b_same else "f32", b_layout)
        out = ctx.mul_mat(a, b) if prec is None else ctx.mul_mat(a, b, prec=prec)
        return out, _mm_ref(av, bv)
    return build


# f32: K <= 64 terms of N(0,1) products, accumulated in f32. f16 weights: ggml converts b to
# f16 for the dot product, an error of ~2**-11 |a_k b_k| per term.
MM_TOL = tols(Tol(2e-5, 1e-5), Tol(2e-2, 2e-3))
for _name, _a, _b in [("basic", (16, 64), (5, 64)), ("vec", (16, 64), (1, 64)), ("odd_k", (7, 37), (3, 37)),
                      ("wide_n", (24, 64), (33, 64)), ("bcast_dims23", (1, 2, 16, 64), (2, 6, 5, 64)),
                      ("batched", (2, 3, 8, 32), (2, 3, 4, 32))]:
    case("mul_mat", _name, _mul_mat_build(_a, _b), F32_F16, MM_TOL, out_type=Type.F32)
case("mul_mat", "prec_f32", _mul_mat_build((16, 64), (5, 64), prec=Prec.F32), F32_F16, MM_TOL,
     out_type=Type.F32)
case("mul_mat", "prec_f32_bcast", _mul_mat_build((1, 2, 16, 32), (1, 4, 3, 32), prec=Prec.F32), F32_F16,
     MM_TOL, out_type=Type.F32)
case("mul_mat", "permuted_a_b", _mul_mat_build((1, 3, 6, 32), (1, 3, 4, 32), "permuted", "permuted"),
     F32_F16, MM_TOL, out_type=Type.F32)
case("mul_mat", "strided_b_bcast", _mul_mat_build((1, 1, 6, 32), (2, 3, 4, 32), "contig", "strided"),
     F32_F16, MM_TOL, out_type=Type.F32)
case("mul_mat", "transposed_a", _mul_mat_build((12, 32), (5, 32), "transposed"), F32_F16, MM_TOL,
     out_type=Type.F32)
case("mul_mat", "f16xf16", _mul_mat_build((16, 64), (5, 64), b_same=True), ("f16",), MM_TOL,
     out_type=Type.F32)


def _mul_mat_id_build(n_expert, n_ff, k, n_used, n_tokens, b_used):
    def build(ctx, rng, dtype):
        w, wv = make_input(ctx, randn(rng, (n_expert, n_ff, k)), dtype)
        b, bv = make_input(ctx, randn(rng, (n_tokens, b_used, k)), "f32")
        ids = rng.integers(0, n_expert, (n_tokens, n_used)).astype(np.int32)
        wv, bv = wv[0], bv[0]
        exp = np.empty((n_tokens, n_used, n_ff))
        for t in range(n_tokens):
            for u in range(n_used):
                exp[t, u] = wv[ids[t, u]] @ bv[t, u % b_used]
        return ctx.mul_mat_id(w, b, ctx.from_numpy(ids)), exp
    return build


case("mul_mat_id", "used2", _mul_mat_id_build(4, 8, 32, 2, 3, 2), F32_F16, MM_TOL, out_type=Type.F32)
case("mul_mat_id", "bcast_b", _mul_mat_id_build(4, 8, 32, 2, 3, 1), F32_F16, MM_TOL, out_type=Type.F32)
case("mul_mat_id", "used3_t5", _mul_mat_id_build(6, 5, 16, 3, 5, 3), F32_F16, MM_TOL, out_type=Type.F32)


def _out_prod_build(a_shape, b_shape, b_layout="contig"):
    # a ne (n, k, ...), b ne (m, k, ...) -> ne (n, m, ...): out = B^T A summed over k (numpy order)
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, a_shape), dtype)
        b, bv = make_input(ctx, randn(rng, b_shape), "f32", b_layout)
        r3, r2 = bv.shape[0] // av.shape[0], bv.shape[1] // av.shape[1]
        ar = np.repeat(np.repeat(av, r3, axis=0), r2, axis=1)
        return ctx.out_prod(a, b), np.swapaxes(bv, -1, -2) @ ar
    return build


case("out_prod", "2d", _out_prod_build((7, 5), (7, 6)), F32_F16, tols(Tol(1e-5, 1e-5), Tol(1e-5, 1e-5)),
     out_type=Type.F32)
case("out_prod", "batched", _out_prod_build((2, 3, 7, 5), (2, 3, 7, 6)), F32_F16,
     tols(Tol(1e-5, 1e-5), Tol(1e-5, 1e-5)), out_type=Type.F32)
case("out_prod", "bcast", _out_prod_build((1, 3, 7, 5), (2, 3, 7, 6)), tol=tols(Tol(1e-5, 1e-5)),
     out_type=Type.F32)
case("out_prod", "bcast_dim2", _out_prod_build((1, 1, 9, 4), (2, 3, 9, 6)), tol=tols(Tol(1e-5, 1e-5)),
     out_type=Type.F32)
case("out_prod", "permuted_b", _out_prod_build((1, 3, 7, 5), (1, 3, 7, 6), "permuted"),
     tol=tols(Tol(1e-5, 1e-5)), out_type=Type.F32)


# -- softmax and masks -----------------------------------------------------------------------------

def _alibi_slopes(n_head, max_bias):
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


def _softmax_ref(z, sinks=None):
    """softmax over the last axis; ``sinks`` (per head, numpy axis 1) join each row's denominator."""
    m = z.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.reshape(1, -1, 1, 1))
    e = np.exp(z - m)
    den = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks.reshape(1, -1, 1, 1) - m)
    return e / den


def _soft_max_build(shape, layout):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape, 3.0), dtype, layout)
        return ctx.soft_max(a), _softmax_ref(av)
    return build


for _shape in [(10,), (4, 33), (2, 3, 17)]:
    case("soft_max", f"{_shape}", _soft_max_build(_shape, "contig"), tol=tols(F32_TRANS))
for _layout in CONTIG:
    case("soft_max", _layout, _soft_max_build(VIEW_SHAPE, _layout), tol=tols(F32_TRANS))


def _soft_max_ext_build(a_shape, mask_shape=None, mask_type="f32", scale=1.0, max_bias=0.0, sinks=False):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, a_shape, 2.0), dtype)
        z = av * float(np.float32(scale))
        mask = None
        if mask_shape is not None:
            m = randn(rng, mask_shape)
            m[rng.random(mask_shape) < 0.3] = -np.inf
            m[..., 0] = 0.0                        # no row is all -inf
            mask, mv = make_input(ctx, m, mask_type)
            rows = av.shape[2]
            mv = mv[:, :, :rows, :]                # mask rows beyond a's rows are unused
            reps = (av.shape[0] // mv.shape[0], av.shape[1] // mv.shape[1], 1, 1)
            slopes = _alibi_slopes(av.shape[1], max_bias).reshape(1, -1, 1, 1)
            with np.errstate(invalid="ignore"):
                z = z + slopes * np.tile(mv, reps)
        sk = None
        sk_v = None
        if sinks:
            sk_v = randn(rng, (av.shape[1],))
            sk = ctx.from_numpy(sk_v)
            sk_v = sk_v.astype(np.float64)
        out = ctx.soft_max_ext(a, mask, scale, max_bias, sinks=sk)
        return out, _softmax_ref(z, sk_v)
    return build


_SMX = tols(F32_TRANS)
case("soft_max_ext", "scale", _soft_max_ext_build((2, 3, 5, 12), None, scale=0.3), tol=_SMX)
case("soft_max_ext", "mask_f32", _soft_max_ext_build((1, 4, 5, 12), (8, 12), "f32", 0.5), tol=_SMX)
case("soft_max_ext", "mask_f16", _soft_max_ext_build((1, 4, 5, 12), (5, 12), "f16", 0.5), tol=_SMX)
case("soft_max_ext", "mask_bcast", _soft_max_ext_build((2, 4, 5, 12), (1, 2, 5, 12), "f16", 0.7), tol=_SMX)
case("soft_max_ext", "alibi", _soft_max_ext_build((1, 6, 5, 12), (5, 12), "f16", 0.5, max_bias=8.0), tol=_SMX)
case("soft_max_ext", "alibi_pow2", _soft_max_ext_build((2, 4, 3, 9), (3, 9), "f32", 1.0, max_bias=4.0),
     tol=_SMX)
case("soft_max_ext", "sinks", _soft_max_ext_build((1, 4, 5, 12), None, scale=0.8, sinks=True), tol=_SMX)
case("soft_max_ext", "sinks_mask", _soft_max_ext_build((2, 3, 4, 10), (4, 10), "f16", 0.5, sinks=True),
     tol=_SMX)


def _diag_mask_build(op, shape, n_past):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        rows, cols = av.shape[2], av.shape[3]
        masked = np.arange(cols)[None, :] > n_past + np.arange(rows)[:, None]
        fill = -np.inf if op == "diag_mask_inf" else 0.0
        return getattr(ctx, op)(a, n_past), np.where(masked, fill, av)
    return build


for _op in ("diag_mask_inf", "diag_mask_zero"):
    for _shape, _np in [((5, 5), 0), ((5, 5), 2), ((2, 4, 6), 1), ((3, 7), 0)]:
        case(_op, f"{_shape}past{_np}", _diag_mask_build(_op, _shape, _np))


# -- rope --------------------------------------------------------------------------------------

def _rope_ref(x4, pos, n_dims, mode, freq_base=10000.0, freq_scale=1.0, attn_factor=1.0, ff=None):
    """RoPE from the math: theta_i = freq_scale * pos * freq_base**(-2i/n_dims) (/ ff[i]) for
    i < n_dims/2. NORMAL rotates (x[2i], x[2i+1]), NEOX (x[i], x[i + n_dims/2]); dims beyond
    n_dims pass through; with ext_factor = 0, YaRN only scales cos/sin by attn_factor."""
    half = n_dims // 2
    i = np.arange(half)
    inv = freq_base ** (-2.0 * i / n_dims)
    if ff is not None:
        inv = inv / ff
    theta = freq_scale * pos.astype(np.float64)[:, None] * inv[None, :]     # (T, half)
    cos = (np.cos(theta) * attn_factor)[None, :, None, :]                   # (1, T, 1, half)
    sin = (np.sin(theta) * attn_factor)[None, :, None, :]
    out = x4.copy()
    if mode == RopeType.NORMAL:
        i0, i1 = 2 * i, 2 * i + 1
    else:
        i0, i1 = i, i + half
    x0, x1 = x4[..., i0], x4[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def _rope_build(mode, n_dims, shape=(1, 5, 3, 16), layout="contig", freq_base=10000.0, freq_scale=1.0,
                attn_factor=1.0, with_ff=False):
    # shape numpy (ne3, n_tokens, n_head, head_dim)
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        pos = rng.integers(0, 64, shape[1]).astype(np.int32)
        ff = ffv = None
        if with_ff:
            ffv = uniform(rng, 0.5, 4.0, (n_dims // 2,))
            ff = ctx.from_numpy(ffv)
            ffv = ffv.astype(np.float64)
        out = ctx.rope_ext(a, ctx.from_numpy(pos), ff, n_dims=n_dims, mode=mode, freq_base=freq_base,
                           freq_scale=freq_scale, ext_factor=0.0, attn_factor=attn_factor)
        return out, _rope_ref(av, pos, n_dims, mode, freq_base, freq_scale, attn_factor, ffv)
    return build


# theta is built in f32 by repeated multiplication (pos < 64): ~3e-5 rad of error
ROPE_TOL = tols(Tol(2e-4, 1e-4), Tol(2e-3, 2e-3))
for _mode in (RopeType.NORMAL, RopeType.NEOX):
    _m = _mode.name.lower()
    case("rope_ext", f"{_m}_full", _rope_build(_mode, 16), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_partial", _rope_build(_mode, 8), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_base500", _rope_build(_mode, 16, freq_base=500.0), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_yarn_scale", _rope_build(_mode, 16, freq_scale=0.25), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_yarn_attn", _rope_build(_mode, 12, freq_scale=0.5, attn_factor=0.7), F32_F16,
         ROPE_TOL)
    case("rope_ext", f"{_m}_freq_factors", _rope_build(_mode, 16, with_ff=True), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_permuted", _rope_build(_mode, 16, (2, 4, 3, 16), "permuted"), F32_F16, ROPE_TOL)
    case("rope_ext", f"{_m}_4d", _rope_build(_mode, 32, (2, 3, 2, 32)), F32_F16, ROPE_TOL)


# -- flash attention ------------------------------------------------------------------------------

def _flash_build(d=32, dv=None, n_q=4, n_head=4, n_kv=10, n_head_kv=2, n_seq=1, mask=True, scale=None,
                 max_bias=0.0, softcap=0.0, sinks=False, prec=None, kv_type="f16"):
    dv = d if dv is None else dv

    def build(ctx, rng, dtype):
        q, qv = make_input(ctx, randn(rng, (n_seq, n_head, n_q, d)), "f32")
        k, kv = make_input(ctx, randn(rng, (n_seq, n_head_kv, n_kv, d)), kv_type)
        v, vv = make_input(ctx, randn(rng, (n_seq, n_head_kv, n_kv, dv)), kv_type)
        sc = 1.0 / math.sqrt(d) if scale is None else scale
        s = np.einsum("shqd,shkd->shqk", qv, np.repeat(kv, n_head // n_head_kv, axis=1))
        s = s * float(np.float32(sc))
        if softcap:
            s = softcap * np.tanh(s / softcap)
        mt = None
        if mask:
            m = randn(rng, (n_q, n_kv))
            m[rng.random((n_q, n_kv)) < 0.3] = -np.inf
            m[:, 0] = 0.0
            mt, mv = make_input(ctx, m, "f16")
            slopes = _alibi_slopes(n_head, max_bias).reshape(1, -1, 1, 1)
            s = s + slopes * mv
        sk = skv = None
        if sinks:
            skv = randn(rng, (n_head,))
            sk = ctx.from_numpy(skv)
            skv = skv.astype(np.float64)
        p = _softmax_ref(s, skv)
        o = np.einsum("shqk,shkd->shqd", p, np.repeat(vv, n_head // n_head_kv, axis=1))
        out = ctx.flash_attn_ext(q, k, v, mt, sc, max_bias, softcap, prec=prec, sinks=sk)
        return out, np.swapaxes(o, 1, 2)          # ne (dv, n_head, n_q, n_seq)
    return build


# q is rounded to f16 for the f16 K dot products and V is accumulated in f16
FA_TOL = tols(Tol(5e-3, 5e-3))
_FA = [("mask", {}), ("nomask", {"mask": False}), ("mha", {"n_head_kv": 4}), ("mqa", {"n_head_kv": 1}),
       ("seq2", {"n_seq": 2}), ("dv16", {"dv": 16}), ("d64_q1", {"d": 64, "n_q": 1, "n_kv": 33}),
       ("softcap", {"softcap": 20.0}), ("alibi", {"max_bias": 8.0, "n_head": 6, "n_head_kv": 3}),
       ("sinks", {"sinks": True}), ("prec_f32", {"prec": Prec.F32}), ("scale", {"scale": 0.05}),
       ("kv_f32", {"kv_type": "f32"})]
for _name, _kw in _FA:
    case("flash_attn_ext", _name, _flash_build(**_kw), FIXED, FA_TOL, out_type=Type.F32)


# -- convolution, pooling ----------------------------------------------------------------------------

def _conv_out(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _im2col_ref(x4, kh, kw, s0, s1, p0, p1, d0, d1, is_2d):
    """ggml im2col: x numpy (N, IC, IH, IW) -> (N, OH, OW, IC*KH*KW), zeros outside."""
    n, ic, ih, iw = x4.shape
    oh = _conv_out(ih, kh, s1, p1, d1) if is_2d else ih
    ow = _conv_out(iw, kw, s0, p0, d0)
    out = np.zeros((n, oh, ow, ic, kh, kw))
    for y in range(oh):
        for xo in range(ow):
            for ky in range(kh):
                for kx in range(kw):
                    iy = y * s1 + ky * d1 - p1 if is_2d else y
                    ix = xo * s0 + kx * d0 - p0
                    if 0 <= iy < ih and 0 <= ix < iw:
                        out[:, y, xo, :, ky, kx] = x4[:, :, iy, ix]
    return out.reshape(n, oh, ow, ic * kh * kw)


def _im2col_build(is_2d, s0, s1, p0, p1, d0, d1, b_f16=False):
    def build(ctx, rng, dtype):
        dst = Type.F32 if dtype == "f32" else Type.F16
        if is_2d:
            b, bv = make_input(ctx, randn(rng, (2, 3, 6, 7)), "f16" if b_f16 else "f32")   # N, IC, H, W
            kern = ctx.new_tensor(Type.F16, (3, 2, 3, 4))                                    # KW, KH, IC, OC
            exp = _im2col_ref(bv, 2, 3, s0, s1, p0, p1, d0, d1, True)
        else:
            b, bv = make_input(ctx, randn(rng, (2, 9)), "f16" if b_f16 else "f32")         # IC, L (N = 1)
            kern = ctx.new_tensor(Type.F16, (3, 2, 5))                                       # K, IC, OC
            exp = _im2col_ref(bv[0][:, :, None, :], 1, 3, s0, 1, p0, 0, d0, 1, False)
            exp = exp[:, 0][None]                                                            # (1, N, OL, IC*K)
        out = ctx.im2col(kern, b, s0, s1, p0, p1, d0, d1, is_2d, dst)
        return out, store(exp, dtype).astype(np.float64)
    return build


case("im2col", "2d", _im2col_build(True, 1, 1, 0, 0, 1, 1), F32_F16)
case("im2col", "2d_s2_p1", _im2col_build(True, 2, 1, 1, 0, 1, 1), F32_F16)
case("im2col", "2d_dilated", _im2col_build(True, 1, 2, 1, 2, 2, 1), F32_F16)
case("im2col", "2d_f16_input", _im2col_build(True, 2, 2, 1, 1, 1, 1, b_f16=True), ("f16",))
case("im2col", "1d", _im2col_build(False, 2, 0, 1, 0, 1, 0), F32_F16)
case("im2col", "1d_dilated", _im2col_build(False, 1, 0, 2, 0, 2, 0), F32_F16)


def _conv1d_ref(w, x, s, p, d):
    # w (OC, IC, K), x (N, IC, L) -> (N, OC, OL)
    oc, ic, k = w.shape
    n, _, length = x.shape
    ol = _conv_out(length, k, s, p, d)
    xp = np.pad(x, ((0, 0), (0, 0), (p, p)))
    cols = np.stack([xp[:, :, o * s + np.arange(k) * d] for o in range(ol)], axis=2)   # (N, IC, OL, K)
    return np.einsum("oik,nilk->nol", w, cols)


def _conv2d_ref(w, x, s0, s1, p0, p1, d0, d1):
    # w (OC, IC, KH, KW), x (N, IC, H, W) -> (N, OC, OH, OW)
    oc, ic, kh, kw = w.shape
    n, _, h, wd = x.shape
    oh, ow = _conv_out(h, kh, s1, p1, d1), _conv_out(wd, kw, s0, p0, d0)
    xp = np.pad(x, ((0, 0), (0, 0), (p1, p1), (p0, p0)))
    out = np.zeros((n, oc, oh, ow))
    for y in range(oh):
        for xo in range(ow):
            patch = xp[:, :, y * s1 + np.arange(kh)[:, None] * d1, xo * s0 + np.arange(kw)[None, :] * d0]
            out[:, :, y, xo] = np.einsum("oihw,nihw->no", w, patch)
    return out


def _conv1d_build(n, s, p, d):
    def build(ctx, rng, dtype):
        # ggml_conv_1d = im2col to f16 + mul_mat: both operands are rounded to f16
        w, wv = make_input(ctx, randn(rng, (5, 4, 3)), dtype)          # OC, IC, K
        x, xv = make_input(ctx, randn(rng, (n, 4, 12)), "f32")          # N, IC, L
        ref = _conv1d_ref(store(wv[0], "f16").astype(np.float64), store(xv[0], "f16").astype(np.float64), s, p, d)
        return ctx.conv_1d(w, x, s, p, d), ref
    return build


def _conv2d_build(n, s0, s1, p0, p1, d0, d1):
    def build(ctx, rng, dtype):
        w, wv = make_input(ctx, randn(rng, (3, 2, 3, 3)), dtype)        # OC, IC, KH, KW
        x, xv = make_input(ctx, randn(rng, (n, 2, 7, 8)), "f32")         # N, IC, H, W
        ref = _conv2d_ref(store(wv, "f16").astype(np.float64), store(xv, "f16").astype(np.float64),
                          s0, s1, p0, p1, d0, d1)
        return ctx.conv_2d(w, x, s0, s1, p0, p1, d0, d1), ref
    return build


CONV_TOL = tols(Tol(1e-4, 1e-4))
case("conv_1d", "n1", _conv1d_build(1, 1, 0, 1), F32_F16, CONV_TOL, out_type=Type.F32)
case("conv_1d", "n1_s2_p1", _conv1d_build(1, 2, 1, 1), F32_F16, CONV_TOL, out_type=Type.F32)
case("conv_1d", "n1_p2_d2", _conv1d_build(1, 1, 2, 2), F32_F16, CONV_TOL, out_type=Type.F32)
# ggml's own ggml_conv_1d mislabels the batch axis for N > 1; ggmlpy composes it correctly.
case("conv_1d", "batch2", _conv1d_build(2, 1, 1, 1), F32_F16, CONV_TOL, out_type=Type.F32)
case("conv_2d", "n1", _conv2d_build(1, 1, 1, 0, 0, 1, 1), F32_F16, CONV_TOL, out_type=Type.F32)
case("conv_2d", "batch2_s2_p1", _conv2d_build(2, 2, 1, 1, 0, 1, 1), F32_F16, CONV_TOL, out_type=Type.F32)
case("conv_2d", "dilated", _conv2d_build(2, 1, 2, 2, 1, 2, 1), F32_F16, CONV_TOL, out_type=Type.F32)


def _pool1d_ref(x, op, k, s, p):
    # ggml pool_1d: padded positions are skipped; AVG divides by the number of real elements
    length = x.shape[-1]
    n = (length + 2 * p - k) // s + 1
    out = np.empty(x.shape[:-1] + (n,))
    for o in range(n):
        lo, hi = max(o * s - p, 0), min(o * s - p + k, length)
        win = x[..., lo:hi]
        out[..., o] = win.max(axis=-1) if op == PoolOp.MAX else win.mean(axis=-1)
    return out


def _pool2d_ref(x, op, k0, k1, s0, s1, p0, p1):
    # ggml pool_2d: padded positions are skipped; AVG divides by k0 * k1 (padding counted)
    h, w = x.shape[-2:]
    oh, ow = (h + 2 * p1 - k1) // s1 + 1, (w + 2 * p0 - k0) // s0 + 1
    out = np.empty(x.shape[:-2] + (oh, ow))
    for y in range(oh):
        for xo in range(ow):
            y0, y1 = max(y * s1 - p1, 0), min(y * s1 - p1 + k1, h)
            x0, x1 = max(xo * s0 - p0, 0), min(xo * s0 - p0 + k0, w)
            win = x[..., y0:y1, x0:x1]
            out[..., y, xo] = win.max(axis=(-1, -2)) if op == PoolOp.MAX else win.sum(axis=(-1, -2)) / (k0 * k1)
    return out


def _pool1d_build(op, shape, k, s, p):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        return ctx.pool_1d(a, op, k, s, p), _pool1d_ref(av, op, k, s, p)
    return build


def _pool2d_build(op, shape, k0, k1, s0, s1, p0, p1):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        return ctx.pool_2d(a, op, k0, k1, s0, s1, p0, p1), _pool2d_ref(av, op, k0, k1, s0, s1, p0, p1)
    return build


for _op in (PoolOp.MAX, PoolOp.AVG):
    _n = _op.name.lower()
    case("pool_1d", f"{_n}_k2s2", _pool1d_build(_op, (3, 10), 2, 2, 0), F32_F16, tols(F32_ARITH),
         out_type=Type.F32)
    case("pool_1d", f"{_n}_k3s1", _pool1d_build(_op, (2, 3, 9), 3, 1, 0), F32_F16, tols(F32_ARITH),
         out_type=Type.F32)
    case("pool_1d", f"{_n}_k3s2p1", _pool1d_build(_op, (4, 11), 3, 2, 1), F32_F16, tols(F32_ARITH),
         out_type=Type.F32)
    case("pool_2d", f"{_n}_k2s2", _pool2d_build(_op, (2, 3, 6, 8), 2, 2, 2, 2, 0, 0), F32_F16,
         tols(F32_ARITH), out_type=Type.F32)
    case("pool_2d", f"{_n}_k3x2s1x2", _pool2d_build(_op, (1, 2, 7, 9), 3, 2, 1, 2, 0, 0), F32_F16,
         tols(F32_ARITH), out_type=Type.F32)
    case("pool_2d", f"{_n}_k3s2p1", _pool2d_build(_op, (2, 1, 7, 6), 3, 3, 2, 2, 1, 1), F32_F16,
         tols(F32_ARITH), out_type=Type.F32)


# -- resize, pad, generators -----------------------------------------------------------------

def _nearest_idx(n_out, n_in):
    # ggml: i_in = (int64)(i_out / ((float) n_out / n_in)), in f32
    sf = np.float32(n_out) / np.float32(n_in)
    return np.minimum((np.arange(n_out, dtype=np.float32) / sf).astype(np.int64), n_in - 1)


def _upscale_build(shape, factor, layout="contig"):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        return ctx.upscale(a, factor), np.repeat(np.repeat(av, factor, axis=3), factor, axis=2)
    return build


def _interp_build(shape, ne):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        exp = av
        for dim in range(4):
            exp = np.take(exp, _nearest_idx(ne[dim], av.shape[3 - dim]), axis=3 - dim)
        return ctx.interpolate(a, *ne, ScaleMode.NEAREST), exp
    return build


case("upscale", "x2", _upscale_build((2, 3, 5), 2))
case("upscale", "x3", _upscale_build((2, 1, 4, 3), 3))
case("upscale", "x2_permuted", _upscale_build(VIEW_SHAPE, 2, "permuted"))
case("interpolate", "up_3to7", _interp_build((2, 3, 4), (7, 5, 2, 1)))
case("interpolate", "down", _interp_build((3, 6, 9), (4, 2, 3, 1)))
case("interpolate", "all_dims", _interp_build((2, 3, 2, 5), (10, 4, 6, 3)))


def _pad_build(shape, pads, layout="contig"):
    # pads: ((lp0, rp0), (lp1, rp1), (lp2, rp2), (lp3, rp3)) in ggml order
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        if all(lp == 0 for lp, _ in pads):
            out = ctx.pad(a, *(rp for _, rp in pads))
        else:
            out = ctx.pad_ext(a, *(p for lr in pads for p in lr))
        return out, np.pad(av, list(reversed(pads)))
    return build


case("pad", "right", _pad_build((3, 5), ((0, 2), (0, 1), (0, 0), (0, 0))))
case("pad", "right_4d", _pad_build((2, 2, 3, 4), ((0, 1), (0, 2), (0, 3), (0, 1))))
case("pad", "ext", _pad_build((2, 3, 5), ((1, 2), (3, 0), (1, 1), (0, 2))))
case("pad", "ext_permuted", _pad_build(VIEW_SHAPE, ((2, 1), (1, 1), (0, 1), (1, 0)), "permuted"))


def _arange_build(start, stop, step):
    def build(ctx, rng, dtype):
        n = int(math.ceil(np.float32(np.float32(stop) - np.float32(start)) / np.float32(step)))
        return ctx.arange(start, stop, step), np.float32(start) + np.float32(step) * np.arange(n, dtype=np.float64)
    return build


for _args in [(0.0, 10.0, 1.0), (-2.5, 3.0, 0.5), (1.0, 2.0, 0.3), (5.0, 6.0)]:
    case("arange", str(_args), _arange_build(*(_args + (1.0,))[:3]), tol=tols(Tol(1e-6, 1e-6)))


def _timestep_ref(t, dim, max_period):
    half = dim // 2
    freqs = np.exp(-math.log(max_period) * np.arange(half) / half)
    args = t[:, None] * freqs[None, :]
    emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1)
    if dim % 2:
        emb = np.concatenate([emb, np.zeros((len(t), 1))], axis=-1)
    return emb


def _timestep_build(n, dim, max_period):
    def build(ctx, rng, dtype):
        t = np.concatenate([[0.0, 1.0], rng.uniform(0, 200, n - 2)]).astype(np.float32)
        return ctx.timestep_embedding(ctx.from_numpy(t), dim, max_period), _timestep_ref(t.astype(np.float64), dim,
                                                                                        max_period)
    return build


for _n, _dim, _mp in [(5, 16, 10000), (3, 15, 10000), (4, 32, 100)]:
    case("timestep_embedding", f"n{_n}d{_dim}p{_mp}", _timestep_build(_n, _dim, _mp), tol=tols(Tol(2e-4, 1e-5)))


# -- views, reshapes, layout ---------------------------------------------------------------------------

def _view_build(kind):
    def build(ctx, rng, dtype):
        x = store(randn(rng, (4, 6, 10)), dtype)        # contiguous base, ne (10, 6, 4)
        base = ctx.from_numpy(x)
        isz = x.itemsize
        if kind == "view_1d":
            ne, nb, off = (13, 1, 1, 1), None, 7 * isz
            v = ctx.view_1d(base, 13, off)
        elif kind == "view_2d":
            ne, nb, off = (4, 5, 1, 1), (isz * 12,), 3 * isz
            v = ctx.view_2d(base, 4, 5, nb[0], off)
        elif kind == "view_3d":
            ne, nb, off = (3, 2, 4, 1), (isz * 20, isz * 60), 10 * isz + 2 * isz
            v = ctx.view_3d(base, 3, 2, 4, nb[0], nb[1], off)
        else:  # view_4d: dims 2 and 3 swapped relative to the base, a sub-block of rows
            ne, nb, off = (5, 3, 2, 2), (isz * 10, isz * 120, isz * 60), 20 * isz + 4 * isz
            v = ctx.view_4d(base, 5, 3, 2, 2, nb[0], nb[1], nb[2], off)
        full_nb = (isz,) + (tuple(nb) if nb else ())
        for i in range(len(full_nb), 4):
            full_nb = full_nb + (full_nb[-1] * ne[i - 1],)
        exp = np_view(x, ne, full_nb, off).astype(np.float64)

        def check(actual):
            assert_close(actual, exp, what=f"cont({kind})")
            assert_close(result4(v), exp, what=f"{kind} read directly")
        return ctx.cont(v), check
    return build


for _kind in ("view_1d", "view_2d", "view_3d", "view_4d"):
    case(_kind, "cont", _view_build(_kind), F32_F16)


def _reshape_build(n):
    def build(ctx, rng, dtype):
        x = store(randn(rng, (2, 3, 4, 5)), dtype)
        nes = {1: (120,), 2: (12, 10), 3: (6, 5, 4), 4: (3, 2, 5, 4)}[n]
        r = getattr(ctx, f"reshape_{n}d")(ctx.from_numpy(x), *nes)
        exp = to4(x.reshape(tuple(reversed(nes)))).astype(np.float64)

        def check(actual):
            assert_close(actual, exp, what=f"neg(neg(reshape_{n}d))")
            assert r.ne == ne_of(exp)
            assert_close(result4(r), exp, what=f"reshape_{n}d read directly")
        # go through an op so the reshaped view is read by a kernel
        out = ctx.neg(ctx.neg(r))
        return out, check
    return build


for _n in (1, 2, 3, 4):
    case(f"reshape_{_n}d", "neg_neg", _reshape_build(_n), F32_F16)


def _permute_build(axes, noncontig_src=False):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, (2, 3, 4, 5)), dtype, "permuted" if noncontig_src else "contig")
        p = ctx.permute(a, *axes)
        exp = np_permute(av, axes)

        def check(actual):
            assert_close(actual, exp, what=f"cont(permute{axes})")
            assert_close(result4(p), exp, what=f"permute{axes} read directly")
        return ctx.cont(p), check
    return build


for _axes in [(0, 1, 2, 3), (1, 0, 2, 3), (0, 2, 1, 3), (2, 0, 3, 1), (3, 2, 1, 0), (1, 2, 3, 0)]:
    case("permute", "".join(map(str, _axes)), _permute_build(_axes), F32_F16)
case("permute", "2031_of_view", _permute_build((2, 0, 3, 1), True), F32_F16)


def _transpose_build(shape, double=False):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        t = ctx.transpose(a)
        exp = np.swapaxes(av, 2, 3)
        if double:
            t, exp = ctx.transpose(t), av
        return ctx.cont(t), exp
    return build


case("transpose", "2d", _transpose_build((5, 7)), F32_F16)
case("transpose", "4d", _transpose_build((2, 3, 4, 5)), F32_F16)
case("transpose", "twice", _transpose_build((3, 6), True), F32_F16)


def _cont_nd_build(n):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, (2, 3, 4, 5)), dtype)
        t = ctx.transpose(a)                                   # ne (4, 5, 3, 2), not contiguous
        nes = {1: (120,), 2: (20, 6), 3: (4, 15, 2), 4: (2, 2, 5, 6)}[n]
        src = np.swapaxes(av, 2, 3)
        exp = to4(np.ascontiguousarray(src).reshape(tuple(reversed(nes))))
        return getattr(ctx, f"cont_{n}d")(t, *nes), exp
    return build


for _n in (1, 2, 3, 4):
    case(f"cont_{_n}d", "of_transpose", _cont_nd_build(_n), F32_F16)
def _cont_build(layout, axes):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, (2, 3, 4, 5)), dtype, layout)
        return ctx.cont(ctx.permute(a, *axes)), np_permute(av, axes)
    return build


case("cont", "of_permute", _cont_build("contig", (1, 2, 0, 3)), F32_F16)
case("cont", "of_permuted_view", _cont_build("permuted", (3, 1, 0, 2)), F32_F16)
case("cont", "of_strided_view", _cont_build("strided", (0, 1, 2, 3)), F32_F16)


# -- rows: get_rows / set_rows ------------------------------------------------------------------------------

def _get_rows_build(a_shape, idx_shape, layout="contig"):
    def build(ctx, rng, dtype):
        x = randn(rng, a_shape)
        if dtype == "q8_0":
            a = ctx.from_numpy(x, type=Type.Q8_0)
            av = result4(a).astype(np.float64)      # the dequantized rows are what get_rows returns
        else:
            a, av = make_input(ctx, x, dtype, layout)
        idx = rng.integers(0, a_shape[-2], idx_shape).astype(np.int32)
        i4 = idx.reshape((1,) * (3 - idx.ndim) + idx.shape)                   # numpy (ne2, ne1, ne0) of b
        exp = np.empty((i4.shape[0], i4.shape[1], i4.shape[2], av.shape[3]))
        for k3 in range(i4.shape[0]):
            for k2 in range(i4.shape[1]):
                exp[k3, k2] = av[k3, k2, i4[k3, k2]]
        return ctx.get_rows(a, ctx.from_numpy(idx)), exp
    return build


for _name, _a, _i in [("2d", (10, 32), (7,)), ("3d", (3, 10, 32), (3, 5)), ("4d", (2, 3, 6, 64), (2, 3, 4))]:
    case("get_rows", _name, _get_rows_build(_a, _i), ("f32", "f16", "q8_0"), out_type=Type.F32)
case("get_rows", "3d_permuted_src", _get_rows_build((3, 10, 32), (3, 5), "permuted"), F32_F16, out_type=Type.F32)


def _set_rows_build(a_shape, b_rows, idx_type, idx_bcast=False, b_f16=False, b_layout="contig"):
    def build(ctx, rng, dtype):
        dst0 = store(randn(rng, a_shape), dtype)
        a = ctx.from_numpy(dst0)
        a4 = to4(dst0)
        b, bv = make_input(ctx, randn(rng, a4.shape[:2] + (b_rows, a4.shape[3])), "f16" if b_f16 else "f32",
                           b_layout)
        # c: numpy (c.ne2, c.ne1, b_rows); c.ne1 / c.ne2 broadcast over b's dims 2 / 3
        c_shape = (1, 1) if idx_bcast else a4.shape[:2]
        idx = np.stack([rng.permutation(a4.shape[2])[:b_rows] for _ in range(c_shape[0] * c_shape[1])])
        idx = idx.reshape(c_shape + (b_rows,)).astype(np.int64 if idx_type == "i64" else np.int32)
        exp = a4.astype(np.float64)
        for k3 in range(exp.shape[0]):
            for k2 in range(exp.shape[1]):
                exp[k3, k2, idx[k3 % c_shape[0], k2 % c_shape[1]]] = store(bv[k3, k2], dtype)
        return ctx.set_rows(a, b, ctx.from_numpy(idx)), exp
    return build


case("set_rows", "2d_i64", _set_rows_build((10, 16), 4, "i64"), F32_F16)
case("set_rows", "2d_i32", _set_rows_build((10, 16), 4, "i32"), F32_F16)
case("set_rows", "3d_i64", _set_rows_build((2, 8, 16), 3, "i64"), F32_F16)
case("set_rows", "3d_bcast_idx", _set_rows_build((2, 8, 16), 3, "i32", idx_bcast=True), F32_F16)
case("set_rows", "f16_src", _set_rows_build((10, 16), 5, "i64", b_f16=True), F32_F16)
case("set_rows", "strided_src", _set_rows_build((2, 8, 16), 3, "i64", b_layout="strided"), F32_F16)
case("set_rows", "permuted_src", _set_rows_build((2, 8, 16), 3, "i32", b_layout="permuted"), F32_F16)


# -- copies and casts --------------------------------------------------------------------------------

def _cpy_build(src, dst, transposed=False):
    def build(ctx, rng, dtype):
        x = randn(rng, (6, 10))
        a, av = make_input(ctx, x, src)
        exp = av
        if transposed:
            a, exp = ctx.transpose(a), np.swapaxes(av, 2, 3)
        b = ctx.new_tensor(Type.F16 if dst == "f16" else Type.F32, ne_of(exp))
        return ctx.cpy(a, b), store(exp, dst).astype(np.float64)
    return build


case("cpy", "f32_to_f16", _cpy_build("f32", "f16"), FIXED, out_type=Type.F16)
case("cpy", "f16_to_f32", _cpy_build("f16", "f32"), FIXED, out_type=Type.F32)
case("cpy", "f32_to_f16_transposed", _cpy_build("f32", "f16", True), FIXED, out_type=Type.F16)
case("cpy", "f16_to_f32_transposed", _cpy_build("f16", "f32", True), FIXED, out_type=Type.F32)
case("cpy", "f32_to_f32_transposed", _cpy_build("f32", "f32", True), FIXED, out_type=Type.F32)


def q8_0_bound(x):
    """Per-element bound of the q8_0 round trip of rows ``x`` (last axis, blocks of 32).

    q8_0 stores d = amax/127 as f16 and q = round(x/d) in [-127, 127]; the value
    read back is q * f16(d), so |x - q f16(d)| <= d/2 + 127 |d - f16(d)|
    <= d (1/2 + 127 * 2**-11) < 0.5625 d, i.e. well inside max|x|/127 per block.
    """
    blocks = np.abs(x).reshape(x.shape[:-1] + (-1, 32))
    d = blocks.max(axis=-1, keepdims=True) / 127.0
    return np.broadcast_to(d * (0.5 + 127 * 2.0 ** -11) + 1e-7, blocks.shape).reshape(x.shape)


def _cpy_q8_0_build(shape):
    def build(ctx, rng, dtype):
        x = randn(rng, shape, 3.0)
        a = ctx.from_numpy(x)
        q = ctx.new_tensor(Type.Q8_0, ne_of(x))
        back = ctx.new_tensor(Type.F32, ne_of(x))
        out = ctx.cpy(ctx.cpy(a, q), back)
        xv = to4(x).astype(np.float64)

        def check(actual):
            err = np.abs(actual - xv)
            bound = q8_0_bound(xv)
            assert (err <= bound).all(), f"q8_0 round trip: max err/bound {(err / bound).max():.3f}"
            assert err.max() > 0                     # it was really quantized
        return out, check
    return build


case("cpy", "f32_q8_0_f32", _cpy_q8_0_build((4, 64)), FIXED, out_type=Type.F32)
case("cpy", "f32_q8_0_f32_3d", _cpy_q8_0_build((2, 3, 96)), FIXED, out_type=Type.F32)


def _cast_build(src, dst):
    def build(ctx, rng, dtype):
        if "i32" in (src, dst):
            x = rng.integers(-1000, 1000, (5, 7))
        else:
            x = randn(rng, (5, 7))
        npt = {"f32": np.float32, "f16": np.float16, "i32": np.int32}
        t = {"f32": Type.F32, "f16": Type.F16, "i32": Type.I32}
        a = ctx.from_numpy(x.astype(npt[src]))
        return ctx.cast(a, t[dst]), x.astype(npt[src]).astype(npt[dst])
    return build


for _s, _d in [("f32", "f16"), ("f16", "f32"), ("f32", "i32"), ("i32", "f32")]:
    _ot = {"f32": Type.F32, "f16": Type.F16, "i32": Type.I32}[_d]
    case("cast", f"{_s}_to_{_d}", _cast_build(_s, _d), FIXED, out_type=_ot)


def _concat_build(a_shape, dim, extra, a_layout="contig"):
    def build(ctx, rng, dtype):
        b_shape = list(to4(np.zeros(a_shape)).shape)
        b_shape[ggml_axis(dim)] = extra
        a, av = make_input(ctx, randn(rng, a_shape), dtype, a_layout)
        b, bv = make_input(ctx, randn(rng, tuple(b_shape)), dtype)
        return ctx.concat(a, b, dim), np.concatenate([av, bv], axis=ggml_axis(dim))
    return build


def _concat_transposed_build(dim):
    def build(ctx, rng, dtype):
        base, bav = make_input(ctx, randn(rng, (2, 3, 5, 4)), dtype)
        a, av = ctx.transpose(base), np.swapaxes(bav, 2, 3)                 # ne (5, 4, 3, 2), strided
        b_shape = list(av.shape)
        b_shape[ggml_axis(dim)] = 2
        b, bv = make_input(ctx, randn(rng, tuple(b_shape)), dtype)
        return ctx.concat(a, b, dim), np.concatenate([av, bv], axis=ggml_axis(dim))
    return build


for _dim in range(4):
    case("concat", f"dim{_dim}", _concat_build((2, 3, 4, 5), _dim, 3), F32_F16)
    case("concat", f"dim{_dim}_transposed_a", _concat_transposed_build(_dim), F32_F16)
case("concat", "dim1_2d", _concat_build((3, 7), 1, 2), F32_F16)
case("concat", "dim0_permuted_a", _concat_build(VIEW_SHAPE, 0, 4, "permuted"), F32_F16)


def _repeat_build(a_shape, reps, four_d=False):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, a_shape), dtype)
        exp = np.tile(av, reps)
        if four_d:
            return ctx.repeat_4d(a, *ne_of(exp)), exp
        return ctx.repeat(a, ctx.new_tensor(Type.F32, ne_of(exp))), exp
    return build


case("repeat", "4d", _repeat_build((1, 3, 1, 4), (2, 1, 2, 2)), F32_F16)
case("repeat", "row", _repeat_build((5,), (1, 3, 2, 1)), F32_F16)
case("repeat", "2d", _repeat_build((2, 3), (1, 1, 3, 4)), F32_F16)
case("repeat_4d", "4d", _repeat_build((2, 1, 3, 2), (1, 3, 2, 2), four_d=True), F32_F16)


def _fill_build(shape, c):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype)
        return ctx.fill(a, c), np.full(av.shape, float(store(np.float32(c), dtype)))
    return build


case("fill", "(3, 7)", _fill_build((3, 7), 2.5), F32_F16)
case("fill", "(2, 3, 4, 5)", _fill_build((2, 3, 4, 5), -0.1), F32_F16)


def _roll_build(shape, shifts, layout="contig"):
    def build(ctx, rng, dtype):
        a, av = make_input(ctx, randn(rng, shape), dtype, layout)
        exp = np.roll(av, [shifts[3 - ax] for ax in range(4)], axis=(0, 1, 2, 3))
        return ctx.roll(a, *shifts), exp
    return build


case("roll", "dim0", _roll_build((3, 7), (2, 0, 0, 0)))
case("roll", "all_dims", _roll_build((2, 3, 4, 5), (-2, 1, 2, -1)))
case("roll", "neg_dim1", _roll_build((6, 4), (0, -5, 0, 0)))
case("roll", "permuted", _roll_build(VIEW_SHAPE, (3, -2, 1, 1), "permuted"))


# -- state-space models --------------------------------------------------------------------

SSM_TOL = tols(Tol(1e-5, 1e-4))      # float32 sums over the kernel / the state, and expf in the scan


def _ssm_conv_build(d_conv, d_inner, n_t, n_s, strided=False):
    """ggml's ssm_conv: out[s, t, i] = sum_k sx[s, i, t + k] * c[i, k] (numpy order), no bias."""
    def build(ctx, rng, dtype):
        ncs = d_conv - 1 + n_t
        x = randn(rng, (n_s, d_inner, ncs))
        if strided:
            # each sequence's block at a stride wider than packed (dims 0 and 1 stay packed)
            wide = np.zeros((n_s, d_inner + 2, ncs), np.float32)
            wide[:, 1:1 + d_inner] = x
            base = ctx.from_numpy(wide)
            sx = ctx.view(base, (ncs, d_inner, n_s), (base.nb[1], base.nb[2]), base.nb[1])
        else:
            sx = ctx.from_numpy(x)
        w = randn(rng, (d_inner, d_conv))
        c = ctx.from_numpy(w)
        xv, wv = x.astype(np.float64), w.astype(np.float64)
        exp = np.zeros((n_s, n_t, d_inner))
        for t in range(n_t):
            exp[:, t] = (xv[:, :, t:t + d_conv] * wv[None]).sum(-1)
        return ctx.ssm_conv(sx, c), exp
    return build


case("ssm_conv", "k3_1tok", _ssm_conv_build(3, 8, 1, 4), FIXED, SSM_TOL, out_type=Type.F32)
case("ssm_conv", "k4_prompt", _ssm_conv_build(4, 16, 9, 2), FIXED, SSM_TOL, out_type=Type.F32)
case("ssm_conv", "k3_seq_strided", _ssm_conv_build(3, 5, 6, 3, strided=True), FIXED, SSM_TOL, out_type=Type.F32)


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))      # ggml_compute_softplus_f32


def _ssm_scan_ref(s, x, dt, A, B, C, ids, K):
    """The selective scan in float64, numpy order: s (n_rows, n_head, head_dim, d_state), x (n_seqs, n_tok,
    n_head, head_dim), dt (n_seqs, n_tok, n_head), A (n_head, 1 or d_state), B and C (n_seqs, n_tok, n_group,
    d_state). Returns ggml's 1-d result: y, then K blocks of every sequence's state (slot k: k tokens back)."""
    n_seqs, n_tok, n_head, _ = x.shape
    per = n_head // B.shape[2]
    y = np.zeros(x.shape)
    snaps = np.zeros((K, n_seqs) + s.shape[1:])
    for j in range(n_seqs):
        st = s[ids[j]].copy()
        for t in range(n_tok):
            for h in range(n_head):
                d = _softplus(dt[j, t, h])
                g = h // per
                st[h] = st[h] * np.exp(d * A[h])[None, :] + B[j, t, g][None, :] * (x[j, t, h] * d)[:, None]
                y[j, t, h] = st[h] @ C[j, t, g]
            if n_tok - 1 - t < K:
                snaps[n_tok - 1 - t, j] = st
    return np.concatenate([y.ravel(), snaps.ravel()])


def _ssm_scan_build(d_state, head_dim, n_head, n_group, n_tok, n_seqs, n_rows, mamba1=False, K=1,
                    x_strided=False):
    def build(ctx, rng, dtype):
        s = randn(rng, (n_rows, n_head, head_dim, d_state), 0.5)
        x = randn(rng, (n_seqs, n_tok, n_head, head_dim))
        dt = uniform(rng, -3.0, 2.0, (n_seqs, n_tok, n_head))
        A = -uniform(rng, 0.2, 2.0, (n_head, d_state if mamba1 else 1))
        B = randn(rng, (n_seqs, n_tok, n_group, d_state), 0.5)
        C = randn(rng, (n_seqs, n_tok, n_group, d_state), 0.5)
        ids = rng.permutation(n_rows)[:n_seqs].astype(np.int32)
        if x_strided:
            # x as a view whose tokens sit at a stride wider than packed (heads and head_dim packed)
            wide = np.zeros((n_seqs, n_tok, n_head + 1, head_dim), np.float32)
            wide[:, :, :n_head] = x
            base = ctx.from_numpy(wide)
            xt = ctx.view(base, (head_dim, n_head, n_tok, n_seqs), base.nb[1:], 0)
        else:
            xt = ctx.from_numpy(x)
        out = ctx.ssm_scan(ctx.from_numpy(s), xt, ctx.from_numpy(dt), ctx.from_numpy(A), ctx.from_numpy(B),
                           ctx.from_numpy(C), ctx.from_numpy(ids), K)
        exp = _ssm_scan_ref(*(a.astype(np.float64) for a in (s, x, dt, A, B, C)), ids, K)
        return out, exp
    return build


case("ssm_scan", "mamba2_groups", _ssm_scan_build(16, 4, 4, 2, 5, 2, 3), FIXED, SSM_TOL, out_type=Type.F32)
case("ssm_scan", "mamba2_snapshots", _ssm_scan_build(16, 8, 2, 1, 6, 3, 4, K=3), FIXED, SSM_TOL,
     out_type=Type.F32)
case("ssm_scan", "mamba2_x_strided", _ssm_scan_build(8, 4, 3, 1, 4, 2, 2, x_strided=True), FIXED, SSM_TOL,
     out_type=Type.F32)
case("ssm_scan", "mamba1", _ssm_scan_build(8, 6, 1, 1, 4, 2, 2, mamba1=True), FIXED, SSM_TOL, out_type=Type.F32)


def _gated_delta_ref(q, k, v, g, beta, state, K):
    """The gated delta rule in float64, numpy order: q, k (n_seqs, n_tok, H_k, S), v (n_seqs, n_tok, H, S),
    g (n_seqs, n_tok, H, 1 or S), beta (n_seqs, n_tok, H, 1), state (n_seqs, H, S, S) with state[s, h, j, i]
    = S[i][j]. Written from the delta rule itself (S = diag(exp g) S; S += k (beta (v - S^T k))^T;
    o = S^T q / sqrt(S)), not from ggml's loop. Returns ggml's 2-d result: o, then K blocks of states."""
    n_seqs, n_tok, H, S = v.shape
    o = np.zeros(v.shape)
    snaps = np.zeros((K,) + state.shape)
    for j in range(n_seqs):
        for h in range(H):
            hk = h % q.shape[2]                     # value head h reads key head h % H_k (ggml's tiling)
            M = state[j, h].T.copy()                # M[i, jj] = S[i][jj]
            for t in range(n_tok):
                M = np.exp(g[j, t, h])[:, None] * M  # a scalar gate broadcasts; a KDA gate scales row i
                kt, qt = k[j, t, hk], q[j, t, hk]
                M = M + np.outer(kt, beta[j, t, h, 0] * (v[j, t, h] - M.T @ kt))
                o[j, t, h] = M.T @ qt / np.sqrt(S)
                if n_tok - 1 - t < K:
                    snaps[n_tok - 1 - t, j, h] = M.T
    return np.concatenate([o.ravel(), snaps.ravel()]).reshape(-1, H * S)   # ggml's ne (S_v * H, rows)


def _gated_delta_build(S, H_k, H, n_tok, n_seqs, kda=False, K=1, q_strided=False):
    def build(ctx, rng, dtype):
        def l2(a):
            return a / np.linalg.norm(a, axis=-1, keepdims=True)
        q = l2(randn(rng, (n_seqs, n_tok, H_k, S))).astype(np.float32)
        k = l2(randn(rng, (n_seqs, n_tok, H_k, S))).astype(np.float32)
        v = randn(rng, (n_seqs, n_tok, H, S))
        g = -uniform(rng, 0.05, 1.0, (n_seqs, n_tok, H, S if kda else 1))
        beta = uniform(rng, 0.1, 0.9, (n_seqs, n_tok, H, 1))
        st = randn(rng, (n_seqs, H, S, S), 0.5)
        if q_strided:
            # q's heads at a stride wider than packed (rows stay contiguous), as a view of a wider projection
            wide = np.zeros((n_seqs, n_tok, H_k, S + 3), np.float32)
            wide[..., :S] = q
            base = ctx.from_numpy(wide)
            qt = ctx.view(base, (S, H_k, n_tok, n_seqs), base.nb[1:], 0)
        else:
            qt = ctx.from_numpy(q)
        out = ctx.gated_delta_net(qt, ctx.from_numpy(k), ctx.from_numpy(v), ctx.from_numpy(g), ctx.from_numpy(beta),
                                  ctx.from_numpy(st), K)
        exp = _gated_delta_ref(*(a.astype(np.float64) for a in (q, k, v, g, beta, st)), K)
        return out, exp
    return build


case("gated_delta_net", "one_token", _gated_delta_build(8, 2, 2, 1, 3), FIXED, SSM_TOL, out_type=Type.F32)
case("gated_delta_net", "prompt_gqa", _gated_delta_build(16, 2, 4, 7, 2), FIXED, SSM_TOL, out_type=Type.F32)
case("gated_delta_net", "kda_gate", _gated_delta_build(8, 1, 2, 5, 2, kda=True), FIXED, SSM_TOL, out_type=Type.F32)
case("gated_delta_net", "snapshots", _gated_delta_build(8, 2, 2, 6, 2, K=3), FIXED, SSM_TOL, out_type=Type.F32)
case("gated_delta_net", "q_strided", _gated_delta_build(8, 1, 1, 4, 2, q_strided=True), FIXED, SSM_TOL,
     out_type=Type.F32)
