"""The regression guard for speed: ggmlpy against llama.cpp at the sizes users run, as ratios.

One command runs the table bench/README.md quotes: the real-size presets of the built-in models
(Llama-3.2-1B and -3B shapes by default; Qwen3 and MoE shapes with ``--presets``) in Q4_K_M and Q8_0,
prompt processing (pp512), generation (tg128) and, for the first preset and type, generation at depth
(tg32 at ``-d 4096``), and the
110M llama2.c shape in four types plus F16 at depth 512; each test against llama.cpp (llama-cpp-python)
in the same process tree, interleaved round by round (``ggmlpy bench --vs llama.cpp --rounds N``),
the ratio the median of the per-round ratios. The closing note of a change that touches a kernel
quotes this table before and after.

    python bench/realsize.py                       # 1B and 3B shapes and 110M, 5 rounds (~40 min, 2 cores)
    python bench/realsize.py --quick               # 110M only, 3 rounds (~3 min)
    python bench/realsize.py --presets llama3.2-1B --types Q4_K_M --rounds 3 --json out.json

The first lines printed are ``ggmlpy info`` (the machine, the build, the own kernels' choices); the
models are written to ``$GGMLPY_CACHE`` the first time (the 3B shape takes a few minutes).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

from ggmlpy._system import format_system_info
from ggmlpy.benchmark import parse_args, run
from ggmlpy.models.calibrate import cached_summary


def _bench(argv: list[str]) -> list:
    """The results of one ``ggmlpy bench`` command line (its tables go to stderr as they come)."""
    rc, results = run(parse_args(argv), out=sys.stderr, err=sys.stderr)
    if rc:
        print(f"realsize: ggmlpy bench {' '.join(argv)} exited {rc}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="llama3.2-1B,llama3.2-3B", help="real-size presets (comma list)")
    ap.add_argument("--types", default="Q4_K_M,Q8_0", help="their weight types")
    ap.add_argument("--small-types", default="F16,Q8_0,Q4_0,Q4_K_M", help="the 110M model's types ('' for none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", default=None)
    ap.add_argument("--depth", type=int, default=4096, help="depth of the tg32 test at real size (0: none)")
    ap.add_argument("--quick", action="store_true", help="110M only, 3 rounds")
    ap.add_argument("--kernels", default=None, choices=("measure", "own", "ggml"))
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    a = ap.parse_args(argv)
    if a.quick:
        a.presets, a.rounds = "", min(a.rounds, 3)
    common = ["--vs", "llama.cpp", "--rounds", str(a.rounds), "-r", str(a.repetitions), "-o", "none"]
    if a.threads:
        common += ["-t", a.threads]
    if a.kernels:
        common += ["--kernels", a.kernels]
    print(format_system_info())
    runs: list[tuple[str, list[str]]] = []
    if a.presets:
        real = ["--synthetic", a.presets, "--type", a.types]
        runs.append(("real size", real + ["-p", "512", "-n", "128"]))
        if a.depth:                      # the first preset and type only: each repetition prefills the depth
            first = ["--synthetic", a.presets.split(",")[0], "--type", a.types.split(",")[0]]
            runs.append(("real size, depth", first + ["-p", "0", "-n", "32", "-d", str(a.depth)]))
    if a.small_types:
        small = ["--synthetic", "110M", "--type", a.small_types]
        runs += [("110M", small + ["-p", "512", "-n", "128"]),
                 ("110M, depth", ["--synthetic", "110M", "--type", "F16", "-p", "512", "-n", "128", "-d", "512"])]
    rows = []
    t0 = time.perf_counter()
    for label, args in runs:
        for r in _bench(common + args):
            if r.engine != "ggmlpy":
                continue
            ratio = r.ratios.get("llama.cpp")
            rows.append({"set": label, "model": r.model_type, "size_mib": r.model_size / 2**20, "test": r.inst.name,
                         "ggmlpy_ts": statistics.fmean(r.samples_ts), "ratio": ratio[0] if ratio else None,
                         "ratio_sd": ratio[1] if ratio else None})
    out = io.StringIO()
    out.write("\n| model | size | test | ggmlpy t/s | ggmlpy/llama.cpp |\n|---|---:|---|---:|---:|\n")
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f} ± {row['ratio_sd']:.2f}"
        out.write(f"| {row['model']} | {row['size_mib']:.0f} MiB | {row['test']} | {row['ggmlpy_ts']:.2f} | "
                  f"{ratio} |\n")
    out.write(f"\n{a.rounds} rounds interleaved, median of per-round ratios; {time.perf_counter() - t0:.0f} s\n")
    out.write("\n".join(cached_summary()) + "\n")
    print(out.getvalue())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
