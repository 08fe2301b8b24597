"""The generation step's attention alone: ``Context.attn_decode`` against ggml's ``flash_attn_ext``.

A cache laid out as the runner's (each cell a row of every head's K, or V, side by side), one query
row per layer, the 110M model's shapes by default. Each repetition flushes the CPU caches (a pass
over 256 MiB), then runs every layer's attention; both kernels alternate. Prints the median time
and the K/V bytes read per second.

    python bench/attention.py                       # 12 layers, 12 heads of 64, 576 cells visible
    python bench/attention.py --visible 2048 --cells 2304 --threads 2 --chunks 1,2,4
    python bench/attention.py --chunks 2 --prefetch 0,2,4,8,16      # the kernel's prefetch distance
    python bench/attention.py --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --visible 4096 \
        --cells 4352 --avx2                   # Llama-3.2-1B at depth 4096, both vectorised paths
    python bench/attention.py --prompt 512 --depth 0,512            # a prompt's: attn_prefill

With ``--prompt N`` it times a prompt's attention instead: N causal query rows after ``--depth``
cached positions, ``Context.attn_prefill`` against ``flash_attn_ext``, with the FLOP rate of the
positions the rows see.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy


def _graphs(ctx, outs: dict) -> dict:
    """One graph per name, over that name's result tensors."""
    graphs = {}
    for name, ts in outs.items():
        graphs[name] = gf = ctx.new_graph()
        for t in ts:
            gf.build_forward_expand(t)
    return graphs


def _print_times(times: dict, work: float, unit: str, width: int, digits: int, decimals: int) -> None:
    """Each kernel's median time, ``work`` (bytes or FLOPs) per second in ``unit`` (10^9), and its
    speed against flash_attn_ext's."""
    base = np.median(times["flash_attn_ext"])
    for name, ts in times.items():
        t = np.median(ts)
        print(f"  {name:{width}s} {t * 1e3:{digits}.{decimals}f} ms  {work / t / 1e9:6.1f} {unit}  "
              f"{base / t:5.2f}x flash_attn_ext")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (grouped-query attention; default: --heads)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cells", type=int, default=768, help="cells in the view (the padded range)")
    ap.add_argument("--visible", type=int, default=576, help="cells the row sees (the rest masked)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", default="1,2", help="attn_decode's n_chunks values to time")
    ap.add_argument("--prefetch", default=None,
                    help="comma-separated prefetch distances (cells ahead, 0 = none) to time attn_decode with "
                         "(default: the kernel's own)")
    ap.add_argument("--avx2", action="store_true",
                    help="also time attn_decode's AVX2 path where the AVX-512 one runs "
                         "(the same nodes built with avx512=False)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=0, help="time a prompt of this many rows (attn_prefill)")
    ap.add_argument("--depth", default="0", help="with --prompt: comma-separated cached positions before it")
    a = ap.parse_args(argv)
    if a.prompt:
        for depth in (int(d) for d in a.depth.split(",")):
            _prompt(a, depth)
        return
    rng = np.random.default_rng(0)
    L, H, D, n = a.layers, a.heads, a.head_dim, a.cells
    G = a.kv_heads or H
    ctx = ggmlpy.Context(2 * L * n * G * D * 2 + (64 << 20))
    caches = [[ctx.from_numpy(rng.standard_normal((n, G * D)).astype(np.float16)) for _ in range(2)] for _ in range(L)]
    q = ctx.from_numpy(rng.standard_normal((1, H, D)).astype(np.float32))
    mask = np.full((1, n), -np.inf, np.float16)
    mask[:, :a.visible] = 0
    m = ctx.from_numpy(mask)

    def heads(t):
        return ctx.view(t, (D, n, G), (t.nb[1], D * 2), 0)

    graphs = {}
    default_pfd = ggmlpy._core._attn_decode_prefetch()
    pfds = [default_pfd] if a.prefetch is None else [int(x) for x in a.prefetch.split(",")]
    prefetch = {}                     # graph name -> the prefetch distance it runs with
    chunks = {}                       # graph name -> its n_chunks
    for c in (int(x) for x in a.chunks.split(",")):
        for d in pfds:
            name = f"attn_decode n_chunks={c}" + (f" pf={d}" if a.prefetch is not None else "")
            graphs[name] = [ctx.attn_decode(q, heads(k), heads(v), m, scale=D ** -0.5, n_chunks=c)
                            for k, v in caches]
            prefetch[name], chunks[name] = d, c
    if a.avx2 and G < H and ggmlpy._core._attn_decode_avx512(D, D):     # the AVX-512 path: grouped heads
        for name in list(graphs):
            graphs[name + " AVX2"] = [ctx.attn_decode(q, heads(k), heads(v), m, scale=D ** -0.5, n_chunks=chunks[name],
                                                      avx512=False) for k, v in caches]
            prefetch[name + " AVX2"] = prefetch[name]
    graphs["flash_attn_ext"] = [ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), heads(k), heads(v), m, scale=D ** -0.5)
                                for k, v in caches]
    graphs = _graphs(ctx, graphs)
    flush = np.ones(64 << 20, np.float32)
    times = {name: [] for name in graphs}
    for _ in range(a.reps):
        for name, gf in graphs.items():
            flush.sum()
            ggmlpy._core._attn_decode_prefetch(prefetch.get(name, default_pfd))
            t0 = time.perf_counter()
            gf.compute(a.threads)
            times[name].append(time.perf_counter() - t0)
    ggmlpy._core._attn_decode_prefetch(default_pfd)
    kv_bytes = L * a.visible * G * D * 2 * 2
    print(f"{L} layers, {H} heads ({G} K/V) of {D}, {a.visible} of {n} cells visible, F16 cache, {a.threads} threads, "
          f"cold caches; {kv_bytes / 2**20:.1f} MiB of K/V per token")
    _print_times(times, kv_bytes, "GB/s", 24, 7, 3)


def _prompt(a, depth: int) -> None:
    rng = np.random.default_rng(0)
    L, H, D, T = a.layers, a.heads, a.head_dim, a.prompt
    n = (depth + T + 255) // 256 * 256                      # the padded range, as the runner's
    ctx = ggmlpy.Context(2 * L * n * H * D * 2 + T * H * D * 4 + T * n * 2 + (64 << 20))
    q = ctx.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32))
    mask = np.full((T, n), -np.inf, np.float16)
    for i in range(T):
        mask[i, :depth + i + 1] = 0
    m = ctx.from_numpy(mask)
    outs = {"flash_attn_ext": [], "attn_prefill": []}
    for _ in range(L):
        kc, vc = (ctx.from_numpy(rng.standard_normal((n, H * D)).astype(np.float16)) for _ in range(2))
        k, v = (ctx.view(c, (D, n, H), (c.nb[1], D * 2), 0) for c in (kc, vc))
        outs["flash_attn_ext"].append(ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, m, scale=D ** -0.5))
        outs["attn_prefill"].append(ctx.attn_prefill(q, k, v, m, scale=D ** -0.5))
    graphs = _graphs(ctx, outs)
    times = {name: [] for name in graphs}
    for _ in range(max(3, a.reps // 4)):
        for name, gf in graphs.items():
            t0 = time.perf_counter()
            gf.compute(a.threads)
            times[name].append(time.perf_counter() - t0)
    diff = np.abs(outs["attn_prefill"][0].numpy() - outs["flash_attn_ext"][0].numpy()).max()
    flops = 2 * H * 2 * D * L * sum(depth + i + 1 for i in range(T))
    print(f"{L} layers, {H} heads of {D}, a prompt of {T} rows after {depth} positions, F16 cache, "
          f"{a.threads} threads; max |difference| {diff:.1e}")
    _print_times(times, flops, "GFLOP/s", 16, 8, 2)
    ctx.free()


if __name__ == "__main__":
    main()
