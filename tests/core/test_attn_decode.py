"""``Context.attn_decode``: ggmlpy's CPU kernel for the generation step's attention.

Checked against numpy in float64 (``softmax(scale q.k + mask) v``, grouped heads broadcast) in both
layouts the kernel reads differently (one head's rows contiguous, and a cache's cells with every
head side by side, by its AVX-512 and its AVX2 path), for float16 and float32 K/V, every group size
and thread split, NaN and inf in the cells the mask hides, masks with holes, a sliding window's
leading run and the padding's trailing run, fully masked rows, every chunk count and 1-3 threads;
against ``flash_attn_ext`` as the models call it; and the runner's logits with the kernel on and off.
"""

import functools

import numpy as np
import pytest

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, _core
from ggmlpy.models import blocks

# float32 accumulation over at most a few hundred positions: observed 1e-6 relative to the largest
# output; flash_attn_ext (float16 accumulators for an F16 cache) is at ~5e-3 on the same data.
TOL = 1e-5


def _reference(Q, K, V, M, scale):
    """Q (n_q, n_head, dk), K (n_head_kv, n_kv, dk), V (n_head_kv, n_kv, dv), M (n_q, n_kv) -> (n_q, n_head, dv)."""
    group = Q.shape[1] // K.shape[0]
    Kf = np.repeat(K.astype(np.float64), group, 0)
    Vf = np.repeat(V.astype(np.float64), group, 0)
    s = np.einsum("qhd,hkd->qhk", Q.astype(np.float64), Kf) * scale + M.astype(np.float64)[:, None, :]
    out = np.zeros((Q.shape[0], Q.shape[1], V.shape[2]))
    for r in range(Q.shape[0]):
        if np.isneginf(M[r]).all():
            continue                                       # nothing visible: zeros
        p = np.exp(s[r] - s[r].max(-1, keepdims=True))
        out[r] = np.einsum("hk,hkd->hd", p / p.sum(-1, keepdims=True), Vf)
    return out


def _mask(rng, n_q, n_kv, lead=0, tail=0, holes=0):
    M = np.zeros((n_q, n_kv), np.float16)
    for r in range(n_q):
        M[r, :lead + r] = -np.inf                          # a window that slides with the row
        if tail:
            M[r, n_kv - tail:] = -np.inf
        if holes:
            M[r, rng.choice(n_kv, holes, replace=False)] = -np.inf
    return M


def _run(Q, K, V, M, *, scale, cells, chunks, threads, kv_type, op="attn_decode", softcap=0.0, avx512=True):
    """attn_decode (or ``op="attn_prefill"``, which has no chunks and takes a ``softcap``) on K/V
    laid out head-major (cells=False) or as a cache (cells=True: ne = (dk * n_head_kv, n_kv),
    viewed per head)."""
    n_head_kv, n_kv, dk = K.shape
    dv = V.shape[2]
    with ggmlpy.Context(64 << 20) as ctx:
        if cells:
            kc = ctx.from_numpy(K.transpose(1, 0, 2).reshape(n_kv, n_head_kv * dk).astype(kv_type))
            vc = ctx.from_numpy(V.transpose(1, 0, 2).reshape(n_kv, n_head_kv * dv).astype(kv_type))
            es = kc.nb[0]
            k = ctx.view(kc, (dk, n_kv, n_head_kv), (kc.nb[1], dk * es), 0)
            v = ctx.view(vc, (dv, n_kv, n_head_kv), (vc.nb[1], dv * es), 0)
        else:
            k, v = ctx.from_numpy(K.astype(kv_type)), ctx.from_numpy(V.astype(kv_type))
        q, m = ctx.from_numpy(Q), ctx.from_numpy(M) if M is not None else None
        if op == "attn_decode":
            o = ctx.attn_decode(q, k, v, m, scale=scale, n_chunks=chunks, avx512=avx512)
        else:
            o = ctx.attn_prefill(q, k, v, m, scale=scale, logit_softcap=softcap)
        assert tuple(o.ne[:3]) == (dv, Q.shape[1], Q.shape[0]) and o.type == ggmlpy.Type.F32
        gf = ctx.new_graph()
        gf.build_forward_expand(o)
        gf.compute(threads)
        return o.numpy()


CASES = [  # n_head, n_head_kv, dk, dv, n_q, n_kv, lead, tail, holes
    (12, 12, 64, 64, 1, 640, 0, 64, 5),        # the 110M model at depth, padded
    (8, 2, 64, 64, 3, 300, 0, 44, 3),          # grouped-query heads, several rows
    (4, 4, 128, 128, 2, 513, 100, 1, 0),       # a sliding window's leading run
    (6, 3, 72, 40, 5, 257, 0, 0, 17),          # K and V sizes differ
    (2, 1, 8, 8, 1, 3, 0, 0, 0),               # tiny
    (2, 1, 6, 5, 2, 9, 0, 2, 1),               # sizes that are not multiples of 8: the portable path
    (20, 4, 64, 64, 2, 300, 0, 20, 4),         # five query heads per K/V head
    (4, 2, 256, 256, 1, 200, 0, 8, 2),         # a large head size
]


@pytest.fixture(params=["heads", "cells", "cells-avx2"])
def layout(request):
    """The K/V layout and the path that reads it: one head's rows contiguous, or a cache's cells
    (on an AVX-512 CPU, grouped heads of sizes multiples of 16: its AVX-512 kernel; "cells-avx2"
    turns that off, so one machine checks both). Yields whether the layout is the cache's."""
    old = _core._attn_decode_allow_avx512(request.param != "cells-avx2")
    try:
        yield request.param != "heads"
    finally:
        _core._attn_decode_allow_avx512(old)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}/{}-d{}x{}-q{}-kv{}".format(*c[:6]))
@pytest.mark.parametrize("kv_type", [np.float16, np.float32], ids=["f16", "f32"])
def test_matches_numpy(case, kv_type, layout):
    cells = layout
    n_head, n_head_kv, dk, dv, n_q, n_kv, lead, tail, holes = case
    rng = np.random.default_rng(hash(case) % 2**32)
    Q = rng.standard_normal((n_q, n_head, dk)).astype(np.float32)
    K = (rng.standard_normal((n_head_kv, n_kv, dk)) * 2).astype(kv_type)
    V = rng.standard_normal((n_head_kv, n_kv, dv)).astype(kv_type)
    M = _mask(rng, n_q, n_kv, lead, tail, holes)
    scale = 1 / np.sqrt(dk)
    ref = _reference(Q, K, V, M, scale)
    for chunks in sorted({1, 2, 3, min(7, n_kv)}):
        for threads in (1, 2, 3):
            out = _run(Q, K, V, M, scale=scale, cells=cells, chunks=chunks, threads=threads, kv_type=kv_type)
            err = np.abs(out - ref).max() / np.abs(ref).max()
            assert err < TOL, (chunks, threads, err)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_grouped_heads_in_every_thread_split(group, head_dim, layout):
    """The cache path reads a kv head's row once for the query heads of its group (at most four at a
    time): every group size, head sizes of one, three and eight 16-float chunks, and thread counts
    whose split of the heads cuts groups in two (3 threads over 2 kv heads), two positions at a time
    with an odd last one (n_kv 203)."""
    n_head_kv, n_kv = 2, 203
    n_head = n_head_kv * group
    rng = np.random.default_rng(group * 1000 + head_dim)
    Q = rng.standard_normal((2, n_head, head_dim)).astype(np.float32)
    K = rng.standard_normal((n_head_kv, n_kv, head_dim)).astype(np.float16)
    V = rng.standard_normal((n_head_kv, n_kv, head_dim)).astype(np.float16)
    M = _mask(rng, 2, n_kv, lead=3, tail=10, holes=9)
    scale = head_dim ** -0.5
    ref = _reference(Q, K, V, M, scale)
    for chunks, threads in ((1, 1), (1, 3), (2, 2), (3, 3), (4, 2)):
        out = _run(Q, K, V, M, scale=scale, cells=layout, chunks=chunks, threads=threads, kv_type=np.float16)
        assert np.abs(out - ref).max() / np.abs(ref).max() < TOL, (chunks, threads)


@pytest.mark.parametrize("kv_type", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("portable", [False, True], ids=["vectorised", "portable"])
def test_masked_cells_are_never_read_into_the_result(layout, kv_type, portable):
    """A cell the mask hides may hold anything (a cache's cells no sequence has written): NaN and
    inf there, in K and in V, inside and at the ends of the visible span, change nothing. ggml's
    flash attention skips such cells too."""
    rng = np.random.default_rng(11)
    Q = rng.standard_normal((2, 8, 32)).astype(np.float32)
    K = rng.standard_normal((2, 300, 32)).astype(kv_type)
    V = rng.standard_normal((2, 300, 32)).astype(kv_type)
    M = np.zeros((2, 300), np.float16)
    hidden = np.r_[0:5, 70:75, 151, 152, 153, 290:300]
    M[:, hidden] = -np.inf
    ref = _reference(Q, K, V, M, 0.2)
    K[:, hidden[::2]] = np.nan
    K[:, hidden[1::2]] = np.inf
    V[:, hidden[::3]] = np.nan
    V[:, hidden[1::3]] = -np.inf
    old = _core._kernels_force_portable(portable)
    try:
        for chunks in (1, 2, 3):
            out = _run(Q, K, V, M, scale=0.2, cells=layout, chunks=chunks, threads=2, kv_type=kv_type)
            assert np.isfinite(out).all(), chunks
            assert np.abs(out - ref).max() / np.abs(ref).max() < TOL, chunks
    finally:
        _core._kernels_force_portable(old)


@pytest.mark.skipif(not _core._attn_decode_avx512(64, 64), reason="no AVX-512 on this CPU")
def test_each_node_takes_the_path_it_was_built_with():
    """``avx512=False`` keeps one node on the AVX2 path (the calibration times both and builds the
    faster): its values are bit for bit those of the AVX2 path chosen process-wide, ``avx512=True``'s
    those of the AVX-512 path, and the two paths differ in the last bits (their sums go in other
    orders), so each comparison would see a node on the wrong path."""
    rng = np.random.default_rng(21)
    Q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    K = rng.standard_normal((2, 300, 64)).astype(np.float16)
    V = rng.standard_normal((2, 300, 64)).astype(np.float16)
    M = _mask(rng, 2, 300, 0, 20, 7)
    run = functools.partial(_run, Q, K, V, M, scale=0.125, cells=True, chunks=2, threads=2, kv_type=np.float16)
    wide, narrow = run(avx512=True), run(avx512=False)
    old = _core._attn_decode_allow_avx512(False)
    try:
        assert np.array_equal(run(avx512=True), narrow)      # the switch keeps every node on AVX2
    finally:
        _core._attn_decode_allow_avx512(old)
    assert not np.array_equal(wide, narrow)
    ref = _reference(Q, K, V, M, 0.125)
    for out in (wide, narrow):
        assert np.abs(out - ref).max() / np.abs(ref).max() < TOL


@pytest.mark.parametrize("distance", [0, 1, 8, 64])
def test_prefetch_distance_changes_no_value(distance):
    # the cache layout the prefetch reads ahead in, with the prefetch running past the cache's end
    n_head, n_head_kv, dk, dv, n_q, n_kv, lead, tail, holes = CASES[1]
    rng = np.random.default_rng(7)
    Q = rng.standard_normal((n_q, n_head, dk)).astype(np.float32)
    K = rng.standard_normal((n_head_kv, n_kv, dk)).astype(np.float16)
    V = rng.standard_normal((n_head_kv, n_kv, dv)).astype(np.float16)
    M = _mask(rng, n_q, n_kv, lead, tail, holes)
    old = _core._attn_decode_prefetch(distance)
    try:
        assert _core._attn_decode_prefetch() == distance
        out = _run(Q, K, V, M, scale=0.125, cells=True, chunks=2, threads=2, kv_type=np.float16)
    finally:
        _core._attn_decode_prefetch(old)
    ref = _reference(Q, K, V, M, 0.125)
    assert np.abs(out - ref).max() / np.abs(ref).max() < TOL
    with pytest.raises(GGMLValueError, match="outside"):
        _core._attn_decode_prefetch(65)
    assert _core._attn_decode_prefetch() == old


def test_without_mask_and_fully_masked_rows():
    rng = np.random.default_rng(1)
    Q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    K = rng.standard_normal((2, 50, 16)).astype(np.float16)
    V = rng.standard_normal((2, 50, 16)).astype(np.float16)
    ref = _reference(Q, K, V, np.zeros((3, 50), np.float16), 0.3)
    np.testing.assert_allclose(_run(Q, K, V, None, scale=0.3, cells=False, chunks=2, threads=2, kv_type=np.float16),
                               ref, rtol=0, atol=TOL * np.abs(ref).max())
    M = np.zeros((3, 50), np.float16)
    M[1] = -np.inf                                         # row 1 sees nothing
    M[2, :30] = -np.inf                                    # row 2: its first chunk is all masked
    out = _run(Q, K, V, M, scale=0.3, cells=True, chunks=3, threads=2, kv_type=np.float16)
    assert np.all(out[1] == 0.0)
    ref = _reference(Q, K, V, M, 0.3)
    assert np.abs(out - ref).max() < TOL * np.abs(ref).max()


def test_large_scores_do_not_overflow():
    """Scores of several hundred: the running maximum keeps every exp in range."""
    rng = np.random.default_rng(2)
    Q = (rng.standard_normal((1, 2, 32)) * 30).astype(np.float32)
    K = (rng.standard_normal((2, 400, 32)) * 4).astype(np.float16)
    V = rng.standard_normal((2, 400, 32)).astype(np.float16)
    M = np.zeros((1, 400), np.float16)
    out = _run(Q, K, V, M, scale=1.0, cells=True, chunks=2, threads=2, kv_type=np.float16)
    ref = _reference(Q, K, V, M, 1.0)
    assert np.isfinite(out).all() and np.abs(out - ref).max() < TOL * np.abs(ref).max()


def test_a_masked_run_inside_the_row():
    """Whole blocks masked between visible ones (the running state carried across them), in every
    chunking: a chunk that starts or ends inside the run, or sees nothing but it."""
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((2, 12, 64)).astype(np.float32)
    K = (rng.standard_normal((12, 700, 64)) * 2).astype(np.float16)
    V = rng.standard_normal((12, 700, 64)).astype(np.float16)
    M = np.zeros((2, 700), np.float16)
    M[0, 20:500] = -np.inf
    M[1, 130:400] = -np.inf
    ref = _reference(Q, K, V, M, 0.125)
    for chunks in (1, 2, 3, 5):
        out = _run(Q, K, V, M, scale=0.125, cells=True, chunks=chunks, threads=2, kv_type=np.float16)
        assert np.abs(out - ref).max() / np.abs(ref).max() < TOL, chunks


def test_agrees_with_flash_attn_ext():
    """The two kernels the models switch between give the same attention (to flash_attn_ext's own
    float16 accuracy)."""
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    K = rng.standard_normal((4, 256, 64)).astype(np.float16)
    V = rng.standard_normal((4, 256, 64)).astype(np.float16)
    M = _mask(rng, 2, 256, tail=40)
    with ggmlpy.Context(16 << 20) as ctx:
        q, k, v, m = (ctx.from_numpy(a) for a in (Q, K, V, M))
        ours = ctx.attn_decode(q, k, v, m, scale=0.125, n_chunks=2)
        fa = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, m, scale=0.125)
        gf = ctx.new_graph()
        gf.build_forward_expand(ours)
        gf.build_forward_expand(fa)
        gf.compute(2)
        assert ours.shape == fa.shape
        np.testing.assert_allclose(ours.numpy(), fa.numpy(), rtol=0, atol=1e-2)
        ref = _reference(Q, K, V, M, 0.125)
        assert np.abs(ours.numpy() - ref).max() < np.abs(fa.numpy() - ref).max()


def _bad(ctx, n_chunks=1, op="attn_decode", **over):
    """attn_decode (or ``op``) on no_alloc tensors of valid shapes, some replaced by ``over``: name -> (type, ne)
    or a Tensor."""
    shapes = dict(q=("F32", (64, 8, 2)), k=("F16", (64, 100, 4)), v=("F16", (64, 100, 4)), mask=("F16", (100, 2)))
    shapes.update(over)
    t = {name: spec if isinstance(spec, ggmlpy.Tensor) else ctx.new_tensor(getattr(ggmlpy.Type, spec[0]), spec[1])
         for name, spec in shapes.items()}
    if op == "attn_prefill":
        return ctx.attn_prefill(t["q"], t["k"], t["v"], t["mask"], scale=1.0)
    return ctx.attn_decode(t["q"], t["k"], t["v"], t["mask"], scale=1.0, n_chunks=n_chunks)


@pytest.mark.parametrize("over, exc, words", [
    (dict(q=("F16", (64, 8, 2))), GGMLTypeError, "q has type f16"),
    (dict(k=("Q8_0", (64, 100, 4))), GGMLTypeError, "k has type q8_0"),
    (dict(k=("F16", (32, 100, 4))), GGMLValueError, "shapes do not match"),
    (dict(k=("F16", (64, 100, 3)), v=("F16", (64, 100, 3))), GGMLValueError, "n_head % n_head_kv"),
    (dict(v=("F16", (64, 99, 4))), GGMLValueError, "shapes do not match"),
    (dict(q=("F32", (64, 8, 2, 2))), GGMLValueError, "3 dimensions"),
    (dict(mask=("F16", (99, 2))), GGMLValueError, "mask does not fit"),
    (dict(mask=("F16", (100, 1))), GGMLValueError, "mask does not fit"),
    (dict(mask=("F16", (100, 2, 8))), GGMLValueError, "shared by the heads"),
    (dict(mask=("F32", (100, 2))), GGMLTypeError, "mask has type f32"),
    (dict(q=("F32", (2048, 8, 2)), k=("F16", (2048, 100, 4))), GGMLValueError, "head sizes above 1024"),
    (dict(n_chunks=0), GGMLValueError, r"n_chunks must be in 1\.\.n_kv = 100"),
    (dict(n_chunks=101), GGMLValueError, r"n_chunks must be in 1\.\.n_kv = 100"),
])
def test_refuses_what_it_cannot_compute(over, exc, words):
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        with pytest.raises(exc, match=words):
            _bad(ctx, **over)


def test_transposed_rows_are_refused():
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        k = ctx.new_tensor(ggmlpy.Type.F16, (100, 64, 4))
        with pytest.raises(GGMLValueError, match="k must have contiguous rows"):
            _bad(ctx, k=ctx.permute(k, 1, 0, 2, 3))


@pytest.mark.skipif(not _core._attn_decode_vectorized(64, 64),
                    reason="no vectorised kernel on this CPU: the models keep flash_attn_ext")
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_runner_logits_with_and_without_the_kernel(tmp_path, monkeypatch, avx512):
    """Generation at depth through the runner: the logits with the kernel (each of its vectorised
    paths) equal those with ggml's flash attention, and the kernel really ran. F32 weights and cache:
    both sides exact to float32 rounding (with F16 weights ggml rounds the activations to float16,
    where a last-bit difference in the attention can move a value by an ulp of float16)."""
    if avx512 and not _core._attn_decode_avx512(16, 16):
        pytest.skip("no AVX-512 on this CPU")
    old = _core._attn_decode_allow_avx512(avx512)
    try:
        _runner_logits(tmp_path, monkeypatch)
    finally:
        _core._attn_decode_allow_avx512(old)


def _runner_logits(tmp_path, monkeypatch):
    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import write_synthetic
    from ggmlpy.runner import Runner

    path = write_synthetic(tmp_path / "m.gguf", "tiny", "F32")
    model = load_model(path, devices="cpu")
    calls = []
    real = blocks._decode_chunks            # asked only when attention takes attn_decode

    def spy(n_kv):
        calls.append(n_kv)
        return real(n_kv)

    monkeypatch.setattr(blocks, "_decode_chunks", spy)
    prompt = np.arange(300, dtype=np.int32) % 200 + 1
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "decode_kernel", on)
        del calls[:]
        rt = Runner(model, n_ctx=512, n_seq_max=2, n_threads=2, type_k="f32", type_v="f32")
        rt.decode(prompt, seq=0, logits="last")
        rt.decode(prompt[:50], seq=1, logits="last")
        steps = []
        for i in range(4):                      # both sequences, one token each: 2 query rows
            steps.append(rt.decode_batch([5 + i, 9 + i], [300 + i, 50 + i], [0, 1], [True, True]).copy())
        logits[on] = np.stack(steps)
        rt.close()
        assert bool(calls) == on                # the prompts (300 and 50 rows) keep flash_attn_ext
    ref = logits[False]
    np.testing.assert_allclose(logits[True], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
