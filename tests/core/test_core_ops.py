"""Every core op against a numpy reference, over the table in op_cases.py.

One test per (case, dtype): build the inputs with a generator seeded from the
test id, compute the op on the CPU with 2 threads (so the kernels' work
splitting is exercised), read the result back as a 4-d array and compare with
the case's reference and tolerance. A few behaviours the table cannot express
(in-place clamp, index checks) have their own tests at the end.
"""

from __future__ import annotations

import gc
import zlib

import numpy as np
import pytest
from helpers import DTYPES, assert_close, compute, new_ctx, result4, to4
from op_cases import CASES

import ggmlpy
from ggmlpy import Type


@pytest.fixture(scope="module", autouse=True)
def _fast_gc():
    """Move the objects alive before these tests to gc's permanent generation.

    conftest's leak check runs gc.collect() around every test, which costs
    ~0.1 s each with the whole pytest session tracked; frozen objects are
    skipped, and everything a test creates is still collected and counted.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _params():
    out = []
    for c in CASES:
        for dt in c.dtypes:
            tid = c.id if dt is None else f"{c.id}-{dt}"
            marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
            out.append(pytest.param(c, dt, id=tid, marks=marks))
    return out


def _expected_type(case, dtype):
    if case.out_type is None:
        return None
    if case.out_type == "same":
        return DTYPES[dtype][0] if dtype in DTYPES else None
    return case.out_type


def test_table_covers_the_required_ops():
    required = """add sub mul div scale sqr sqrt exp log sum sum_rows mean argmax argsort top_k clamp abs
        neg step relu leaky_relu gelu gelu_quick silu tanh sigmoid swiglu geglu reglu norm rms_norm
        group_norm l2_norm mul_mat mul_mat_id out_prod soft_max soft_max_ext diag_mask_inf rope_ext
        flash_attn_ext im2col conv_1d conv_2d pool_1d pool_2d upscale interpolate pad arange
        timestep_embedding view_1d view_2d view_3d view_4d reshape_1d reshape_2d reshape_3d reshape_4d
        permute transpose cont cont_1d cont_2d cont_3d cont_4d get_rows set_rows cpy concat repeat cast
        cumsum fill roll diag_mask_zero count_equal ssm_conv ssm_scan gated_delta_net""".split()
    have = {c.op for c in CASES}
    assert not set(required) - have, f"missing ops: {sorted(set(required) - have)}"
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"


@pytest.mark.parametrize("case,dtype", _params())
def test_op(case, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{case.id}-{dtype}".encode()))
    # the with block frees the arena even when the test fails (its traceback keeps the objects)
    with new_ctx() as ctx:
        out, expected = case.build(ctx, rng, dtype)
        want_type = _expected_type(case, dtype)
        if want_type is not None:
            assert out.type == want_type, f"{case.id}: result type {out.type.name}, expected {want_type.name}"
        compute(ctx, out, n_threads=2)
        actual = result4(out)
        if callable(expected):
            expected(actual)
        else:
            tol = case.tol.get(dtype, case.tol["f32"])
            assert_close(actual, to4(expected), tol.atol, tol.rtol, what=f"{case.id} [{dtype}]")


# -- behaviours outside the table ----------------------------------------------------------


def test_clamp_leaves_its_input():
    # ggml 0.25's ggml_clamp is out of place (0.20's returned a view that wrote into a)
    ctx = new_ctx()
    x = np.linspace(-2, 2, 9, dtype=np.float32)
    a = ctx.from_numpy(x)
    out = ctx.clamp(a, -1.0, 1.0)
    compute(ctx, out)
    np.testing.assert_array_equal(out.get(), np.clip(x, -1, 1))
    np.testing.assert_array_equal(a.get(), x)


def test_same_graph_computes_again_with_new_inputs():
    ctx = new_ctx()
    a = ctx.from_numpy(np.zeros((3, 8), np.float32))
    b = ctx.from_numpy(np.zeros((8,), np.float32))
    out = ctx.mul(ctx.add(a, b), b)
    gf = compute(ctx, out)
    rng = np.random.default_rng(7)
    for _ in range(3):
        x, y = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
        a.set(x)
        b.set(y)
        gf.compute(1)
        assert_close(out.get(), (x.astype(np.float64) + y) * y, 1e-6, 1e-6, "recompute")


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_mul_mat_thread_counts_agree(n_threads):
    rng = np.random.default_rng(3)
    ctx = new_ctx()
    a = rng.standard_normal((40, 64)).astype(np.float32)
    b = rng.standard_normal((9, 64)).astype(np.float32)
    out = ctx.mul_mat(ctx.from_numpy(a), ctx.from_numpy(b))
    compute(ctx, out, n_threads=n_threads)
    assert_close(out.get(), b.astype(np.float64) @ a.T, 2e-5, 1e-5, f"mul_mat threads={n_threads}")


def test_get_rows_index_out_of_range_raises():
    ctx = new_ctx()
    a = ctx.from_numpy(np.zeros((4, 8), np.float32))
    out = ctx.get_rows(a, ctx.from_numpy(np.array([0, 4], np.int32)))
    with pytest.raises(ggmlpy.GGMLError):
        compute(ctx, out)


def test_set_rows_index_out_of_range_raises():
    ctx = new_ctx()
    a = ctx.from_numpy(np.zeros((4, 8), np.float32))
    b = ctx.from_numpy(np.ones((1, 8), np.float32))
    out = ctx.set_rows(a, b, ctx.from_numpy(np.array([-1], np.int64)))
    with pytest.raises(ggmlpy.GGMLError):
        compute(ctx, out)


def test_mul_mat_id_expert_out_of_range_raises():
    ctx = new_ctx()
    w = ctx.from_numpy(np.zeros((2, 4, 32), np.float32))
    b = ctx.from_numpy(np.zeros((1, 1, 32), np.float32))
    out = ctx.mul_mat_id(w, b, ctx.from_numpy(np.array([[2]], np.int32)))
    with pytest.raises(ggmlpy.GGMLError):
        compute(ctx, out)


@pytest.mark.parametrize("op", ["scale", "sum", "mean", "argmax", "soft_max", "argsort"])
def test_contiguous_only_ops_reject_views(op):
    # these kernels index the input as if contiguous: the binding must refuse a strided view
    ctx = new_ctx()
    base = ctx.from_numpy(np.zeros((4, 6), np.float32))
    t = ctx.transpose(base)
    call = {"scale": lambda: ctx.scale(t, 2.0)}.get(op, lambda: getattr(ctx, op)(t))
    with pytest.raises(ggmlpy.GGMLValueError):
        call()


def test_unsupported_types_raise():
    ctx = new_ctx()
    a16 = ctx.from_numpy(np.zeros((2, 8), np.float16))
    a32 = ctx.from_numpy(np.zeros((2, 8), np.float32))
    with pytest.raises(ggmlpy.GGMLTypeError):
        ctx.add(a32, a16)                   # b must be a's type or f32
    with pytest.raises(ggmlpy.GGMLTypeError):
        ctx.scale(a16, 2.0)                 # f32 only
    with pytest.raises(ggmlpy.GGMLTypeError):
        ctx.mul_mat(a32, a16)               # b f32 (or a's type for f16 a)


def test_view_out_of_bounds_raises():
    ctx = new_ctx()
    base = ctx.from_numpy(np.zeros((4, 6), np.float32))
    with pytest.raises(ggmlpy.GGMLValueError):
        ctx.view_1d(base, 25)
    with pytest.raises(ggmlpy.GGMLValueError):
        ctx.view_2d(base, 6, 4, 6 * 4, 4)     # the last row runs past the end


def test_cont_of_q8_0_view_keeps_blocks():
    # a contiguous q8_0 tensor reshaped through cont keeps its bytes
    ctx = new_ctx()
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    q = ctx.from_numpy(x, type=Type.Q8_0)
    out = ctx.cont(q, (128, 2))
    compute(ctx, out)
    assert out.type == Type.Q8_0
    np.testing.assert_array_equal(result4(out).reshape(-1), result4(q).reshape(-1))


def test_top_k_zero_gives_an_empty_result():
    with new_ctx() as ctx:
        a = ctx.from_numpy(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
        t = ctx.top_k(a, 0)
        assert t.ne == (0, 3, 1, 1)
        compute(ctx, t, n_threads=2)
        assert t.get().shape == (3, 0)
        assert ctx.from_numpy(np.zeros((3, 0), np.float32)).get().shape == (3, 0)
