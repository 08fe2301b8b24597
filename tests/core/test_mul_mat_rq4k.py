"""``Context.mul_mat_rq4k``: a prompt's tokens through a Q4_K matrix ggml repacked, ggmlpy's AVX2 kernel.

Against ggml's repacked ``mul_mat`` bit for bit: ggml runs its 4-token gemm on the first ``m - m % 4``
tokens and its one-vector kernel (another float order) on the rest, so a token count that is a multiple
of 4 is compared whole, and any other count against ggml's result for the same tokens padded to a
multiple of 4 (each token's value here does not depend on the others). Shapes of one super-block to
ffn_down's 8192 columns, row groups that split unevenly over 1-3 threads, a thread's rows over several of
the kernel's windows, inputs that probe the quantization (zero rows, a row whose largest value is
negative, huge and tiny values), weights whose 6-bit scales and mins take many values; the refusals; a
Q4_K_M model's prompt with the kernel and without (the same logits).
"""

import numpy as np
import pytest
from test_mul_mat_vec import _on_cpu_backend
from test_repack import AVX2, EXTRA
from test_repack import _weight as _repack_weight

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, _core

#: ggml repacks Q4_K on x86 with AVX2, where the kernel runs
RQ4K = "CPU_REPACK" in EXTRA and AVX2 and not _core._kernels_force_portable()
needs_rq4k = pytest.mark.skipif(not RQ4K, reason="no repacked Q4_K here (CPU_REPACK on x86 with AVX2)")


def _weights(rng, n, k):
    """n x k float32 whose Q4_K scales and mins take many values (scaled by row and column, offset per
    32-column sub-block)."""
    W = rng.standard_normal((n, k)).astype(np.float32)
    W *= rng.uniform(0.1, 3.0, (n, 1)).astype(np.float32) * rng.uniform(0.2, 2.0, k).astype(np.float32)
    W += rng.uniform(-1, 1, (n, k // 32, 1)).repeat(32, axis=2).reshape(n, k).astype(np.float32)
    return W


def _both(w, X, threads=(1, 2, 3)):
    """mul_mat_rq4k's result for each thread count, and ggml's mul_mat's on X padded with zero tokens to a
    multiple of 4 (its gemm on every token), cut back to X's tokens."""
    m, k = X.shape
    pad = -(-m // 4) * 4
    g = ggmlpy.Context.for_tensors(8, graph_size=32, no_alloc=True)
    x = g.new_tensor("F32", (k, m))
    xp = g.new_tensor("F32", (k, pad))
    Xp = np.zeros((pad, k), np.float32)
    Xp[:m] = X
    outs, ref = _on_cpu_backend(g, g.mul_mat_rq4k(w, x), g.mul_mat(w, xp), [(x, X), (xp, Xp)], threads,
                                (-1, w.ne[1]))
    return outs, ref[:m]


@needs_rq4k
@pytest.mark.parametrize("shape", [(8, 256), (40, 512), (776, 2048), (64, 8192)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("m", [4, 5, 7, 64, 130])
def test_equals_mul_mat_exactly(shape, m):
    """776 rows: 97 groups of 8, split unevenly over 2 and 3 threads; 8192 columns: a group takes 88 KiB
    prepared, two per window."""
    rng = np.random.default_rng(shape[0] * 7 + m)
    W = _weights(rng, *shape)
    ctx, buf, w = _repack_weight("Q4_K", W, EXTRA["CPU_REPACK"])
    assert w.is_repacked and _core._mul_mat_rq4k_ok(w)
    X = rng.standard_normal((m, shape[1])).astype(np.float32)
    outs, ref = _both(w, X)
    assert ref.shape == (m, shape[0]) and np.isfinite(ref).all()
    for o in outs:
        np.testing.assert_array_equal(o, ref)
    if m % 4 == 0:      # no padding: ggml's result on the very same graph input
        assert np.abs(ref).max() > 1.0


@needs_rq4k
def test_a_thread_over_several_windows():
    """1600 rows of 256: 200 groups of 2752 prepared bytes, 71 to a 192 KiB window, so each of 1-3 threads
    prepares two or more windows and passes every token over each."""
    rng = np.random.default_rng(3)
    W = _weights(rng, 1600, 256)
    ctx, buf, w = _repack_weight("Q4_K", W, EXTRA["CPU_REPACK"])
    X = rng.standard_normal((36, 256)).astype(np.float32)
    outs, ref = _both(w, X)
    for o in outs:
        np.testing.assert_array_equal(o, ref)


@needs_rq4k
def test_inputs_that_probe_the_quantization():
    """Tokens ggml's Q8_K quantization treats specially: all zeros (scale 0), the largest magnitude
    negative (the scale's sign), one huge value among small ones, values near the float's smallest."""
    rng = np.random.default_rng(11)
    k = 512
    W = _weights(rng, 64, k)
    ctx, buf, w = _repack_weight("Q4_K", W, EXTRA["CPU_REPACK"])
    X = rng.standard_normal((8, k)).astype(np.float32)
    X[0] = 0.0
    X[1, 5] = -50.0
    X[2, :256] = 0.0
    X[3, 300] = 3e30
    X[4] *= 1e-36
    X[5, ::2] = -1.0                            # ties in magnitude, negative first
    X[5, 1::2] = 1.0
    outs, ref = _both(w, X, threads=(1, 2))
    for o in outs:
        np.testing.assert_array_equal(o, ref)
    assert (ref[0] == 0).all()


def test_refuses_what_it_cannot_compute():
    with ggmlpy.Context(4 << 20) as ctx:
        plain = ctx.new_tensor("Q4_K", (256, 8))
        x = ctx.new_tensor("F32", (256, 6))
        assert not _core._mul_mat_rq4k_ok(plain)
        with pytest.raises(GGMLValueError, match="mul_mat_rq4k: w must be a Q4_K matrix ggml repacked"):
            ctx.mul_mat_rq4k(plain, x)
        with pytest.raises(GGMLTypeError, match="mul_mat_rq4k"):
            ctx.mul_mat_rq4k(plain, ctx.new_tensor("F16", (256, 6)))


@needs_rq4k
def test_refuses_shapes_types_and_switched_off():
    rng = np.random.default_rng(5)
    ctx, buf, w = _repack_weight("Q4_K", _weights(rng, 16, 512), EXTRA["CPU_REPACK"])
    with ggmlpy.Context(4 << 20) as g:
        for shape in ((256, 6), (512, 6, 2)):
            with pytest.raises(GGMLValueError, match="mul_mat_rq4k: shapes do not match"):
                g.mul_mat_rq4k(w, g.new_tensor("F32", shape))
        with pytest.raises(GGMLTypeError, match="mul_mat_rq4k"):
            g.mul_mat_rq4k(w, g.new_tensor("F16", (512, 6)))
        for switch in (lambda on: _core._mul_mat_rq4k_allow(on), lambda on: not _core._kernels_force_portable(not on)):
            old = switch(False)
            try:
                assert not _core._mul_mat_rq4k_ok(w)
                with pytest.raises(GGMLValueError, match="mul_mat_rq4k: w must be"):
                    g.mul_mat_rq4k(w, g.new_tensor("F32", (512, 6)))
            finally:
                switch(old)
        assert _core._mul_mat_rq4k_ok(w)
    cq, bq, w0 = _repack_weight("Q4_0", np.ones((16, 512), np.float32), EXTRA["CPU_REPACK"])
    assert w0.is_repacked and not _core._mul_mat_rq4k_ok(w0)


@needs_rq4k
def test_a_prompt_through_a_repacked_q4_k_model(tmp_path, monkeypatch):
    """The synthetic llama in Q4_K_M (its Q4_K matrices repacked by ggml) takes mul_mat_rq4k at every
    Q4_K matrix of its prompt (the suite's kernel mode is "own"), with the logits of ggml's mul_mat at
    every position (60 tokens: a multiple of 4, so ggml's gemm covers every one)."""
    from dataclasses import replace

    from ggmlpy.models import blocks, load_model
    from ggmlpy.models.synthetic import SIZES, write_synthetic
    from ggmlpy.runner import Runner

    cfg = replace(SIZES["tiny"], n_embd=256, n_ff=512)          # Q4_K rows need whole 256-value blocks
    path = write_synthetic(tmp_path / "m.gguf", cfg, "Q4_K_M", arch="llama")
    taken = []
    ok = _core._mul_mat_rq4k_ok
    monkeypatch.setattr(blocks._core, "_mul_mat_rq4k_ok", lambda w: taken.append(ok(w)) or ok(w))
    logits = {}
    with load_model(path, devices="cpu") as model:
        q4k = [t for name, (t, _) in model.weights.tensors.items() if t.type.name == "Q4_K" and t.is_repacked]
        assert q4k
        for on in (True, False):
            monkeypatch.setattr(blocks, "gemm_kernel", on)
            del taken[:]
            with Runner(model, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=2) as rt:
                logits[on] = rt.decode(np.arange(60, dtype=np.int32) + 5, logits="all")
            assert taken.count(True) >= len(q4k) if on else not taken
    assert np.isfinite(logits[True]).all()
    np.testing.assert_array_equal(logits[True], logits[False])
