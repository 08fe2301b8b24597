"""Tests for the extended KV caches in ggmlpy.kvcache.

Transposed V storage (Ollama's ``PermutedV``), non-causal
spans, the memory-saving sliding window and the Wrapper.
Scenarios follow Ollama's ``kvcache/causal_test.go`` (padding 1, K = V).
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import _cache, _expand_put, _flat, _m, _step, _vnp  # noqa: F401

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal, KVCacheFull, NotSupported, Wrapper

X = -np.inf


# ---------------------------------------------------------------- 1. transposed V

VT = pytest.mark.parametrize("v_trans", [False, True])


@VT
@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_store_v_trans(v_trans, dtype):
    c = _cache(16, 1, 8, dtype, head_dim=2, n_head_kv=3, v_trans=v_trans)
    want_ne = (c.n_cells, 6) if v_trans else (6, c.n_cells)
    assert c.values[0].ne[:2] == want_ne
    x = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    k, v, mask, plan = _step(c, [0, 1, 2, 3], [0] * 4, x, -x)
    assert np.array_equal(k, x.transpose(1, 0, 2)) and np.array_equal(v, -x.transpose(1, 0, 2))
    assert np.array_equal(mask, _m("oxxx", "ooxx", "ooox", "oooo"))
    y = np.full((1, 3, 2), 100, dtype=np.float32)
    k, v, mask, plan = _step(c, [4], [0], y, 2 * y)
    assert np.array_equal(v, np.concatenate([-x, 2 * y]).transpose(1, 0, 2))
    assert np.array_equal(mask, _m("ooooo"))


@VT
def test_sequences_v_trans(v_trans):
    c = _cache(8, 2, 8, v_trans=v_trans)
    _, v, mask, _ = _step(c, [0, 0, 1, 1, 2], [0, 1, 0, 1, 0])
    assert _flat(v) == [1, 1, 2, 2, 3]
    _, v, mask, plan = _step(c, [3, 2], [0, 1])
    assert plan.cell_ids.tolist() == [5, 6]
    assert _flat(v) == [1, 1, 2, 2, 3, 4, 3]
    assert np.array_equal(mask, _m("oxoxoox", "xoxoxxo"))
    # a sub-range starting past cell 0: seq 1 only
    c2 = _cache(8, 2, 8, v_trans=v_trans)
    _step(c2, [0, 1], [0, 0])
    _, v, _, plan = _step(c2, [0, 1], [1, 1])
    assert (plan.lo, plan.hi) == (2, 4) and _flat(v) == [1, 2]


@VT
def test_swa_v_trans(v_trans):
    c = _cache(16, 1, 4, window=1, v_trans=v_trans)
    _step(c, [0, 1, 2, 3], [0] * 4)
    k, v, mask, plan = _step(c, [4, 5], [0, 0])
    assert _flat(k) == _flat(v) == [5, 6, 3, 4]
    assert np.array_equal(mask, _m("oxxo", "ooxx"))


@VT
def test_defrag_v_trans(v_trans):
    x2 = np.arange(4 * 2 * 2, dtype=np.float32).reshape(4, 2, 2) + 50
    c2 = _cache(8, 2, 8, head_dim=2, n_head_kv=2, v_trans=v_trans)
    _step(c2, [0, 0, 1, 1], [0, 1, 0, 1], x2, -x2)
    c2.clear(0)           # holes at 0 and 2
    moves = c2.defrag()   # cell 3 moves into the hole at 0
    assert moves == [(3, 0, 1)] and c2.fragmentation() == 0.0
    k, v, _, _ = _step(c2, [2], [1], np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.float32))
    assert np.array_equal(k[:, :2], x2[[3, 1]].transpose(1, 0, 2))
    assert np.array_equal(v[:, :2], -x2[[3, 1]].transpose(1, 0, 2))


def test_v_trans_rejects_quantized():
    with pytest.raises(ValueError):
        Causal(1, 64, 64, Type.Q8_0, v_trans=True)


def _reference(q, hist, positions, seqs, scale, group, window=None, except_rows=()):
    n, n_head, d = q.shape
    out = np.zeros_like(q)
    for i, (p, s) in enumerate(zip(positions, seqs)):
        items = [(pp, kk, vv) for pp, kk, vv in hist[s]
                 if (pp <= p or i in except_rows)
                 and (window is None or pp >= p - window)]
        ks = np.stack([it[1] for it in items])
        vs = np.stack([it[2] for it in items])
        for h in range(n_head):
            logits = ks[:, h // group] @ q[i, h] * scale
            w = np.exp(logits - logits.max())
            out[i, h] = (w / w.sum()) @ vs[:, h // group]
    return out


def _attention_run(c, steps, d, n_head, n_head_kv, seed=1, ref_kw=None, fwd_kw=None):
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(d)
    hist = {s: [] for s in range(c.cells.n_seq_max)}
    rnd = (lambda a: a.astype(np.float16).astype(np.float32)) if c.dtype == Type.F16 else (lambda a: a)
    for j, (positions, seqs) in enumerate(steps):
        n = len(positions)
        q = rng.standard_normal((n, n_head, d)).astype(np.float32)
        k = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        v = rng.standard_normal((n, n_head_kv, d)).astype(np.float32)
        for i, (p, s) in enumerate(zip(positions, seqs)):
            hist[s].append((p, rnd(k[i]), rnd(v[i])))
        kw = (fwd_kw or {}).get(j, {})
        plan = c.start_forward(positions, seqs, **kw)
        with ggmlpy.Context(1 << 22) as ctx:
            qt = ctx.new_tensor(Type.F32, (d, n_head, n))
            qt.set(q)
            kt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            kt.set(k)
            vt = ctx.new_tensor(Type.F32, (d, n_head_kv, n))
            vt.set(v)
            gf = ctx.new_graph(128)
            for t in c.put(ctx, 0, plan, kt, vt):
                gf.build_forward_expand(t)
            kv, vv, mask = c.get(ctx, 0, plan, mask_type=Type.F32)
            qp = ctx.permute(qt, 0, 2, 1, 3)               # (d, n, n_head)
            kq = ctx.mul_mat(kv, qp)                        # (n_kv, n, n_head)
            kq = ctx.soft_max_ext(kq, mask, float(scale))
            if not c.v_trans:
                vv = ctx.cont(ctx.permute(vv, 1, 0, 2, 3))  # (n_kv, d, n_head_kv)
            else:
                assert vv.ne[:3] == (plan.n_kv, d, n_head_kv)
            o = ctx.mul_mat(vv, kq)                         # (d, n, n_head)
            o = ctx.cont(ctx.permute(o, 0, 2, 1, 3))        # (d, n_head, n)
            gf.build_forward_expand(o)
            gf.compute(2)
            got = o.get().reshape(n, n_head, d)
        c.apply(plan)
        rk = dict(ref_kw or {})
        if "except_rows" in kw:
            rk["except_rows"] = set(kw["except_rows"])
        want = _reference(q, hist, positions, seqs, scale, n_head // n_head_kv, **rk)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@VT
@pytest.mark.parametrize("dtype", [Type.F32, Type.F16])
def test_mul_mat_attention_over_two_sequences(v_trans, dtype):
    c = _cache(16, 2, 8, dtype, head_dim=8, n_head_kv=2, v_trans=v_trans)
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3], [0, 1, 1]), ([4, 5, 4], [0, 0, 1])]
    _attention_run(c, steps, 8, 4, 2)


# ---------------------------------------------------------------- 2. non-causal spans


@VT
def test_non_causal_span(v_trans):
    c = _cache(16, 2, 8, v_trans=v_trans)
    _step(c, [0, 1], [0, 0])
    # seq 0 continues with a bidirectional span at batch rows 1..2 (pos 3, 4); seq 1 interleaved
    _, _, mask, plan = _step(c, [2, 3, 4, 5, 0], [0, 0, 0, 0, 1], except_rows=[1, 2])
    assert plan.cell_ids.tolist() == [2, 3, 4, 5, 6]
    assert np.array_equal(mask, _m(
        "oooxxxx",    # pos 2: causal
        "oooooox",    # pos 3: sees 4 and 5 too (own sequence, this batch)
        "oooooox",    # pos 4: likewise
        "oooooox",    # pos 5: causal, sees everything before
        "xxxxxxo",    # seq 1: isolated
    ))
    # the exemption is per batch: the next batch is causal again
    _, _, mask, _ = _step(c, [6, 1], [0, 1], except_rows=[])
    assert np.array_equal(mask, _m("ooooooxox", "xxxxxxoxo"))
    with pytest.raises(ValueError):
        c.start_forward([7], [0], except_rows=[3])


def test_non_causal_span_keeps_window():
    w = _cache(16, 1, 8, window=1)
    _, _, mask, _ = _step(w, [0, 1, 2, 3], [0] * 4, except_rows=[1])
    assert np.array_equal(mask, _m("oxxx", "oooo", "xoox", "xxoo"))


@VT
def test_attention_windowed_and_non_causal(v_trans):
    c = _cache(16, 2, 8, Type.F16, head_dim=8, n_head_kv=2, v_trans=v_trans, window=3)
    steps = [([0, 0, 1, 1, 2], [0, 1, 0, 1, 0]), ([3, 2, 3, 4], [0, 1, 1, 1]), ([4, 5, 5], [0, 0, 1])]
    _attention_run(c, steps, 8, 4, 2, ref_kw={"window": 3}, fwd_kw={1: {"except_rows": [1, 2]}})


# ---------------------------------------------------------------- 3. windowed memory


@VT
def test_swa_mem(v_trans):
    # Ollama TestSWAMem: window 1, memory 3
    c = _cache(16, 1, 4, window=1, memory=3, v_trans=v_trans)
    assert (c.memory, c.n_cells) == (3, 7)
    k, v, mask, _ = _step(c, [0, 1, 2, 3], [0] * 4)
    assert np.array_equal(mask, _m("oxxx", "ooxx", "xoox", "xxoo"))
    k, v, mask, plan = _step(c, [4, 5], [0, 0])
    assert plan.trim == {0: 4} and plan.cell_ids.tolist() == [0, 4]
    assert _flat(k) == _flat(v) == [5, 2, 3, 4, 6]  # pos 0 evicted, 1..3 kept but masked
    assert np.array_equal(mask, _m("oxxox", "oxxxo"))
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 5)


def test_swa_mem_sizing_and_validation():
    assert _cache(16, 1, 4, window=2, memory=5).memory == 5
    assert _cache(16, 2, 4, window=2, memory=2).memory == 3  # several sequences: window + 1
    assert _cache(16, 2, 4, window=2, memory=5).memory == 5
    c = _cache(4, 1, 4, window=2, memory=8)  # memory >= capacity: unlimited
    assert (c.memory, c.n_cells) == (None, 4)
    assert _cache(16, 1, 4, window=2, memory=0).memory == 2  # 0 means the window
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, window=4, memory=3)
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, memory=3)
    with pytest.raises(ValueError):
        Causal(1, 4, 4, Type.F32, window=4, memory=-1)


@pytest.mark.parametrize("memory, want", [
    (None, [True] + [False] * 4 + [True] * 2),      # Ollama TestCanResume (window 4)
    (5, [True] + [False] * 5 + [True] * 2),         # Ollama TestCanResumeSWAMem (window 4, memory 5)
])
def test_can_resume_windowed(memory, want):
    c = _cache(16, 1, 8, window=4, memory=memory)
    first = list(range(7)) if memory else list(range(5))
    _step(c, first, [0] * len(first))
    assert all(c.can_resume(0, p) for p in range(len(first) + 1))
    _step(c, [len(first)], [0])
    got = [c.can_resume(0, p) for p in range(len(want))]
    assert got == want
    assert not c.can_resume(0, len(first) + 2)  # past the last stored position + 1


def test_swa_mem_evicts_idle_sequence_and_fills():
    c = _cache(16, 2, 2, window=1, memory=2)
    assert (c.memory, c.n_cells) == (2, 6)
    _step(c, [0, 1], [0, 0])
    _step(c, [0, 1], [1, 1])
    _step(c, [2, 3], [0, 0])  # lowest 2: seq 0 keeps pos >= 0; seq 1 idle at 2 keeps >= 0
    assert c.cells.used == 6
    _, _, _, plan = _step(c, [4, 5], [0, 0])  # seq 0 drops pos < 2, frees two cells
    assert plan.cell_ids.tolist() == [0, 1]
    with pytest.raises(KVCacheFull):
        c.start_forward([2, 3, 4], [1, 1, 1])


# ---------------------------------------------------------------- 4. Wrapper


def _wstep(w, positions, seqs, vals=None, **kw):
    """One forward over every wrapper layer; layer l writes K = V = (pos + 1) * (l + 1)."""
    plan = w.start_forward(positions, seqs, **kw)
    n = len(positions)
    base = np.asarray(positions, dtype=np.float32) + 1 if vals is None else np.asarray(vals, np.float32)
    outs = []
    with ggmlpy.Context(1 << 20) as ctx:
        gf = ctx.new_graph(256)
        for layer in range(w.n_layers):
            x = (base * (layer + 1)).reshape(n, 1, 1)
            t = ctx.new_tensor(Type.F32, (1, 1, n))
            t.set(x)
            for r in w.put(ctx, layer, plan, t, t):
                gf.build_forward_expand(r)
            kv, vv, mask = w.get(ctx, layer, plan)
            kc, vc = ctx.cont(kv), ctx.cont(vv)
            gf.build_forward_expand(kc)
            gf.build_forward_expand(vc)
            outs.append((kc, vc, mask))
        gf.compute(2)
        res = [(_flat(k.get()), _flat(v.get()), m.get().astype(np.float32).reshape(n, -1)) for k, v, m in outs]
    w.apply(plan)
    return res, plan


def _wrapper(v_trans=False, shift=False, **init):
    shift_fn = (lambda ctx, layer, k, off: ctx.scale(k, 1.0)) if shift else None
    swa = Causal(2, 1, 1, Type.F32, window=1, v_trans=v_trans, shift_fn=shift_fn)
    full = Causal(1, 1, 1, Type.F32, v_trans=v_trans)
    w = Wrapper([swa, full], [0, 1, 0])  # layers 0 and 2 local (window 1), layer 1 global
    w.init(16, 1, 4, **init)
    return w, swa, full


@VT
def test_wrapper_routes_layers(v_trans):
    w, swa, full = _wrapper(v_trans)
    assert w.route(0) == (swa, 0) and w.route(1) == (full, 0) and w.route(2) == (swa, 1)
    assert w.underlying(1) is full
    res, _ = _wstep(w, [0, 1, 2, 3], [0] * 4)
    assert res[0][0] == res[0][1] == [1, 2, 3, 4]
    assert res[1][0] == [2, 4, 6, 8] and res[2][0] == [3, 6, 9, 12]
    assert np.array_equal(res[0][2], _m("oxxx", "ooxx", "xoox", "xxoo"))
    assert np.array_equal(res[1][2], _m("oxxx", "ooxx", "ooox", "oooo"))
    res, plan = _wstep(w, [4, 5], [0, 0])
    assert plan[0].cell_ids.tolist() == [0, 1] and plan[1].cell_ids.tolist() == [4, 5]
    assert res[0][0] == [5, 6, 3, 4] and res[2][1] == [15, 18, 9, 12]
    assert res[1][0] == [2, 4, 6, 8, 10, 12]
    assert np.array_equal(res[0][2], _m("oxxo", "ooxx"))
    assert np.array_equal(res[1][2], _m("ooooox", "oooooo"))
    # AND of can_resume: the full cache could resume at 2, the window cache not
    assert full.can_resume(0, 3) and not swa.can_resume(0, 3) and not w.can_resume(0, 3)
    assert w.can_resume(0, 6) and w.can_resume(0, 0)


def _wforward(w, rt, positions, seqs):
    """_wstep through ``w.forward`` in a graph the runtime allocates: the caches' inputs (cell_ids, masks) are
    created unallocated and filled by ``fw.fill(plan)`` once the scheduler allocated them."""
    plan = w.start_forward(positions, seqs)
    n = len(positions)
    base = np.asarray(positions, dtype=np.float32) + 1
    with ggmlpy.Context.for_tensors(256, graph_size=256, no_alloc=True) as ctx:
        gf = ctx.new_graph(256)
        fw = w.forward(ctx, plan)
        xs, outs = [], []
        for layer in range(w.n_layers):
            x = ctx.new_tensor(Type.F32, (1, 1, n)).set_input()
            xs.append(x)
            fw.set_layer(layer).put(x, x)
            kv, vv, mask = fw.get()
            outs.append((ctx.cont(kv), ctx.cont(vv), ctx.cont(mask)))     # copies that read the mask input too
        for t in fw.pending:
            gf.build_forward_expand(t)
        for out in outs:
            for t in out:
                gf.build_forward_expand(t)

        def fill():
            for layer, x in enumerate(xs):
                x.set((base * (layer + 1)).reshape(n, 1, 1))
            fw.fill(plan)

        rt.run(gf, fill)
        res = [(_flat(k.get()), _flat(v.get()), m.get().astype(np.float32).reshape(n, -1)) for k, v, m in outs]
    w.apply(plan)
    return res, plan


@VT
def test_wrapper_forward_through_the_runtime_equals_direct_use(v_trans):
    """The Wrapper's per-graph view (each layer routed to its cache's own inputs, filled after the
    scheduler allocated them) writes and reads exactly what direct put/get do, step after step."""
    from ggmlpy.backend import Runtime, choose_devices, split_layers

    a, _, _ = _wrapper(v_trans)
    rt = Runtime([ggmlpy.device("CPU")], n_threads=1)
    # the scheduler runs tensors of backend buffers: the caches placed on the CPU device
    b, _, _ = _wrapper(v_trans, placement=split_layers(3, choose_devices("cpu")), runtime=rt)
    try:
        for positions in ([0, 1, 2, 3], [4, 5], [6], [7, 8, 9]):
            want, plan_a = _wstep(a, positions, [0] * len(positions))
            got, plan_b = _wforward(b, rt, positions, [0] * len(positions))
            assert plan_a.key == plan_b.key
            for (k1, v1, m1), (k2, v2, m2) in zip(want, got):
                assert k1 == k2 and v1 == v2 and np.array_equal(m1, m2)
    finally:
        b.close()
        rt.close()


def test_forward_fill_refuses_a_plan_of_another_shape():
    c = Causal(1, 1, 1, Type.F32)
    c.init(16, 1, 4)
    with ggmlpy.Context.for_tensors(16, no_alloc=True) as ctx:
        fw = c.forward(ctx, c.start_forward([0, 1], [0, 0]))
        fw.set_layer(0).get()
        with pytest.raises(ValueError, match="fill"):
            fw.fill(c.start_forward([0], [0]))        # one row for a graph of two


def test_wrapper_validation():
    a = Causal(1, 1, 1, Type.F32)
    with pytest.raises(ValueError):
        Wrapper([a], [0, 0])  # two layers routed to a one-layer cache
    with pytest.raises(ValueError):
        Wrapper([a], [1])
    with pytest.raises(ValueError):
        Wrapper([], [])


def test_wrapper_start_forward_failure_changes_nothing():
    swa = Causal(1, 1, 1, Type.F32, window=1)
    full = Causal(1, 1, 1, Type.F32)
    w = Wrapper([swa, full], [0, 1])
    w.init(4, 1, 4)
    _wstep(w, [0, 1, 2], [0] * 3)
    before = [(c.cells.pos.copy(), c.cells.seqs.copy()) for c in (swa, full)]
    with pytest.raises(KVCacheFull):  # the window cache has room, the full one does not
        w.start_forward([3, 4], [0, 0])
    after = [(c.cells.pos.copy(), c.cells.seqs.copy()) for c in (swa, full)]
    assert all(np.array_equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))


def test_wrapper_remove_is_all_or_nothing():
    w, swa, full = _wrapper(shift=True)  # only the window cache can shift
    _wstep(w, [0, 1, 2, 3], [0] * 4)
    before = [(c.cells.pos.copy(), c.cells.seqs.copy()) for c in (swa, full)]
    with pytest.raises(NotSupported):
        w.remove(0, 2, 3)
    after = [(c.cells.pos.copy(), c.cells.seqs.copy()) for c in (swa, full)]
    assert all(np.array_equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))
    w.remove(0, 2)  # to the end: fine everywhere
    assert swa.seq_pos_max(0) == full.seq_pos_max(0) == 1


@VT
def test_wrapper_view_writes_in_layer_order(v_trans):
    """A layer's K/V come from the earlier layers' reads of the cache, so a graph must write every layer
    before the next layer reads it. The view's pending writes are in put (model layer) order, not grouped
    by cache: a graph that expands them first (as DecoderModel.build does) reads each layer as written.
    Grouped by cache, layer 2 (window cache) was computed from layer 1 (full cache) before layer 1 was
    written, and read its zeros."""
    swa = Causal(2, 1, 1, Type.F32, window=4, v_trans=v_trans)
    full = Causal(1, 1, 1, Type.F32, v_trans=v_trans)
    w = Wrapper([swa, full], [0, 1, 0])
    w.init(16, 1, 4)
    plan = w.start_forward([0, 1, 2], [0, 0, 0])
    with ggmlpy.Context(1 << 20) as ctx:
        fw = w.forward(ctx, plan)
        x = ctx.from_numpy(np.array([1, 2, 3], np.float32).reshape(3, 1, 1))
        puts = []
        for layer in range(3):
            puts.extend(fw.set_layer(layer).put(x, x))
            k, _, _ = fw.get()                         # (1, 3 cells, 1): this batch's rows
            x = ctx.scale_bias(ctx.reshape(ctx.cont(k), (1, 1, 3)), 1.0, 1.0)   # the next layer's K: read + 1
        assert [id(t) for t in fw.pending] == [id(t) for t in puts]
        gf = ctx.new_graph(256)
        for t in fw.pending:
            gf.build_forward_expand(t)
        gf.build_forward_expand(x)
        gf.compute(1)
        assert _flat(x.get()) == [4, 5, 6]
    assert [_flat(c.keys[i].numpy())[:3] for c, i in ((swa, 0), (full, 0), (swa, 1))] == [[1, 2, 3], [2, 3, 4],
                                                                                        [3, 4, 5]]


def test_wrapper_shift_fn_gets_the_model_layer():
    """Each wrapped cache calls shift_fn with the model layer (Causal.model_layers, from the routing), not
    its own index: a model whose layers rotate differently (gemma3's local and global RoPE bases) needs it."""
    seen = []

    def shift_fn(ctx, layer, k, off):
        seen.append(layer)
        return ctx.scale(k, float(layer + 1))         # a marker per model layer instead of a rotation

    swa = Causal(2, 1, 1, Type.F32, shift_fn=shift_fn)
    full = Causal(1, 1, 1, Type.F32, shift_fn=shift_fn)
    w = Wrapper([swa, full], [0, 1, 0])
    w.init(16, 1, 4)
    assert (swa.model_layers, full.model_layers) == ([0, 2], [1])
    _wstep(w, [0, 1, 2, 3], [0] * 4)                # layer l holds K = (pos + 1) * (l + 1)
    w.remove(0, 1, 2)                                # positions 2, 3 move down to 1, 2: re-"rotated"
    assert sorted(seen) == [0, 1, 2]
    assert _flat(swa.keys[1].numpy())[:4] == [3, 6, 9 * 3, 12 * 3]          # model layer 2: x3
    assert _flat(full.keys[0].numpy())[:4] == [2, 4, 6 * 2, 8 * 2]          # model layer 1: x2
    with pytest.raises(ValueError, match="2 model layers given for a cache of 1"):
        Causal(1, 1, 1, Type.F32).init(16, 1, 4, layers=[0, 1])


def test_wrapper_copy_prefix_clear_and_apply():
    swa = Causal(1, 1, 1, Type.F32, window=2)
    full = Causal(1, 1, 1, Type.F32)
    w = Wrapper([swa, full], [1, 0])
    w.init(8, 2, 4)
    _wstep(w, [0, 1, 2], [0] * 3)
    w.copy_prefix(0, 1, 2)
    assert swa.seq_pos_max(1) == full.seq_pos_max(1) == 1
    plan = w.start_forward([2], [1])
    with pytest.raises(TypeError):
        w.apply(plan[0])
    w.apply(plan)
    assert swa.seq_pos_max(1) == full.seq_pos_max(1) == 2
    w.clear(0)
    assert swa.seq_pos_max(0) == full.seq_pos_max(0) == -1 and full.seq_pos_max(1) == 2
    w.clear()
    assert swa.cells.used == full.cells.used == 0
