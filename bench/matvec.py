"""The generation step's matrix products alone: ``Context.mul_mat_vec`` against ggml's ``mul_mat``.

The 110M model's 49 matrices (12 layers of fused Q/K/V, output, fused gate/up and down, then the
output head) in one weight type, times one vector each: one graph of ``mul_mat`` and one of
``mul_mat_vec`` over the same weights, alternated, the CPU caches flushed (a pass over 256 MiB)
before each. Prints the median time, the weight bytes read per second and the speed against
``mul_mat``.

    python bench/matvec.py                                   # F16, Q8_0, Q6_K; 1 and 2 threads
    python bench/matvec.py --type Q8_0 --threads 1 --prefetch 0,1024,4096,16384
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy
from ggmlpy import Type, _core


def _weights(ctx, wtype, shapes, rng):
    ws = []
    for n, k in shapes:
        w = ctx.new_tensor(getattr(Type, wtype), (k, n))
        W = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        if wtype in ("F32", "F16", "BF16"):
            w.set(W)
        else:
            w.set_bytes(ggmlpy.quantize(W, getattr(Type, wtype)))
        ws.append(w)
    return ws


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="F16,Q8_0,Q6_K", help="comma-separated weight types")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prefetch", default=None, help="comma-separated prefetch distances in bytes (default: the kernel's)")
    ap.add_argument("--reps", type=int, default=11)
    a = ap.parse_args(argv)
    E, F, V, L = 768, 2048, 32000, 12
    shapes = [(3 * E, E), (E, E), (2 * F, E), (E, F)] * L + [(V, E)]
    default_pfd = _core._mul_mat_vec_prefetch()
    pfds = [default_pfd] if a.prefetch is None else [int(p) for p in a.prefetch.split(",")]
    flush = np.ones(64 << 20, np.float32)
    rng = np.random.default_rng(0)
    for wtype in a.type.split(","):
        ctx = ggmlpy.Context(600 << 20)
        ws = _weights(ctx, wtype, shapes, rng)
        xs = {k: ctx.from_numpy(rng.standard_normal((1, k)).astype(np.float32)) for k in (E, F)}
        graphs = {"mul_mat": ctx.new_graph(), "mul_mat_vec": ctx.new_graph()}
        for w in ws:
            graphs["mul_mat"].build_forward_expand(ctx.mul_mat(w, xs[w.ne[0]]))
            graphs["mul_mat_vec"].build_forward_expand(ctx.mul_mat_vec(w, xs[w.ne[0]]))
        nbytes = sum(w.nbytes for w in ws)
        runs = [("mul_mat", None)] + [("mul_mat_vec", d) for d in pfds]
        for threads in (int(t) for t in a.threads.split(",")):
            times = {r: [] for r in runs}
            for _ in range(a.reps):
                for r in runs:
                    flush.sum()
                    if r[1] is not None:
                        _core._mul_mat_vec_prefetch(r[1])
                    t0 = time.perf_counter()
                    graphs[r[0]].compute(threads)
                    times[r].append(time.perf_counter() - t0)
            _core._mul_mat_vec_prefetch(default_pfd)
            base = np.median(times[runs[0]])
            print(f"{wtype}, {threads} thread(s), {nbytes / 2**20:.0f} MiB of weights, cold caches")
            for r, ts in times.items():
                t = np.median(ts)
                name = r[0] if r[1] is None else f"mul_mat_vec pf={r[1]}"
                print(f"  {name:24s} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:6.1f} GB/s  {base / t:5.2f}x mul_mat")
        ctx.free()


if __name__ == "__main__":
    main()
