#!/usr/bin/env python
"""Binding overhead of ggmlpy against plain C and a ctypes binding, measured interleaved.

Usage::

    python bench/overhead.py [--reps N] [--inner N] [--iters N] [--json FILE] [--no-c] [--quiet]

Two workloads (see bench/baselines.py for the C and ctypes versions):

``graph_build``
    A ``no_alloc`` context, two F32[64] tensors ``x`` and ``y`` and a graph of
    16384 nodes, then 10,000 times ``x = add(x, y); build_forward_expand(gf, x)``.
    Reported as time per op added (loop time / 10,000); context creation is
    not timed.

``round_trip``
    Set up once: an allocating context with ``a``, ``b`` (F32[64]), ``c = a + b``
    and its graph.  One round trip copies two 64-float numpy arrays into ``a``
    and ``b``, computes the graph on one thread and copies ``c`` into a new
    numpy array.  Reported as time per round trip.

Each repetition runs C, ctypes and ggmlpy one after the other (the order
rotates from one repetition to the next), so all three see the same machine
state; timings on a shared machine drift by 10-30% over minutes, and only
ratios taken within one repetition are comparable.

Within a repetition each implementation runs each workload ``--inner`` times
(default 10) and the repetition's figure is the fastest of those runs.  For C
that is one run of the C program with ``reps=--inner + 10``, which reports its
minimum.  Taking the fastest run matters for graph_build: the C program is a
fresh process, and in its first ~14 repetitions three runs out of four put
every op's tensor on pages never touched before (glibc cannot reuse the freed
4 MB arena for the next posix_memalign until free chunks coalesce): about 1000
minor page faults per 10,000 ops, which triple C's time, while the long-lived
Python process reuses already-mapped memory.  The fastest run is the no-fault
steady state for all three; the 10 extra C repetitions give the C program
about as many clean runs as the Python sides get.  The medians of the inner
runs are kept in the JSON output too.

The summary gives, per workload and implementation, the median and minimum
over repetitions, and the ratios ggmlpy/C, ctypes/C and ggmlpy/ctypes as the
median of the per-repetition ratios with their min-max spread, next to the
targets: graph build within 1.25x of C per op added, round trip within 1.5 us.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import (  # noqa: E402
    GGML_DEFAULT_GRAPH_SIZE,
    GGML_TYPE_F32,
    GRAPH_SIZE,
    CtypesRoundTrip,
    build_c_baseline,
    ctypes_graph_build,
    ggml_init_params,
    load_ctypes_ggml,
    run_c_baseline,
)

import ggmlpy  # noqa: E402

N_OPS = 10000          # fixed: the C baseline's N_OPS
N_ELEM = 64            # fixed: the C baseline's N_ELEM

# The targets.
TARGET_GRAPH_BUILD_RATIO = 1.25     # ggmlpy / C, per op added
TARGET_ROUND_TRIP_NS = 1500.0       # ggmlpy, absolute, per round trip

WARMUP_RUNS = 12      # graph_build runs per Python implementation before timing
C_EXTRA_REPS = 10     # extra repetitions per C process (see run_c)

IMPLS = ("c", "ctypes", "ggmlpy")
LABELS = {"c": "C", "ctypes": "ctypes", "ggmlpy": "ggmlpy"}


# --------------------------------------------------------------------------
# ggmlpy workloads (shared with bench_overhead.py)
# --------------------------------------------------------------------------

def ggmlpy_graph_setup(n_ops: int = N_OPS):
    """Context, x, y and an empty graph for the graph_build workload."""
    graph_size = max(GRAPH_SIZE, n_ops)
    ctx = ggmlpy.Context.for_tensors(n_ops + 2, 0, graph_size=graph_size, no_alloc=True)
    x = ctx.new_tensor_1d(ggmlpy.Type.F32, N_ELEM)
    y = ctx.new_tensor_1d(ggmlpy.Type.F32, N_ELEM)
    gf = ctx.new_graph(graph_size)
    return ctx, x, y, gf


def ggmlpy_graph_loop(ctx, x, y, gf, n_ops: int = N_OPS):
    """The timed part of graph_build, written as a user would write it."""
    for _ in range(n_ops):
        x = ctx.add(x, y)
        gf.build_forward_expand(x)
    return x


def ggmlpy_graph_build(n_ops: int = N_OPS) -> float:
    """Workload 1 through ggmlpy; return the seconds spent in the add/expand loop."""
    ctx, x, y, gf = ggmlpy_graph_setup(n_ops)
    t0 = time.perf_counter()
    ggmlpy_graph_loop(ctx, x, y, gf, n_ops)
    elapsed = time.perf_counter() - t0
    if gf.n_nodes != n_ops:
        raise RuntimeError(f"ggmlpy graph has {gf.n_nodes} nodes, expected {n_ops}")
    ctx.free()
    return elapsed


class GgmlpyRoundTrip:
    """Workload 2 through ggmlpy: context, a, b, c = a + b and its graph, made once."""

    def __init__(self, n: int = N_ELEM):
        self.n = int(n)
        self.ctx = ggmlpy.Context.for_tensors(3, 3 * self.n * 4, graph_size=GGML_DEFAULT_GRAPH_SIZE)
        self.a = self.ctx.new_tensor_1d(ggmlpy.Type.F32, self.n)
        self.b = self.ctx.new_tensor_1d(ggmlpy.Type.F32, self.n)
        self.c = self.ctx.add(self.a, self.b)
        self.gf = self.ctx.new_graph(GGML_DEFAULT_GRAPH_SIZE)
        self.gf.build_forward_expand(self.c)

    def __call__(self, ha: np.ndarray, hb: np.ndarray) -> np.ndarray:
        self.a.set(ha)
        self.b.set(hb)
        self.gf.compute(1)
        return self.c.get()

    def loop(self, ha: np.ndarray, hb: np.ndarray, iters: int) -> tuple[float, np.ndarray]:
        """``iters`` round trips written inline (no wrapper call); (seconds, last output)."""
        a, b, c, gf = self.a, self.b, self.c, self.gf
        out = None
        t0 = time.perf_counter()
        for _ in range(iters):
            a.set(ha)
            b.set(hb)
            gf.compute(1)
            out = c.get()
        return time.perf_counter() - t0, out

    def close(self) -> None:
        self.ctx.free()


def ctypes_round_trip_loop(rt: CtypesRoundTrip, ha, hb, iters: int) -> tuple[float, np.ndarray]:
    out = None
    t0 = time.perf_counter()
    for _ in range(iters):
        out = rt(ha, hb)
    return time.perf_counter() - t0, out


# ctypes graph_build split into setup and loop (for pytest-benchmark, which
# times the loop itself); the same calls as baselines.ctypes_graph_build.

def ctypes_graph_setup(n_ops: int = N_OPS, lib=None):
    g = lib if lib is not None else load_ctypes_ggml()
    graph_size = max(GRAPH_SIZE, n_ops)
    params = ggml_init_params(
        mem_size=g.ggml_tensor_overhead() * (n_ops + 2) + g.ggml_graph_overhead_custom(graph_size, False),
        mem_buffer=None,
        no_alloc=True,
    )
    ctx = g.ggml_init(params)
    if not ctx:
        raise MemoryError("ggml_init failed")
    x = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM)
    y = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM)
    gf = g.ggml_new_graph_custom(ctx, graph_size, False)
    return g, ctx, x, y, gf


def ctypes_graph_loop(g, ctx, x, y, gf, n_ops: int = N_OPS):
    add, expand = g.ggml_add, g.ggml_build_forward_expand
    for _ in range(n_ops):
        x = add(ctx, x, y)
        expand(gf, x)
    return x


# --------------------------------------------------------------------------
# Statistics and printing
# --------------------------------------------------------------------------

def _summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _ratios(num: list[float], den: list[float]) -> dict:
    per_rep = [a / b for a, b in zip(num, den)]
    return {
        "median": statistics.median(per_rep),
        "min": min(per_rep),
        "max": max(per_rep),
        "ratio_of_medians": statistics.median(num) / statistics.median(den),
        "per_rep": per_rep,
    }


def _fmt_time(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:9.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:9.3f} us"
    return f"{ns:9.1f} ns"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meta(args, c_exe) -> dict:
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count()
    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "ggmlpy": getattr(ggmlpy, "__version__", None) or _ggmlpy_version(),
        "ggml_commit": _safe(getattr(ggmlpy, "ggml_commit", None)),
        "ggml_version": _safe(getattr(ggmlpy, "ggml_version", None)),
        "cpu": _cpu_model(),
        "cpus_available": ncpu,
        "platform": platform.platform(),
        "reps": args.reps,
        "inner": args.inner,
        "n_ops": N_OPS,
        "round_trip_iters": args.iters,
        "n_elem": N_ELEM,
        "c_baseline": str(c_exe) if c_exe else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _ggmlpy_version():
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("ggmlpy")
    except Exception:
        return None


def _safe(fn):
    try:
        return fn() if callable(fn) else fn
    except Exception:
        return None


WORKLOADS = {
    "graph_build": {
        "title": f"graph_build: time per op added (add + build_forward_expand, {N_OPS:,} ops per rep)",
        "unit": "ns_per_op",
    },
    "round_trip": {
        "title": "round_trip: time per round trip (2 x set F32[64], compute on 1 thread, get)",
        "unit": "ns_per_round_trip",
    },
}


def analyse(per_rep: dict) -> dict:
    """per_rep[workload][impl] = [ns, ...] -> summaries, ratios and target checks."""
    out = {}
    for wl, by_impl in per_rep.items():
        have = [i for i in IMPLS if by_impl.get(i)]
        res = {"unit": WORKLOADS[wl]["unit"], "per_rep": by_impl,
               "summary": {i: _summary(by_impl[i]) for i in have}, "ratios": {}}
        for num, den in (("ggmlpy", "c"), ("ctypes", "c"), ("ggmlpy", "ctypes")):
            if num in have and den in have:
                res["ratios"][f"{num}/{den}"] = _ratios(by_impl[num], by_impl[den])
        target = {}
        if wl == "graph_build":
            r = res["ratios"].get("ggmlpy/c")
            target = {"what": "ggmlpy/C per op added", "limit": TARGET_GRAPH_BUILD_RATIO,
                      "value": r["median"] if r else None,
                      "met": (r["median"] <= TARGET_GRAPH_BUILD_RATIO) if r else None,
                      "met_at_best": (r["min"] <= TARGET_GRAPH_BUILD_RATIO) if r else None}
        elif wl == "round_trip" and "ggmlpy" in have:
            s = res["summary"]["ggmlpy"]
            target = {"what": "ggmlpy per round trip (ns)", "limit": TARGET_ROUND_TRIP_NS,
                      "value": s["median"], "met": s["median"] <= TARGET_ROUND_TRIP_NS,
                      "met_at_best": s["min"] <= TARGET_ROUND_TRIP_NS}
        res["target"] = target
        out[wl] = res
    return out


def _yn(b) -> str:
    return "n/a" if b is None else ("MET" if b else "NOT MET")


def print_table(results: dict, meta: dict, file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p(f"ggmlpy binding overhead: {meta['reps']} interleaved reps (order rotates C -> ctypes -> ggmlpy), "
      f"each rep's figure = fastest of {meta['inner']} runs")
    p(f"  {meta['cpu']}, {meta['cpus_available']} CPUs, Python {meta['python']}, numpy {meta['numpy']}, "
      f"ggmlpy {meta['ggmlpy']}, ggml {meta['ggml_version']} ({meta['ggml_commit']})")
    for wl, res in results.items():
        p()
        p(WORKLOADS[wl]["title"])
        p(f"  {'':10s} {'median':>12s} {'min':>12s} {'max':>12s}")
        for impl in IMPLS:
            s = res["summary"].get(impl)
            if s is None:
                p(f"  {LABELS[impl]:10s} {'(not run)':>12s}")
                continue
            p(f"  {LABELS[impl]:10s} {_fmt_time(s['median']):>12s} "
              f"{_fmt_time(s['min']):>12s} {_fmt_time(s['max']):>12s}")
        p(f"  {'ratio':16s} {'median':>7s} {'min':>7s} {'max':>7s}   (of per-rep ratios)   target")
        tgt = res["target"]
        for key, r in res["ratios"].items():
            num, den = key.split("/")
            label = f"{LABELS[num]} / {LABELS[den]}"
            extra = ""
            if wl == "graph_build" and key == "ggmlpy/c":
                extra = (f"<= {TARGET_GRAPH_BUILD_RATIO:.2f}x: {_yn(tgt['met'])} "
                         f"(best rep: {_yn(tgt['met_at_best'])})")
            p(f"  {label:16s} {r['median']:6.2f}x {r['min']:6.2f}x {r['max']:6.2f}x   {'':22s}{extra}")
        if wl == "round_trip" and tgt:
            p(f"  target: ggmlpy round trip <= {TARGET_ROUND_TRIP_NS / 1e3:.1f} us: median "
              f"{tgt['value'] / 1e3:.3f} us {_yn(tgt['met'])}, best rep "
              f"{res['summary']['ggmlpy']['min'] / 1e3:.3f} us {_yn(tgt['met_at_best'])}")
        elif wl == "graph_build" and "ggmlpy/c" not in res["ratios"]:
            p(f"  target: ggmlpy/C <= {TARGET_GRAPH_BUILD_RATIO:.2f}x per op: n/a (C baseline not run)")
    if "c" in results.get("graph_build", {}).get("summary", {}):
        c = results["graph_build"]["per_rep"]["c"]
        p()
        p(f"C graph_build drift across the run: first rep {c[0]:.1f} ns/op, last {c[-1]:.1f} ns/op, "
          f"min-max {min(c):.1f}-{max(c):.1f} ns/op")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30,
                    help="interleaved repetitions (default 30)")
    ap.add_argument("--inner", type=int, default=10,
                    help="timed runs of each workload per implementation within one rep; the rep's "
                         "figure is their minimum (default 10)")
    ap.add_argument("--iters", type=int, default=2000,
                    help="round trips per timed run (default 2000; short runs keep the three "
                         "implementations close in time)")
    ap.add_argument("--json", metavar="FILE", help="write meta data, per-rep timings and the summary here")
    ap.add_argument("--no-c", action="store_true", help="skip the C baseline (no compiler / headers)")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.iters < 1 or args.inner < 1:
        ap.error("--reps, --inner and --iters must be >= 1")

    tmp = tempfile.TemporaryDirectory(prefix="ggmlpy-bench-")
    c_exe = None
    if not args.no_c:
        try:
            c_exe = build_c_baseline(tmp.name)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"warning: C baseline unavailable, ratios against C are skipped: {e}", file=sys.stderr)

    lib = load_ctypes_ggml()
    ha = np.arange(N_ELEM, dtype=np.float32)
    hb = (0.5 * np.arange(N_ELEM) + 1.0).astype(np.float32)
    expected = ha + hb
    g_rt = GgmlpyRoundTrip()
    c_rt = CtypesRoundTrip(N_ELEM, lib=lib)

    def run_c():
        # A fresh C process alternates page-faulting and clean graph_build runs
        # for its first ~14 repetitions (glibc cannot reuse the freed 4 MB arena
        # for the next posix_memalign until free chunks coalesce); inner + 10
        # repetitions give it about as many clean runs as the Python sides get.
        r = run_c_baseline(c_exe, reps=args.inner + C_EXTRA_REPS, iters=args.iters)
        gb, rt = r["graph_build"], r["round_trip"]
        if gb.get("n_ops", N_OPS) != N_OPS:
            raise RuntimeError(f"C baseline built with N_OPS={gb['n_ops']}, expected {N_OPS}")
        return ((gb["ns_per_op"], gb["ns_per_op_median"]),
                (rt["ns_per_iter"], rt["ns_per_iter_median"]))

    def run_ctypes():
        gb = [ctypes_graph_build(N_OPS, lib=lib) / N_OPS * 1e9 for _ in range(args.inner)]
        rt = []
        for _ in range(args.inner):
            sec, out = ctypes_round_trip_loop(c_rt, ha, hb, args.iters)
            if not np.array_equal(out, expected):
                raise RuntimeError("ctypes round trip returned a wrong result")
            rt.append(sec / args.iters * 1e9)
        return (min(gb), statistics.median(gb)), (min(rt), statistics.median(rt))

    def run_ggmlpy():
        gb = [ggmlpy_graph_build(N_OPS) / N_OPS * 1e9 for _ in range(args.inner)]
        rt = []
        for _ in range(args.inner):
            sec, out = g_rt.loop(ha, hb, args.iters)
            if not np.array_equal(out, expected):
                raise RuntimeError("ggmlpy round trip returned a wrong result")
            rt.append(sec / args.iters * 1e9)
        return (min(gb), statistics.median(gb)), (min(rt), statistics.median(rt))

    runners = {"c": run_c, "ctypes": run_ctypes, "ggmlpy": run_ggmlpy}
    active = [i for i in IMPLS if i != "c" or c_exe is not None]

    # Warm-up: imports, first-touch of the libraries, numpy caches, and about
    # a dozen fresh graph_build contexts, after which glibc reuses mapped
    # memory instead of faulting in new pages for every context.
    for _ in range(-(-WARMUP_RUNS // args.inner)):
        for impl in active:
            if impl != "c":
                runners[impl]()
    if "c" in active:
        runners["c"]()

    per_rep = {wl: {i: [] for i in active} for wl in WORKLOADS}
    inner_median = {wl: {i: [] for i in active} for wl in WORKLOADS}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        order = active[rep % len(active):] + active[:rep % len(active)]
        for impl in order:
            for wl, (best, med) in zip(("graph_build", "round_trip"), runners[impl]()):
                per_rep[wl][impl].append(best)
                inner_median[wl][impl].append(med)
        if not args.quiet:
            print(f"\rrep {rep + 1}/{args.reps}", end="", file=sys.stderr, flush=True)
    if not args.quiet:
        print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_start

    c_rt.close()
    g_rt.close()
    tmp.cleanup()

    meta = _meta(args, c_exe)
    meta["wall_s"] = wall
    results = analyse(per_rep)
    for wl in results:
        results[wl]["per_rep_inner_median"] = inner_median[wl]
    print_table(results, meta)
    print(f"\n({wall:.1f} s for {args.reps} reps x {args.inner} runs)")
    if args.json:
        doc = {"meta": meta,
               "targets": {"graph_build_ratio_vs_c": TARGET_GRAPH_BUILD_RATIO,
                           "round_trip_ns": TARGET_ROUND_TRIP_NS},
               "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
