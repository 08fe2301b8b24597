"""Tests for ggmlpy.kvcache.Causal, the host-memory causal KV cache.

The scenarios follow Ollama's ``kvcache/causal_test.go`` (padding 1, K and V
written with the same data, views and masks checked after ``get``).
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import _cache, _flat, _m, _step  # noqa: F401

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal, ForwardPlan, KVCacheFull, NotSupported

X = -np.inf










def _snapshot(cache: Causal):
    cells = cache.cells
    return (cells.pos.copy(), cells.seqs.copy(), cells.used,
            [k.get().copy() for k in cache.keys], [v.get().copy() for v in cache.values])


def _same(a, b) -> bool:
    return (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
            and all(np.array_equal(x, y) for x, y in zip(a[3] + a[4], b[3] + b[4])))


# ---------------------------------------------------------------- init and sizing


def test_init_sizes_and_bytes():
    c = Causal(2, 8, 16, Type.F16, n_head_kv=2)
    c.init(5, 2, 4)
    assert c.n_cells == 10
    assert [k.ne[:2] for k in c.keys] == [(8, 10)] * 2
    assert [v.ne[:2] for v in c.values] == [(16, 10)] * 2
    assert c.bytes_per_layer() == 10 * (8 + 16) * 2
    assert not c.keys[0].get().any() and not c.values[1].get().any()
    c.close()
    assert c.bytes_per_layer() == 0
    with pytest.raises(RuntimeError):
        c.start_forward([0], [0])

    p = Causal(1, 8, 8, Type.F32, padding=4)
    p.init(5, 2, 4)
    assert p.n_cells == 12

    q = Causal(1, 64, 64, Type.Q8_0, n_head_kv=2)
    q.init(4, 1, 4)
    assert q.bytes_per_layer() == 4 * 2 * (2 * 34)
    with pytest.raises(ValueError):
        Causal(1, 48, 48, Type.Q8_0, n_head_kv=2)  # head dim 24 is not a block multiple


def test_window_sizing():
    c = _cache(16, 1, 4, window=1)
    assert (c.memory, c.n_cells) == (1, 5)
    c = _cache(16, 2, 2, window=1)
    assert (c.memory, c.n_cells) == (2, 6)
    c = _cache(4, 2, 2, window=8)  # window >= capacity: unlimited
    assert (c.memory, c.n_cells) == (None, 8)


# ---------------------------------------------------------------- Ollama scenarios


@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_store(dtype):
    c = _cache(16, 1, 8, dtype, head_dim=2, n_head_kv=3)
    x = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    k, v, mask, plan = _step(c, [0, 1, 2, 3], [0, 0, 0, 0], x, -x)
    assert (plan.lo, plan.hi) == (0, 4)
    assert np.array_equal(k, x.transpose(1, 0, 2)) and np.array_equal(v, -x.transpose(1, 0, 2))
    assert np.array_equal(mask, _m("oxxx", "ooxx", "ooox", "oooo"))

    y = np.full((1, 3, 2), 100, dtype=np.float32)
    k, v, mask, plan = _step(c, [4], [0], y, y)
    assert k.shape == (3, 5, 2)
    assert np.array_equal(k, np.concatenate([x, y]).transpose(1, 0, 2))
    assert np.array_equal(mask, _m("ooooo"))


def test_sequences_in_one_batch():
    c = _cache(8, 2, 8)
    k, _, mask, plan = _step(c, [0, 0, 1, 1, 2], [0, 1, 0, 1, 0])
    assert plan.cell_ids.tolist() == [0, 1, 2, 3, 4] and plan.cell_ids.dtype == np.int64
    assert _flat(k) == [1, 1, 2, 2, 3]
    assert np.array_equal(mask, _m("oxxxx", "xoxxx", "oxoxx", "xoxox", "oxoxo"))

    k, _, mask, plan = _step(c, [3, 2], [0, 1])
    assert plan.cell_ids.tolist() == [5, 6] and (plan.lo, plan.hi) == (0, 7)
    assert _flat(k) == [1, 1, 2, 2, 3, 4, 3]
    assert np.array_equal(mask, _m("oxoxoox", "xoxoxxo"))
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 3, 0, 2)


def test_visible_range_covers_only_the_batch_sequences():
    c = _cache(8, 2, 8)
    _step(c, [0, 1], [0, 0])
    _, _, mask, plan = _step(c, [0, 1], [1, 1])
    assert (plan.lo, plan.hi) == (2, 4)
    assert np.array_equal(mask, _m("ox", "oo"))


def test_remove_to_end_and_reuse():
    c = _cache(16, 1, 8)
    _step(c, [0, 1, 2, 3], [0] * 4)
    c.remove(0, 1)  # to the end: never shifts
    assert (c.seq_pos_max(0), c.cells.used) == (0, 1)
    k, _, mask, plan = _step(c, [1, 2], [0, 0], np.array([[[5]], [[6]]], dtype=np.float32))
    assert plan.cell_ids.tolist() == [1, 2] and (plan.lo, plan.hi) == (0, 3)
    assert _flat(k) == [1, 5, 6]
    assert np.array_equal(mask, _m("oox", "ooo"))

    c.remove(0, 2, 2**31 - 1)  # MaxInt32 means "to the end" too
    assert c.seq_pos_max(0) == 1


def test_remove_middle_needs_shift_and_changes_nothing():
    c = _cache(16, 1, 8)
    _step(c, [0, 1, 2, 3], [0] * 4)
    before = _snapshot(c)
    with pytest.raises(NotSupported):
        c.remove(0, 0, 1)
    assert _same(before, _snapshot(c))
    c.remove(0, 2, 10)  # nothing at or past 10: no shift, allowed
    assert c.seq_pos_max(0) == 1
    c.remove(0, 1, 1)  # empty range
    assert c.seq_pos_max(0) == 1


def test_copy_prefix_shares_cells():
    c = _cache(8, 2, 8)
    _step(c, [0, 1, 2, 3], [0] * 4)
    c.copy_prefix(0, 1, 2)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1)
    assert c.cells.used == 4  # metadata only, no new cells
    k, _, mask, plan = _step(c, [2, 3], [1, 1], np.array([[[10]], [[11]]], dtype=np.float32))
    assert plan.cell_ids.tolist() == [4, 5] and (plan.lo, plan.hi) == (0, 6)
    assert _flat(k) == [1, 2, 3, 4, 10, 11]
    assert np.array_equal(mask, _m("ooxxox", "ooxxoo"))
    # seq 0 still sees only its own cells
    _, _, mask, plan = _step(c, [4], [0])
    assert np.array_equal(mask, _m("ooooxxo"))


def test_can_resume():
    c = _cache(16, 1, 8)
    assert c.can_resume(0, 0)
    _step(c, [0, 1, 2, 3, 4], [0] * 5)
    assert [c.can_resume(0, p) for p in range(7)] == [True] * 6 + [False]
    c.remove(0, 3)
    assert [c.can_resume(0, p) for p in range(6)] == [True] * 4 + [False] * 2


def test_can_resume_window():
    # Ollama TestCanResume: window 4
    c = _cache(16, 1, 5, window=4)
    _step(c, [0, 1, 2, 3, 4], [0] * 5)
    assert all(c.can_resume(0, p) for p in range(5))
    _step(c, [5], [0])
    # Ollama also answers False for pos 0 here; starting over needs no history.
    assert [c.can_resume(0, p) for p in range(7)] == [True] + [False] * 4 + [True] * 2


def test_swa_evicts_and_reuses_cells():
    # Ollama TestSWA: window 1
    c = _cache(16, 1, 4, window=1)
    k, _, mask, _ = _step(c, [0, 1, 2, 3], [0] * 4)
    assert _flat(k) == [1, 2, 3, 4]
    assert np.array_equal(mask, _m("oxxx", "ooxx", "xoox", "xxoo"))
    k, _, mask, plan = _step(c, [4, 5], [0, 0])
    assert plan.cell_ids.tolist() == [0, 1]
    assert _flat(k) == [5, 6, 3, 4]
    assert np.array_equal(mask, _m("oxxo", "ooxx"))


def test_cache_full_raises_and_changes_nothing():
    c = _cache(4, 1, 8)
    _step(c, [0, 1, 2], [0] * 3)
    before = _snapshot(c)
    with pytest.raises(KVCacheFull, match=r"cache: 4 batch: 2"):
        c.start_forward([3, 4], [0, 0])
    assert _same(before, _snapshot(c))
    _step(c, [3], [0])  # one cell still fits
    assert c.cells.used == 4


def test_reserve_plan():
    c = _cache(8, 1, 4)
    _step(c, [0], [0])
    before = _snapshot(c)
    plan = c.start_forward([0, 1, 2], [0, 0, 0], reserve=True)
    assert isinstance(plan, ForwardPlan) and plan.reserve
    assert plan.cell_ids.tolist() == [0, 1, 2] and (plan.lo, plan.hi) == (0, 8)
    assert plan.mask.shape == (3, 8) and not plan.mask.any()
    c.apply(plan)
    assert _same(before, _snapshot(c))


def test_plan_then_commit():
    c = _cache(8, 1, 4)
    plan = c.start_forward([0, 1], [0, 0])
    assert c.cells.used == 0
    assert np.array_equal(plan.mask, _m("ox", "oo"))
    c.apply(plan)
    assert c.cells.used == 2
    with pytest.raises(ValueError):
        c.apply(plan)  # the cell_ids are taken now
    assert c.cells.used == 2


def test_clear():
    c = _cache(8, 2, 4)
    _step(c, [0, 0], [0, 1])
    c.clear(0)
    assert (c.seq_pos_max(0), c.seq_pos_max(1)) == (-1, 0)
    c.clear()
    assert c.cells.used == 0


# ---------------------------------------------------------------- exact contents


@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_put_writes_exactly_the_slots(dtype):
    rng = np.random.default_rng(0)
    c = _cache(8, 2, 8, dtype, head_dim=4, n_head_kv=2, n_layers=2)
    x = rng.standard_normal((5, 2, 4)).astype(np.float32)
    _step(c, [0, 1, 2, 0, 1], [0, 0, 0, 1, 1], x, -x, layer=1)
    c.remove(0, 1)  # frees cells 1 and 2
    expect_k = [k.get().astype(np.float32) for k in c.keys]
    expect_v = [v.get().astype(np.float32) for v in c.values]
    npdt = np.float32 if dtype == Type.F32 else np.float16
    for layer in (0, 1):
        kx = rng.standard_normal((3, 2, 4)).astype(np.float32)
        vx = rng.standard_normal((3, 2, 4)).astype(np.float32)
        plan = c.start_forward([2, 1, 2], [1, 0, 0])
        assert plan.cell_ids.tolist() == [1, 2, 5]
        with ggmlpy.Context(1 << 20) as ctx:
            kt = ctx.new_tensor(Type.F32, (4, 2, 3))
            kt.set(kx)
            vt = ctx.new_tensor(Type.F32, (4, 2, 3))
            vt.set(vx)
            gf = ctx.new_graph(16)
            for t in c.put(ctx, layer, plan, kt, vt):
                gf.build_forward_expand(t)
            gf.compute(2)
        expect_k[layer][plan.cell_ids] = kx.reshape(3, 8).astype(npdt)
        expect_v[layer][plan.cell_ids] = vx.reshape(3, 8).astype(npdt)
        for i in (0, 1):
            assert c.keys[i].get().dtype == npdt
            assert np.array_equal(c.keys[i].get().astype(np.float32), expect_k[i])
            assert np.array_equal(c.values[i].get().astype(np.float32), expect_v[i])


def test_put_rejects_wrong_batch():
    c = _cache(8, 1, 4, head_dim=2, n_head_kv=1)
    plan = c.start_forward([0, 1], [0, 0])
    with ggmlpy.Context(1 << 16) as ctx:
        k = ctx.new_tensor(Type.F32, (2, 1, 3))
        with pytest.raises(ValueError):
            c.put(ctx, 0, plan, k, k)
        with pytest.raises(ValueError):
            c.get(ctx, 1, plan)


# ---------------------------------------------------------------- attention


def _reference(q, hist, positions, seqs, scale, group):
    """q (n_q, n_head, d); hist[s] = list of (pos, k (n_kv_head, d), v)."""
    out = np.zeros_like(q)
    for i, (p, s) in enumerate(zip(positions, seqs)):
        items = [(kk, vv) for pp, kk, vv in hist[s] if pp <= p]
        ks = np.stack([kk for kk, _ in items])  # (n, n_kv_head, d)
        vs = np.stack([vv for _, vv in items])
        for h in range(q.shape[1]):
            logits = ks[:, h // group] @ q[i, h] * scale
            w = np.exp(logits - logits.max())
            out[i, h] = (w / w.sum()) @ vs[:, h // group]
    return out


def test_flash_attention_over_two_sequences():
    rng = np.random.default_rng(1)
    d, n_head, n_head_kv = 8, 4, 2
    scale = 1 / np.sqrt(d)
    c = _cache(16, 2, 8, Type.F16, head_dim=d, n_head_kv=n_head_kv)
    hist = {0: [], 1: []}
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3], [0, 1, 1]), ([4, 5, 4], [0, 0, 1])]
    for positions, seqs in steps:
        n = len(positions)
        q = rng.standard_normal((n, n_head, d)).astype(np.float32)
        k = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        v = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        for i, (p, s) in enumerate(zip(positions, seqs)):
            hist[s].append((p, k[i].astype(np.float16).astype(np.float32),
                            v[i].astype(np.float16).astype(np.float32)))
        plan = c.start_forward(positions, seqs)
        with ggmlpy.Context(1 << 20) as ctx:
            qt = ctx.new_tensor(Type.F32, (d, n_head, n))
            qt.set(q)
            kt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            kt.set(k)
            vt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            vt.set(v)
            gf = ctx.new_graph(64)
            for t in c.put(ctx, 0, plan, kt, vt):
                gf.build_forward_expand(t)
            kv, vv, mask = c.get(ctx, 0, plan)
            assert kv.ne == (d, plan.n_kv, n_head_kv, 1) and mask.ne == (plan.n_kv, n, 1, 1)
            qp = ctx.permute(qt, 0, 2, 1, 3)  # (d, n, n_head)
            o = ctx.flash_attn_ext(qp, kv, vv, mask, float(scale))
            gf.build_forward_expand(o)
            gf.compute(2)
            got = o.get().reshape(n, n_head, d)
        c.apply(plan)
        want = _reference(q, hist, positions, seqs, scale, n_head // n_head_kv)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
