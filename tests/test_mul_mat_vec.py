"""``Context.mul_mat_vec``: ggmlpy's CPU kernel for the generation step's matrix products.

Its own products (float16, Q8_0) checked against numpy in float64 on the weights as stored: one to
four columns, row counts that leave a tail after the groups of four, rows too
short or not a multiple of 16 (the portable path), the AVX-512 kernel and the portable one, 1-3
threads (each row is summed in the same order whichever thread has it: identical results), every
prefetch distance. Every other type (ggml's dot kernels under this kernel's scheduling) against
``mul_mat``. Its refusals; and the runner's generation with the kernel and with ggml's ``mul_mat``.
"""

import numpy as np
import pytest

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, Type, _core
from ggmlpy.models import blocks

# float32 sums of float32 products of up to 2048 terms: observed at most 4e-7 of the largest output
TOL = 2e-6

VECTOR = _core._mul_mat_vec_vectorized(64)


def _weights(rng, wtype, n, k):
    """A (n, k) weight in ``wtype`` and the float64 values it stores."""
    W = rng.standard_normal((n, k)).astype(np.float32)
    if wtype == "F16":
        return W.astype(np.float16), W.astype(np.float16).astype(np.float64)
    raw = ggmlpy.quantize(W, Type.Q8_0)
    return raw, ggmlpy.dequantize(raw, Type.Q8_0, k).astype(np.float64)


def _run(raw, wtype, X, threads):
    n = X.shape[1]
    with ggmlpy.Context(64 << 20) as ctx:
        if wtype == "F16":
            w = ctx.from_numpy(raw)
        else:
            w = ctx.new_tensor(Type.Q8_0, (n, len(raw) // Type.Q8_0.row_size(n)))
            w.set_bytes(raw)
        x = ctx.from_numpy(X)
        y = ctx.mul_mat_vec(w, x)
        assert y.type == Type.F32 and tuple(y.ne[:2]) == (w.ne[1], X.shape[0])
        gf = ctx.new_graph()
        gf.build_forward_expand(y)
        gf.compute(threads)
        return y.numpy().reshape(X.shape[0], -1)


CASES = [  # wtype, n rows, k
    ("F16", 2304, 768),       # the 110M model's fused Q/K/V
    ("F16", 37, 2048),        # a tail of one row after the groups of four
    ("F16", 6, 48),
    ("F16", 9, 40),           # k not a multiple of 16: the portable path
    ("Q8_0", 768, 2048),      # the 110M model's ffn_down
    ("Q8_0", 70, 256),
    ("Q8_0", 3, 32),          # fewer rows than a group
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-{}x{}".format(*c))
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("vector", [True, False], ids=["avx512", "portable"])
def test_matches_numpy(case, m, vector):
    if vector and not VECTOR:
        pytest.skip("no AVX-512 on this CPU")
    wtype, n, k = case
    rng = np.random.default_rng(n * 7 + k + m)
    raw, Wd = _weights(rng, wtype, n, k)
    X = rng.standard_normal((m, k)).astype(np.float32)
    ref = X.astype(np.float64) @ Wd.T
    old = _core._mul_mat_vec_allow_vector(vector)
    try:
        outs = [_run(raw, wtype, X, t) for t in (1, 2, 3)]
    finally:
        _core._mul_mat_vec_allow_vector(old)
    err = np.abs(outs[0] - ref).max() / np.abs(ref).max()
    assert err < TOL, err
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("distance", [0, 64, 4096, 65536])
def test_prefetch_distance_changes_no_value(distance):
    rng = np.random.default_rng(1)
    raw, Wd = _weights(rng, "F16", 500, 256)
    X = rng.standard_normal((2, 256)).astype(np.float32)
    base = _run(raw, "F16", X, 2)
    old = _core._mul_mat_vec_prefetch(distance)
    try:
        assert _core._mul_mat_vec_prefetch() == distance
        assert np.array_equal(_run(raw, "F16", X, 2), base)
    finally:
        _core._mul_mat_vec_prefetch(old)
    with pytest.raises(GGMLValueError, match="outside"):
        _core._mul_mat_vec_prefetch(-1)


def test_closer_to_exact_than_ggml():
    """ggml rounds the vector to float16 (F16 weights) or quantizes it (Q8_0) before the product;
    this kernel does not."""
    rng = np.random.default_rng(2)
    for wtype in ("F16", "Q8_0"):
        raw, Wd = _weights(rng, wtype, 64, 512)
        X = rng.standard_normal((1, 512)).astype(np.float32)
        ref = X.astype(np.float64) @ Wd.T
        with ggmlpy.Context(16 << 20) as ctx:
            if wtype == "F16":
                w = ctx.from_numpy(raw)
            else:
                w = ctx.new_tensor(Type.Q8_0, (512, 64))
                w.set_bytes(raw)
            x = ctx.from_numpy(X)
            ours, theirs = ctx.mul_mat_vec(w, x), ctx.mul_mat(w, x)
            gf = ctx.new_graph()
            gf.build_forward_expand(ours)
            gf.build_forward_expand(theirs)
            gf.compute(2)
            e_ours = np.abs(ours.numpy() - ref).max() / np.abs(ref).max()
            e_ggml = np.abs(theirs.numpy() - ref).max() / np.abs(ref).max()
        assert e_ours < TOL and e_ggml > 10 * e_ours, (wtype, e_ours, e_ggml)


OTHER_TYPES = ["F32", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]


@pytest.mark.parametrize("wtype", OTHER_TYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_other_types_give_ggmls_values(wtype, m):
    """Every other type goes through ggml's own dot kernel on the vectors converted as mul_mat
    converts them: mul_mat's values (up to the summation order of llamafile's kernels, which
    mul_mat takes for some types: measured at most 2e-7 of the largest output), 1-3 threads alike."""
    rng = np.random.default_rng(len(wtype) + m)
    n, k = 37, 512
    W = rng.standard_normal((n, k)).astype(np.float32)
    X = rng.standard_normal((m, k)).astype(np.float32)
    with ggmlpy.Context(16 << 20) as ctx:
        w = ctx.new_tensor(getattr(Type, wtype), (k, n))
        if wtype in ("F32", "BF16"):
            w.set(W)
        else:
            w.set_bytes(ggmlpy.quantize(W, getattr(Type, wtype)))
        x = ctx.from_numpy(X)
        ours, theirs = ctx.mul_mat_vec(w, x), ctx.mul_mat(w, x)
        outs = []
        for t in (1, 2, 3):
            gf = ctx.new_graph()
            gf.build_forward_expand(ours)
            gf.build_forward_expand(theirs)
            gf.compute(t)
            outs.append(ours.numpy().copy())
        ref = theirs.numpy()
    assert np.abs(outs[0] - ref).max() <= 1e-6 * np.abs(ref).max()
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def _bad(ctx, **over):
    shapes = dict(w=("F16", (64, 10)), x=("F32", (64, 1)))
    shapes.update(over)
    t = {name: ctx.new_tensor(getattr(Type, spec[0]), spec[1]) for name, spec in shapes.items()}
    return ctx.mul_mat_vec(t["w"], t["x"])


@pytest.mark.parametrize("over, exc, words", [
    (dict(w=("I32", (64, 10))), GGMLTypeError, "mul_mat_vec: w has type i32, which has no CPU dot kernel"),
    (dict(w=("F32", (20000, 10)), x=("F32", (20000, 1))), GGMLValueError, "the vectors take 80000 bytes"),
    (dict(x=("F16", (64, 1))), GGMLTypeError, "x has type f16"),
    (dict(x=("F32", (32, 1))), GGMLValueError, "shapes do not match"),
    (dict(x=("F32", (64, 5))), GGMLValueError, "1 <= m <= 4"),
    (dict(x=("F32", (64, 1, 2))), GGMLValueError, "2 dimensions"),
    (dict(w=("F16", (64, 10, 2))), GGMLValueError, "2 dimensions"),
])
def test_refuses_what_it_cannot_compute(over, exc, words):
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        with pytest.raises(exc, match=words):
            _bad(ctx, **over)


@pytest.mark.skipif(not VECTOR, reason="no AVX-512 on this CPU: the models keep mul_mat")
@pytest.mark.parametrize("wtype, tol", [("F16", 3e-3), ("Q8_0", 3e-2)])
def test_runner_logits_with_and_without_the_kernel(tmp_path, monkeypatch, wtype, tol):
    """Generation through the runner: the logits with the kernel match those with ggml's mul_mat to
    the weight type's tolerance against transformers (what separates them is ggml's rounding of the
    activations), and the kernel really ran, for the one-token steps only."""
    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import write_synthetic
    from ggmlpy.runner import Runner

    model = load_model(write_synthetic(tmp_path / "m.gguf", "tiny", wtype))
    rows = []
    real = blocks._core._mul_mat_vec_ok        # asked only when linear() would take the kernel

    def spy(wtype, k, m):
        rows.append(k)
        return real(wtype, k, m)

    monkeypatch.setattr(blocks._core, "_mul_mat_vec_ok", spy)
    prompt = np.arange(40, dtype=np.int32) * 3 % 200 + 1
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "matvec_kernel", on)
        rt = Runner(model, n_ctx=256, n_threads=2)
        rt.decode(prompt, seq=0, logits="last")
        del rows[:]
        steps = [rt.decode([7 + i], seq=0, logits="last").copy() for i in range(5)]
        assert bool(rows) == on
        logits[on] = np.stack(steps)
        rt.close()
    ref = logits[False]
    err = np.abs(logits[True] - ref).max() / np.abs(ref).max()
    assert 0 < err < tol
