"""Serving under load: N concurrent streaming chat clients on loopback, ``ggmlpy serve`` against a peer
server on the same file: llama.cpp's own ``llama-server`` or llama-cpp-python's ``llama_cpp.server``.

The model is the synthetic Llama-3.2-1B shape (Q4_K_M, ``ggmlpy bench --synthetic llama3.2-1B``) with
llama.cpp's real llama-bpe vocabulary (``models/ggml-vocab-llama-bpe.gguf`` of the pinned sdist,
tests/hf_convert.py) and a Llama 3 chat template written into it, so every server tokenizes and
templates the same way (made once, kept in ggmlpy's cache folder). Each round starts one server, sends
``--clients`` chat requests at once (``stream: true``, ``max_tokens`` ``--tokens``, temperature 0, each
a different question), and records per client the time to the first content chunk (TTFT), the tokens
generated (the stream's ``usage``, else its content chunks) and the tokens per second after the first;
the aggregate is all tokens over the round's wall time. Rounds alternate the servers, in the same order
each round. ``ggmlpy serve`` runs ``-np --clients`` slots (continuous batching) of 512 tokens each.

Peers (``--peer``, repeatable; default ``llama-cpp-python``):

- ``llama-server``: llama.cpp's server (``--llama-server PATH``, built from the pinned source; bench/README
  has the recipe) with ``-np --clients`` parallel slots and ``-c 512 * clients``, since its ``-c`` is the total
  that it splits across the slots; it applies the file's template (its Jinja engine is on by default).
- ``llama-cpp-python``: ``llama_cpp.server``, which serves one request at a time (it has no parallel slots;
  started with ``--interrupt_requests False``, since by default a new request cuts a running stream short),
  which is what its users get.

No request asks a server to ignore the end-of-generation token (``ggmlpy serve`` has no such field), so a
server could stop before ``--tokens``; each one that does is reported, and the table counts the tokens it
generated. The workload is checked, not assumed: the prompt token counts must agree with ggmlpy's (same
template and tokenizer; where a server reports them, which ``llama_cpp.server``'s stream does not), and
the texts generated at temperature 0 are compared with ggmlpy's::

    python bench/serve_load.py                         # 4 clients, 64 tokens, 2 rounds, llama_cpp.server
    python bench/serve_load.py --clients 8 --tokens 128 --rounds 3 --json load.json
    python bench/serve_load.py --peer llama-server --llama-server /path/to/llama-server --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' "
          "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QUESTIONS = ["Tell me about cats.", "What is two plus two?", "Name a river in Europe.", "Say hello in French.",
             "Why is the sky blue?", "Write a haiku about rain.", "What is a prime number?", "Describe a bicycle."]


def model_file() -> Path:
    """The synthetic 1B Q4_K_M with llama-bpe's vocabulary and a Llama 3 template (made once)."""
    import hf_convert

    from ggmlpy import gguf
    from ggmlpy.models.synthetic import cache_dir, synthetic_path

    out = Path(cache_dir()) / "serve-llama3.2-1B-Q4_K_M-llama-bpe.gguf"
    if out.is_file():
        return out
    plain = synthetic_path("llama3.2-1B", "Q4_K_M")
    vocab = hf_convert.vocab_file("llama-bpe")
    tmp = out.with_suffix(".tmp")
    with gguf.GGUFReader(plain) as r, gguf.GGUFReader(vocab) as v, \
            gguf.GGUFWriter(tmp, arch=r.metadata["general.architecture"]) as w:
        for key in r.metadata:
            if not key.startswith("tokenizer.") and key not in ("general.architecture", "general.alignment"):
                w.add_from(r, key)
        for key in v.metadata:
            if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
                w.add_from(v, key)
        w.add("tokenizer.chat_template", LLAMA3)
        for info in r.tensors:
            w.add_tensor(info.name, r.tensor_data(info.name, copy=True), type=info.type, ne=info.ne)
    os.replace(tmp, out)
    return out


class Server:
    """A server process on a free port, ready (``/health`` ok, or absent, and ``/v1/models`` answers) or raising
    with its output."""

    def __init__(self, cmd: list, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list = []
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()
        t_end = time.monotonic() + 300
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited:\n" + "".join(self.lines[-40:]))
            try:
                # /health: 503 while ggmlpy serve loads; llama_cpp.server has none (404) and answers once loaded
                if httpx.get(self.url + "/health", timeout=2).status_code in (200, 404) and \
                        httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{cmd[:4]} never became ready:\n" + "".join(self.lines[-40:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_client(url: str, model: str, question: str, tokens: int, out: dict) -> None:
    t0 = time.perf_counter()
    first, chunks, usage, finish, text = None, 0, None, None, []
    # include_usage: the token count from the server itself, since a chunk may carry more or less than one token
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                finish = choice.get("finish_reason") or finish
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    text.append(choice["delta"]["content"])
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks
    out.update(ttft=(first or end) - t0, tokens=n, tps=(n - 1) / (end - first) if first and n > 1 else 0.0,
               end=end, prompt_tokens=usage["prompt_tokens"] if usage else None, finish=finish,
               text="".join(text))


def round_(url: str, model: str, clients: int, tokens: int, questions=QUESTIONS) -> tuple:
    """One round of ``clients`` requests at once: the summary row, and per client its raw result."""
    results = [dict() for _ in range(clients)]
    threads = [threading.Thread(target=one_client, args=(url, model, questions[i % len(questions)], tokens,
                                                         results[i])) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("end" not in r for r in results):          # a client thread raised; its traceback is above
        raise RuntimeError(f"{url}: a client failed")
    wall = max(r["end"] for r in results) - t0
    ttft = sorted(r["ttft"] for r in results)
    row = {"aggregate_tps": sum(r["tokens"] for r in results) / wall,
           "per_client_tps": statistics.median(r["tps"] for r in results),
           "ttft_p50": statistics.median(ttft), "ttft_max": ttft[-1], "tokens": sum(r["tokens"] for r in results),
           "min_tokens": min(r["tokens"] for r in results)}
    return row, results


def llama_server_cmd(exe: str, path: Path, clients: int, n_ctx_slot: int, threads: int, port: int) -> list:
    """llama.cpp's ``llama-server`` as ggmlpy serve is run: ``-c`` is its total context, split across the
    ``-np`` slots (one KV cache per slot unless ``--kv-unified``), so 512 a slot is ``-c 512 * clients``."""
    return [exe, "-m", str(path), "-np", str(clients), "-c", str(n_ctx_slot * clients), "--port", str(port),
            "--host", "127.0.0.1", "-t", str(threads), "--alias", "m", "--jinja"]


def check_workload(name: str, results: list, tokens: int, ref: Optional[list]) -> list:
    """Lines that say where the workload differed: a client stopped before ``tokens``, or a prompt tokenized to a
    different length than ggmlpy's (``ref``); and how many greedy texts equal ggmlpy's. On the synthetic file
    (random weights) the top logits lie within ~0.01 of each other, so two correct engines part ways after a
    few tokens: fewer equal texts is expected there, not a sign of a different workload."""
    notes = []
    for i, r in enumerate(results):
        if r["tokens"] < tokens:
            notes.append(f"{name}: client {i} stopped at {r['tokens']} of {tokens} tokens "
                         f"(finish_reason {r['finish']!r})")
        if ref is None:
            continue
        if r["prompt_tokens"] is not None and ref[i]["prompt_tokens"] is not None and \
                r["prompt_tokens"] != ref[i]["prompt_tokens"]:
            notes.append(f"{name}: client {i}'s prompt is {r['prompt_tokens']} tokens, "
                         f"ggmlpy serve's {ref[i]['prompt_tokens']}")
    if ref is not None:
        # stripped: a server's chat parser may trim the reply's leading space (llama-server keeps it)
        same = sum(r["text"].strip() == q["text"].strip() for r, q in zip(results, ref))
        notes.append(f"{name}: {same} of {len(results)} texts the same as ggmlpy serve's")
    return notes


PEERS = ("llama-server", "llama-cpp-python")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--peer", action="append", choices=PEERS, default=None,
                    help="the server(s) to compare with, repeatable (default llama-cpp-python)")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary, for --peer llama-server")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    peers = list(dict.fromkeys(args.peer or ["llama-cpp-python"]))
    if "llama-server" in peers:
        if not args.llama_server:
            ap.error("--peer llama-server needs --llama-server PATH (bench/README: how to build it)")
        if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
            ap.error(f"--llama-server {args.llama_server}: not an executable file")
    path = model_file()
    n_ctx_slot = 512
    engines = {
        "ggmlpy serve": lambda port: [sys.executable, "-m", "ggmlpy", "serve", "-m", str(path), "--port", str(port),
                                      "-np", str(args.clients), "-c", str(n_ctx_slot), "-t", str(args.threads),
                                      "-dev", "cpu", "--alias", "m"],
    }
    if "llama-server" in peers:
        engines["llama-server"] = lambda port: llama_server_cmd(args.llama_server, path, args.clients, n_ctx_slot,
                                                                args.threads, port)
    if "llama-cpp-python" in peers:
        engines["llama_cpp.server"] = lambda port: [sys.executable, "-m", "llama_cpp.server", "--model", str(path),
                                                    "--port", str(port), "--n_ctx", str(n_ctx_slot * args.clients),
                                                    "--n_threads", str(args.threads), "--model_alias", "m",
                                                    # its default lets a new request cut a running stream short
                                                    "--interrupt_requests", "False"]
    rows: dict = {name: [] for name in engines}
    clients: dict = {name: [] for name in engines}      # per round, per client: tokens, finish, text (the json)
    notes: list = []
    for _ in range(args.rounds):
        ref = None
        for name, cmd in engines.items():                # ggmlpy first: the others are checked against it
            port = free_port()
            srv = Server(cmd(port), port)
            try:
                # warm-up (graphs, caches) on a question of its own: a server's prompt cache must not start
                # the round holding one of the round's prompts
                round_(srv.url, "m", 1, 4, ["Hello."])
                row, results = round_(srv.url, "m", args.clients, args.tokens)
            finally:
                srv.stop()
            rows[name].append(row)
            clients[name].append([{k: r[k] for k in ("tokens", "prompt_tokens", "finish", "text")} for r in results])
            notes += check_workload(name, results, args.tokens, ref)
            ref = ref or results
    print(f"{args.clients} concurrent streaming chats, {args.tokens} tokens each, {args.rounds} rounds, "
          f"{args.threads} threads; {path.name}")
    print("| server | aggregate tok/s | per-client tok/s | TTFT p50 s | TTFT max s |")
    print("|---|---:|---:|---:|---:|")
    summary = {}
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[name] = med
        print(f"| {name} | {med['aggregate_tps']:.1f} | {med['per_client_tps']:.1f} | {med['ttft_p50']:.2f} | "
              f"{med['ttft_max']:.2f} |")
    for name in list(engines)[1:]:
        print(f"aggregate ratio ggmlpy / {name}: "
              f"{summary['ggmlpy serve']['aggregate_tps'] / summary[name]['aggregate_tps']:.2f}x")
    for line in dict.fromkeys(notes):
        print("note:", line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rows, "median": summary,
                                               "notes": notes, "clients": clients}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
