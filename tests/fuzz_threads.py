"""Random multi-threaded programs over shared ggmlpy objects: lifetimes and concurrency fuzzing.

Several threads share one pool of contexts, tensors, graphs, backends, buffers, graph allocators,
schedulers and (optionally) runners over a tiny model, and call random methods on random members
in random order: create, compute, expand, clear, reset, free, drop, read and write data, allocate
and free. Every call either works or raises a ``ggmlpy.GGMLError`` (a refused free of something in
use, a ClosedError after a free, a shape error...). The process must never abort or crash, and
never hang: the parent runs the program in child processes, in chunks, with a time limit.

Anything else a call raises (an AttributeError, a bare ValueError from numpy, ...) is counted as an
"unexpected" exception and reported with its traceback: the binding promised a GGMLError.

Usage (the long run of issue 11; about 200,000 calls)::

    python tests/fuzz_threads.py --calls 200000 --threads 4 --seed 1
    python tests/fuzz_threads.py --calls 20000 --runner        # also share Runners over a tiny model

Prints one JSON line per chunk and a summary: calls made, exceptions by type, aborts, hangs,
unexpected exceptions. Exit status 1 when any chunk crashed, hung or raised something unexpected.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter

import numpy as np

CHUNK_TIMEOUT = 240.0


class Pool:
    """The shared objects; picking is locked, calling is not (that is the point)."""

    KINDS = ("ctx", "tensor", "graph", "backend", "buffer", "gallocr", "sched", "runner")

    def __init__(self, rng: random.Random, cap: int = 24):
        self.lock = threading.Lock()
        self.items = {k: [] for k in self.KINDS}
        self.cap = cap

    def add(self, kind, obj):
        with self.lock:
            lst = self.items[kind]
            lst.append(obj)
            if len(lst) > self.cap:
                lst.pop(0)                      # dropped: garbage collection joins the race

    def pick(self, rng, kind):
        with self.lock:
            lst = self.items[kind]
            return rng.choice(lst) if lst else None

    def drop(self, rng, kind):
        with self.lock:
            lst = self.items[kind]
            if lst:
                lst.pop(rng.randrange(len(lst)))


def _shape(rng):
    if rng.random() < 0.15:
        # some tensors large enough that computes and copies overlap between threads
        return [rng.choice([128, 256, 512]), rng.choice([64, 128, 256])]
    return [rng.choice([1, 2, 3, 4, 8, 16, 32, 64]) for _ in range(rng.randint(1, 3))]


class Program:
    def __init__(self, seed: int, model_path: str | None):
        import ggmlpy

        self.G = ggmlpy
        self.model_path = model_path
        self.model = None
        self.model_lock = threading.Lock()
        self.cpu = ggmlpy.device("CPU")
        self.counts = Counter()
        self.unexpected = []
        self.count_lock = threading.Lock()
        self.pool = Pool(random.Random(seed))
        self.last_dir = os.environ.get("GGMLPY_FUZZ_LAST_DIR")
        self.actions = [m for m in dir(self) if m.startswith("a_")]
        if model_path is None:
            self.actions = [a for a in self.actions if not a.startswith("a_runner")]

    def _note(self, what, alloc, g):
        # --last-dir: the graph each thread is about to allocate, written before the call, so a crash
        # leaves the last one of every thread on disk (a debugging aid; off by default)
        if self.last_dir is None:
            return
        try:
            text = f"{what} {id(alloc):x}\n{g.summary()}\n"
            for t in g.leafs + g.nodes:
                text += f"{t.name} data={t.data_ptr:x} view={t.is_view} flags={t.flags}\n"
        except self.G.GGMLError as e:
            text = f"{what}: {e}\n"
        with open(os.path.join(self.last_dir, f"{threading.get_ident()}.txt"), "w") as f:
            f.write(text)

    # -- actions: each takes a Random and returns nothing; GGMLError is an expected outcome ------

    def a_new_ctx(self, rng):
        self.pool.add("ctx", self.G.Context(rng.choice([1 << 16, 1 << 20, 4 << 20]), no_alloc=rng.random() < 0.4))

    def a_free_ctx(self, rng):
        c = self.pool.pick(rng, "ctx")
        if c is not None:
            c.free()

    def a_reset_ctx(self, rng):
        c = self.pool.pick(rng, "ctx")
        if c is not None:
            c.reset()

    def a_new_tensor(self, rng):
        c = self.pool.pick(rng, "ctx")
        if c is None:
            return
        ne = _shape(rng)
        if rng.random() < 0.5 and not c.closed and not c.no_alloc:
            t = c.from_numpy(np.random.default_rng(rng.randrange(1 << 30)).random(ne[::-1], dtype=np.float32))
        else:
            t = c.new_tensor(rng.choice([self.G.Type.F32, self.G.Type.F16]), ne)
        if rng.random() < 0.5:
            t.set_input()
        self.pool.add("tensor", t)

    def a_op(self, rng):
        c = self.pool.pick(rng, "ctx")
        a = self.pool.pick(rng, "tensor")
        b = self.pool.pick(rng, "tensor")
        if c is None or a is None or b is None:
            return
        op = rng.choice(["add", "mul", "scale", "mul_mat", "cont", "sum_rows", "silu", "transpose", "cpy",
                         "view_1d", "soft_max", "concat"])
        if op == "scale":
            t = c.scale(a, rng.random())
        elif op in ("cont", "sum_rows", "silu", "transpose", "soft_max"):
            t = getattr(c, op)(a)
        elif op == "view_1d":
            t = c.view_1d(a, max(1, a.ne[0] // 2), 0)
        elif op == "concat":
            t = c.concat(a, b, rng.randrange(4))
        else:
            t = getattr(c, op)(a, b)
        self.pool.add("tensor", t)

    def a_new_graph(self, rng):
        c = self.pool.pick(rng, "ctx")
        if c is not None:
            self.pool.add("graph", c.new_graph(rng.choice([64, 256])))

    def a_expand(self, rng):
        g, t = self.pool.pick(rng, "graph"), self.pool.pick(rng, "tensor")
        if g is not None and t is not None:
            g.build_forward_expand(t)

    def a_clear_graph(self, rng):
        g = self.pool.pick(rng, "graph")
        if g is not None:
            g.clear()

    def a_compute(self, rng):
        g = self.pool.pick(rng, "graph")
        if g is not None:
            g.compute(rng.choice([1, 2]))

    def a_cancel(self, rng):
        g = self.pool.pick(rng, "graph")
        if g is not None:
            g.cancel()

    def a_get(self, rng):
        t = self.pool.pick(rng, "tensor")
        if t is not None:
            if rng.random() < 0.5:
                t.get()
            else:
                np.asarray(t).sum()

    def a_set(self, rng):
        t = self.pool.pick(rng, "tensor")
        if t is not None:
            t.set(np.full(t.shape, rng.random(), np.float32))

    def a_new_backend(self, rng):
        self.pool.add("backend", self.cpu.init())

    def a_free_backend(self, rng):
        b = self.pool.pick(rng, "backend")
        if b is not None:
            b.free()

    def a_alloc_ctx(self, rng):
        c, b = self.pool.pick(rng, "ctx"), self.pool.pick(rng, "backend")
        if c is not None and b is not None:
            self.pool.add("buffer", self.G.alloc_ctx_tensors(c, b))

    def a_buffer(self, rng):
        buf = self.pool.pick(rng, "buffer")
        if buf is None:
            self.pool.add("buffer", self.cpu.buffer_type().alloc_buffer(rng.choice([1 << 10, 1 << 20])))
        elif rng.random() < 0.5:
            buf.free()
        else:
            buf.clear(rng.randrange(256))

    def a_gallocr(self, rng):
        ga, g = self.pool.pick(rng, "gallocr"), self.pool.pick(rng, "graph")
        r = rng.random()
        if ga is None or r < 0.2:
            self.pool.add("gallocr", self.G.Gallocr(self.cpu.buffer_type()))
        elif r < 0.35:
            ga.free()
        elif g is not None:
            self._note("gallocr", ga, g)
            (ga.reserve if r < 0.5 else ga.alloc_graph)(g)

    def a_backend_compute(self, rng):
        b, g = self.pool.pick(rng, "backend"), self.pool.pick(rng, "graph")
        if b is not None and g is not None:
            b.graph_compute(g)

    def a_sched(self, rng):
        s, g = self.pool.pick(rng, "sched"), self.pool.pick(rng, "graph")
        r = rng.random()
        if s is None or r < 0.15:
            b = self.pool.pick(rng, "backend")
            if b is not None:
                self.pool.add("sched", self.G.Scheduler([b], graph_size=512))
        elif r < 0.25:
            s.free()
        elif r < 0.35:
            s.reset()
        elif g is not None:
            self._note("sched", s, g)
            (s.reserve if r < 0.5 else s.alloc_graph if r < 0.65 else s.compute)(g)

    def a_drop(self, rng):
        self.pool.drop(rng, rng.choice(Pool.KINDS))

    def a_gc(self, rng):
        if rng.random() < 0.1:
            import gc
            gc.collect()

    # Runners over one shared tiny model: decode, generate, submit and close from any thread.
    def _model(self):
        with self.model_lock:
            if self.model is None:
                from ggmlpy.models import load_model
                self.model = load_model(self.model_path, devices="cpu")
            return self.model

    def a_runner_new(self, rng):
        if rng.random() < 0.3:
            from ggmlpy.runner import Runner
            self.pool.add("runner", Runner(self._model(), n_ctx=rng.choice([64, 128]), n_seq_max=2, n_threads=1))

    def a_runner_use(self, rng):
        r = self.pool.pick(rng, "runner")
        if r is None:
            return
        x = rng.random()
        toks = [rng.randrange(1, 32) for _ in range(rng.randint(1, 12))]
        if x < 0.3:
            r.decode(toks, seq=rng.randrange(2))
        elif x < 0.55:
            r.generate(toks, max_tokens=rng.randint(1, 6), temperature=0)
        elif x < 0.8:
            h = r.submit(toks, max_tokens=rng.randint(1, 6), temperature=0)
            if rng.random() < 0.3:
                h.cancel()
        elif x < 0.9:
            r.clear()
        else:
            r.close()

    # -- the loop ----------------------------------------------------------------------------------

    def run_thread(self, seed: int, n_calls: int):
        rng = random.Random(seed)
        local = Counter()
        for _ in range(n_calls):
            name = rng.choice(self.actions)
            try:
                getattr(self, name)(rng)
                local["ok"] += 1
            except self.G.GGMLError as e:
                local[type(e).__name__] += 1
            except Exception as e:  # noqa: BLE001 - a promise broken: recorded and reported
                local["unexpected"] += 1
                with self.count_lock:
                    if len(self.unexpected) < 10:
                        self.unexpected.append(f"{name}: {type(e).__name__}: {e}\n"
                                               + "".join(traceback.format_exc(limit=6)))
        with self.count_lock:
            self.counts.update(local)


def run_chunk(seed: int, calls: int, threads: int, model_path: str | None) -> dict:
    """Run one chunk in this process (called in the child)."""
    faulthandler.dump_traceback_later(CHUNK_TIMEOUT - 10, exit=True)   # a hang prints every stack
    prog = Program(seed, model_path)
    share = [calls // threads + (i < calls % threads) for i in range(threads)]
    ts = [threading.Thread(target=prog.run_thread, args=(seed * 1000 + i, share[i])) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # close what is left so runner threads end before the interpreter does
    for r in list(prog.pool.items["runner"]):
        try:
            r.close()
        except prog.G.GGMLError:
            pass
    faulthandler.cancel_dump_traceback_later()
    return {"seed": seed, "calls": sum(prog.counts.values()), "seconds": round(time.perf_counter() - t0, 2),
            "counts": dict(prog.counts), "unexpected": prog.unexpected}


def _crash_site(stderr: str) -> str:
    # ggml's message (if it aborted) and the action the crashing thread was in.
    lines = stderr.splitlines()
    why = [ln for ln in lines if "ggml aborted" in ln or "Fatal Python error" in ln][:2]
    cur = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    act = next((ln.strip() for ln in lines[cur:] if " in a_" in ln), "") if cur is not None else ""
    return " | ".join(why + [act])


def tiny_model(path_dir: str) -> str:
    from ggmlpy.models import synthetic
    return str(synthetic.write_synthetic(os.path.join(path_dir, "tiny-F16.gguf"), size="tiny", type="F16"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="random calls in all")
    ap.add_argument("--chunk", type=int, default=10000, help="calls per child process")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runner", action="store_true", help="also share Runners over a tiny model")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_chunk(args.seed, args.calls, args.threads, args.model)), flush=True)
        return 0
    model = None
    if args.runner:
        import tempfile
        model = tiny_model(tempfile.mkdtemp(prefix="ggmlpy-fuzz-"))
    total, aborts, hangs, unexpected = Counter(), [], [], []
    n_chunks = max(1, -(-args.calls // args.chunk))
    t0 = time.perf_counter()
    for k in range(n_chunks):
        seed = args.seed * 10007 + k
        cmd = [sys.executable, "-X", "faulthandler", __file__, "--child", "--seed", str(seed),
               "--calls", str(min(args.chunk, args.calls - k * args.chunk)), "--threads", str(args.threads)]
        if model:
            cmd += ["--model", model]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHUNK_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            hangs.append({"seed": seed, "stderr": (e.stderr or b"")[-3000:].decode(errors="replace")
                          if isinstance(e.stderr, bytes) else (e.stderr or "")[-3000:]})
            continue
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if p.returncode != 0 or not line.startswith("{"):
            (hangs if "Timeout" in p.stderr else aborts).append(
                {"seed": seed, "returncode": p.returncode, "where": _crash_site(p.stderr),
                 "stderr": p.stderr[-3000:]})
            continue
        res = json.loads(line)
        total.update(res["counts"])
        unexpected.extend(res["unexpected"])
        print(json.dumps({"chunk": k, "seed": seed, "calls": res["calls"], "seconds": res["seconds"]}), flush=True)
    summary = {"calls": sum(total.values()), "chunks": n_chunks, "threads": args.threads,
               "seconds": round(time.perf_counter() - t0, 1), "aborts": len(aborts), "hangs": len(hangs),
               "unexpected": len(unexpected), "outcomes": dict(total.most_common())}
    for bad in aborts + hangs:
        print(json.dumps(bad), file=sys.stderr)
    for u in unexpected:
        print(u, file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 1 if aborts or hangs or unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
