"""Graph: capacity checks, node/leaf bookkeeping, lookup, export, threads, cancellation, the GIL."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import ggmlpy as gp


def _chain(ctx, n):
    x = ctx.from_numpy(np.zeros(8, np.float32))
    y = ctx.from_numpy(np.ones(8, np.float32))
    for _ in range(n):
        x = ctx.add(x, y)
    return x


def test_nodes_leafs_and_lookup():
    ctx = gp.Context(1 << 20)
    a = ctx.from_numpy(np.ones(4, np.float32), name="a")
    b = ctx.scale(a, 3.0).set_name("b")
    c = ctx.add(b, a)
    gf = ctx.new_graph(16)
    gf.build_forward_expand(c)
    assert (gf.n_nodes, gf.n_leafs, gf.size, len(gf)) == (2, 1, 16, 2)
    assert gf.nodes == [b, c] and gf.leafs == [a] and gf.node(-1) == c
    assert gf.get_tensor("b") == b and gf.get_tensor("nope") is None
    with pytest.raises(IndexError, match="graph_node"):
        gf.node(2)
    gf.build_forward_expand(c)            # already there: nothing added
    assert gf.n_nodes == 2
    gf.compute(1)
    assert c.get().tolist() == [4.0] * 4
    assert "2 nodes" in gf.summary() and "SCALE" in gf.summary()
    gf.clear()
    assert gf.n_nodes == 0 and gf.n_leafs == 0


def test_full_graph_raises_and_keeps_the_graph_usable():
    ctx = gp.Context(1 << 20)
    x = _chain(ctx, 5)
    gf = ctx.new_graph(3)
    with pytest.raises(gp.GGMLMemoryError, match=r"build_forward_expand: graph is full .* adds 5 nodes"):
        gf.build_forward_expand(x)
    assert gf.n_nodes == 0                # nothing half-added
    small = ctx.scale(ctx.from_numpy(np.ones(2, np.float32)), 2.0)
    gf.build_forward_expand(small)
    gf.compute(1)
    assert small.get().tolist() == [2.0, 2.0]


def test_leaf_capacity_is_separate():
    ctx = gp.Context(1 << 20)
    ts = [ctx.from_numpy(np.ones(2, np.float32)) for _ in range(4)]
    s = ctx.add(ctx.add(ts[0], ts[1]), ctx.add(ts[2], ts[3]))
    gf = ctx.new_graph(3)                 # 3 nodes fit, 4 leafs do not
    with pytest.raises(gp.GGMLMemoryError, match="4 leafs"):
        gf.build_forward_expand(s)


def test_deep_chain_is_refused_before_ggml_recurses():
    ctx = gp.Context.for_tensors(60_010, 60_010 * 32, graph_size=70_000)
    x = ctx.from_numpy(np.zeros(1, np.float32))
    one = ctx.from_numpy(np.ones(1, np.float32))
    for _ in range(60_000):
        x = ctx.add(x, one)
    gf = ctx.new_graph(70_000)
    with pytest.raises(gp.GGMLValueError, match="expand in steps"):
        gf.build_forward_expand(x)


def test_compute_needs_data():
    ctx = gp.Context(1 << 20, no_alloc=True)
    a = ctx.new_tensor(gp.Type.F32, (4,))
    gf = ctx.new_graph(8)
    gf.build_forward_expand(ctx.scale(a, 2.0))
    with pytest.raises(gp.GGMLValueError, match="has no data"):
        gf.compute(1)


def test_threads_give_the_same_result():
    rng = np.random.default_rng(1)
    ctx = gp.Context(64 << 20)
    a = ctx.from_numpy(rng.standard_normal((256, 512)).astype(np.float32))
    b = ctx.from_numpy(rng.standard_normal((128, 512)).astype(np.float32))
    y = ctx.mul_mat(a, b)
    gf = ctx.new_graph()
    gf.build_forward_expand(y)
    gf.compute(1)
    one = y.get()
    gf.compute(2)
    np.testing.assert_allclose(y.get(), one, rtol=1e-5, atol=1e-4)
    with pytest.raises(gp.GGMLValueError, match="n_threads"):
        gf.compute(100000)


def _big_graph(ctx, n=400):
    rng = np.random.default_rng(2)
    w = ctx.from_numpy(rng.standard_normal((512, 512)).astype(np.float32) / 23)
    x = ctx.from_numpy(rng.standard_normal((64, 512)).astype(np.float32))
    for _ in range(n):
        x = ctx.mul_mat(w, x)
    gf = ctx.new_graph(n + 8)
    gf.build_forward_expand(x)
    return gf


def test_gil_is_released_during_compute():
    ctx = gp.Context(256 << 20)
    gf = _big_graph(ctx)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    t0 = time.perf_counter()
    gf.compute(1)
    t1 = time.perf_counter()
    done.set()
    th.join()
    during = [t for t in ticks if t0 < t < t1]
    # With the GIL held the other thread could not run at all during compute.
    assert t1 - t0 > 0.05 and len(during) >= 5, (t1 - t0, len(during))


def test_cancel_from_another_thread():
    ctx = gp.Context(256 << 20)
    gf = _big_graph(ctx, 2000)
    timer = threading.Timer(0.05, gf.cancel)
    timer.start()
    with pytest.raises(gp.ComputeAborted):
        gf.compute(1)
    timer.join()
    gf2 = ctx.new_graph(4)                # the context still works afterwards
    t = ctx.scale(ctx.from_numpy(np.ones(2, np.float32)), 5.0)
    gf2.build_forward_expand(t)
    gf2.compute(1)
    assert t.get().tolist() == [5.0, 5.0]


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
def test_ctrl_c_interrupts_compute():
    ctx = gp.Context(256 << 20)
    gf = _big_graph(ctx, 2000)
    # A shell may start us with SIGINT ignored (background jobs): use Python's default handler here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            gf.compute(1)
        assert time.perf_counter() - t0 < 5.0
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_dump_dot(tmp_path):
    ctx = gp.Context(1 << 20)
    gf = ctx.new_graph(8)
    gf.build_forward_expand(ctx.relu(ctx.from_numpy(np.ones(3, np.float32))))
    path = tmp_path / "g.dot"
    gf.dump_dot(path)
    text = path.read_text()
    assert text.startswith("digraph") and "node_0" in text and text.count("->") == 1
    with pytest.raises(OSError):
        gf.dump_dot(tmp_path / "missing-dir" / "g.dot")


def test_cross_context_graph_refuses_freed_inputs():
    weights = gp.Context(1 << 20)
    w = weights.from_numpy(np.full(4, 2.0, np.float32))
    ctx = gp.Context(1 << 20)
    y = ctx.mul(ctx.from_numpy(np.ones(4, np.float32)), w)
    gf = ctx.new_graph(8)
    gf.build_forward_expand(y)
    gf.compute(1)
    assert y.get().tolist() == [2.0] * 4
    weights.free()
    with pytest.raises(gp.ClosedError, match="freed"):
        gf.compute(1)


def _mixed_expression(ctx, order=None):
    # Leafs, a source read twice, a view, a leaf first met deep in the graph,
    # and a 3-source op; `order` collects every tensor in the order ggml's
    # depth-first visit would file it (sources in slot order, then the tensor).
    x = ctx.from_numpy(np.arange(8, dtype=np.float32), name="x")
    y = ctx.from_numpy(np.ones(8, np.float32), name="y")
    w = ctx.from_numpy(np.full((8, 8), 0.5, np.float32), name="w")
    z = ctx.from_numpy(np.full(8, 2.0, np.float32), name="z")
    a = ctx.add(x, y)
    b = ctx.mul(a, a)                     # one source slot pair on the same tensor
    v = ctx.view_1d(b, 4, 8)
    c = ctx.add(ctx.cont(v), ctx.view_1d(x, 4, 0))
    d = ctx.mul_mat(w, ctx.add(b, x))
    e = ctx.add(d, z)                     # z enters the graph only here
    if order is not None:
        order.extend([x, y, a, b, v])
        order.extend([c.src[0], c.src[1], c])      # cont(v), the view of x, c
        order.extend([w, d.src[1], d, z, e])
    return e, c


def test_op_by_op_expand_records_what_ggml_expand_records():
    # build_forward_expand files a new node whose sources are all in the graph
    # itself (one probe of ggml's visited set instead of ggml's several); the
    # graph it leaves must be the one ggml's own recursive expand builds:
    # same nodes and leafs in the same order, names, use counts and
    # compute marks (ggml's fusion reads the use counts).
    ref_ctx = gp.Context(1 << 20)
    e_ref, c_ref = _mixed_expression(ref_ctx)
    ref = ref_ctx.new_graph(64)
    ref.build_forward_expand(c_ref)       # c's ancestors are new: ggml's expand
    ref.build_forward_expand(e_ref)

    ctx = gp.Context(1 << 20)
    order = []
    e, c = _mixed_expression(ctx, order)
    gf = ctx.new_graph(64)
    for t in order:                       # every expand after the leafs' is one new tensor
        gf.build_forward_expand(t)
    state, want = gf._visit_state(), ref._visit_state()
    assert [s[0] for s in state] == [s[0] for s in want]
    assert state == want
    # the values the checks above compare are not trivial
    assert {s[1] for s in want} >= {0, 1, 2} and any(s[2] for s in want) and not all(s[2] for s in want)
    gf.compute(1)
    ref.compute(1)
    np.testing.assert_array_equal(e.numpy(), e_ref.numpy())


def test_expand_of_a_tensor_already_in_the_graph_adds_nothing():
    ctx = gp.Context(1 << 20)
    e, _ = _mixed_expression(ctx)
    gf = ctx.new_graph(64)
    gf.build_forward_expand(e)
    before = gf._visit_state()
    for t in (e, e.src[0], e.src[1]):
        gf.build_forward_expand(t)
    assert gf._visit_state() == before


def test_fast_expand_still_refuses_a_full_graph():
    ctx = gp.Context(1 << 20)
    x = ctx.from_numpy(np.zeros(4, np.float32))
    gf = ctx.new_graph(2)
    gf.build_forward_expand(x)            # a leaf on its own
    x1 = ctx.neg(x)
    gf.build_forward_expand(x1)
    x2 = ctx.neg(x1)
    gf.build_forward_expand(x2)
    x3 = ctx.neg(x2)
    with pytest.raises(gp.GGMLMemoryError, match="graph is full"):
        gf.build_forward_expand(x3)
    # the refused expand filed nothing and counted no use of x2
    assert gf._visit_state() == [("node_0", 1, True), ("node_1", 0, True), ("leaf_0", 1, False)]
    gf2 = ctx.new_graph(4)
    gf2.build_forward_expand(x3)
    assert gf2.n_nodes == 3
