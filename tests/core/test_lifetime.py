"""Lifetimes: memory that is freed is given back (measured by RSS), memory that is gone is never read
again (ClosedError instead), and nothing another thread is computing over is freed or changed under it.

Scenarios that crashed the interpreter before run in a child process (tests/helpers.run_child), so a
regression shows as a failed test with faulthandler's stack, not as a dead test run.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import rss_growth, run_child

import ggmlpy

CPU = ggmlpy.device("CPU")
MiB = 1 << 20


# --- memory given back ---------------------------------------------------------------------------

def test_buffer_free_and_collection_give_the_memory_back():
    bt = CPU.buffer_type()

    def free_explicitly():
        b = bt.alloc_buffer(256 * MiB)
        b.clear(1)                        # touch every page: RSS really holds it until freed
        b.free()

    def drop():
        b = bt.alloc_buffer(128 * MiB)
        b.clear(1)
        del b

    # the leak this guards against was +256 MiB per cycle
    assert rss_growth(free_explicitly, loops=4) < 16
    assert rss_growth(drop, loops=4) < 16


def test_context_tensors_in_a_backend_buffer_are_freed_with_the_context():
    def cycle():
        ctx = ggmlpy.Context(1 * MiB, no_alloc=True)
        t = ctx.new_tensor_1d(ggmlpy.Type.F32, 32 * MiB)        # 128 MiB
        buf = ggmlpy.alloc_ctx_tensors(ctx, CPU.buffer_type())
        buf.clear(2)
        assert t.get()[-1] != 0
        ctx.free()
        buf.free()

    assert rss_growth(cycle, loops=4) < 16


def _big_compute_graph(ctx, n=1024):
    # one node whose result is 64 MiB: the compute buffer is at least that large
    a = ctx.new_tensor_2d(ggmlpy.Type.F32, n, 4 * n)
    b = ctx.new_tensor_2d(ggmlpy.Type.F32, n, 4 * n)
    a.set_input()
    b.set_input()
    y = ctx.mul_mat(a, b)                               # ne (4n, 4n): 64 MiB of f32
    gf = ctx.new_graph()
    gf.build_forward_expand(ctx.sum(y))
    return gf


def test_scheduler_reserve_and_free_give_the_compute_buffers_back():
    be = CPU.init()
    sizes = []

    def cycle():
        ctx = ggmlpy.Context(4 * MiB, no_alloc=True)
        gf = _big_compute_graph(ctx)
        s = ggmlpy.Scheduler([be])
        s.reserve(gf)
        sizes.append(s.buffer_size(be))
        s.alloc_graph(gf)
        s.free()
        ctx.free()

    assert rss_growth(cycle, loops=4) < 16
    # ggml's CPU buffers are not written by reserve or alloc_graph, so RSS alone would not see them
    # leak: the virtual size does (4 leaked cycles would be 256 MiB and more)
    assert rss_growth(cycle, loops=4, field="VmSize") < 16
    assert min(sizes) >= 64 * MiB                      # the loop really allocated that much each time


# --- tensors never outlive the memory they point into ----------------------------------------------

ALLOCATOR_CHILD = r"""
import gc, sys
import numpy as np
import ggmlpy
from ggmlpy import ClosedError

be = ggmlpy.device("CPU").init()

def graph(n=1 << 18):
    ctx = ggmlpy.Context(1 << 20, no_alloc=True)
    a = ctx.new_tensor_1d(ggmlpy.Type.F32, n)
    a.set_input()
    y = ctx.scale(a, 2.0)
    gf = ctx.new_graph()
    gf.build_forward_expand(y)
    return ctx, a, y, gf

def expect_closed(fn, what):
    try:
        fn()
    except ClosedError as e:
        print(what, "ClosedError", e)
    else:
        raise SystemExit(f"{what}: no ClosedError")

case = sys.argv[1]
if case == "sched-free":
    ctx, a, y, gf = graph()
    s = ggmlpy.Scheduler([be])
    s.alloc_graph(gf)
    a.set(np.ones(a.ne[0], np.float32))
    s.compute(gf)
    assert float(y.get()[5]) == 2.0
    s.free()
    expect_closed(y.get, "get")
    expect_closed(y.numpy, "numpy")
    expect_closed(lambda: a.set(np.ones(a.ne[0], np.float32)), "set")
    expect_closed(lambda: gf.compute(1), "compute")
    expect_closed(lambda: be.graph_compute(gf), "backend compute")
elif case == "gallocr-dropped":
    ctx, a, y, gf = graph()
    ga = ggmlpy.Gallocr(be.buffer_type)
    ga.alloc_graph(gf)
    a.set(np.arange(a.ne[0], dtype=np.float32))
    be.graph_compute(gf)
    del ga
    gc.collect()
    for _ in range(3):                       # churn the heap: freed memory would be reused now
        junk = [np.ones(1 << 18, np.float32) * i for i in range(8)]
    assert np.array_equal(y.get(), 2 * np.arange(a.ne[0], dtype=np.float32)), "values changed"
    be.graph_compute(gf)                     # still computable: the context keeps the allocator alive
    print("kept alive")
elif case == "gallocr-free":
    ctx, a, y, gf = graph()
    ga = ggmlpy.Gallocr(be.buffer_type)
    ga.alloc_graph(gf)
    ga.free()
    expect_closed(y.get, "get")
    expect_closed(lambda: be.graph_compute(gf), "backend compute")
elif case == "gallocr-grows":
    ga = ggmlpy.Gallocr(be.buffer_type)
    c1, a1, y1, g1 = graph(1 << 10)
    ga.alloc_graph(g1)
    c2, a2, y2, g2 = graph(1 << 22)          # bigger: ggml frees the old buffer and allocates a new one
    ga.alloc_graph(g2)
    expect_closed(y1.get, "get of the small graph")
    expect_closed(lambda: ga.alloc_graph(g1), "re-allocating the small graph")
    a2.set(np.ones(a2.ne[0], np.float32))
    be.graph_compute(g2)
    assert float(y2.get()[-1]) == 2.0
    # reserving the largest graph first keeps both valid
    gb = ggmlpy.Gallocr(be.buffer_type)
    c3, a3, y3, g3 = graph(1 << 22)
    gb.reserve(g3)
    c4, a4, y4, g4 = graph(1 << 10)
    gb.alloc_graph(g4)
    gb.alloc_graph(g3)
    a4.set(np.ones(a4.ne[0], np.float32))
    be.graph_compute(g4)
    assert float(y4.get()[0]) == 2.0
elif case == "sched-grows":
    s = ggmlpy.Scheduler([be])
    c1, a1, y1, g1 = graph(1 << 10)
    s.alloc_graph(g1)
    c2, a2, y2, g2 = graph(1 << 22)
    s.alloc_graph(g2)
    expect_closed(y1.get, "get of the small graph")
    expect_closed(lambda: s.compute(g1), "computing the small graph again")
    s.compute(g2)
print("OK")
"""


@pytest.mark.parametrize("case", ["sched-free", "gallocr-dropped", "gallocr-free", "gallocr-grows", "sched-grows"])
def test_tensors_placed_by_an_allocator_never_read_freed_memory(case):
    out = run_child(ALLOCATOR_CHILD, case)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout + out.stderr


# --- shapes of programs the thread fuzzer found aborting or crashing in ggml --------------------------

FOUND_CHILD = r"""
import sys
import numpy as np
import ggmlpy
from ggmlpy import GGMLValueError, ClosedError

be = ggmlpy.device("CPU").init()
case = sys.argv[1]

def expect(exc, fn, what):
    try:
        fn()
    except exc as e:
        print(what, type(e).__name__, e)
    else:
        raise SystemExit(f"{what}: no {exc.__name__}")

if case == "gallocr-next-graph":
    # a Gallocr used for one graph, then for a graph with another set of leafs: ggml placed the new
    # leafs with the old graph's plan (segfault); it is planned for every new graph now
    ga = ggmlpy.Gallocr(be.buffer_type)
    c1 = ggmlpy.Context(1 << 20, no_alloc=True)
    a = c1.new_tensor_2d(ggmlpy.Type.F32, 64, 32)
    a.set_input()
    g1 = c1.new_graph()
    g1.build_forward_expand(c1.scale(a, 2.0))
    ga.alloc_graph(g1)
    c2 = ggmlpy.Context(1 << 20, no_alloc=True)
    b = c2.new_tensor_1d(ggmlpy.Type.F32, 16)
    c = c2.new_tensor_1d(ggmlpy.Type.F32, 16)
    g2 = c2.new_graph()
    g2.build_forward_expand(b)
    g2.build_forward_expand(c2.add(b, c))
    ga.alloc_graph(g2)
    b.set(np.ones(16, np.float32))
    c.set(np.full(16, 2.0, np.float32))
    be.graph_compute(g2)
    assert g2.node(-1).get().tolist() == [3.0] * 16
elif case == "sched-unplaceable-leaf":
    s = ggmlpy.Scheduler([be])
    ctx = ggmlpy.Context(1 << 20, no_alloc=True)
    leaf = ctx.new_tensor_2d(ggmlpy.Type.F16, 16, 8)          # no data, not an input
    g0 = ctx.new_graph()
    g0.build_forward_expand(leaf)
    expect(GGMLValueError, lambda: s.alloc_graph(g0), "no nodes")
    g1 = ctx.new_graph()
    g1.build_forward_expand(ctx.cont(ctx.view_1d(leaf, 8, 0)))   # read only through a view
    expect(GGMLValueError, lambda: s.compute(g1), "read through a view")
    leaf.set_input()                                            # an input is placed on the CPU
    s.alloc_graph(g1)
elif case == "alloc-views-without-memory":
    host = ggmlpy.Context(1 << 20)
    h = host.from_numpy(np.ones((4, 8), np.float32))           # host arena, no backend buffer
    ctx = ggmlpy.Context(1 << 20, no_alloc=True)
    ctx.view_1d(h, 8, 0)
    expect(GGMLValueError, lambda: ggmlpy.alloc_ctx_tensors(ctx, be), "view of host memory")
    other = ggmlpy.Context(1 << 20, no_alloc=True)
    t = other.new_tensor_1d(ggmlpy.Type.F32, 32)               # not allocated yet
    ctx2 = ggmlpy.Context(1 << 20, no_alloc=True)
    ctx2.new_tensor_1d(ggmlpy.Type.F32, 4)                      # something of its own to allocate
    v = ctx2.view_1d(t, 8, 0)
    expect(GGMLValueError, lambda: ggmlpy.alloc_ctx_tensors(ctx2, be), "view of unallocated")
    ggmlpy.alloc_ctx_tensors(other, be)                        # allocated first: then it works
    ggmlpy.alloc_ctx_tensors(ctx2, be)
    t.set(np.arange(32, dtype=np.float32))
    assert v.get().tolist() == list(range(8))                  # the view reads its source's memory
    other2 = ggmlpy.Context(1 << 20, no_alloc=True)
    u = other2.new_tensor_1d(ggmlpy.Type.F32, 32)
    ctx3 = ggmlpy.Context(1 << 20, no_alloc=True)
    ctx3.new_tensor_1d(ggmlpy.Type.F32, 4)
    ctx3.view_1d(u, 8, 0)
    other2.free()                                              # the view's source is gone
    expect(GGMLValueError, lambda: ggmlpy.alloc_ctx_tensors(ctx3, be), "view of freed")
elif case == "graph-of-freed-tensors":
    x = ggmlpy.Context(1 << 20)
    t = x.from_numpy(np.ones(8, np.float32))
    y = x.scale(t, 2.0)
    gctx = ggmlpy.Context(1 << 20)
    g = gctx.new_graph()
    g.build_forward_expand(y)                                  # the graph's context made none of them
    assert g.nodes[0].context is x                             # owned by x, not by the graph's context
    x.free()
    for what, fn in (("summary", g.summary), ("nodes", lambda: g.nodes), ("leafs", lambda: g.leafs),
                     ("get_tensor", lambda: g.get_tensor("leaf_0")), ("compute", lambda: g.compute(1))):
        expect(ClosedError, fn, what)
print("OK")
"""


@pytest.mark.parametrize("case", ["gallocr-next-graph", "sched-unplaceable-leaf", "alloc-views-without-memory",
                                  "graph-of-freed-tensors"])
def test_programs_the_thread_fuzzer_found(case):
    out = run_child(FOUND_CHILD, case)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout + out.stderr


# --- nothing is freed or changed under a running compute -------------------------------------------

THREADS_CHILD = r"""
import sys, threading, time
import numpy as np
import ggmlpy
from ggmlpy import GGMLValueError, ClosedError

N, DEPTH = 1024, 48          # about a second of single-threaded compute

def long_graph(ctx, w):
    x = w
    for _ in range(DEPTH):
        x = ctx.mul_mat(w, x)
    gf = ctx.new_graph(256)
    gf.build_forward_expand(x)
    return gf, x

def scheduled_long_graph(be):
    # The long graph over weights in a buffer of backend ``be``, allocated by a scheduler of ``be``
    wctx = ggmlpy.Context(1 << 20, no_alloc=True)
    w = wctx.new_tensor_2d(ggmlpy.Type.F32, N, N)
    buf = ggmlpy.alloc_ctx_tensors(wctx, be)
    w.set(w_np)
    ctx = ggmlpy.Context(1 << 20, no_alloc=True)
    gf, x = long_graph(ctx, w)
    s = ggmlpy.Scheduler([be])
    s.alloc_graph(gf)
    return s, gf, x, buf

def run_while_computing(compute, attempt):
    # Start compute in a thread, then call attempt() while it is surely running.
    errors = []
    started = threading.Event()
    def work():
        started.set()
        try:
            compute()
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=work)
    t.start()
    started.wait()
    time.sleep(0.15)
    result = attempt()
    running = t.is_alive()
    t.join(120)
    assert not errors, errors
    return result, running

def refusals(*fns):
    # the GGMLValueError message of each call that was refused
    out = []
    for fn in fns:
        try:
            fn()
        except GGMLValueError as e:
            out.append(str(e))
    return out

case = sys.argv[1]
w_np = (np.random.default_rng(0).random((N, N), dtype=np.float32) - 0.5) / N
if case == "free-graph-context":
    ctx = ggmlpy.Context(256 << 20)
    w = ctx.from_numpy(w_np)
    gf, x = long_graph(ctx, w)
    def attempt():
        try:
            ctx.free()
        except GGMLValueError as e:
            return str(e)
        return None
    msg, running = run_while_computing(lambda: gf.compute(1), attempt)
    assert running, "compute finished before the attempt: scenario too short"
    assert msg is not None and "being computed" in msg, msg
    assert np.isfinite(x.get()).all()        # the compute finished over intact memory
    ctx.free()                               # and freeing works once it is done
elif case == "reset-input-context":
    wctx = ggmlpy.Context(8 << 20)
    w = wctx.from_numpy(w_np)
    ctx = ggmlpy.Context(256 << 20)
    gf, x = long_graph(ctx, w)
    msgs, running = run_while_computing(lambda: gf.compute(1), lambda: refusals(wctx.reset, wctx.free))
    assert running and len(msgs) == 2, msgs
    assert np.isfinite(x.get()).all()
elif case == "expand-while-computing":
    ctx = ggmlpy.Context(256 << 20)
    w = ctx.from_numpy(w_np)
    gf, x = long_graph(ctx, w)
    extra = ctx.scale(x, 2.0)
    msgs, running = run_while_computing(
        lambda: gf.compute(1),
        lambda: refusals(lambda: gf.build_forward_expand(extra), gf.clear, lambda: gf.compute(1)))
    assert running and len(msgs) == 3, msgs
    gf.build_forward_expand(extra)           # fine once the compute is over
elif case == "sched-free-waits":
    be = ggmlpy.device("CPU").init()
    be.set_n_threads(1)
    s, gf, x, buf = scheduled_long_graph(be)
    def attempt():
        t0 = time.perf_counter()
        s.free()                             # blocks until the compute is done, then frees
        return time.perf_counter() - t0
    waited, running = run_while_computing(lambda: s.compute(gf), attempt)
    assert running is False                  # free() returned only after the compute ended
    assert waited > 0.05, waited             # and it did wait: the compute (about 1 s) was still running
    try:
        x.get()
    except ClosedError:
        pass
    else:
        raise SystemExit("tensor of a freed scheduler readable")
    try:
        be.free()
    except GGMLValueError:
        raise SystemExit("backend refused to free after its scheduler was freed")
elif case == "backend-in-use":
    be = ggmlpy.device("CPU").init()
    s = ggmlpy.Scheduler([be])
    try:
        be.free()
    except GGMLValueError as e:
        assert "Scheduler" in str(e)
    else:
        raise SystemExit("backend freed under a live scheduler")
    s.free()
    be.free()
elif case == "threadpool-while-scheduled":
    be = ggmlpy.device("CPU").init()
    be.set_threadpool(2)
    s, gf, x, buf = scheduled_long_graph(be)
    # the pool the scheduler's compute runs on must not be replaced or freed under it
    errs, running = run_while_computing(lambda: s.compute(gf),
                                        lambda: refusals(lambda: be.set_threadpool(1), lambda: be.set_n_threads(1)))
    assert running, "the compute ended before the attempt: the test proves nothing"
    assert len(errs) == 2 and all("computing" in e for e in errs), errs
    be.set_threadpool(1)                     # and once it is done, it may
    assert be.threadpool_threads == 1
    s.free()
print("OK")
"""


@pytest.mark.parametrize("case", ["free-graph-context", "reset-input-context", "expand-while-computing",
                                  "sched-free-waits", "backend-in-use", "threadpool-while-scheduled"])
def test_nothing_a_running_compute_reads_is_freed_or_changed(case):
    out = run_child(THREADS_CHILD, case, timeout=300)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout + out.stderr


# --- sizes and values out of range -------------------------------------------------------------------

def test_context_sizes_out_of_range_raise():
    with pytest.raises(ggmlpy.GGMLMemoryError, match="mem_size"):
        ggmlpy.Context(2**64 - 1)                   # used to round up to a 0-byte arena
    with pytest.raises(ggmlpy.GGMLValueError, match="out of range"):
        ggmlpy.Context(2**64)
    with pytest.raises(ggmlpy.GGMLValueError, match="out of range"):
        ggmlpy.Context(-1)
    with pytest.raises(ggmlpy.GGMLTypeError):
        ggmlpy.Context(2.5)


@pytest.mark.parametrize("dtype,values", [(np.int64, [2**40, 5]), (np.int64, [-(2**31) - 1, 0]),
                                          (np.uint32, [2**31, 1])])
def test_integer_values_that_do_not_fit_raise(dtype, values):
    ctx = ggmlpy.Context(MiB)
    t = ctx.new_tensor_1d(ggmlpy.Type.I32, 2)
    t.set(np.array([7, 8], np.int32))
    with pytest.raises(ggmlpy.GGMLValueError, match="does not fit"):
        t.set(np.array(values, dtype))              # 2**40 used to be stored as 0
    assert t.get().tolist() == [7, 8]               # nothing was written
    t.set(np.array([-(2**31), 2**31 - 1], np.int64))  # values that fit are fine
    assert t.get().tolist() == [-(2**31), 2**31 - 1]


@pytest.mark.parametrize("op", ["sum_rows", "mean", "argmax"])
def test_reductions_of_empty_rows_check_room_for_their_result(op):
    ctx = ggmlpy.Context(MiB)
    t = ctx.new_tensor_2d(ggmlpy.Type.F32, 0, 2**20)   # no data, but the result has 2**20 elements
    with pytest.raises(ggmlpy.GGMLMemoryError, match=op):
        getattr(ctx, op)(t)
    big = ggmlpy.Context(16 * MiB)
    t = big.new_tensor_2d(ggmlpy.Type.F32, 0, 2**20)
    y = getattr(big, op)(t)
    assert y.ne[:2] == ((2**20, 1) if op == "argmax" else (1, 2**20))


def test_is_contiguous_agrees_with_the_ops():
    ctx = ggmlpy.Context(MiB)
    a = ctx.from_numpy(np.arange(64, dtype=np.float32).reshape(8, 8))
    # a size-1 dimension with an unpacked stride: ggml_is_contiguous says yes, ggml's scale kernel no
    v = ctx.view_2d(a, 4, 1, 8 * 4 * 3, 0)            # ne (4, 1), nb[1] = 96 instead of 16
    assert not v.is_contiguous
    seen = set()
    for t in (a, v, ctx.transpose(a), ctx.view_1d(a, 8, 4), ctx.reshape_2d(a, 16, 4)):
        seen.add(t.is_contiguous)
        if t.is_contiguous:
            ctx.scale(t, 2.0)                         # every op needing contiguity takes it
            ctx.sum(t)
        else:
            with pytest.raises(ggmlpy.GGMLValueError, match="contiguous"):
                ctx.sum(t)
            assert ctx.cont(t).is_contiguous
    assert seen == {True, False}


def test_threads_share_a_context_for_reading():
    # Many threads computing their own graphs over one shared weights context is the normal case
    # and must keep working with the busy accounting.
    wctx = ggmlpy.Context(4 * MiB)
    w = wctx.from_numpy(np.eye(64, dtype=np.float32))
    results, errors = [], []

    def work(i):
        try:
            ctx = ggmlpy.Context(4 * MiB)
            x = ctx.from_numpy(np.full((4, 64), i, np.float32))
            y = ctx.mul_mat(w, x)
            gf = ctx.new_graph()
            gf.build_forward_expand(y)
            for _ in range(20):
                gf.compute(1)
            results.append((i, float(y.get()[0, 0])))
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    assert sorted(results) == [(i, float(i)) for i in range(6)]
    wctx.free()                                        # nobody computes any more: free works
