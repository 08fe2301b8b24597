"""``Context.mul_mat_vec``: ggmlpy's schedule for ggml's dot kernels in the generation step's products.

Every weight type with a CPU dot kernel against ``mul_mat`` (the same kernels on the same converted
vectors: equal up to the summation order of llamafile's kernels, which ``mul_mat`` takes for some
types), and float16 against numpy in float64 on the vectors rounded as ggml rounds them; one to four
columns, row counts that split unevenly over the threads, 1-3 threads (each row is one thread's
whichever the count: identical results), every prefetch distance. Its refusals; and the runner's
generation with the kernel and with ``mul_mat``. Q4_0 weights in ggml's ``CPU_REPACK`` layout (the
VNNI kernel): bit-identical to ggml's repacked ``mul_mat``.
"""

import numpy as np
import pytest
from test_repack import AVX2, CPU, EXTRA
from test_repack import _weight as _repack_weight

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, Type, _core, backend
from ggmlpy.models import blocks

#: relative to the largest output, against mul_mat (observed at most 2e-7) and numpy (4e-7)
TOL = 1e-6

#: whether repacked Q4_0 weights get mul_mat_vec's VNNI kernel here (ggml repacks Q4_0 on x86 with
#: AVX2; the kernel needs AVX-512 with VNNI)
RQ4 = "CPU_REPACK" in EXTRA and AVX2 and _core._mul_mat_vec_vnni()
needs_rq4 = pytest.mark.skipif(not RQ4, reason="no repacked Q4_0 kernel here (CPU_REPACK with AVX2, AVX-512 VNNI)")
#: per type, whether repacked weights get one of mul_mat_vec's kernels here: Q4_0 the VNNI one, Q4_K the VNNI
#: one or, on a CPU with AVX2 alone, gemm.c's
RQ = {"Q4_0": RQ4, "Q4_K": RQ4 or ("CPU_REPACK" in EXTRA and AVX2 and not _core._kernels_force_portable())}


def _needs_rq(wtype):
    if not RQ[wtype]:
        pytest.skip(f"no kernel for repacked {wtype} here")

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]


def _weight(ctx, wtype, W):
    w = ctx.new_tensor(getattr(Type, wtype), W.shape[::-1])
    if wtype in ("F32", "F16", "BF16"):
        w.set(W)
    else:
        w.set_bytes(ggmlpy.quantize(W, getattr(Type, wtype)))
    return w


def _both(wtype, W, X, threads=(1, 2, 3)):
    """mul_mat_vec's result for each thread count, and mul_mat's."""
    m = X.shape[0]
    with ggmlpy.Context(64 << 20) as ctx:
        w = _weight(ctx, wtype, W)
        x = ctx.from_numpy(X)
        ours, theirs = ctx.mul_mat_vec(w, x), ctx.mul_mat(w, x)
        assert ours.type == Type.F32 and tuple(ours.ne[:2]) == tuple(theirs.ne[:2]) == (W.shape[0], m)
        outs = []
        for t in threads:
            gf = ctx.new_graph()
            gf.build_forward_expand(ours)
            gf.build_forward_expand(theirs)
            gf.compute(t)
            outs.append(ours.numpy().reshape(m, -1).copy())
        return outs, theirs.numpy().reshape(m, -1)


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("shape", [(37, 512), (2304, 768), (3, 256)], ids=["37x512", "2304x768", "3x256"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_equals_mul_mat(wtype, shape, m):
    rng = np.random.default_rng(len(wtype) * 100 + shape[0] + m)
    W = rng.standard_normal(shape).astype(np.float32)
    X = rng.standard_normal((m, shape[1])).astype(np.float32)
    outs, ref = _both(wtype, W, X)
    assert np.abs(outs[0] - ref).max() <= TOL * np.abs(ref).max()
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.skipif(not _core._mul_mat_vec_vnni(), reason="no AVX-512 VNNI: Q8_0 and Q6_K keep ggml's vec_dot")
@pytest.mark.parametrize("wtype", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("shape", [(37, 512), (2304, 768), (1, 256)], ids=["37x512", "2304x768", "1x256"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_vnni_row_pair_kernels_equal_mul_mat_exactly(wtype, shape, m):
    """Q8_0 and Q6_K rows two at a time in the VNNI kernels: ggml's arithmetic (8 int32 lanes per
    block, its scale product, its final sum), so mul_mat's values bit for bit, with an odd row count
    (the lone last row), on 1-3 threads; and the same values with the kernel switched off (ggml's
    vec_dot). Q6_K's weights are scaled by row and column so that its int8 scales take many values,
    negative ones included."""
    switch = {"Q8_0": _core._mul_mat_vec_q8, "Q6_K": _core._mul_mat_vec_q6_k}[wtype]
    rng = np.random.default_rng(shape[0] * 7 + m)
    W = rng.standard_normal(shape).astype(np.float32)
    if wtype == "Q6_K":
        W *= (rng.uniform(0.05, 4.0, (shape[0], 1)).astype(np.float32)
              * rng.uniform(0.1, 3.0, shape[1]).astype(np.float32))
    X = rng.standard_normal((m, shape[1])).astype(np.float32) * np.float32(3)
    assert switch()
    outs, ref = _both(wtype, W, X)
    assert all(np.array_equal(o, ref) for o in outs)
    old = switch(False)
    try:
        assert np.array_equal(_both(wtype, W, X, threads=(2,))[0][0], ref)
    finally:
        switch(old)


@pytest.mark.parametrize("wtype", ["Q8_0", "Q6_K", "F16"])
@pytest.mark.parametrize("m", [1, 3])
def test_the_vec_dot_path_gives_the_same_values_and_is_the_one_recorded(wtype, m):
    """``own_rows=False``: every row through ggml's vec_dot under the schedule. Its values are the row
    kernels' bit for bit (each is ggml's arithmetic) and mul_mat's; the op records the path asked for
    (the graphs' choice per site is read back from it), and ``_mul_mat_vec_own_rows`` names the weights
    with two paths: Q8_0 and Q6_K where the VNNI kernels run, none with the portable path forced."""
    rng = np.random.default_rng(m)
    W = rng.standard_normal((301, 512)).astype(np.float32)
    X = rng.standard_normal((m, 512)).astype(np.float32)
    with ggmlpy.Context(64 << 20) as ctx:
        w = _weight(ctx, wtype, W)
        x = ctx.from_numpy(X)
        own, dot, ref = ctx.mul_mat_vec(w, x), ctx.mul_mat_vec(w, x, own_rows=False), ctx.mul_mat(w, x)
        assert (_core._mul_mat_vec_path(own), _core._mul_mat_vec_path(dot), _core._mul_mat_vec_path(ref)) == \
            ("vnni", "dot", None)
        assert _core._mul_mat_vec_own_rows(w) == (_core._mul_mat_vec_vnni() and wtype != "F16")
        old = _core._kernels_force_portable(True)
        try:
            assert not _core._mul_mat_vec_own_rows(w)
        finally:
            _core._kernels_force_portable(old)
        gf = ctx.new_graph()
        for t in (own, dot, ref):
            gf.build_forward_expand(t)
        gf.compute(2)
        assert np.array_equal(own.numpy(), dot.numpy())
        assert np.abs(dot.numpy() - ref.numpy()).max() <= TOL * np.abs(ref.numpy()).max()


def test_float16_against_numpy():
    """F16 weights: ggml's kernel on the vectors rounded to float16, summed in float32."""
    rng = np.random.default_rng(5)
    W = rng.standard_normal((300, 2048)).astype(np.float16)
    X = rng.standard_normal((3, 2048)).astype(np.float32)
    outs, _ = _both("F16", W.astype(np.float32), X, threads=(2,))
    ref = X.astype(np.float16).astype(np.float64) @ W.astype(np.float64).T
    assert np.abs(outs[0] - ref).max() <= TOL * np.abs(ref).max()


@pytest.mark.parametrize("kernel, wtype", [("dot", "F16"), ("q8_0", "Q8_0"), ("q6_k", "Q6_K")])
@pytest.mark.parametrize("distance", [0, 64, 4096, 65536])
def test_prefetch_distance_changes_no_value(distance, kernel, wtype):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((500, 256)).astype(np.float32)
    X = rng.standard_normal((2, 256)).astype(np.float32)
    base = _both(wtype, W, X, threads=(2,))[0][0]
    old = _core._mul_mat_vec_prefetch(distance, kernel=kernel)
    try:
        assert _core._mul_mat_vec_prefetch(kernel=kernel) == distance
        assert np.array_equal(_both(wtype, W, X, threads=(2,))[0][0], base)
    finally:
        _core._mul_mat_vec_prefetch(old, kernel=kernel)
    with pytest.raises(GGMLValueError, match="outside"):
        _core._mul_mat_vec_prefetch(-1)
    with pytest.raises(GGMLValueError, match="kernel 'q4'"):
        _core._mul_mat_vec_prefetch(kernel="q4")


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


@pytest.mark.parametrize("wtype", ["F16", "Q8_0", "Q4_0", "Q4_K_M"])
def test_runner_logits_with_and_without_the_kernel(tmp_path, monkeypatch, wtype):
    """Generation through the runner: the logits with the kernel equal those with mul_mat (the same
    dot kernels), and the kernel really ran for the one-token steps; on a repacked weight (a Q4_0
    model's weights are in CPU_REPACK where the CPU has it) only where a kernel for it runs (RQ)."""
    from dataclasses import replace

    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import SIZES, write_synthetic
    from ggmlpy.runner import Runner

    # K-quants need rows of 256: the tiny shape widened
    size = replace(SIZES["tiny"], n_embd=256, n_ff=512) if wtype == "Q4_K_M" else "tiny"
    model = load_model(write_synthetic(tmp_path / "m.gguf", size, wtype), devices="cpu")
    taken = []
    real = blocks._core._mul_mat_vec_ok        # asked only when linear() has a few tokens

    def spy(w, m):
        ok = real(w, m)
        # the repacked layout it has a kernel for: Q4_0 in CPU_REPACK (an AMX buffer holds F16 and
        # Q8_0 weights too, in a layout it cannot read)
        kind = w.type.name if w.is_repacked and w.type in (Type.Q4_0, Type.Q4_K) and w.buffer_type == "CPU_REPACK" \
            else "other" if w.is_repacked else "plain"
        taken.append((kind, ok))
        return ok

    monkeypatch.setattr(blocks._core, "_mul_mat_vec_ok", spy)
    prompt = np.arange(40, dtype=np.int32) * 3 % 200 + 1
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "matvec_kernel", on)
        rt = Runner(model, n_ctx=256, n_threads=2)
        rt.decode(prompt, seq=0, logits="last")
        del taken[:]
        steps = [rt.decode([7 + i], seq=0, logits="last").copy() for i in range(5)]
        if on:
            assert taken and all(ok == {"plain": True, "other": False, **RQ}[kind] for kind, ok in taken)
            if "AMX" not in EXTRA or not backend.amx_usable():   # where AMX runs, it takes the matrices
                # it ran at least once wherever it could: on a plain weight (every one outside CPU_REPACK;
                # Q4_K_M's Q6_K ones where ggml does not repack Q6_K) or a repacked Q4 one with its kernel
                can = any(kind == "plain" or RQ.get(kind, False) for kind, _ in taken)
                assert can or (wtype in ("Q4_0", "Q4_K_M") and "CPU_REPACK" in EXTRA and not RQ[wtype[:4]])
                assert any(ok for _, ok in taken) == can
        else:
            assert not taken
        logits[on] = np.stack(steps)
        rt.close()
    ref = logits[False]
    assert np.abs(logits[True] - ref).max() <= TOL * np.abs(ref).max()


def test_weights_it_cannot_read_are_refused():
    """A repacked weight it does not take (its kernel switched off: a layout it has no kernel for
    reads the same: ggml's own, in a buffer whose tensors the CPU backend runs only in its kernels'
    ops): refused, the buffer named; the models keep mul_mat for it."""
    if "CPU_REPACK" not in EXTRA or not AVX2:
        pytest.skip("no CPU_REPACK buffer for Q4_K and Q4_0")
    with pytest.raises(GGMLValueError, match="type must be 'Q4_0' or 'Q4_K'"):
        _core._mul_mat_vec_repacked(False, type="Q6_K")
    for wtype in ("Q4_K", "Q4_0"):
        ctx, buf, w = _repack_weight(wtype, np.zeros((16, 256), np.float32), EXTRA["CPU_REPACK"])
        old = _core._mul_mat_vec_repacked(False, type=wtype)
        try:
            assert w.is_repacked and not _core._mul_mat_vec_ok(w, 1)
            with ggmlpy.Context(1 << 20) as c2:
                with pytest.raises(GGMLValueError, match="w must be plain rows in host memory.*in CPU_REPACK"):
                    c2.mul_mat_vec(w, c2.new_tensor("F32", (256, 1)))
        finally:
            _core._mul_mat_vec_repacked(old, type=wtype)
        assert _core._mul_mat_vec_ok(w, 1) == RQ[wtype]   # switched on again: taken where a kernel runs


# ---- Q4_0 and Q4_K in ggml's CPU_REPACK layout: the VNNI kernels ---------------------------------

def _on_cpu_backend(g, ours, theirs, inputs, threads, shape):
    """g's tensors allocated in a CPU buffer, inputs ((tensor, array) pairs) set, the graph of ours
    (and theirs, if not None) computed by the CPU backend (the only one that reads a repacked weight)
    once per thread count: ours for each count and theirs once, reshaped to shape."""
    graph = g.new_graph(32)
    for t in (ours, theirs):
        if t is not None:
            graph.build_forward_expand(t)
    buf = _core.alloc_ctx_tensors(g, CPU.buffer_type())
    for t, a in inputs:
        t.set(a)
    be = CPU.init()
    outs = []
    for n in threads:
        be.set_n_threads(n)
        be.graph_compute(graph)
        outs.append(ours.get().reshape(shape).copy())
    ref = None if theirs is None else theirs.get().reshape(shape).copy()
    del buf
    return outs, ref


def _repacked_both(w, X, threads=(1, 2, 3)):
    """mul_mat_vec's result on the repacked weight w for each thread count, and mul_mat's."""
    m, k = X.shape
    g = ggmlpy.Context.for_tensors(8, graph_size=32, no_alloc=True)
    x = g.new_tensor("F32", (k, m), name="x")
    return _on_cpu_backend(g, g.mul_mat_vec(w, x), g.mul_mat(w, x), [(x, X)], threads, (m, -1))


@pytest.mark.parametrize("wtype, shape", [
    ("Q4_0", (8, 32)), ("Q4_0", (64, 512)), ("Q4_0", (2304, 768)), ("Q4_0", (776, 3072)),
    ("Q4_K", (8, 256)), ("Q4_K", (64, 512)), ("Q4_K", (2304, 768)), ("Q4_K", (776, 3072)),
], ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
@pytest.mark.parametrize("m", [1, 2, 3])
def test_repacked_equals_mul_mat_exactly(wtype, shape, m):
    """Bit-identical to ggml's repacked mul_mat (the same integer dots, the same float steps in the
    same order), on 1-3 threads (776 rows: 97 groups of 8, split unevenly); and within TOL of the
    plain layout's mul_mat, whose kernel sums in another order. Q4_K's weights are scaled by row
    and column so that its 6-bit scales and mins take many values."""
    _needs_rq(wtype)
    rng = np.random.default_rng(shape[0] + m)
    W = rng.standard_normal(shape).astype(np.float32)
    if wtype == "Q4_K":
        W *= (rng.uniform(0.1, 3.0, (shape[0], 1)).astype(np.float32)
              * rng.uniform(0.2, 2.0, shape[1]).astype(np.float32))
        W += rng.uniform(-1, 1, (shape[0], shape[1] // 32, 1)).repeat(32, axis=2).reshape(shape).astype(np.float32)
    X = rng.standard_normal((m, shape[1])).astype(np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    assert w.is_repacked and _core._mul_mat_vec_ok(w, m)
    outs, ref = _repacked_both(w, X)
    assert all(np.array_equal(o, ref) for o in outs)
    plain = _both(wtype, W, X, threads=(2,))[1]
    assert np.abs(outs[0] - plain).max() <= TOL * np.abs(plain).max()


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("distance", [0, 64, 16384, 65536])
def test_repacked_prefetch_distance_changes_no_value(distance, wtype):
    _needs_rq(wtype)
    rng = np.random.default_rng(2)
    W = rng.standard_normal((64, 512)).astype(np.float32)
    X = rng.standard_normal((2, 512)).astype(np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    kernel = wtype.lower() + "_repacked"
    old = _core._mul_mat_vec_prefetch(distance, kernel=kernel)
    try:
        assert _core._mul_mat_vec_prefetch(kernel=kernel) == distance
        outs, ref = _repacked_both(w, X, threads=(2,))
        assert np.array_equal(outs[0], ref)
    finally:
        _core._mul_mat_vec_prefetch(old, kernel=kernel)
    assert _core._mul_mat_vec_prefetch(kernel=kernel) == old != _core._mul_mat_vec_prefetch()


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
def test_repacked_takes_at_most_three_vectors(wtype):
    """From 4 vectors on, ggml's mul_mat quantizes them in its GEMM's layout (other values): refused,
    and the models keep mul_mat."""
    _needs_rq(wtype)
    ctx, buf, w = _repack_weight(wtype, np.zeros((16, 256), np.float32), EXTRA["CPU_REPACK"])
    assert [_core._mul_mat_vec_ok(w, m) for m in (1, 3, 4)] == [True, True, False]
    with ggmlpy.Context(1 << 20, no_alloc=True) as c2:
        with pytest.raises(GGMLValueError, match="a repacked w takes at most 3 vectors.*use mul_mat"):
            c2.mul_mat_vec(w, c2.new_tensor("F32", (256, 4)))


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
def test_repacked_weight_outlives_its_names(wtype):
    """The weight is no source of the op (the CPU backend refuses custom ops on repacked tensors): the
    result keeps the weight's context and buffer alive, so dropping every name of them before the
    compute still reads the right bytes."""
    _needs_rq(wtype)
    import gc
    rng = np.random.default_rng(3)
    W = rng.standard_normal((64, 256)).astype(np.float32)
    X = rng.standard_normal((1, 256)).astype(np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    expected = _repacked_both(w, X, threads=(1,))[1]
    g = ggmlpy.Context.for_tensors(4, graph_size=8, no_alloc=True)
    x = g.new_tensor("F32", (256, 1))
    y = g.mul_mat_vec(w, x)
    del ctx, buf, w
    gc.collect()
    graph = g.new_graph(8)
    graph.build_forward_expand(y)
    keep = _core.alloc_ctx_tensors(g, CPU.buffer_type())
    x.set(X)
    CPU.init().graph_compute(graph)
    assert np.array_equal(y.get().reshape(1, -1), expected)
    del keep


# ---- mul_mat_id_vec: the experts' version -----------------------------------------------------

def _experts(ctx, wtype, W):
    w = ctx.new_tensor(getattr(Type, wtype), W.shape[::-1])
    if wtype in ("F32", "F16", "BF16"):
        w.set(W)
    else:
        w.set_bytes(ggmlpy.quantize(W.reshape(-1, W.shape[-1]), getattr(Type, wtype)))
    return w


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("n_tokens", [1, 2, 4])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_experts_equal_mul_mat_id(wtype, n_tokens, per_slot):
    """Each token's chosen experts: mul_mat_id's values, bit for bit (the same kernels, each row
    one call), whatever the thread count; ids as top_k returns them (a strided view)."""
    rng = np.random.default_rng(n_tokens * 10 + per_slot + len(wtype))
    k, rows, n_expert, n_used = 256, 36, 6, 3
    W = rng.standard_normal((n_expert, rows, k)).astype(np.float32)
    X = rng.standard_normal((n_tokens, n_used if per_slot else 1, k)).astype(np.float32)
    L = rng.standard_normal((n_tokens, n_expert)).astype(np.float32)
    with ggmlpy.Context(64 << 20) as ctx:
        w = _experts(ctx, wtype, W)
        x = ctx.from_numpy(X)
        ids = ctx.top_k(ctx.from_numpy(L), n_used)             # (n_used, n_tokens), rows n_expert apart
        ours, theirs = ctx.mul_mat_id_vec(w, x, ids), ctx.mul_mat_id(w, x, ids)
        assert tuple(ours.ne[:3]) == tuple(theirs.ne[:3]) == (rows, n_used, n_tokens)
        outs = []
        for t in (1, 2, 3):
            gf = ctx.new_graph()
            gf.build_forward_expand(ours)
            gf.build_forward_expand(theirs)
            gf.compute(t)
            outs.append(ours.numpy().copy())
            assert np.array_equal(outs[-1], theirs.numpy())
        chosen = ids.numpy()
    assert sorted(chosen.reshape(n_tokens, n_used)[0].tolist()) == sorted(np.argsort(-L[0])[:n_used].tolist())


def test_an_expert_id_out_of_range_gives_nan_rows():
    """mul_mat_id asserts (the process would abort); this op marks the rows instead."""
    with ggmlpy.Context(16 << 20) as ctx:
        w = ctx.from_numpy(np.ones((4, 8, 64), np.float16))
        x = ctx.from_numpy(np.ones((1, 1, 64), np.float32))
        ids = ctx.from_numpy(np.array([[1, 7, -1]], np.int32))
        y = ctx.mul_mat_id_vec(w, x, ids)
        gf = ctx.new_graph()
        gf.build_forward_expand(y)
        gf.compute(2)
        out = y.numpy()
    assert (out[0] == 64).all() and np.isnan(out[1:]).all()


@pytest.mark.parametrize("over, exc, words", [
    (dict(w=("I32", (64, 8, 4))), GGMLTypeError, "mul_mat_id_vec: as_ has type i32"),
    (dict(x=("F16", (64, 1, 1))), GGMLTypeError, "b has type f16"),
    (dict(ids=("F32", (2, 1))), GGMLTypeError, "ids has type f32"),
    (dict(x=("F32", (64, 3, 1))), GGMLValueError, "b \\(k, 1 or n_used, n_tokens\\)"),
    (dict(x=("F32", (64, 1, 5)), ids=("I32", (2, 5))), GGMLValueError, "1 <= n_tokens <= 4"),
    (dict(x=("F32", (32, 1, 1))), GGMLValueError, "shapes do not match"),
])
def test_experts_refuse_what_they_cannot_compute(over, exc, words):
    shapes = dict(w=("F16", (64, 8, 4)), x=("F32", (64, 1, 1)), ids=("I32", (2, 1)))
    shapes.update(over)
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        t = {name: ctx.new_tensor(getattr(Type, spec[0]), spec[1]) for name, spec in shapes.items()}
        with pytest.raises(exc, match=words):
            ctx.mul_mat_id_vec(t["w"], t["x"], t["ids"])


def test_moe_runner_logits_with_and_without_the_kernel(tmp_path, monkeypatch):
    """A mixture of experts through the runner (the synthetic qwen3moe, Q8_0 experts): the one-token
    steps take the experts' kernel, with the logits of mul_mat_id."""
    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import synthetic_path
    from ggmlpy.runner import Runner

    model = load_model(synthetic_path("tiny", "Q8_0", cache_dir=tmp_path, arch="qwen3moe"), devices="cpu")
    asked = []
    real = blocks._core._mul_mat_id_vec_ok

    def spy(w, n):
        ok = real(w, n)
        asked.append(ok)
        return ok

    monkeypatch.setattr(blocks._core, "_mul_mat_id_vec_ok", spy)
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "matvec_kernel", on)
        rt = Runner(model, n_ctx=256, n_threads=2)
        rt.decode(np.arange(30, dtype=np.int32) + 5, seq=0, logits="last")
        del asked[:]
        logits[on] = np.stack([rt.decode([9 + i], seq=0, logits="last").copy() for i in range(4)])
        assert (any(asked) and all(asked)) if on else not asked
        rt.close()
    np.testing.assert_array_equal(logits[True], logits[False])


def _repacked_experts_both(w, X, L, n_used, threads=(1, 2, 3), ids_given=None):
    """mul_mat_id_vec's result on the repacked expert stack w for each thread count, and mul_mat_id's
    (None when ids_given holds ids ggml would abort on)."""
    n_tokens, xb, k = X.shape
    g = ggmlpy.Context.for_tensors(12, graph_size=32, no_alloc=True)
    x = g.new_tensor("F32", (k, xb, n_tokens))
    if ids_given is None:
        logits = g.new_tensor("F32", (L.shape[1], n_tokens))
        ids = g.top_k(logits, n_used)                          # (n_used, n_tokens), rows n_expert apart
        inputs = [(x, X), (logits, L)]
    else:
        ids = g.new_tensor("I32", ids_given.shape[::-1])
        inputs = [(x, X), (ids, ids_given)]
    theirs = g.mul_mat_id(w, x, ids) if ids_given is None else None
    return _on_cpu_backend(g, g.mul_mat_id_vec(w, x, ids), theirs, inputs, threads, (n_tokens, -1, w.ne[1]))


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("n_tokens", [1, 2, 4])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_repacked_experts_equal_mul_mat_id_exactly(n_tokens, per_slot, wtype):
    """A repacked Q4_0 or Q4_K expert stack (each expert's matrix repacked on its own): ggml's
    repacked mul_mat_id's values bit for bit, for 1-4 tokens and 1-3 threads."""
    _needs_rq(wtype)
    rng = np.random.default_rng(20 + n_tokens * 2 + per_slot)
    k, rows, n_expert, n_used = 512, 40, 6, 3
    W = rng.standard_normal((n_expert, rows, k)).astype(np.float32)
    X = rng.standard_normal((n_tokens, n_used if per_slot else 1, k)).astype(np.float32)
    L = rng.standard_normal((n_tokens, n_expert)).astype(np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    assert w.is_repacked and _core._mul_mat_id_vec_ok(w, n_tokens * X.shape[1])
    assert not _core._mul_mat_vec_ok(w, 1)                     # a stack: mul_mat_vec takes matrices
    outs, ref = _repacked_experts_both(w, X, L, n_used)
    assert ref.shape == (n_tokens, n_used, rows)
    assert all(np.array_equal(o, ref) for o in outs)


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
def test_repacked_expert_id_out_of_range_gives_nan_rows(wtype):
    _needs_rq(wtype)
    k = 64 if wtype == "Q4_0" else 256
    W = np.ones((4, 8, k), np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    ids = np.array([[1, 7, -1]], np.int32)
    outs, _ = _repacked_experts_both(w, np.ones((1, 1, k), np.float32), None, 3, threads=(2,), ids_given=ids)
    out = outs[0]
    assert out.shape == (1, 3, 8) and np.allclose(out[0, 0], k, rtol=1e-3) and np.isnan(out[0, 1:]).all()
