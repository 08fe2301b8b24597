"""pytest-benchmark benchmarks of ggmlpy's binding overhead, next to a ctypes binding.

Run explicitly (the normal test run, ``pytest`` with ``testpaths = ["tests"]``,
never collects this file: its name does not match ``test_*.py``)::

    python -m pytest bench/bench_overhead.py --benchmark-only
    python -m pytest bench/bench_overhead.py --benchmark-only --benchmark-group-by=group \\
        --benchmark-json=overhead.json

Groups (pytest-benchmark compares the members of a group with each other):

``graph_build``
    ``[ggmlpy]`` and ``[ctypes]``: one round = 10,000 times
    ``x = add(x, y); build_forward_expand(gf, x)`` in a fresh ``no_alloc``
    context (made in the untimed setup).  ``extra_info`` holds ns per op and,
    when a C compiler is available, the C baseline's ns per op (run once for
    the module, not interleaved: use bench/overhead.py for ratios you can trust).
``graph_build_parts``
    ggmlpy's loop split in two: 10,000 ``ctx.add`` alone, and 10,000
    ``gf.build_forward_expand`` of an already built chain.
``round_trip``
    ``[ggmlpy]`` and ``[ctypes]``: copy two float32[64] arrays into ``a``,
    ``b``, compute ``c = a + b`` on one thread, copy ``c`` out.
``round_trip_parts``
    The pieces of ggmlpy's round trip (``set``, ``compute``, ``get``, and the
    zero-copy ``numpy()`` for comparison), the bare ``ggml_graph_compute``
    through ctypes, and an empty Python call (the timing floor).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import (  # noqa: E402
    GGML_STATUS_SUCCESS,
    CtypesRoundTrip,
    build_c_baseline,
    load_ctypes_ggml,
    run_c_baseline,
)
from overhead import (  # noqa: E402
    N_ELEM,
    N_OPS,
    TARGET_GRAPH_BUILD_RATIO,
    TARGET_ROUND_TRIP_NS,
    GgmlpyRoundTrip,
    ctypes_graph_loop,
    ctypes_graph_setup,
    ggmlpy_graph_loop,
    ggmlpy_graph_setup,
)

GRAPH_ROUNDS = 20
# A fresh 4-5 MB context per round: glibc needs about ten of them before it
# hands back already-mapped memory instead of new pages (each first-touch page
# fault costs ~1-3 us here); warm up past that so rounds measure the binding.
GRAPH_WARMUP_ROUNDS = 12
# Round-trip calls take ~0.3-10 us: a fixed batch of calls per timed round
# amortises the timer's own cost (~50-100 ns); pytest-benchmark's automatic
# calibration is thrown off by one slow first call on a busy machine.
SHORT_ROUNDS = 200
SHORT_ITERATIONS = 200


def _short(benchmark, fn, *args):
    return benchmark.pedantic(fn, args=args, rounds=SHORT_ROUNDS, iterations=SHORT_ITERATIONS,
                              warmup_rounds=5)


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def c_ref(tmp_path_factory):
    """The C baseline's results (min and median over 20 reps), or None without a compiler."""
    try:
        exe = build_c_baseline(tmp_path_factory.mktemp("c_baseline"))
    except (FileNotFoundError, RuntimeError) as e:
        print(f"C baseline unavailable: {e}", file=sys.stderr)
        return None
    return run_c_baseline(exe, reps=20, iters=10000)


@pytest.fixture(scope="module")
def host_arrays():
    ha = np.arange(N_ELEM, dtype=np.float32)
    hb = (0.5 * np.arange(N_ELEM) + 1.0).astype(np.float32)
    return ha, hb, ha + hb


@pytest.fixture
def g_rt():
    rt = GgmlpyRoundTrip(N_ELEM)
    yield rt
    rt.close()


@pytest.fixture
def c_rt():
    rt = CtypesRoundTrip(N_ELEM)
    yield rt
    rt.close()


def _stats(benchmark):
    """(min, median) seconds per round, or None when benchmarking is disabled."""
    meta = getattr(benchmark, "stats", None)
    st = getattr(meta, "stats", None)
    if st is None:
        return None
    return st.min, st.median


# --------------------------------------------------------------------------
# graph_build
# --------------------------------------------------------------------------

_GRAPH_IMPLS = {
    "ggmlpy": (ggmlpy_graph_setup, ggmlpy_graph_loop, lambda s: s[3].n_nodes, lambda s: s[0].free()),
    "ctypes": (ctypes_graph_setup, ctypes_graph_loop,
               lambda s: s[0].ggml_graph_n_nodes(s[4]), lambda s: s[0].ggml_free(s[1])),
}


def _pedantic_fresh(benchmark, make, target, release, rounds=GRAPH_ROUNDS):
    """Time ``target(*state)`` with a fresh ``state = make()`` per round (setup untimed).

    The previous round's state is released in the next setup, so freeing is
    not timed either. Returns the last state (still alive) and a release function.
    """
    live = []

    def setup():
        while live:
            release(live.pop())
        live.append(make())
        return live[-1], {}

    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=GRAPH_WARMUP_ROUNDS, iterations=1)
    return live[-1], lambda: [release(s) for s in live]


@pytest.mark.benchmark(group="graph_build")
@pytest.mark.parametrize("impl", ["ggmlpy", "ctypes"])
def test_graph_build(benchmark, impl, c_ref):
    setup, loop, n_nodes, release = _GRAPH_IMPLS[impl]
    state, done = _pedantic_fresh(benchmark, setup, loop, release)
    try:
        assert n_nodes(state) == N_OPS
    finally:
        done()
    benchmark.extra_info["n_ops"] = N_OPS
    st = _stats(benchmark)
    if st is not None:
        benchmark.extra_info["ns_per_op_min"] = st[0] / N_OPS * 1e9
        benchmark.extra_info["ns_per_op_median"] = st[1] / N_OPS * 1e9
        if c_ref is not None:
            c_min = c_ref["graph_build"]["ns_per_op"]
            benchmark.extra_info["c_ns_per_op_min"] = c_min
            # Minimum against minimum: the C program's median includes first-touch page faults.
            benchmark.extra_info["ratio_vs_c_min"] = benchmark.extra_info["ns_per_op_min"] / c_min
            if impl == "ggmlpy":
                benchmark.extra_info["target_ratio_vs_c"] = TARGET_GRAPH_BUILD_RATIO


def _ggmlpy_chain(n_ops=N_OPS):
    """A graph setup plus a chain of n_ops adds not yet in the graph."""
    ctx, x, y, gf = ggmlpy_graph_setup(n_ops)
    chain = []
    for _ in range(n_ops):
        x = ctx.add(x, y)
        chain.append(x)
    return ctx, gf, chain


def _expand_all(ctx, gf, chain):
    expand = gf.build_forward_expand
    for t in chain:
        expand(t)


def _add_only(ctx, x, y, gf):
    add = ctx.add
    for _ in range(N_OPS):
        x = add(x, y)
    return x


@pytest.mark.benchmark(group="graph_build_parts")
def test_graph_build_part_add(benchmark):
    state, done = _pedantic_fresh(benchmark, ggmlpy_graph_setup, _add_only, lambda s: s[0].free())
    done()
    st = _stats(benchmark)
    if st is not None:
        benchmark.extra_info["ns_per_add_median"] = st[1] / N_OPS * 1e9


@pytest.mark.benchmark(group="graph_build_parts")
def test_graph_build_part_expand(benchmark):
    state, done = _pedantic_fresh(benchmark, _ggmlpy_chain, _expand_all, lambda s: s[0].free())
    try:
        assert state[1].n_nodes == N_OPS
    finally:
        done()
    st = _stats(benchmark)
    if st is not None:
        benchmark.extra_info["ns_per_expand_median"] = st[1] / N_OPS * 1e9


# --------------------------------------------------------------------------
# round_trip
# --------------------------------------------------------------------------

def _round_trip_info(benchmark, impl, c_ref):
    st = _stats(benchmark)
    if st is None:
        return
    if impl == "ggmlpy":
        benchmark.extra_info["target_ns"] = TARGET_ROUND_TRIP_NS
        benchmark.extra_info["target_met_median"] = st[1] * 1e9 < TARGET_ROUND_TRIP_NS
    if c_ref is not None:
        c_min = c_ref["round_trip"]["ns_per_iter"]
        benchmark.extra_info["c_ns_per_round_trip_min"] = c_min
        benchmark.extra_info["ratio_vs_c_min"] = st[0] * 1e9 / c_min


@pytest.mark.benchmark(group="round_trip")
def test_round_trip_ggmlpy(benchmark, g_rt, host_arrays, c_ref):
    ha, hb, expected = host_arrays
    a, b, c, gf = g_rt.a, g_rt.b, g_rt.c, g_rt.gf

    def round_trip():
        a.set(ha)
        b.set(hb)
        gf.compute(1)
        return c.get()

    out = _short(benchmark, round_trip)
    assert np.array_equal(out, expected)
    _round_trip_info(benchmark, "ggmlpy", c_ref)


@pytest.mark.benchmark(group="round_trip")
def test_round_trip_ctypes(benchmark, c_rt, host_arrays, c_ref):
    ha, hb, expected = host_arrays
    out = _short(benchmark, c_rt, ha, hb)
    assert np.array_equal(out, expected)
    _round_trip_info(benchmark, "ctypes", c_ref)


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_ggmlpy_set(benchmark, g_rt, host_arrays):
    _short(benchmark, g_rt.a.set, host_arrays[0])


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_ggmlpy_compute(benchmark, g_rt, host_arrays):
    g_rt.a.set(host_arrays[0])
    g_rt.b.set(host_arrays[1])
    _short(benchmark, g_rt.gf.compute, 1)
    assert np.array_equal(g_rt.c.get(), host_arrays[2])


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_ggmlpy_get(benchmark, g_rt):
    _short(benchmark, g_rt.c.get)


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_ggmlpy_numpy_view(benchmark, g_rt):
    _short(benchmark, g_rt.c.numpy)


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_ctypes_compute(benchmark, c_rt):
    lib = load_ctypes_ggml()
    status = _short(benchmark, lib.ggml_graph_compute, c_rt.gf, c_rt._cplan_ref)
    assert status == GGML_STATUS_SUCCESS


@pytest.mark.benchmark(group="round_trip_parts")
def test_round_trip_part_empty_call(benchmark):
    _short(benchmark, lambda: None)
