"""``ggmlpy embed``: llama.cpp's ``llama-embedding`` (its flags, :func:`add_embed_args`, and the command,
:func:`cmd_embed`): each input's embedding, or with ``--query`` a reranker's score of each input as a document.
See ``docs/embeddings.md``."""

from __future__ import annotations

import argparse
import json
import sys

from ggmlpy._cliargs import UsageError
from ggmlpy._cliargs import read_text as _read_text

__all__ = ["add_embed_args", "cmd_embed", "embed_inputs"]


def add_embed_args(p: argparse.ArgumentParser, add_model_args) -> None:
    """``embed``'s flags: its own, then the model's (``add_model_args``, run's and chat's), and its command."""
    p.add_argument("-p", "--prompt", action="append", default=None, help="an input (repeatable)")
    p.add_argument("-f", "--file", default=None, help="read the inputs from FILE, one per line ('-': stdin)")
    p.add_argument("--pooling", default=None, choices=("none", "mean", "cls", "last", "rank"),
                   help="how a text's token states become its embedding (default: the file's pooling_type, "
                        "else mean); none: one per token")
    p.add_argument("--embd-normalize", type=int, default=2, metavar="N",
                   help="llama.cpp's: -1 none, 0 max-abs (int16 range), 1 taxicab, 2 Euclidean (default), "
                        "p > 2 p-norm")
    p.add_argument("--embd-output-format", default="text", choices=("text", "array", "json"),
                   help="text (default): one line per embedding; array: a JSON array of them; json: OpenAI's "
                        "embedding list")
    p.add_argument("--query", default=None,
                   help="score each input as a document for this query (a reranker: a model with a "
                        "classification head), instead of embedding it")
    p.add_argument("--truncate", action="store_true", help="cut an input longer than the model reads at once")
    add_model_args(p)
    p.set_defaults(func=cmd_embed)


def embed_inputs(args: argparse.Namespace) -> list:
    """``ggmlpy embed``'s inputs: each -p, else each line of -f (``-``: stdin), empty lines skipped."""
    if args.prompt:
        return list(args.prompt)
    if args.file is None:
        raise UsageError("an input is needed: -p TEXT (repeatable) or -f FILE (one input per line, '-' for stdin)")
    text = sys.stdin.read() if args.file == "-" else _read_text(args.file, "-f")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"-f {args.file}: no inputs (every line is empty)")
    return lines


def cmd_embed(args: argparse.Namespace) -> int:
    """``ggmlpy embed`` (llama.cpp's ``llama-embedding``): each input's embedding, or with --query each input's
    score as a document for it (a reranker)."""
    import numpy as np

    from ggmlpy.cli import _lenient, _open_runner  # the command line's own (it imports this module)

    if args.embd_normalize < -1:
        raise UsageError(f"--embd-normalize {args.embd_normalize}: must be at least -1 (-1 none, 0 max-abs, "
                         "1 taxicab, 2 Euclidean, p > 2 p-norm)")
    inputs = embed_inputs(args)
    _lenient(sys.stdout)
    model, rt = _open_runner(args, "ggmlpy embed")
    try:
        if args.query is not None:
            vectors = [np.array([s]) for s in rt.rerank(args.query, inputs, truncate=args.truncate)]
            label = "rerank score"
        else:
            got = rt.embed(inputs, pooling=args.pooling, normalize=args.embd_normalize, truncate=args.truncate)
            vectors = [np.asarray(v) for v in got]
            label = "embedding"
    finally:
        rt.close()
        model.close()
    fmt = args.embd_output_format
    if fmt == "json":
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        print(json.dumps({"object": "list", "data": data}))
    elif fmt == "array":
        print(json.dumps([v.tolist() for v in vectors]))
    else:
        for i, v in enumerate(vectors):
            rows = v.reshape(-1, v.shape[-1]) if v.ndim > 1 else [v]
            for j, row in enumerate(rows):
                tag = f"{label} {i}" + (f" token {j}" if v.ndim > 1 else "")
                print(f"{tag}: " + " ".join(f"{x:9.6f}" for x in row))
    return 0
