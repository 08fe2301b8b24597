"""Embeddings per second: a batch of short texts through an encoder, ggmlpy's ``Runner.embed`` against
llama-cpp-python's ``Llama.embed`` (llama.cpp's embedding path) on the same file.

The model is a bge-small-shaped BERT (12 layers, n_embd 384, 12 heads, feed-forward 1536, 512 positions) with
random weights and llama.cpp's real ``bert-bge`` WordPiece vocabulary, sentence-transformers' mean pooling,
converted by llama.cpp's own converter (tests/hf_convert.py) to ``--type`` (F16 by default; made once, kept in
ggmlpy's cache folder). Each round embeds the same ``--texts`` short sentences (8 to 20 tokens) in one call on
each engine, interleaved, after one warm-up call each; both pack the texts into one batch as separate
sequences (llama-cpp-python's ``embed`` does so up to ``n_batch`` tokens), both L2-normalise, both use every
core. Printed: the median embeddings/s of each and the median of the per-round ratios with its spread::

    python bench/embeddings.py                       # 64 texts, F16, 5 rounds
    python bench/embeddings.py --texts 256 --type q8_0 --rounds 3 --json emb.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

WORDS = ("the quick brown fox jumps over a lazy dog while rain falls on quiet streets and tensors hold numbers "
         "that models turn into vectors for search retrieval ranking of documents across many languages").split()


def texts(n: int) -> list:
    """``n`` different short sentences (8 to 20 words), fixed by a seed."""
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "." for _ in range(n)]


def model_file(outtype: str) -> Path:
    """The bge-small-shaped BERT converted to ``outtype`` (made once)."""
    import hf_convert
    import torch
    import transformers
    from encoder_helpers import pooling_files

    from ggmlpy.models.synthetic import cache_dir

    out = Path(cache_dir()) / f"bench-bert-bge-small-{outtype}.gguf"
    if out.is_file():
        return out
    cfg = transformers.BertConfig(vocab_size=len(hf_convert.tokenizer("bert-bge")), hidden_size=384,
                                  num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
                                  max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    tmp = out.with_suffix(".d")
    path = hf_convert.convert(hf, tmp, "bert-bge", outtype=outtype, files=pooling_files("mean"))
    os.replace(path, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=64, help="texts per call (default 64)")
    ap.add_argument("--type", default="f16", help="the converter's --outtype (default f16)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each engine once per round (default 5)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    import llama_cpp
    import numpy as np

    from ggmlpy import load_model
    from ggmlpy.runner import Runner

    path = model_file(args.type)
    batch = texts(args.texts)
    model = load_model(str(path), devices="cpu")
    rt = Runner(model, n_threads=args.threads, n_ubatch=2048, n_batch=2048, n_seq_max=max(64, args.texts))
    llm = llama_cpp.Llama(str(path), embedding=True, verbose=False, n_ctx=512, n_batch=2048, n_ubatch=2048,
                          n_threads=args.threads, n_threads_batch=args.threads)
    n_tokens = sum(len(rt.tokenizer.encode(t)) for t in batch)
    engines = {"ggmlpy": lambda: rt.embed(batch), "llama.cpp": lambda: np.array(llm.embed(batch, normalize=True))}
    for fn in engines.values():
        fn()                                            # warm-up: graphs, kernel choices, thread pools
    a, b = engines["ggmlpy"](), engines["llama.cpp"]()
    cos = float(np.min(np.sum(a * b, axis=1)))          # the same embeddings (random weights: a sanity check)
    rates: dict = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            fn()
            rates[name].append(args.texts / (time.perf_counter() - t0))
    ratios = [g / c for g, c in zip(rates["ggmlpy"], rates["llama.cpp"])]
    rt.close()
    model.close()
    llm.close()
    res = {"model": path.name, "texts": args.texts, "tokens": n_tokens, "threads": args.threads,
           "min_cosine": cos, **{f"{k}_per_s": statistics.median(v) for k, v in rates.items()},
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"{path.name}: {args.texts} texts ({n_tokens} tokens) per call, {args.threads} threads, "
          f"min cosine between the engines {cos:.6f}")
    print(f"ggmlpy    {res['ggmlpy_per_s']:8.1f} embeddings/s")
    print(f"llama.cpp {res['llama.cpp_per_s']:8.1f} embeddings/s")
    print(f"ratio {res['ratio']:.2f} (rounds {res['ratio_min']:.2f} .. {res['ratio_max']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
