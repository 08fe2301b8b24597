"""A prompt's products on Q4_K weights ggml repacked: ggmlpy's kernels against ggml's ops.

``Context.mul_mat_rq4k`` against ``mul_mat`` on matrices (default: the Llama-3.2-1B shape's four), and
``Context.mul_mat_id_rq`` against ``mul_mat_id`` on an expert stack (``--experts``), on the same weights in
ggml's ``CPU_REPACK`` buffer, the two graphs alternating; each result is checked equal to ggml's first.
Prints the median times and the ratio per thread count.

    python bench/prompt_q4k.py                                  # 512 tokens, 1 and 2 threads
    python bench/prompt_q4k.py --tokens 8,64,512 --shapes 2048x2048,8192x2048
    python bench/prompt_q4k.py --experts 128x768x2048 --used 8   # n_expert x rows x columns
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy
from ggmlpy import Type, _core


def _repacked(shape, rng):
    """A Q4_K tensor of ``shape`` (ggml's ne) in the CPU_REPACK buffer, and what keeps it."""
    extra = {b.name: b for b in ggmlpy.device("cpu").extra_buffer_types()}
    if "CPU_REPACK" not in extra:
        raise SystemExit("this build/CPU has no CPU_REPACK buffer")
    ctx = ggmlpy.Context.for_tensors(1, no_alloc=True)
    w = ctx.new_tensor(Type.Q4_K, shape)
    buf = _core.alloc_ctx_tensors(ctx, extra["CPU_REPACK"])
    w.set((rng.standard_normal(w.shape) * 0.02).astype(np.float32))
    return w, (ctx, buf)


def _time(backend, graphs, reps):
    times = [[] for _ in graphs]
    for _ in range(reps):
        for i, g in enumerate(graphs):
            t0 = time.perf_counter()
            backend.graph_compute(g)
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512", help="comma-separated token counts")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="2048x2048,512x2048,8192x2048,2048x8192",
                    help="rows x columns, comma-separated")
    ap.add_argument("--experts", default=None, help="n_expert x rows x columns: time the experts' op instead")
    ap.add_argument("--used", type=int, default=8, help="experts per token (--experts)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cpu = ggmlpy.device("cpu")
    backend = cpu.init()
    if a.experts:
        n_expert, rows, k = (int(v) for v in a.experts.split("x"))
        weights = [_repacked((k, rows, n_expert), rng)]
    else:
        weights = [_repacked((int(s.split("x")[1]), int(s.split("x")[0])), rng) for s in a.shapes.split(",")]
    if not all(_core._mul_mat_id_rq_ok(w) if a.experts else _core._mul_mat_rq4k_ok(w) for w, _ in weights):
        raise SystemExit("ggmlpy's kernel does not run here (Q4_K repacked on x86 with AVX2)")
    for m in (int(t) for t in a.tokens.split(",")):
        ctx = ggmlpy.Context.for_tensors(8 * len(weights) + 8, graph_size=64, no_alloc=True)
        graphs, pairs, inputs = [ctx.new_graph(64), ctx.new_graph(64)], [], []
        for w, _ in weights:
            x = ctx.new_tensor(Type.F32, (w.ne[0], 1, m) if a.experts else (w.ne[0], m))
            inputs.append((x, rng.standard_normal(x.shape).astype(np.float32)))
            if a.experts:
                ids = ctx.new_tensor(Type.I32, (a.used, m))
                order = np.argsort(rng.random((m, w.ne[2])), axis=1)[:, :a.used].astype(np.int32)
                inputs.append((ids, order))
                theirs, ours = ctx.mul_mat_id(w, x, ids), ctx.mul_mat_id_rq(w, x, ids)
            else:
                theirs, ours = ctx.mul_mat(w, x), ctx.mul_mat_rq4k(w, x)
            graphs[0].build_forward_expand(theirs)
            graphs[1].build_forward_expand(ours)
            pairs.append((theirs, ours))
        keep = _core.alloc_ctx_tensors(ctx, cpu.buffer_type())
        for t, v in inputs:
            t.set(v)
        macs = m * sum(w.ne[0] * w.ne[1] * (a.used if a.experts else 1) for w, _ in weights)
        for th in (int(t) for t in a.threads.split(",")):
            backend.set_n_threads(th)
            for g in graphs:
                backend.graph_compute(g)
            same = all(np.array_equal(t.numpy(), o.numpy()) for t, o in pairs)
            ggml_s, own_s = _time(backend, graphs, a.reps)
            # ggml's mul_mat sends the last m % 4 tokens through its one-vector kernel (another float order)
            check = "equal" if same else "differ" + ("" if m % 4 == 0 or a.experts else " (m % 4 tokens: expected)")
            print(f"{m} tokens, {th} thread(s): ggml {ggml_s * 1e3:8.2f} ms ({macs / ggml_s / 1e9:5.1f} GMAC/s)  "
                  f"ggmlpy {own_s * 1e3:8.2f} ms ({macs / own_s / 1e9:5.1f} GMAC/s)  {ggml_s / own_s:5.2f}x  {check}")
        ctx.free()
        del keep


if __name__ == "__main__":
    main()
