"""Timings of ggmlpy.kvcache.Causal bookkeeping at realistic sizes (no assertions).

Workloads, on an F16 cache of 8,192 cells, 4 layers, n_embd_k = n_embd_v = 512
(64 MiB of K/V), 4 sequences:

* ``start_forward+mask``: ``start_forward`` of a 512-token batch (128 tokens
  of each sequence) over a cache holding 7,680 cells, plus building the F16
  mask tensor (``Causal.mask_tensor``). Nothing is committed, so every
  repetition sees the same state.
* ``defrag interleaved``: ``defrag()`` of a full cache whose 4 sequences were
  written interleaved token by token, after clearing sequences 1 and 3: half
  the cells free, every other cell a hole (about 2,048 single-cell moves).
* ``defrag blocks``: the same with the sequences written in 512-cell blocks:
  half free, few long runs to move.

Each defrag repetition rebuilds the fragmented state (metadata only; the K/V
payload is whatever the previous repetition left) outside the timed region.

    python bench/bench_kvcache.py [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

import ggmlpy
from ggmlpy import Type
from ggmlpy.kvcache import Causal

N_LAYERS = 4
N_EMBD = 512
N_HEAD_KV = 4
N_SEQ = 4
N_CELLS = 8192
BATCH = 512


def make_cache() -> Causal:
    c = Causal(N_LAYERS, N_EMBD, N_EMBD, Type.F16, n_head_kv=N_HEAD_KV)
    c.init(N_CELLS // N_SEQ, N_SEQ, BATCH)
    assert c.n_cells == N_CELLS
    return c


def fill(cache: Causal, n_tokens: int, interleaved: bool) -> None:
    """Commit ``n_tokens`` cells (metadata only) for the 4 sequences, in batches of BATCH."""
    cache.clear()
    per_seq = n_tokens // N_SEQ
    if interleaved:  # token i of the batch: seq i % 4
        for base in range(0, per_seq, BATCH // N_SEQ):
            k = min(BATCH // N_SEQ, per_seq - base)
            seqs = np.tile(np.arange(N_SEQ), k)
            pos = base + np.repeat(np.arange(k), N_SEQ)
            cache.apply(cache.start_forward(pos, seqs))
    else:  # each batch one sequence
        for base in range(0, per_seq, BATCH):
            for s in range(N_SEQ):
                pos = np.arange(base, min(per_seq, base + BATCH))
                cache.apply(cache.start_forward(pos, np.full(pos.size, s)))


def bench_start_forward(cache: Causal, reps: int) -> list[float]:
    fill(cache, N_CELLS - BATCH, interleaved=True)
    per = BATCH // N_SEQ
    seqs = np.repeat(np.arange(N_SEQ), per)
    pos = np.concatenate([np.arange(per) + cache.seq_pos_max(s) + 1 for s in range(N_SEQ)])
    size = N_CELLS * BATCH * 2 + (1 << 16)
    times = []
    for _ in range(reps + 1):  # the first one warms up
        with ggmlpy.Context(size) as ctx:
            t0 = time.perf_counter()
            plan = cache.start_forward(pos, seqs)
            Causal.mask_tensor(ctx, plan, Type.F16)
            times.append(time.perf_counter() - t0)
    return times[1:]


def bench_defrag(cache: Causal, reps: int, interleaved: bool) -> tuple[list[float], int]:
    times, n_moves = [], 0
    for _ in range(reps + 1):
        fill(cache, N_CELLS, interleaved)
        cache.clear(1)
        cache.clear(3)
        t0 = time.perf_counter()
        moves = cache.defrag()
        times.append(time.perf_counter() - t0)
        n_moves = len(moves)
    return times[1:], n_moves


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per workload (default 10)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)

    cache = make_cache()
    try:
        rows = [("start_forward+mask", f"{BATCH}-token batch, {N_CELLS - BATCH} cells held",
                 bench_start_forward(cache, args.reps))]
        for name, inter in (("defrag interleaved", True), ("defrag blocks", False)):
            t, n = bench_defrag(cache, args.reps, inter)
            rows.append((name, f"{N_CELLS // 2} live of {N_CELLS}, {n} moves", t))
        mib = cache.bytes_per_layer() * N_LAYERS / 2**20
    finally:
        cache.close()

    print(f"Causal F16, {N_LAYERS} layers, n_embd_k = n_embd_v = {N_EMBD}, {N_CELLS} cells "
          f"({mib:.0f} MiB), {N_SEQ} sequences; {args.reps} reps")
    print(f"{'workload':<20} {'setup':<34} {'median ms':>10} {'min ms':>9}")
    results = []
    for name, setup, t in rows:
        med, lo = statistics.median(t) * 1e3, min(t) * 1e3
        print(f"{name:<20} {setup:<34} {med:>10.3f} {lo:>9.3f}")
        results.append({"name": name, "setup": setup, "median_ms": med, "min_ms": lo,
                         "times_ms": [x * 1e3 for x in t]})
    if args.json:
        meta = {"python": sys.version.split()[0], "machine": platform.machine(),
                "ggmlpy": getattr(ggmlpy, "__version__", None), "reps": args.reps,
                "n_layers": N_LAYERS, "n_embd": N_EMBD, "n_cells": N_CELLS, "batch": BATCH}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
