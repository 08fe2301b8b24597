"""Cost of constrained output (ggmlpy.sampling.grammar) per generated token, at a real vocabulary.

For each vocabulary (``models/ggml-vocab-*.gguf`` that tests/hf_convert.py fetches; qwen2's 151,936
tokens by default) it times building the :class:`VocabBridge` (once per tokenizer), then runs the
tests' garbage-preferring model (random float32 logits each step, the arg-max after the mask) under a
JSON schema and under llama.cpp's json.gbnf (as GBNF means it, one character a lexeme, and with
llguidance's greedy lexemes: ``lexemes=True``), and reports per token, median and 95th percentile:

* ``mask``: llguidance computing the next mask (:meth:`GrammarMatcher.prepare`, the part that can run
  during the forward pass, with the GIL released);
* ``apply``: setting the refused tokens of a float32 row to -inf with the mask ready (on the critical
  path between the logits and the sampler);
* ``accept``: advancing the matcher past the chosen token.

::

    python bench/grammar_mask.py
    python bench/grammar_mask.py --vocab qwen2,llama-bpe --tokens 400 --json mask.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                          "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(grammar, bridge, tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mask, apply, accept = [], [], []
    done = 0
    while done < tokens:
        m = grammar.matcher(bridge)
        while not m.is_stopped and done < tokens:
            logits = rng.random(bridge.n_vocab, dtype=np.float32)
            t0 = time.perf_counter()
            m.prepare()
            t1 = time.perf_counter()
            m.apply(logits)
            t2 = time.perf_counter()
            t = int(np.argmax(logits))
            m.accept(t)
            t3 = time.perf_counter()
            mask.append(t1 - t0)
            apply.append(t2 - t1)
            accept.append(t3 - t2)
            done += 1
    us = 1e6
    return {k: {"median_us": statistics.median(v) * us, "p95_us": _pct(v, 0.95) * us}
            for k, v in (("mask", mask), ("apply", apply), ("accept", accept))}


def main(argv: list[str] | None = None) -> int:
    import hf_convert

    from ggmlpy.sampling.grammar import Grammar, VocabBridge
    from ggmlpy.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="qwen2", help="comma-separated llama.cpp vocabularies (default qwen2)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens per grammar (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    json_gbnf = hf_convert.grammars()["json"]
    grammars = {"json_schema": Grammar.json_schema(SCHEMA), "gbnf json": Grammar.gbnf(json_gbnf),
                "gbnf json lexemes": Grammar.gbnf(json_gbnf, lexemes=True)}
    results = []
    print(f"{'vocab':<12} {'n_vocab':>8} {'bridge s':>9} {'grammar':<18} "
          f"{'mask us (p50/p95)':>18} {'apply us':>14} {'accept us':>14}")
    for name in args.vocab.split(","):
        tok = Tokenizer.from_gguf(hf_convert.vocab_file(name))
        bridge = VocabBridge(tok)   # not .of(): time a fresh build
        for gname, g in grammars.items():
            r = run(g, bridge, args.tokens, args.seed)
            results.append({"vocab": name, "n_vocab": bridge.n_vocab, "bridge_s": bridge.build_seconds,
                            "grammar": gname, **r})
            print(f"{name:<12} {bridge.n_vocab:>8} {bridge.build_seconds:>9.2f} {gname:<18} "
                  + " ".join(f"{r[k]['median_us']:>7.0f}/{r[k]['p95_us']:<6.0f}" for k in ("mask", "apply", "accept")))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
