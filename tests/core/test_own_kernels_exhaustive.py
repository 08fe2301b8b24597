"""ggmlpy's own CPU kernels against numpy in float64 over every head size and row length.

The own ops (``attn_prefill``, ``attn_decode``, ``mul_mat_vec``, ``mul_mat_id_vec``, ``geglu_tanh``)
have vectorised loops that run for some sizes only (multiples of 8 or 16, whole blocks) and portable
ones for the rest, and each has tails: of head sizes, of rows, of tiles and blocks. Here every op
runs over every size from 1 to 256: attention with every K head size against varied V sizes, every
V size against varied K sizes, both equal, and random pairs; the products over every row length of
the float weight types and every whole-block one of Q8_0/Q4_0/Q5_0 (and Q4_0 repacked where ggml
repacks it); GeGLU over every row length. Odd row counts and head counts, inputs that are views
(padded strides, offsets, a cache's cell-major layout, masks wider and taller than needed) whose
padding is NaN, so a read outside the view shows; 1-3 threads. Everything twice: on the vectorised
path and with ``_core._kernels_force_portable(True)`` on the portable one (on a CPU without the
vector kernels both runs are portable). Many sizes go into one graph, so the sweep takes seconds.
Then one hypothesis test per op: random shapes, strides, masks, thread counts and paths
(``GGMLPY_KERNEL_CASES=N`` runs N examples each instead of the profile's, at most 60).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggmlpy
from ggmlpy import Type, _core

D = np.arange(1, 257)          # every head size / row length the sweeps cover

#: attention, against float64: float32 arithmetic over at most a few hundred positions, relative to
#: the largest |V| (the output is a convex combination of V's rows); observed below 1e-6
TOL_ATTN = 1e-5
#: products, relative to sum |w| |x| of the row (float32 sums of up to 512 terms)
TOL_DOT = 2e-5
#: GeGLU: relative where |ref| > 1e-3 (a few float32 ulps of the sigmoid), absolute below
TOL_GLU, ATOL_GLU = 4e-6, 1e-9

PATHS = pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])


@contextlib.contextmanager
def _path(portable):
    old = _core._kernels_force_portable(portable)
    try:
        yield
    finally:
        _core._kernels_force_portable(old)


# ---- inputs as views -----------------------------------------------------------------------------

def _view(ctx, rng, A, *, type=None, swap=False, pad=True):
    """A (numpy order: (n2, n1, n0), rows last) as a ggml view (n0, n1, n2) of a larger tensor whose
    every dimension is padded before and after with NaN (or, for integers, -1); with ``swap`` the
    outer two dimensions are stored the other way round (a KV cache: a cell's heads side by side,
    nb[2] < nb[1]). ``type`` converts float data (F16, BF16) as ``from_numpy`` does."""
    B = np.swapaxes(A, 0, 1) if swap else A
    before = rng.integers(0, 3, 3) if pad else np.zeros(3, int)
    after = rng.integers(0, 3, 3) if pad else np.zeros(3, int)
    S = tuple(int(b + x + y) for b, x, y in zip(B.shape, before, after))
    fill = -1 if A.dtype.kind == "i" else np.nan
    store = np.full(S, fill, A.dtype)
    store[before[0]:before[0] + B.shape[0], before[1]:before[1] + B.shape[1], before[2]:before[2] + B.shape[2]] = B
    t = ctx.from_numpy(store, type)
    es = t.nb[0]
    off = int((before[0] * S[1] + before[1]) * S[2] + before[2]) * es
    inner, outer = S[2] * es, S[1] * S[2] * es
    n2, n1, n0 = A.shape
    return ctx.view(t, (n0, n1, n2), (outer, inner) if swap else (inner, outer), off)


def _bf16(a):
    """float32 rounded to bfloat16 as ggml rounds it (to nearest even), back in float32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


# ---- attention ---------------------------------------------------------------------------------

def _attn_reference(Q, K, V, M, scale, softcap=0.0):
    """softmax(s + mask) v in float64, s = scale q.k or softcap * tanh(scale q.k / softcap); Q (n_q,
    n_head, dk), K (n_head_kv, n_kv, dk), V (n_head_kv, n_kv, dv), M (n_q, n_kv) or None; a row that
    sees nothing gives zeros."""
    group = Q.shape[1] // K.shape[0]
    Kf, Vf = (np.repeat(a.astype(np.float64), group, 0) for a in (K, V))
    s = np.einsum("qhd,hkd->qhk", Q.astype(np.float64), Kf) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if M is not None:
        s = s + M.astype(np.float64)[:, None, :]
    top = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0))          # a row that sees nothing: all 0
    total = p.sum(-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    return np.einsum("qhk,hkd->qhd", p, Vf)


def _mask(rng, n_q, n_kv, kind):
    """(n_q, n_kv) float16: causal at depth with holes and finite values, random, or with rows that see
    nothing (kind 1, 2, 3); None for kind 0."""
    if kind == 0:
        return None
    M = np.zeros((n_q, n_kv), np.float16)
    if kind == 1:
        depth = max(0, n_kv - n_q)
        for r in range(n_q):
            M[r, depth + r + 1:] = -np.inf
        M[rng.random((n_q, n_kv)) < 0.1] = -np.inf
    elif kind == 2:
        M[rng.random((n_q, n_kv)) < rng.random()] = -np.inf
    else:
        M[rng.random(n_q) < 0.5] = -np.inf
        M[:, : rng.integers(0, n_kv + 1)] = -np.inf            # a leading run (a sliding window)
    live = np.isfinite(M)
    M[live & (rng.random((n_q, n_kv)) < 0.2)] = np.float16(-1.5)
    return M


def _attn_case(ctx, rng, op, dk, dv, *, n_q, n_kv, n_head_kv, group, kv_type, cells, kind, chunks=1,
               softcap=0.0, views=True):
    """One attention node on random data laid out as views; its float64 reference and max |V|."""
    n_head = n_head_kv * group
    Q = rng.standard_normal((n_q, n_head, dk)).astype(np.float32)
    K = (rng.standard_normal((n_head_kv, n_kv, dk)) * 2).astype(kv_type)
    V = rng.standard_normal((n_head_kv, n_kv, dv)).astype(kv_type)
    M = _mask(rng, n_q, n_kv, kind)
    q = _view(ctx, rng, Q, pad=views)
    k = _view(ctx, rng, K, swap=cells, pad=views)
    v = _view(ctx, rng, V, swap=cells, pad=views)
    m = None
    if M is not None:
        # the mask may be wider and taller than needed: what lies past n_kv and n_q is never read
        extra = rng.integers(0, 3, 2) if views else (0, 0)
        big = np.full((n_q + extra[0], n_kv + extra[1]), np.nan, np.float16)
        big[:n_q, :n_kv] = M
        m = _view(ctx, rng, big[None], pad=views)
    scale = float(1 / np.sqrt(dk))
    if op == "attn_decode":
        o = ctx.attn_decode(q, k, v, m, scale=scale, n_chunks=chunks)
    else:
        o = ctx.attn_prefill(q, k, v, m, scale=scale, logit_softcap=softcap)
    assert tuple(o.ne[:3]) == (dv, n_head, n_q)
    return o, _attn_reference(Q, K, V, M, scale, softcap), float(np.abs(V.astype(np.float32)).max())


def _pairs(seed, vector_step, top=256):
    """(dk, dv, cells) cases: every size against itself (both multiples of ``vector_step`` where the
    vector kernel runs: those in both layouts, which it reads differently), every dk against a
    shuffled dv, every dv against a shuffled dk, and random pairs up to ``top``, half of them
    multiples of the vector step. ``cells`` None: a random layout."""
    rng = np.random.default_rng(seed)
    pairs = [(int(d), int(d)) for d in D]
    pairs += [(int(d), int(e)) for d, e in zip(D, rng.permutation(D))]
    pairs += [(int(e), int(d)) for d, e in zip(D, rng.permutation(D))]
    pairs += [tuple(int(x) for x in rng.integers(1, top + 1, 2)) for _ in range(32)]
    pairs += [tuple(int(x) * vector_step for x in rng.integers(1, top // vector_step + 1, 2)) for _ in range(32)]
    both = [(d, d, cells) for d in range(vector_step, 257, vector_step) for cells in (False, True)]
    return [(dk, dv, None) for dk, dv in pairs if dk != dv or dk % vector_step] + both


def _run_batches(cases, build, threads=(1, 2, 3), per_graph=48):
    """build(ctx, rng, case) -> (node, check) for each case, many nodes per graph; runs each graph
    once (the thread count cycling over ``threads``) and calls every check with its node's values."""
    failures = []
    for b in range(0, len(cases), per_graph):
        chunk = cases[b:b + per_graph]
        rng = np.random.default_rng(b)
        with ggmlpy.Context(256 << 20) as ctx:
            built = [build(ctx, rng, c) for c in chunk]
            gf = ctx.new_graph(8192)
            for node, _ in built:
                gf.build_forward_expand(node)
            gf.compute(threads[(b // per_graph) % len(threads)])
            for c, (node, check) in zip(chunk, built):
                msg = check(node.numpy())
                if msg:
                    failures.append((c, msg))
    assert not failures, f"{len(failures)} of {len(cases)} cases wrong, e.g. {failures[:6]}"


def _attn_check(ref, vmax):
    def check(out):
        out = out.reshape(ref.shape)
        err = np.abs(out - ref).max() / max(vmax, 1e-3)
        return None if err <= TOL_ATTN else f"error {err:.3g}"
    return check


@PATHS
@pytest.mark.parametrize("op", ["attn_prefill", "attn_decode"])
def test_attention_every_head_size(op, portable):
    """K and V head sizes 1..256 each (attn_prefill's range; attn_decode, which takes up to 1024,
    also random pairs up to that), odd query row counts around the 64-row tile, cache lengths around
    the 64- and 128-position blocks, grouped-query heads, every mask kind, F16 and F32 caches in both
    layouts, and chunks."""
    prefill = op == "attn_prefill"
    cases = _pairs(1, 16) if prefill else _pairs(2, 8, top=1024)
    sizes_q = (1, 3, 5, 7, 63, 65, 67) if prefill else (1, 2, 3, 5)
    sizes_kv = (1, 2, 5, 17, 63, 64, 65, 100, 129, 130)

    def build(ctx, rng, case):
        dk, dv, cells = case
        n_kv = int(rng.choice(sizes_kv))
        o, ref, vmax = _attn_case(
            ctx, rng, op, dk, dv, n_q=int(rng.choice(sizes_q)), n_kv=n_kv, n_head_kv=int(rng.integers(1, 3)),
            group=int(rng.integers(1, 4)), kv_type=np.float16 if rng.random() < 0.5 else np.float32,
            cells=bool(rng.random() < 0.5) if cells is None else cells, kind=int(rng.integers(0, 4)),
            chunks=int(rng.integers(1, min(3, n_kv) + 1)))
        return o, _attn_check(ref, vmax)

    with _path(portable):
        _run_batches(cases, build)


# ---- products ----------------------------------------------------------------------------------

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q5_0")     # dot type Q8_0: reproducible with ggmlpy.quantize


def _weights(ctx, rng, wtype, shape, views=True):
    """A weight of numpy shape ``shape`` ((rows, k) or (n_expert, rows, k)) as a view with padded
    rows, experts and (whole-block) columns, and the float64 values it holds."""
    W = rng.standard_normal((1,) * (3 - len(shape)) + tuple(shape)).astype(np.float32)
    if wtype in FLOAT_TYPES:
        if wtype == "F16":
            W = W.astype(np.float16).astype(np.float32)
        elif wtype == "BF16":
            W = _bf16(W)
        w = _view(ctx, rng, W, type=getattr(Type, wtype), pad=views)
        return w, W.astype(np.float64).reshape(shape)
    t = getattr(Type, wtype)
    n2, n1, k = W.shape
    before = rng.integers(0, 2, 3) if views else np.zeros(3, int)
    after = rng.integers(0, 2, 3) if views else np.zeros(3, int)
    S = (n2 + before[0] + after[0], n1 + before[1] + after[1], k + 32 * (before[2] + after[2]))
    store = (rng.standard_normal(S) * 100).astype(np.float32)          # what the view must not reach
    store[before[0]:before[0] + n2, before[1]:before[1] + n1, 32 * before[2]:32 * before[2] + k] = W
    tensor = ctx.new_tensor(t, S[::-1])
    raw = ggmlpy.quantize(store.reshape(-1, S[2]), t)
    tensor.set_bytes(raw)
    deq = ggmlpy.dequantize(raw, t, S[2]).reshape(S)
    row = t.row_size(S[2])
    off = int(before[0] * S[1] + before[1]) * row + t.row_size(32 * before[2])
    w = ctx.view(tensor, (k, n1, n2), (row, row * S[1]), off)
    Wq = deq[before[0]:before[0] + n2, before[1]:before[1] + n1, 32 * before[2]:32 * before[2] + k]
    return w, Wq.astype(np.float64).reshape(shape)


def _as_dot_type(wtype, X):
    """The vectors X (float32, rows last) as the dot kernel sees them: converted to the weight type's
    dot type, as mul_mat converts them; and the largest per-element step that conversion may take
    differently from ggmlpy.quantize (one rounding of a Q8_0 value)."""
    if wtype == "F32":
        return X.astype(np.float64), 0.0
    if wtype == "F16":
        return X.astype(np.float16).astype(np.float64), 0.0
    if wtype == "BF16":
        return _bf16(X).astype(np.float64), 0.0
    k = X.shape[-1]
    deq = ggmlpy.dequantize(ggmlpy.quantize(X.reshape(-1, k), Type.Q8_0), Type.Q8_0, k).reshape(X.shape)
    return deq.astype(np.float64), float(np.abs(X).max()) / 127


def _dot_check(ref, bound):
    def check(out):
        out = out.reshape(ref.shape)
        bad = ~(np.abs(out - ref) <= bound) & ~(np.isnan(ref) & np.isnan(out))
        return None if not bad.any() else f"{int(bad.sum())} wrong, worst {np.nanmax(np.abs(out - ref) / bound):.3g}x"
    return check


def _mat_cases():
    """(type, k): every k in 1..256 for the float types, every whole-block k up to 512 for the
    quantized ones (twice: other row counts)."""
    cases = [(t, int(k)) for t in FLOAT_TYPES for k in D]
    cases += [(t, k) for t in QUANT_TYPES for k in range(32, 513, 32)] * 2
    return cases


def _mat_vec_build(ctx, rng, case, views=True):
    wtype, k = case
    n, m = int(rng.choice([1, 2, 3, 5, 7, 9, 17, 33, 65])), int(rng.integers(1, 5))
    w, W = _weights(ctx, rng, wtype, (n, k), views)
    X = rng.standard_normal((m, k)).astype(np.float32)
    x = _view(ctx, rng, X[None], pad=views)
    o = ctx.mul_mat_vec(w, x)
    assert tuple(o.ne[:2]) == (n, m)
    Xd, step = _as_dot_type(wtype, X)
    ref = Xd @ W.T
    bound = TOL_DOT * (np.abs(Xd) @ np.abs(W).T) + 2 * step * np.abs(W).max(1)[None, :] + 1e-30
    return o, _dot_check(ref, bound)


@PATHS
def test_mul_mat_vec_every_row_length(portable):
    """Row lengths 1..256 (F32, F16, BF16) and every whole block up to 512 (Q8_0: the VNNI kernel
    two rows at a time on the vector path; Q4_0, Q5_0), odd row counts (the VNNI kernel's lone last
    row), 1-4 vectors, weights and vectors as padded views."""
    with _path(portable):
        _run_batches(_mat_cases(), _mat_vec_build)


def _mat_id_build(ctx, rng, case, views=True):
    wtype, k = case
    rows, n_expert = int(rng.choice([1, 3, 5, 8, 9, 17])), int(rng.integers(1, 5))
    n_used, n_tok = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    xb = 1 if rng.random() < 0.5 else n_used
    w, W = _weights(ctx, rng, wtype, (n_expert, rows, k), views)
    X = rng.standard_normal((n_tok, xb, k)).astype(np.float32)
    ids = rng.integers(-1, n_expert + 1, (1, n_tok, n_used)).astype(np.int32)   # out of range: NaN rows
    x = _view(ctx, rng, X, pad=views)
    i = _view(ctx, rng, ids, pad=views)
    o = ctx.mul_mat_id_vec(w, x, i)
    assert tuple(o.ne[:3]) == (rows, n_used, n_tok)
    Xd, step = _as_dot_type(wtype, X)
    ref = np.full((n_tok, n_used, rows), np.nan)
    bound = np.ones_like(ref)
    for t in range(n_tok):
        for s in range(n_used):
            e = ids[0, t, s]
            if 0 <= e < n_expert:
                xv = Xd[t, s % xb]
                ref[t, s] = W[e] @ xv
                bound[t, s] = TOL_DOT * (np.abs(W[e]) @ np.abs(xv)) + 2 * step * np.abs(W[e]).max(1) + 1e-30
    return o, _dot_check(ref, bound)


@PATHS
def test_mul_mat_id_vec_every_row_length(portable):
    """The experts' product over the same row lengths and types: odd row and expert counts, one
    vector per token or one per slot, ids out of range (NaN rows), every input a padded view (ids
    included)."""
    with _path(portable):
        _run_batches(_mat_cases(), _mat_id_build)


@pytest.mark.skipif(not _core._mul_mat_vec_vnni(), reason="no AVX-512 VNNI: no repacked Q4_0 kernel")
@PATHS
def test_mul_mat_vec_repacked_q4_0_every_row_length(portable):
    """Q4_0 in ggml's CPU_REPACK layout (8-row groups), every whole block up to 512 columns, 8-40
    rows, 1-3 vectors: the VNNI kernel against float64. The portable switch turns the kernel off
    (ggml's layout has no portable kernel of ours): the op then refuses the weight, and the models'
    check says no."""
    from test_repack import EXTRA
    from test_repack import _weight as _repack_weight

    if "CPU_REPACK" not in EXTRA:
        pytest.skip("no CPU_REPACK buffer here")
    from test_mul_mat_vec import _repacked_both

    rng = np.random.default_rng(5)
    with _path(portable):
        for k in range(32, 513, 32):
            n, m = 8 * int(rng.integers(1, 6)), int(rng.integers(1, 4))
            W = rng.standard_normal((n, k)).astype(np.float32)
            X = rng.standard_normal((m, k)).astype(np.float32)
            ctx, buf, w = _repack_weight("Q4_0", W, EXTRA["CPU_REPACK"])
            assert w.is_repacked
            if portable:
                assert not _core._mul_mat_vec_ok(w, m) and not _core._mul_mat_id_vec_ok(w, m)
                continue
            out = _repacked_both(w, X, threads=(int(rng.integers(1, 4)),))[0][0]
            Wd = ggmlpy.dequantize(ggmlpy.quantize(W, Type.Q4_0), Type.Q4_0, k).astype(np.float64)
            Xd, step = _as_dot_type("Q4_0", X)
            bound = TOL_DOT * (np.abs(Xd) @ np.abs(Wd).T) + 2 * step * np.abs(Wd).max(1)[None, :]
            assert (np.abs(out - Xd @ Wd.T) <= bound).all(), k


# ---- GeGLU -------------------------------------------------------------------------------------

def _glu_reference(X, G):
    x = X.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))) * G.astype(np.float64)


def _glu_data(rng, shape):
    X = (rng.standard_normal(shape) * 3).astype(np.float32)
    G = rng.standard_normal(shape).astype(np.float32)
    special = np.array([-100.0, -20.0, -10.0, -1e-3, 0.0, 1e-3, 3.0, 10.0, 100.0], np.float32)
    X.flat[: min(X.size, 9)] = special[: X.size]
    return X, G


def _contiguous_view(ctx, rng, A, views=True):
    """A as a contiguous view at an offset of 0-15 floats into a larger tensor (geglu_tanh takes
    contiguous inputs only): its rows start at any alignment."""
    off = int(rng.integers(0, 16)) if views else 0
    store = np.full(A.size + off + 3, np.nan, np.float32)
    store[off:off + A.size] = A.ravel()
    return ctx.view(ctx.from_numpy(store), A.shape[::-1], None, 4 * off)


def _glu_check(ref):
    def check(out):
        out = out.reshape(ref.shape)
        bad = ~(np.abs(out - ref) <= TOL_GLU * np.abs(ref) + ATOL_GLU)
        return None if not bad.any() else f"{int(bad.sum())} wrong"
    return check


def _glu_build(ctx, rng, case, views=True):
    n, split = case
    rows = (int(rng.choice([1, 2, 3, 5, 7])),) + ((int(rng.integers(1, 4)),) if rng.random() < 0.3 else ())
    X, G = _glu_data(rng, rows[::-1] + (n,))
    if split:
        o = ctx.geglu_tanh(_contiguous_view(ctx, rng, X, views), _contiguous_view(ctx, rng, G, views))
    else:
        o = ctx.geglu_tanh(_contiguous_view(ctx, rng, np.concatenate([X, G], axis=-1), views))
    return o, _glu_check(_glu_reference(X, G))


@PATHS
def test_geglu_tanh_every_row_length(portable):
    """Row lengths 1..256 and the chunk boundaries beyond (255-257, 511-513), fused and split, 1-7
    rows in 2 or 3 dimensions, inputs at every alignment."""
    cases = [(int(n), s) for n in list(D) + [257, 511, 512, 513, 1000] for s in (False, True)]
    with _path(portable):
        _run_batches(cases, _glu_build)


# ---- the switch ---------------------------------------------------------------------------------

def test_force_portable_switch():
    """The switch turns every vector kernel off (what the models ask before choosing one says no),
    the per-kernel switches stay as they were, and it comes back."""
    assert _core._kernels_force_portable() is False
    before = _core._attn_prefill_vectorized(64, 64), _core._geglu_vectorized()
    old = _core._kernels_force_portable(True)
    try:
        assert old is False and _core._kernels_force_portable() is True
        assert not _core._attn_prefill_vectorized(64, 64) and not _core._attn_decode_vectorized(64, 64)
        assert not _core._geglu_vectorized()
        assert _core._attn_prefill_allow_vector() and _core._geglu_allow_vector() and _core._mul_mat_vec_q8()
    finally:
        _core._kernels_force_portable(old)
    assert _core._kernels_force_portable() is False
    assert _core._attn_prefill_vectorized(64, 64) == before[0] and _core._geglu_vectorized() == before[1]


# ---- hypothesis: random shapes, strides, masks, threads and paths --------------------------------

def _one(build, case, seed, threads, portable, views):
    rng = np.random.default_rng(seed)
    with _path(portable), ggmlpy.Context(64 << 20) as ctx:
        node, check = build(ctx, rng, case)
        gf = ctx.new_graph()
        gf.build_forward_expand(node)
        gf.compute(threads)
        msg = check(node.numpy())
    assert msg is None, msg


common = dict(seed=st.integers(0, 2**32 - 1), threads=st.integers(1, 4), portable=st.booleans(),
              views=st.booleans())


def _bounded(n):
    """The profile's example count (tests/conftest.py: dev 50, ci 200), at most n; a long run sets it
    with GGMLPY_KERNEL_CASES (``GGMLPY_KERNEL_CASES=2000 pytest tests/core/test_own_kernels_exhaustive.py
    -k hypothesis``)."""
    cases = os.environ.get("GGMLPY_KERNEL_CASES")
    return settings(max_examples=int(cases) if cases else min(n, settings().max_examples), deadline=None)


@_bounded(60)
@given(op=st.sampled_from(["attn_prefill", "attn_decode"]), dk=st.integers(1, 256), dv=st.integers(1, 256),
       n_q=st.integers(1, 140), n_kv=st.integers(1, 300), n_head_kv=st.integers(1, 3), group=st.integers(1, 4),
       f16=st.booleans(), cells=st.booleans(), kind=st.integers(0, 3), chunks=st.integers(1, 8),
       softcap=st.sampled_from([0.0, 0.0, 2.0, 30.0]), big=st.booleans(), **common)
def test_attention_hypothesis(op, dk, dv, n_q, n_kv, n_head_kv, group, f16, cells, kind, chunks, softcap, big, seed,
                              threads, portable, views):
    if op == "attn_decode":                # few rows, no soft cap; head sizes up to its 1024
        n_q, softcap = 1 + n_q % 6, 0.0
        dk, dv = (dk * 4 - n_q % 4, dv * 4 - n_kv % 4) if big else (dk, dv)
    chunks = min(chunks, n_kv)

    def build(ctx, rng, _):
        o, ref, vmax = _attn_case(ctx, rng, op, dk, dv, n_q=n_q, n_kv=n_kv, n_head_kv=n_head_kv, group=group,
                                  kv_type=np.float16 if f16 else np.float32, cells=cells, kind=kind,
                                  chunks=chunks, softcap=softcap, views=views)
        return o, _attn_check(ref, vmax)

    _one(build, None, seed, threads, portable, views)


@_bounded(60)
@given(wtype=st.sampled_from(FLOAT_TYPES + QUANT_TYPES), k=st.integers(1, 512), experts=st.booleans(), **common)
def test_products_hypothesis(wtype, k, experts, seed, threads, portable, views):
    if wtype in QUANT_TYPES:
        k = 32 * (1 + k % 16)
    build = _mat_id_build if experts else _mat_vec_build
    _one(lambda ctx, rng, case: build(ctx, rng, case, views), (wtype, k), seed, threads, portable, views)


@_bounded(60)
@given(n=st.integers(1, 1100), split=st.booleans(), **common)
def test_geglu_tanh_hypothesis(n, split, seed, threads, portable, views):
    _one(lambda ctx, rng, case: _glu_build(ctx, rng, case, views), (n, split), seed, threads, portable, views)
