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
