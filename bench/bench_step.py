"""The one-token generation step: time per token inside ggml's compute and outside it (Python: cache
plan, inputs, reading the logits), with each layer's weights fused (Q/K/V and gate/up in one matrix
each, the default) and apart, interleaved round by round in one process.

    python bench/bench_step.py                         # synthetic 110M Q4_0, 2 threads
    python bench/bench_step.py --type Q4_K_M --rounds 7

Prints per configuration the median over the rounds of the total and compute time per token (µs), the
time outside compute, and the fused/unfused ratio of the totals.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ggmlpy.backend import Runtime
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import synthetic_path
from ggmlpy.runner import Runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="110M")
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    in_compute = [0.0]
    compute = Runtime.compute

    def timed(self, graph):                 # the time of ggml's compute, the rest is the step's own
        t = time.perf_counter()
        compute(self, graph)
        in_compute[0] += time.perf_counter() - t

    Runtime.compute = timed
    path = synthetic_path(args.size, args.type)
    runners = {}
    for fuse in (True, False):
        model = load_model(path, fuse=fuse)
        runners[fuse] = Runner(model, n_ctx=args.tokens + 8, n_threads=args.threads)
    rng = np.random.default_rng(0)
    total: dict[bool, list[float]] = {True: [], False: []}
    inside: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for fuse, rt in runners.items():
            rt.clear()
            rt.decode([1])                  # the first step builds the graph
            toks = rng.integers(0, rt.n_vocab, args.tokens - 1)
            in_compute[0] = 0.0
            t0 = time.perf_counter()
            for tok in toks:
                rt.decode([int(tok)])
            n = len(toks)
            total[fuse].append((time.perf_counter() - t0) / n * 1e6)
            inside[fuse].append(in_compute[0] / n * 1e6)
    print(f"{args.size} {args.type}, {args.threads} threads, {args.tokens} tokens, median of {args.rounds} rounds")
    print(f"{'weights':>8} {'total µs':>10} {'compute µs':>11} {'outside µs':>11}")
    for fuse in (True, False):
        tot, ins = statistics.median(total[fuse]), statistics.median(inside[fuse])
        print(f"{'fused' if fuse else 'apart':>8} {tot:10.0f} {ins:11.0f} {tot - ins:11.0f}")
    ratios = [b / a for a, b in zip(total[True], total[False])]
    print(f"fused is {statistics.median(ratios):.2f}x the speed of apart (median of per-round ratios)")
    for rt in runners.values():
        model = rt.model
        rt.close()
        model.close()


if __name__ == "__main__":
    main()
