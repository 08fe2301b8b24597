"""``Context.geglu_tanh``: GeGLU with GELU's tanh form evaluated in float32 (ggmlpy's CPU kernel).

Against torch's ``gelu(approximate="tanh")`` in float64 (transformers' ``gelu_pytorch_tanh``): the
fused form (gate and up halves of one row) and the split form, the AVX-512 loop and the portable
one, row lengths that end inside a vector and inside a chunk of work, a single row split across
threads, the values where the formula's branches meet and its extremes; and ggml's own ``geglu``
for scale (its float16 table). Its refusals, and the gemma models' choice of it.
"""

import numpy as np
import pytest

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, _core

torch = pytest.importorskip("torch")

#: max |got - ref| / |ref| over values with |ref| > 1e-3 (observed 1.4e-6: a few float32 ulps of the
#: sigmoid); ggml's table misses by up to ~5e-3
TOL = 4e-6

VECTOR = [True, False] if _core._geglu_vectorized() else [False]


def _ref(X, G):
    x = torch.from_numpy(X.astype(np.float64))
    return (torch.nn.functional.gelu(x, approximate="tanh") * torch.from_numpy(G.astype(np.float64))).numpy()


def _run(build, arrays, threads):
    with ggmlpy.Context(64 << 20) as ctx:
        y = build(ctx, *[ctx.from_numpy(a) for a in arrays])
        outs = []
        for t in threads:
            gf = ctx.new_graph()
            gf.build_forward_expand(y)
            gf.compute(t)
            outs.append(y.numpy().copy())
        return outs


def _err(got, ref):
    big = np.abs(ref) > 1e-3
    return (np.abs(got - ref)[big] / np.abs(ref)[big]).max()


@pytest.fixture(params=VECTOR, ids=lambda v: "avx512" if v else "portable")
def vector(request):
    old = _core._geglu_allow_vector(request.param)
    yield request.param
    _core._geglu_allow_vector(old)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 300), (7, 17), (2, 5, 40)], ids=["token", "300", "17", "3d"])
def test_fused_and_split_match_torch(vector, shape):
    rng = np.random.default_rng(sum(shape))
    X = (rng.standard_normal(shape) * 3).astype(np.float32)
    G = rng.standard_normal(shape).astype(np.float32)
    X.flat[:9] = [-100.0, -20.0, -10.0, -1e-3, 0.0, 1e-3, 3.0, 10.0, 100.0][: X.size]
    ref = _ref(X, G)
    fused = _run(lambda c, a: c.geglu_tanh(a), [np.concatenate([X, G], axis=-1)], threads=(1, 2, 3))
    split = _run(lambda c, a, b: c.geglu_tanh(a, b), [X, G], threads=(2,))
    for got in fused + split:
        assert got.size == ref.size and got.dtype == np.float32        # numpy() drops trailing 1s
        got = got.reshape(ref.shape)
        assert _err(got, ref) <= TOL
        assert np.all(np.abs(got[np.abs(ref) <= 1e-3] - ref[np.abs(ref) <= 1e-3]) <= 1e-9)
    assert all(np.array_equal(fused[0], f) for f in fused[1:])      # each value is one thread's
    assert np.array_equal(fused[0], split[0])


def test_more_exact_than_ggmls_table():
    rng = np.random.default_rng(4)
    X = (rng.standard_normal((64, 512)) * 2).astype(np.float32)
    ref = _ref(X[:, :256], X[:, 256:])
    ours = _run(lambda c, a: c.geglu_tanh(a), [X], threads=(2,))[0]
    ggml = _run(lambda c, a: c.geglu(a), [X], threads=(2,))[0]
    assert _err(ours, ref) <= TOL < 1e-4 < _err(ggml, ref)


@pytest.mark.parametrize("args, exc, words", [
    (dict(a=("F16", (8, 2))), GGMLTypeError, "geglu_tanh: a has type f16"),
    (dict(a=("F32", (7, 2))), GGMLValueError, "a.ne\\[0\\] must be even"),
    (dict(a=("F32", (8, 2)), b=("F32", (8, 3))), GGMLValueError, "geglu_tanh: a and b must have the same ne"),
    (dict(a=("F32", (8, 2)), b=("I32", (8, 2))), GGMLTypeError, "b has type i32"),
])
def test_refuses_what_it_cannot_compute(args, exc, words):
    with ggmlpy.Context(1 << 20, no_alloc=True) as ctx:
        t = {k: ctx.new_tensor(v[0], v[1]) for k, v in args.items()}
        with pytest.raises(exc, match=words):
            ctx.geglu_tanh(t["a"], t.get("b"))


def test_refuses_a_strided_view():
    with ggmlpy.Context(1 << 20) as ctx:
        a = ctx.new_tensor("F32", (8, 4))
        with pytest.raises(GGMLValueError, match="geglu_tanh: a must be contiguous"):
            ctx.geglu_tanh(ctx.transpose(a))


def test_the_gemma_model_chooses_it_on_the_cpu(tmp_path, monkeypatch):
    """gemma3's feed-forward takes the kernel on a CPU layer where it is vectorised (asked once per
    layer and graph), and its logits then differ from those with ggml's table, by less than that
    table's own error (test_arch_gemma compares both with transformers)."""
    from ggmlpy.models import blocks, load_model
    from ggmlpy.models.synthetic import write_synthetic
    from ggmlpy.runner import Runner

    asked = []
    real = blocks._core._geglu_vectorized
    monkeypatch.setattr(blocks._core, "_geglu_vectorized", lambda: asked.append(1) or real())
    model = load_model(write_synthetic(tmp_path / "m.gguf", "tiny", "F16", arch="gemma3"), devices="cpu")
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "glu_kernel", on)
        del asked[:]
        rt = Runner(model, n_ctx=64, n_threads=2)
        logits[on] = rt.decode(np.arange(1, 12, dtype=np.int32), seq=0, logits="all").copy()
        rt.close()
        assert bool(asked) == on
    rel = np.abs(logits[True] - logits[False]).max() / np.abs(logits[False]).max()
    assert (rel > 0) == real() and rel < 5e-3
    model.close()
