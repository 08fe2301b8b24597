"""Tests for ggmlpy.kvcache.Wrapper, the cache of a model with window and full layers.

Each model layer routed to its cache (a sliding-window one for the local layers, a full one for the
global layers): the views and masks each layer gets, direct use against the per-graph view the runtime
fills, validation, all-or-nothing failures, the key shift per model layer, copy_prefix, clear, apply.
Scenarios follow Ollama's ``kvcache/causal_test.go`` (padding 1, K = V).
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import _flat, _m

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal, KVCacheFull, NotSupported, Wrapper

VT = pytest.mark.parametrize("v_trans", [False, True])


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
