"""``Context.mul_mat_id_rq``: the experts' product of a prompt on a Q4_0 or Q4_K stack ggml repacked.

Two kernels stand behind it: gemv.c's AVX-512 VNNI kernel (Q4_0 and Q4_K) and, on a CPU with AVX2 but
not VNNI, gemm.c's (Q4_K); each test runs whichever this CPU has, and is skipped where it has neither.

Against ggml's repacked ``mul_mat_id`` bit for bit (the same arithmetic per token and slot): one token to
a prompt's worth, inputs shared by the slots or one per slot, experts chosen by many tokens, by none, by
one, 1-3 threads, rows that split unevenly over the threads, a stack whose rows do not fit one block of
the kernel's cache tiling; an id out of range gives NaN rows; what it cannot compute is refused.
"""

import numpy as np
import pytest
from test_mul_mat_vec import EXTRA, RQ, RQ4, _needs_rq, _on_cpu_backend
from test_repack import _weight as _repack_weight

import ggmlpy
from ggmlpy import GGMLTypeError, GGMLValueError, _core

needs_rq4 = pytest.mark.skipif(not RQ4, reason="no repacked Q4_0/Q4_K kernel here (CPU_REPACK with AVX2, "
                                               "AVX-512 VNNI)")
needs_q4k = pytest.mark.skipif(not RQ["Q4_K"], reason="no repacked Q4_K kernel here (CPU_REPACK with AVX2)")


def _both(w, X, ids_np, threads=(1, 2, 3), reference=True):
    """mul_mat_id_rq's result for each thread count, and ggml's mul_mat_id's (None without reference)."""
    n_tokens, xb, k = X.shape
    g = ggmlpy.Context.for_tensors(8, graph_size=32, no_alloc=True)
    x = g.new_tensor("F32", (k, xb, n_tokens))
    ids = g.new_tensor("I32", ids_np.shape[::-1])
    theirs = g.mul_mat_id(w, x, ids) if reference else None
    return _on_cpu_backend(g, g.mul_mat_id_rq(w, x, ids), theirs, [(x, X), (ids, ids_np)], threads,
                           (n_tokens, -1, w.ne[1]))


def _ids(rng, n_tokens, n_expert, n_used, skew=False):
    """Each token's n_used distinct experts; ``skew``: most tokens choose among the first three experts and
    the last expert is never chosen."""
    p = np.full(n_expert, 1.0)
    if skew:
        p[:3], p[-1] = 40.0, 0.0
    p /= p.sum()
    return np.stack([rng.choice(n_expert, n_used, replace=False, p=p) for _ in range(n_tokens)]).astype(np.int32)


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("n_tokens", [1, 5, 64, 200])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "input-per-slot"])
def test_equals_mul_mat_id_exactly(wtype, n_tokens, per_slot):
    _needs_rq(wtype)
    rng = np.random.default_rng(n_tokens * 2 + per_slot)
    k, rows, n_expert, n_used = 512, 40, 6, 3
    W = rng.standard_normal((n_expert, rows, k)).astype(np.float32)
    X = rng.standard_normal((n_tokens, n_used if per_slot else 1, k)).astype(np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    assert w.is_repacked and _core._mul_mat_id_rq_ok(w)
    outs, ref = _both(w, X, _ids(rng, n_tokens, n_expert, n_used, skew=n_tokens > 5))
    assert ref.shape == (n_tokens, n_used, rows) and np.isfinite(ref).all()
    assert all(np.array_equal(o, ref) for o in outs)


@needs_q4k
def test_rows_beyond_one_cache_block():
    """An expert of 4096 rows of 2048 (Q4_K: 4.5 MiB, many of the kernel's 256 KiB row blocks per thread)
    with 30 tokens over 4 experts: each block meets every run of vectors."""
    rng = np.random.default_rng(7)
    k, rows, n_expert, n_used = 2048, 4096, 4, 2
    W = rng.standard_normal((n_expert, rows, k)).astype(np.float32)
    X = rng.standard_normal((30, 1, k)).astype(np.float32)
    ctx, buf, w = _repack_weight("Q4_K", W, EXTRA["CPU_REPACK"])
    outs, ref = _both(w, X, _ids(rng, 30, n_expert, n_used), threads=(2,))
    assert np.array_equal(outs[0], ref)


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K"])
def test_an_expert_id_out_of_range_gives_nan_rows(wtype):
    _needs_rq(wtype)
    k = 64 if wtype == "Q4_0" else 256
    W = np.ones((4, 8, k), np.float32)
    ctx, buf, w = _repack_weight(wtype, W, EXTRA["CPU_REPACK"])
    ids = np.array([[1, 7, -1], [2, 0, 3]], np.int32)
    outs, _ = _both(w, np.ones((2, 1, k), np.float32), ids, threads=(1, 2), reference=False)
    for out in outs:
        assert np.allclose(out[0, 0], k, rtol=1e-3) and np.isnan(out[0, 1:]).all()
        assert np.allclose(out[1], k, rtol=1e-3)


def test_refuses_what_it_cannot_compute():
    with ggmlpy.Context(1 << 20) as ctx:
        plain = ctx.new_tensor("Q4_0", (64, 8, 4))
        x = ctx.new_tensor("F32", (64, 1, 2))
        ids = ctx.new_tensor("I32", (2, 2))
        with pytest.raises(GGMLValueError, match="mul_mat_id_rq: as_ must be .* repacked"):
            ctx.mul_mat_id_rq(plain, x, ids)
        assert not _core._mul_mat_id_rq_ok(plain)
        with pytest.raises(GGMLTypeError, match="mul_mat_id_rq"):
            ctx.mul_mat_id_rq(plain, x, ctx.new_tensor("F32", (2, 2)))


@needs_rq4
def test_refuses_shapes_that_do_not_match():
    W = np.ones((4, 8, 64), np.float32)
    ctx, buf, w = _repack_weight("Q4_0", W, EXTRA["CPU_REPACK"])
    with ggmlpy.Context(1 << 20) as g:
        for x, ids in (((32, 1, 2), (2, 2)), ((64, 1, 3), (2, 2)), ((64, 3, 2), (2, 2))):
            with pytest.raises(GGMLValueError, match="mul_mat_id_rq: shapes do not match"):
                g.mul_mat_id_rq(w, g.new_tensor("F32", x), g.new_tensor("I32", ids))


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_K_M"])
def test_a_prompt_through_a_repacked_moe_model(tmp_path, monkeypatch, wtype):
    """The synthetic qwen3moe's prompt (its expert stacks repacked by ggml) takes mul_mat_id_rq in every
    expert layer (the suite's kernel mode is "own": where the stack qualifies, the op runs), with the
    logits of ggml's mul_mat_id at every position."""
    _needs_rq(wtype[:4])
    from dataclasses import replace

    from ggmlpy.models import blocks, load_model
    from ggmlpy.models.synthetic import SIZES, write_synthetic
    from ggmlpy.runner import Runner

    # Q4_K experts need rows of whole 256-value blocks: experts 256 wide (an eighth of n_ff) over n_embd 256
    cfg = SIZES["tiny"] if wtype == "Q4_0" else replace(SIZES["tiny"], n_embd=256, n_ff=2048)
    path = write_synthetic(tmp_path / "m.gguf", cfg, wtype, arch="qwen3moe")
    taken = []
    ok = _core._mul_mat_id_rq_ok
    monkeypatch.setattr(blocks._core, "_mul_mat_id_rq_ok", lambda w: taken.append(ok(w)) or ok(w))
    logits = {}
    with load_model(path, devices="cpu") as model:
        stacks = [t for name, t in model.weights.tensors.items() if name.endswith("_exps.weight")]
        q4 = [t for t, _ in stacks if t.type.name == wtype[:4]]      # Q4_K_M writes some Q6_K stacks too
        assert q4 and all(t.is_repacked for t in q4)
        for on in (True, False):
            monkeypatch.setattr(blocks, "experts_kernel", on)
            del taken[:]
            with Runner(model, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=2) as rt:
                logits[on] = rt.decode(np.arange(60, dtype=np.int32) + 5, logits="all")
            assert taken.count(True) >= len(q4) if on else not taken
    np.testing.assert_array_equal(logits[True], logits[False])
