"""The generation step's matrix products alone: ``Context.mul_mat_vec`` against ggml's ``mul_mat``.

The 110M model's 49 matrices (12 layers of fused Q/K/V, output, fused gate/up and down, then the
output head) in one weight type, times one vector each: one graph of ``mul_mat`` and one of
``mul_mat_vec`` over the same weights, alternated, the CPU caches flushed (a pass over 256 MiB)
before each. Prints the median time, the weight bytes read per second and the speed against
``mul_mat``. A type written ``Q4_0:repack`` puts the weights in ggml's ``CPU_REPACK`` buffer, where
ggml rearranges them for its own kernels: the Q4_0 VNNI kernel of ``mul_mat_vec`` against ggml's
repacked ``mul_mat``.

    python bench/matvec.py                                   # F16, Q8_0, Q6_K, Q4_0:repack; 1 and 2 threads
    python bench/matvec.py --type Q8_0 --threads 1 --prefetch 0,1024,4096,16384
    python bench/matvec.py --type Q4_0:repack --prefetch 0,4096,16384,32768
    python bench/matvec.py --type Q8_0 --model model.gguf    # a file's matrices: its 2-D weights of that type

With ``--model`` the matrices are the shapes of the file's two-dimensional weights of each type, in the
file's order (random values: only the shapes are the file's), so one graph is one token's products at that
model's sizes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy
from ggmlpy import Type, _core


def _weights(wtype, shapes, rng):
    """The weights in a CPU buffer (``T:repack``: ggml's CPU_REPACK one), and what keeps them."""
    wtype, _, where = wtype.partition(":")
    cpu = ggmlpy.device("cpu")
    buft = cpu.buffer_type()
    if where == "repack":
        extra = {bt.name: bt for bt in cpu.extra_buffer_types()}
        if "CPU_REPACK" not in extra:
            raise SystemExit("this build/CPU has no CPU_REPACK buffer")
        buft = extra["CPU_REPACK"]
    ctx = ggmlpy.Context.for_tensors(len(shapes), no_alloc=True)
    ws = [ctx.new_tensor(getattr(Type, wtype), (k, n)) for n, k in shapes]
    keep = [ctx, _core.alloc_ctx_tensors(ctx, buft)]
    for w, (n, k) in zip(ws, shapes):
        W = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        if wtype in ("F32", "F16", "BF16"):
            w.set(W)
        else:
            w.set_bytes(ggmlpy.quantize(W, getattr(Type, wtype)))
    return ws, keep


def _file_shapes(path: str, wtype: str) -> list[tuple[int, int]]:
    """(rows, columns) of each 2-D weight of type ``wtype`` in the GGUF file ``path``, in file order."""
    from gguf import GGUFReader  # the test extra's; only this option needs it

    return [(int(t.shape[1]), int(t.shape[0])) for t in GGUFReader(path).tensors
            if len(t.shape) == 2 and t.tensor_type.name == wtype.partition(":")[0] and "token_embd" not in t.name]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="F16,Q8_0,Q6_K,Q4_0:repack", help="comma-separated weight types")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prefetch", default=None,
                    help="comma-separated prefetch distances in bytes (default: the kernel's)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--model", default=None, help="a GGUF file whose matrix shapes to use (not its values)")
    a = ap.parse_args(argv)
    E, F, V, L = 768, 2048, 32000, 12
    default_shapes = [(3 * E, E), (E, E), (2 * F, E), (E, F)] * L + [(V, E)]
    flush = np.ones(64 << 20, np.float32)
    rng = np.random.default_rng(0)
    backend = ggmlpy.device("cpu").init()          # a repacked weight computes only on its backend
    for wtype in a.type.split(","):
        repacked = wtype.endswith(":repack")
        kernel = "q4_0_repacked" if repacked else "q8_0" if wtype == "Q8_0" and _core._mul_mat_vec_vnni() else "dot"
        default_pfd = _core._mul_mat_vec_prefetch(kernel=kernel)
        pfds = [default_pfd] if a.prefetch is None else [int(p) for p in a.prefetch.split(",")]
        shapes = _file_shapes(a.model, wtype) if a.model else default_shapes
        if not shapes:
            raise SystemExit(f"{a.model}: no two-dimensional {wtype} weights")
        ws, keep = _weights(wtype, shapes, rng)
        # the vectors and results in a CPU buffer (the backend computes only on backend memory)
        n_graph = max(256, 2 * len(ws) + 8)
        # room for the second graph
        ctx = ggmlpy.Context.for_tensors(4 * len(ws) + 520, graph_size=n_graph, no_alloc=True)
        xs = {k: ctx.new_tensor(Type.F32, (k, 1)) for k in sorted({k for _, k in shapes})}
        graphs = {"mul_mat": ctx.new_graph(n_graph), "mul_mat_vec": ctx.new_graph(n_graph)}
        for w in ws:
            graphs["mul_mat"].build_forward_expand(ctx.mul_mat(w, xs[w.ne[0]]))
            graphs["mul_mat_vec"].build_forward_expand(ctx.mul_mat_vec(w, xs[w.ne[0]]))
        keep.append(_core.alloc_ctx_tensors(ctx, ggmlpy.device("cpu").buffer_type()))
        for k, x in xs.items():
            x.set(rng.standard_normal((1, k)).astype(np.float32))
        nbytes = sum(w.nbytes for w in ws)
        runs = [("mul_mat", None)] + [("mul_mat_vec", d) for d in pfds]
        for threads in (int(t) for t in a.threads.split(",")):
            backend.set_n_threads(threads)
            times = {r: [] for r in runs}
            for _ in range(a.reps):
                for r in runs:
                    flush.sum()
                    if r[1] is not None:
                        _core._mul_mat_vec_prefetch(r[1], kernel=kernel)
                    t0 = time.perf_counter()
                    backend.graph_compute(graphs[r[0]])
                    times[r].append(time.perf_counter() - t0)
            _core._mul_mat_vec_prefetch(default_pfd, kernel=kernel)
            base = np.median(times[runs[0]])
            print(f"{wtype}, {threads} thread(s), {nbytes / 2**20:.0f} MiB of weights, cold caches")
            for r, ts in times.items():
                t = np.median(ts)
                name = r[0] if r[1] is None else f"mul_mat_vec pf={r[1]}"
                print(f"  {name:24s} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:6.1f} GB/s  {base / t:5.2f}x mul_mat")
        ctx.free()
        del keep


if __name__ == "__main__":
    main()
