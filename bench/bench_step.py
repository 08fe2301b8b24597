"""The one-token generation step: time per token inside ggml's compute and outside it (the runner's
own work: cache plan, inputs, reading the logits), for each weight type, and optionally with each
layer's weights fused (Q/K/V and gate/up in one matrix each, the default) and apart.

    python bench/bench_step.py                           # synthetic 110M F16 and Q4_0, 2 threads
    python bench/bench_step.py --type Q4_K_M --rounds 9
    python bench/bench_step.py --fuse both               # fused and separate weights, interleaved

Every configuration is loaded once; the rounds alternate between them, so all see the same machine
state. A round clears the cache and generates ``-n`` tokens one ``Runner.decode`` call at a time (as
``ggmlpy bench`` times tg); the first step builds the graph and is not counted. Compute is timed
around ``Runtime.compute`` (the scheduler's graph compute); everything else in ``decode`` is the
step's own work, which the target bounds: at most 0.15 ms per token on the 110M model.

Prints per configuration the median over the rounds of the total, compute and outside time per
token (µs) with the outside time's min-max, and with ``--fuse both`` the fused/apart speed ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ggmlpy.backend import Runtime
from ggmlpy.models import load_model
from ggmlpy.models.synthetic import synthetic_path
from ggmlpy.runner import Runner

TARGET_OUTSIDE_US = 150.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="110M")
    ap.add_argument("--type", default="F16,Q4_0", help="comma-separated weight types")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fuse", choices=("on", "off", "both"), default="on")
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()

    in_compute = [0.0]
    compute = Runtime.compute

    def timed(self, graph):                 # the time of ggml's compute, the rest is the step's own
        t = time.perf_counter()
        compute(self, graph)
        in_compute[0] += time.perf_counter() - t

    Runtime.compute = timed
    fuses = {"on": [True], "off": [False], "both": [True, False]}[args.fuse]
    runners = {}
    for typ in args.type.split(","):
        path = synthetic_path(args.size, typ)
        for fuse in fuses:
            model = load_model(path, fuse=fuse, devices="cpu")
            runners[(typ, fuse)] = Runner(model, n_ctx=args.tokens + 8, n_threads=args.threads)
    rng = np.random.default_rng(0)
    total: dict[tuple, list[float]] = {k: [] for k in runners}
    inside: dict[tuple, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for key, rt in runners.items():
            rt.clear()
            rt.decode([1])                  # the first step builds the graph
            toks = rng.integers(0, rt.n_vocab, args.tokens - 1)
            in_compute[0] = 0.0
            t0 = time.perf_counter()
            for tok in toks:
                rt.decode([int(tok)])
            n = len(toks)
            total[key].append((time.perf_counter() - t0) / n * 1e6)
            inside[key].append(in_compute[0] / n * 1e6)
    print(f"{args.size}, {args.threads} threads, {args.tokens} tokens, median of {args.rounds} rounds "
          f"(outside: min-max over the rounds)")
    print(f"{'type':>7} {'weights':>8} {'total µs':>10} {'compute µs':>11} {'outside µs':>11} {'min-max':>12}  target")
    for key in runners:
        outside = [a - b for a, b in zip(total[key], inside[key])]
        med = statistics.median(outside)
        ok = "met" if med <= TARGET_OUTSIDE_US else "NOT MET"
        print(f"{key[0]:>7} {'fused' if key[1] else 'apart':>8} {statistics.median(total[key]):10.0f} "
              f"{statistics.median(inside[key]):11.0f} {med:11.0f} {min(outside):5.0f}-{max(outside):<6.0f}"
              f"  <= {TARGET_OUTSIDE_US:.0f}: {ok}")
    if args.fuse == "both":
        for typ in args.type.split(","):
            ratios = [b / a for a, b in zip(total[(typ, True)], total[(typ, False)])]
            print(f"{typ}: fused is {statistics.median(ratios):.2f}x the speed of apart (median of per-round ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"type": k[0], "fused": k[1], "total_us": total[k], "compute_us": inside[k]}
                       for k in runners], f, indent=1)
    for rt in runners.values():
        model = rt.model
        rt.close()
        model.close()


if __name__ == "__main__":
    main()
