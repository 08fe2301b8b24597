"""Encode throughput of ggmlpy.tokenizer against llama.cpp's tokenizer, on llama.cpp's vocabulary files.

For each vocabulary (``models/ggml-vocab-*.gguf`` of the llama-cpp-python sdist that tests/hf_convert.py
fetches) the same few MB of mixed text go through ``Tokenizer.encode`` and through llama.cpp's
``llama_tokenize`` (llama-cpp-python's vocabulary-only ``Llama(...).tokenize``), interleaved over
several rounds; the table gives MB/s (UTF-8 bytes in) and the median of the per-round ratios, and
checks that both gave the same ids. Every ggmlpy pass uses a tokenizer made afresh (WPM and UGM
keep the ids of words they have seen; llama.cpp keeps nothing). ggmlpy is timed twice: as it runs
by default (the text cut into exact pieces encoded on every core) and with
``TOKENIZERS_PARALLELISM=false`` (one thread, as llama.cpp's tokenizer runs).

The text: English prose and code (this Python's standard library sources) and llama.cpp's
multilingual tokenizer test strings (CJK, emoji, Cyrillic, whitespace runs), about 3 MB::

    python bench/tokenizer_speed.py
    python bench/tokenizer_speed.py --vocab llama-bpe,qwen2 --mb 5 --rounds 5 --json tok.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

DEFAULT_VOCABS = ("llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "deepseek-llm", "command-r", "gemma-4",
                  "bert-bge", "nomic-bert-moe")


def corpus(mb: float) -> str:
    """About ``mb`` MB of text: two thirds English prose and code, one third multilingual."""
    import hf_convert

    english = []
    lib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(lib.glob("*.py")):
        english.append(p.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, english)) > mb * 1e6 * 2 / 3:
            break
    multi = []
    for v in hf_convert.vocabs():
        multi += [t for t, _ in hf_convert.vocab_tests(v)]
    multi_text = "\n".join(multi)
    n_multi = int(mb * 1e6 / 3)
    multi_text = (multi_text * (n_multi // max(1, len(multi_text.encode())) + 1))
    text = "\n".join(english)[: int(mb * 1e6 * 2 / 3)] + "\n" + multi_text
    # trim to the byte budget on a character boundary
    data = text.encode("utf-8")[: int(mb * 1e6)]
    return data.decode("utf-8", errors="ignore")


def _time(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_vocab(vocab: str, text: str, rounds: int) -> dict:
    import hf_convert
    import llama_cpp

    from ggmlpy.tokenizer import Tokenizer

    path = hf_convert.vocab_file(vocab)
    tok = Tokenizer.from_gguf(path)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    data = text.encode("utf-8")
    mb = len(data) / 1e6
    rows = {"ggmlpy": [], "ggmlpy_1t": [], "llama.cpp": []}
    same = True
    tok.encode(text[:100_000], add_special=False)       # warm the engine's caches and thread pool
    llm.tokenize(data[:100_000], add_bos=False, special=False)
    for r in range(rounds):
        order = ["ggmlpy", "ggmlpy_1t", "llama.cpp"]
        order = order[r % 3:] + order[:r % 3]
        for who in order:
            if who == "llama.cpp":
                dt, ids = _time(lambda: llm.tokenize(data, add_bos=False, special=False))
                ref = ids
            else:
                # a fresh tokenizer each time (made outside the timing): WPM and UGM keep the ids of
                # words they have seen, and llama.cpp has no such cache, so every pass is a first one
                tok = Tokenizer.from_gguf(path)
                old = os.environ.get("TOKENIZERS_PARALLELISM")
                if who == "ggmlpy_1t":
                    os.environ["TOKENIZERS_PARALLELISM"] = "false"
                try:
                    dt, ids = _time(lambda t=tok: t.encode(text, add_special=False))
                finally:
                    if old is None:
                        os.environ.pop("TOKENIZERS_PARALLELISM", None)
                    else:
                        os.environ["TOKENIZERS_PARALLELISM"] = old
                mine = ids
            rows[who].append(dt)
        same = same and mine == ref
    ratio = statistics.median(lc / g for lc, g in zip(rows["llama.cpp"], rows["ggmlpy"]))
    ratio_1t = statistics.median(lc / g for lc, g in zip(rows["llama.cpp"], rows["ggmlpy_1t"]))
    return {"vocab": vocab, "kind": tok.kind, "pre": tok.pre, "mb": mb, "n_tokens": len(ref),
            "ggmlpy_mb_s": mb / statistics.median(rows["ggmlpy"]),
            "ggmlpy_1t_mb_s": mb / statistics.median(rows["ggmlpy_1t"]),
            "llama_cpp_mb_s": mb / statistics.median(rows["llama.cpp"]),
            "ratio": ratio, "ratio_1t": ratio_1t, "same_ids": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default=",".join(DEFAULT_VOCABS), help="comma-separated ggml-vocab names")
    ap.add_argument("--mb", type=float, default=3.0, help="size of the text in MB (default 3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: it is the peer this benchmark compares with", file=sys.stderr)
        return 1
    text = corpus(args.mb)
    rows = []
    print(f"text: {len(text.encode()) / 1e6:.2f} MB, {len(text)} characters; {args.rounds} interleaved rounds")
    print("| vocabulary | type | ggmlpy MB/s | ggmlpy 1 thread MB/s | llama.cpp MB/s | ratio | ratio 1 thread "
          "| same ids |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for v in args.vocab.split(","):
        r = bench_vocab(v.strip(), text, args.rounds)
        rows.append(r)
        print(f"| {r['vocab']} | {r['kind']} {r['pre']} | {r['ggmlpy_mb_s']:.2f} | {r['ggmlpy_1t_mb_s']:.2f} | "
              f"{r['llama_cpp_mb_s']:.2f} | {r['ratio']:.2f}x | {r['ratio_1t']:.2f}x | "
              f"{'yes' if r['same_ids'] else 'NO'} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_ids"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
