"""``Context.attn_prefill``: ggmlpy's CPU kernel for a prompt's attention.

Checked against numpy in float64 (``test_attn_decode._reference``) for causal prompts at depth 0
and deeper, grouped-query heads, K and V of different sizes (V sizes that are not multiples of 4 too), row
counts and cache lengths that are not multiples of the 64-row tiles and 64-position blocks, masks with
holes (several sequences in one batch), a sliding window, values other than 0 and -inf, rows that see
nothing, no mask at all, soft-
capped scores (gemma2); the
cache's layout (a cell's heads side by side) and a head-major one; float16 and float32 K/V; the
AVX-512 kernel and the portable one, 1-3 threads. Then against ``flash_attn_ext`` and through the
runner: a prompt's logits with the kernel and with ggml's flash attention.
"""

import numpy as np
import pytest
from test_attn_decode import _bad, _mask, _reference, _run

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, _core
from ggmlpy.models import blocks

# float32 throughout: attn_decode's bound. Observed: at most 1.5e-6 of the largest output over
# CASES, 5.7e-6 with scores of several hundred (their float32 rounding, ~6e-5, lands in the exp)
TOL = 1e-5

VECTOR = _core._attn_prefill_vectorized(64, 64)


def _causal(rng, n_q, n_kv, depth=0, tail=0, holes=0, window=0, value=None):
    """Row r sees positions up to depth + r (and, with ``window``, no further back than window - 1),
    minus ``holes`` random ones, never the last ``tail`` (padding); ``value`` puts one finite
    non-zero mask value in each row."""
    M = _mask(rng, n_q, n_kv, 0, tail, holes)
    for r in range(n_q):
        M[r, depth + r + 1:] = -np.inf
        if window:
            M[r, :max(0, depth + r + 1 - window)] = -np.inf
        if value is not None:
            M[r, rng.integers(0, depth + r + 1)] = value
    return M


CASES = [  # id, n_head, n_head_kv, dk, dv, n_q, n_kv, mask maker
    ("110M-prompt", 12, 12, 64, 64, 512, 512, lambda rng: _causal(rng, 512, 512)),
    ("gqa-at-depth", 8, 2, 64, 64, 130, 256, lambda rng: _causal(rng, 130, 256, depth=70, tail=56)),
    ("window-128", 4, 4, 128, 128, 64, 300, lambda rng: _causal(rng, 64, 300, depth=200, window=100, tail=36)),
    ("two-sequences", 6, 3, 80, 48, 100, 150, lambda rng: _causal(rng, 100, 150, depth=40, holes=30, value=-1.5)),
    ("dead-rows", 4, 2, 64, 64, 96, 96,
     lambda rng: np.where(np.arange(96)[:, None] % 9 == 0, np.float16(-np.inf), _causal(rng, 96, 96))),
    ("no-mask", 2, 2, 32, 32, 70, 200, lambda rng: None),
    ("head-256", 2, 1, 256, 256, 65, 130, lambda rng: _causal(rng, 65, 130, depth=65)),
    ("sizes-of-8", 2, 1, 8, 24, 70, 90, lambda rng: _causal(rng, 70, 90, depth=20)),   # not multiples of 16: portable
    # V sizes that end inside the product kernel's 4 rows (issue 33: it wrote past O into the softmax state)
    ("v-size-21", 3, 1, 13, 21, 70, 150, lambda rng: _causal(rng, 70, 150, depth=60)),
    ("v-size-6", 2, 2, 5, 6, 65, 200, lambda rng: _causal(rng, 65, 200, depth=100, holes=20)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("kv_type", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("cells", [False, True], ids=["heads", "cells"])
@pytest.mark.parametrize("vector", [True, False], ids=["avx512", "portable"])
def test_matches_numpy(case, kv_type, cells, vector):
    if vector and not VECTOR:
        pytest.skip("no AVX-512 on this CPU")
    _, n_head, n_head_kv, dk, dv, n_q, n_kv, make_mask = case
    rng = np.random.default_rng(sum(map(ord, case[0])))
    Q = rng.standard_normal((n_q, n_head, dk)).astype(np.float32)
    K = (rng.standard_normal((n_head_kv, n_kv, dk)) * 2).astype(kv_type)
    V = rng.standard_normal((n_head_kv, n_kv, dv)).astype(kv_type)
    M = make_mask(rng)
    scale = 1 / np.sqrt(dk)
    ref = _reference(Q, K, V, M if M is not None else np.zeros((n_q, n_kv), np.float16), scale)
    if M is not None:
        assert (np.abs(ref[np.isneginf(M).all(1)]) == 0).all()
    old = _core._attn_prefill_allow_vector(vector)
    try:
        outs = [_run(Q, K, V, M, scale=scale, cells=cells, chunks=1, threads=t, kv_type=kv_type, op="attn_prefill")
                for t in (1, 2, 3)]
    finally:
        _core._attn_prefill_allow_vector(old)
    err = np.abs(outs[0] - ref).max() / np.abs(ref).max()
    assert err < TOL, err
    # a unit of work (a tile of rows of a head) is one thread's whatever the count: identical results
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def _softcapped_reference(Q, K, V, M, scale, cap):
    """softmax(cap * tanh(scale q.k / cap) + mask) v in float64 (gemma2's attention)."""
    group = Q.shape[1] // K.shape[0]
    Kf, Vf = (np.repeat(a.astype(np.float64), group, 0) for a in (K, V))
    s = np.einsum("qhd,hkd->qhk", Q.astype(np.float64), Kf) * scale
    s = cap * np.tanh(s / cap) + M.astype(np.float64)[:, None, :]
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("qhk,hkd->qhd", p / p.sum(-1, keepdims=True), Vf)


@pytest.mark.parametrize("kv_type", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("vector", [True, False], ids=["avx512", "portable"])
@pytest.mark.parametrize("cap", [50.0, 2.0])
def test_soft_capping(kv_type, vector, cap):
    """gemma2's capped scores: cap * tanh(s / cap) before the mask (a cap of 2 bends every score)."""
    if vector and not VECTOR:
        pytest.skip("no AVX-512 on this CPU")
    rng = np.random.default_rng(int(cap))
    n_q, n_head, n_head_kv, d, n_kv = 100, 4, 2, 64, 160
    Q = (rng.standard_normal((n_q, n_head, d)) * 3).astype(np.float32)
    K = (rng.standard_normal((n_head_kv, n_kv, d)) * 3).astype(kv_type)
    V = rng.standard_normal((n_head_kv, n_kv, d)).astype(kv_type)
    M = _causal(rng, n_q, n_kv, depth=60)
    ref = _softcapped_reference(Q, K, V, M, 0.125, cap)
    old = _core._attn_prefill_allow_vector(vector)
    try:
        with ggmlpy.Context(32 << 20) as ctx:
            q, k, v, m = (ctx.from_numpy(a) for a in (Q, K, V, M))
            ours = ctx.attn_prefill(q, k, v, m, scale=0.125, logit_softcap=cap)
            fa = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, m, scale=0.125, logit_softcap=cap)
            gf = ctx.new_graph()
            gf.build_forward_expand(ours)
            gf.build_forward_expand(fa)
            gf.compute(2)
            out, theirs = ours.numpy(), fa.numpy()
    finally:
        _core._attn_prefill_allow_vector(old)
    assert np.abs(out - ref).max() < TOL * np.abs(ref).max()
    assert np.abs(theirs - ref).max() < 1e-2 * np.abs(ref).max()     # ggml's, on float16 scores


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan")])
def test_soft_cap_must_be_a_positive_number(cap):
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        with pytest.raises(GGMLValueError, match="logit_softcap must be 0"):
            q, k, v = (ctx.new_tensor("F32", (64, 2, 70)), ctx.new_tensor("F16", (64, 80, 2)),
                       ctx.new_tensor("F16", (64, 80, 2)))
            ctx.attn_prefill(q, k, v, scale=1.0, logit_softcap=cap)


def test_large_scores_stay_finite():
    """Scores of several hundred across blocks: the running maximum rescales what was summed."""
    rng = np.random.default_rng(2)
    Q = (rng.standard_normal((80, 2, 32)) * 30).astype(np.float32)
    K = (rng.standard_normal((2, 400, 32)) * 4).astype(np.float16)
    V = rng.standard_normal((2, 400, 32)).astype(np.float16)
    M = _causal(rng, 80, 400, depth=300)
    out = _run(Q, K, V, M, scale=1.0, cells=True, chunks=1, threads=2, kv_type=np.float16, op="attn_prefill")
    ref = _reference(Q, K, V, M, 1.0)
    assert np.isfinite(out).all() and np.abs(out - ref).max() < TOL * np.abs(ref).max()


@pytest.mark.parametrize("kv_type", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("vector", [True, False], ids=["avx512", "portable"])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_masked_cells_are_never_read_into_the_result(kv_type, vector, cap):
    """A cell the mask hides may hold anything (a cache's cells no sequence has written): NaN and
    inf in K and V of cells every row hides, inside blocks the mask cuts and inside the visible
    span, change nothing; NaN in K where some rows see the cell leaves the rows that hide it as
    they were (their scores there are -inf whatever K holds). ggml's flash attention skips such cells too."""
    if vector and not VECTOR:
        pytest.skip("no AVX-512 on this CPU")
    rng = np.random.default_rng(12)
    n_q, n_head, n_head_kv, d, n_kv, depth = 100, 4, 2, 64, 260, 40
    Q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    K = rng.standard_normal((n_head_kv, n_kv, d)).astype(kv_type)
    V = rng.standard_normal((n_head_kv, n_kv, d)).astype(kv_type)
    M = _causal(rng, n_q, n_kv, depth=depth)
    hidden = np.r_[0:3, 10:15, 63, 64, 100:104, 139]            # every row hides these
    M[:, hidden] = -np.inf
    ref = (_softcapped_reference(Q, K, V, M, 0.125, cap) if cap else _reference(Q, K, V, M, 0.125))
    K[:, hidden[::2]] = np.nan
    K[:, hidden[1::2]] = np.inf
    V[:, hidden[::3]] = np.nan
    V[:, hidden[1::3]] = -np.inf
    K[:, 150:] = np.nan                                          # past every row's span
    V[:, 150:] = np.inf
    old = _core._attn_prefill_allow_vector(vector)
    try:
        for cells in (False, True):
            out = _run(Q, K, V, M, scale=0.125, cells=cells, chunks=1, threads=2, kv_type=kv_type, op="attn_prefill",
                       softcap=cap)
            assert np.isfinite(out).all(), cells
            assert np.abs(out - ref).max() < TOL * np.abs(ref).max(), cells
        # a cell rows 0..29 hide and the later rows see: NaN in its K leaves the rows that hide it
        # as they were (what the later rows get from a NaN they see is not specified)
        K[:, depth + 30] = np.nan
        out = _run(Q, K, V, M, scale=0.125, cells=True, chunks=1, threads=2, kv_type=kv_type, op="attn_prefill",
                   softcap=cap)
    finally:
        _core._attn_prefill_allow_vector(old)
    assert np.abs(out[:30] - ref[:30]).max() < TOL * np.abs(ref).max()


def test_agrees_with_flash_attn_ext():
    """The kernel the models take for prompts and the one it replaces give the same attention."""
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((200, 8, 64)).astype(np.float32)
    K = rng.standard_normal((4, 256, 64)).astype(np.float16)
    V = rng.standard_normal((4, 256, 64)).astype(np.float16)
    M = _causal(rng, 200, 256, depth=30, tail=26)
    with ggmlpy.Context(64 << 20) as ctx:
        q, k, v, m = (ctx.from_numpy(a) for a in (Q, K, V, M))
        ours = ctx.attn_prefill(q, k, v, m, scale=0.125)
        fa = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, m, scale=0.125)
        gf = ctx.new_graph()
        gf.build_forward_expand(ours)
        gf.build_forward_expand(fa)
        gf.compute(2)
        assert ours.shape == fa.shape
        ref = _reference(Q, K, V, M, 0.125)
        # ggml's tiled prompt kernel is float32 too (measured 8e-7 of the largest output, ours 1e-6)
        for out in (ours.numpy(), fa.numpy()):
            assert np.abs(out - ref).max() < TOL * np.abs(ref).max()


def test_q_as_a_view_of_fused_projections():
    """q as the models pass it from a fused QKV product: a view whose rows are further apart than
    its heads."""
    rng = np.random.default_rng(4)
    n_q, n_head, dk = 100, 4, 64
    fused = rng.standard_normal((n_q, 3 * n_head * dk)).astype(np.float32)
    K = rng.standard_normal((n_head, 120, dk)).astype(np.float16)
    V = rng.standard_normal((n_head, 120, dk)).astype(np.float16)
    M = _causal(rng, n_q, 120, depth=20)
    with ggmlpy.Context(32 << 20) as ctx:
        f = ctx.from_numpy(fused)
        q = ctx.view(f, (dk, n_head, n_q), (dk * 4, f.nb[1]), 0)
        o = ctx.attn_prefill(q, ctx.from_numpy(K), ctx.from_numpy(V), ctx.from_numpy(M), scale=0.125)
        gf = ctx.new_graph()
        gf.build_forward_expand(o)
        gf.compute(2)
        out = o.numpy()
    ref = _reference(fused[:, :n_head * dk].reshape(n_q, n_head, dk), K, V, M, 0.125)
    assert np.abs(out - ref).max() < TOL * np.abs(ref).max()


@pytest.mark.parametrize("over, exc, words", [
    (dict(q=("F16", (64, 8, 2))), GGMLTypeError, "attn_prefill: q has type f16"),
    (dict(k=("Q8_0", (64, 100, 4))), GGMLTypeError, "k has type q8_0"),
    (dict(k=("F16", (32, 100, 4))), GGMLValueError, "shapes do not match"),
    (dict(k=("F16", (64, 100, 3)), v=("F16", (64, 100, 3))), GGMLValueError, "n_head % n_head_kv"),
    (dict(mask=("F16", (99, 2))), GGMLValueError, "mask does not fit"),
    (dict(mask=("F32", (100, 2))), GGMLTypeError, "mask has type f32"),
    (dict(q=("F32", (512, 8, 2)), k=("F16", (512, 100, 4)), v=("F16", (64, 100, 4))), GGMLValueError,
     "head sizes above 256"),
])
def test_refuses_what_it_cannot_compute(over, exc, words):
    with ggmlpy.Context(8 << 20, no_alloc=True) as ctx:
        with pytest.raises(exc, match=words):
            _bad(ctx, op="attn_prefill", **over)


def test_vectorized_only_where_it_can_be():
    assert not _core._attn_prefill_vectorized(8, 8)          # not multiples of 16
    assert not _core._attn_prefill_vectorized(512, 64)       # above the stack tiles' bound
    old = _core._attn_prefill_allow_vector(False)
    try:
        assert not _core._attn_prefill_vectorized(64, 64)
    finally:
        _core._attn_prefill_allow_vector(old)
    assert _core._attn_prefill_vectorized(64, 64) == VECTOR


@pytest.mark.skipif(not VECTOR, reason="no AVX-512 on this CPU: the models keep flash_attn_ext for prompts")
def test_runner_logits_with_and_without_the_kernel(tmp_path, monkeypatch):
    """Prompts through the runner: the logits with the kernel equal those with ggml's flash
    attention, for one sequence and for two in one batch at depth, and the kernel really ran. F32
    weights and cache: with F16 weights the activations are rounded to float16 before each product,
    and a 1e-7 difference that crosses a rounding boundary shows as 2e-4 in the logits."""
    from test_arch_rpc import _f32_copy

    from ggmlpy.models import load_model
    from ggmlpy.models.synthetic import write_synthetic
    from ggmlpy.runner import Runner

    model = load_model(_f32_copy(write_synthetic(tmp_path / "m.gguf", "tiny", "F16"), tmp_path / "m32.gguf"),
                       devices="cpu")
    calls = []
    real = _core._attn_prefill_vectorized      # asked only when attention would take attn_prefill

    def spy(dk, dv):
        calls.append((dk, dv))
        return real(dk, dv)

    monkeypatch.setattr(blocks._core, "_attn_prefill_vectorized", spy)
    prompt = np.arange(300, dtype=np.int32) % 200 + 1
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(blocks, "prefill_kernel", on)
        del calls[:]
        rt = Runner(model, n_ctx=1024, n_seq_max=2, n_threads=2, type_k="f32", type_v="f32")
        out = [rt.decode(prompt, seq=0, logits="all").copy()]
        rt.decode(prompt[:50], seq=1, logits="last")
        # both sequences in one batch of 140 rows (a mask with each sequence's cells hidden from the other)
        toks = np.concatenate([prompt[:70] + 1, prompt[:70] + 2])
        pos = np.concatenate([np.arange(300, 370), np.arange(50, 120)])
        seqs = np.repeat([0, 1], 70)
        out.append(rt.decode_batch(toks, pos, seqs, np.ones(140, bool)).copy())
        out.append(rt.decode([7], seq=0, logits="last").copy())
        logits[on] = out
        rt.close()
        assert bool(calls) == on
    for got, ref in zip(logits[True], logits[False]):      # measured: 2e-7 of the largest logit
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
