"""Serving under load: N concurrent streaming chat clients on loopback, ``ggmlpy serve`` against
llama-cpp-python's ``llama_cpp.server`` on the same file.

The model is the synthetic Llama-3.2-1B shape (Q4_K_M, ``ggmlpy bench --synthetic llama3.2-1B``) with
llama.cpp's real llama-bpe vocabulary (``models/ggml-vocab-llama-bpe.gguf`` of the pinned sdist,
tests/hf_convert.py) and a Llama 3 chat template written into it, so both servers tokenize and
template the same way (made once, kept in ggmlpy's cache folder). Each round starts one server, sends
``--clients`` chat requests at once (``stream: true``, ``max_tokens`` ``--tokens``, temperature 0, each
a different question), and records per client the time to the first content chunk (TTFT) and the
chunks (tokens) per second after it; the aggregate is all tokens over the round's wall time. Rounds
alternate the two servers. ``ggmlpy serve`` runs ``-np --clients`` slots (continuous batching);
``llama_cpp.server`` serves one request at a time (it has no parallel slots; started with
``--interrupt_requests False``, since by default a new request cuts a running stream short), which is what
its users get::

    python bench/serve_load.py                         # 4 clients, 64 tokens, 2 rounds each
    python bench/serve_load.py --clients 8 --tokens 128 --rounds 3 --json load.json
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
    first, n = None, 0
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                n += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    out.update(ttft=(first or end) - t0, tokens=n, tps=(n - 1) / (end - first) if first and n > 1 else 0.0,
               end=end)


def round_(url: str, model: str, clients: int, tokens: int) -> dict:
    results = [dict() for _ in range(clients)]
    threads = [threading.Thread(target=one_client, args=(url, model, QUESTIONS[i % len(QUESTIONS)], tokens,
                                                         results[i])) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in results) - t0
    ttft = sorted(r["ttft"] for r in results)
    return {"aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "per_client_tps": statistics.median(r["tps"] for r in results),
            "ttft_p50": statistics.median(ttft), "ttft_max": ttft[-1], "tokens": sum(r["tokens"] for r in results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    path = model_file()
    n_ctx = 512 * args.clients
    engines = {
        "ggmlpy serve": lambda port: [sys.executable, "-m", "ggmlpy", "serve", "-m", str(path), "--port", str(port),
                                      "-np", str(args.clients), "-c", str(512), "-t", str(args.threads),
                                      "-dev", "cpu", "--alias", "m"],
        "llama_cpp.server": lambda port: [sys.executable, "-m", "llama_cpp.server", "--model", str(path),
                                          "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads",
                                          str(args.threads), "--model_alias", "m",
                                          # its default lets a new request cut a running stream short: queue
                                          "--interrupt_requests", "False"],
    }
    rows: dict = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, cmd in engines.items():
            port = free_port()
            srv = Server(cmd(port), port)
            try:
                round_(srv.url, "m", 1, 4)                       # warm-up: graphs, caches
                rows[name].append(round_(srv.url, "m", args.clients, args.tokens))
            finally:
                srv.stop()
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
    a, b = summary["ggmlpy serve"], summary["llama_cpp.server"]
    print(f"aggregate ratio ggmlpy / llama_cpp.server: {a['aggregate_tps'] / b['aggregate_tps']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rows, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
