"""Portable build against native build: `ggmlpy bench` from two installs, interleaved.

    python bench/portable_vs_native.py NATIVE_GGMLPY PORTABLE_GGMLPY [--rounds 6] [--out DIR] [-- BENCH ARGS]

NATIVE_GGMLPY and PORTABLE_GGMLPY are the ``ggmlpy`` commands of two virtual
environments, one with ``pip install .`` and one with ``GGML_NATIVE=OFF pip
install .`` (or the wheel of tools/build_wheel.py). Each round runs both, the
order flipped every round, with the bench arguments (default ``-p 512 -n 128 -r 3
-t 1,2``); the table gives each build's median t/s and the median over rounds of
the per-round ratio portable/native, with its range. ``--from DIR`` only
re-reads the JSON files of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BUILDS = ("native", "portable")


def run_rounds(cmds: dict, rounds: int, out: Path, bench_args: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for r in range(1, rounds + 1):
        for b in BUILDS if r % 2 else BUILDS[::-1]:
            res = subprocess.run([cmds[b], "bench", *bench_args, "-o", "json"], capture_output=True, text=True,
                                 check=True)
            (out / f"{b}-{r}.json").write_text(res.stdout)
            print(f"round {r}: {b} done", file=sys.stderr, flush=True)


def table(dirs: list) -> str:
    rows, rounds = {}, []
    for d in dirs:
        for f in sorted(Path(d).glob("native-*.json")):
            key = (str(d), f.stem.split("-", 1)[1])
            rounds.append(key)
            for b in BUILDS:
                for x in json.loads((Path(d) / f"{b}-{key[1]}.json").read_text()):
                    test = f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}"
                    rows.setdefault((x["n_threads"], test), {}).setdefault(b, {})[key] = x["avg_ts"]
    lines = [f"{len(rounds)} rounds",
             "| test | threads | native t/s | portable t/s | portable/native | range (middle half) |",
             "|---|---:|---:|---:|---:|---|"]
    for (threads, test), v in sorted(rows.items()):
        ratios = sorted(v["portable"][k] / v["native"][k] for k in rounds)
        q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
        lines.append(f"| {test} | {threads} | {statistics.median(v['native'].values()):.1f} | "
                     f"{statistics.median(v['portable'].values()):.1f} | **{statistics.median(ratios):.3f}x** | "
                     f"{ratios[0]:.2f}–{ratios[-1]:.2f} ({q1:.2f}–{q3:.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = ["-p", "512", "-n", "128", "-r", "3", "-t", "1,2"]
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("native", nargs="?")
    ap.add_argument("portable", nargs="?")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("portable-vs-native"))
    ap.add_argument("--from", dest="from_dirs", type=Path, nargs="+", help="only tabulate these earlier runs")
    args = ap.parse_args(argv)
    if not args.from_dirs:
        if not (args.native and args.portable):
            ap.error("give the two ggmlpy commands, or --from DIR")
        run_rounds({"native": args.native, "portable": args.portable}, args.rounds, args.out, bench_args)
    print(table(args.from_dirs or [args.out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
