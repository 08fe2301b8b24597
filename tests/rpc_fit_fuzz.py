"""``load_model(..., n_gpu_layers="auto")`` over loopback RPC servers that are tiny, mismatched, die or stall.

Each case starts one to three ``ggmlpy rpc-server --mem`` processes on 127.0.0.1 with random budgets
(0.001 MiB, 1 MiB, just below / at / just above what one layer needs, a few MiB ...), fits a small
synthetic model to them (``n_ctx`` 128 or ``"auto"``) (:data:`CFG`: 6 layers of ~1.3 MiB and a 2 MiB
output layer), runs a :class:`~ggmlpy.runner.Runner` with a few concurrent requests, and maybe kills
(SIGKILL) or stops
(SIGSTOP) one server at a random moment: during the fit (a timer thread with a random delay, so the
kill lands in a try's allocation, in the load of the weights or after it) or while the requests
generate. Case ``i`` is a pure function of ``(seed, i)``.

What must hold in every case (anything else is a failure, named with the case):

* the fit either loads, or raises a ``GGMLError`` that names the endpoint of the server that died
  (``RPCError``/``RPCTimeoutError``); with no server harmed it always loads, and each server's share of
  a runner made with the fitted settings is within its budget;
* every request ends within a bounded time: finished, or a ``RunnerError`` naming the dead server's
  endpoint; a later request on the same runner fails the same way, never hangs;
* after the runner and the model are closed, every surviving server has all its memory free again
  (nothing of this client stays allocated there), no runner thread is left, and the client's RSS and
  open files stay flat over the run;
* the process goes on: a model loads and decodes on the CPU after every case with a dead server.

Cases run in a child process; the parent restarts it after an abort (a negative return code: the
case is named) or a case that makes no progress for ``--case-timeout`` seconds (a hang), through
``tests/fuzz_pool.py`` as the other fuzzers do.

Usage::

    python tests/rpc_fit_fuzz.py --cases 200              # the long run
    python tests/rpc_fit_fuzz.py --cases 20 --seed 3      # a sample
    python tests/rpc_fit_fuzz.py --cases 20 --stop        # with servers stopped (SIGSTOP) mid-generation

The last line on stdout is a JSON summary (counts per scenario and outcome, RSS growth, wall time, the
failures); exit status 0 when there are none.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import fuzz_pool

MIB = 2**20
#: budgets (MiB) a server gets: nothing, tiny, around one layer (2.0 MiB with the runner below: the
#: layer, its cache and the graph), mismatched sizes; "one-" and "one+" are one byte below / at it
MEMS = [0.001, 0.5, 1, "one-", "one", "one+", 2.5, 3.5, 5, 8, 16]
#: what happens to one of the servers
SCENARIOS = ["none", "none", "kill-fit", "kill-fit", "kill-generate", "kill-generate"]
#: with --stop: a server SIGSTOPped while requests generate (accepts connections, never answers). Off by
#: default, as the scenario list was before. Before patch 0001's back-off (vendor/ggml) the RPC client
#: reconnected for every later call of the compute, each costing a whole timeout, so such a request
#: took minutes; now it ends about one timeout after the stop
STOP = "stop-generate"
#: the runner the fit leaves room for (small graphs: the layers decide)
RUNNER = {"n_ctx": 128, "n_batch": 32, "n_ubatch": 32, "type_k": "f32", "type_v": "f32", "n_seq_max": 3}
#: bytes one layer of the model needs on a server with RUNNER (weights, cache, graph), as measured on
#: b1aaa0d; a run measures it again (:func:`one_layer_need`) and uses that
ONE_LAYER = 2623488
#: the RPC client's reply timeout in this process (a stopped server is detected after it)
RPC_TIMEOUT = 2.0
#: the bound on one request once its server is dead or stopped
REQUEST_TIMEOUT = 60.0


def _opener(path):
    """What load_model gives the fit's search: the model opened on a placement, nothing read."""
    from ggmlpy.load import load_model

    return lambda placement: load_model(path, placement=placement, load=False)


def model_config():
    from ggmlpy.models import synthetic as syn

    return syn.SyntheticConfig("fit", 256, 6, 4, 4, 512, 4096, 512, "fit test model")


def make_model(folder: str) -> str:
    from ggmlpy.models import synthetic as syn

    p = os.path.join(folder, "fit.gguf")
    if not os.path.exists(p):
        syn.write_synthetic(p, model_config(), "F16", seed=3)
    return p


def _die_with_parent() -> None:
    # a server outlives nothing: if the fuzzing process dies (an abort), so do its servers
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_servers(mems: list, tries: int = 3) -> list:
    """``[(process, "127.0.0.1:port"), ...]``: one ``rpc-server --mem m`` per budget, started together (a
    server that exits at once, its free port taken by another process meanwhile, is started again)."""
    procs = [_start_server(m) for m in mems]
    deadline = time.monotonic() + 60
    for k, m in enumerate(mems):
        for attempt in range(tries):
            p, ep = procs[k]
            port = int(ep.rsplit(":", 1)[1])
            while p.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                if p.poll() is not None and attempt + 1 < tries:
                    procs[k] = _start_server(m)
                    continue
                stop_servers(procs)
                raise RuntimeError(f"rpc-server --mem {m} at {ep} did not start (exit status {p.poll()})")
            break
    return procs


def _start_server(m) -> tuple:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1", "--port",
                          str(port), "--threads", "1", "--mem", repr(float(m))],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    return p, f"127.0.0.1:{port}"


def stop_servers(procs) -> None:
    for p, _ in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except OSError:
            pass
        p.kill()
        p.wait()


def fit(path: str, eps: list, **kw):
    from ggmlpy.models import load_model

    return load_model(path, devices="auto", rpc=eps, n_gpu_layers="auto", margin=0, **{**RUNNER, **kw})


def one_layer_need(path: str) -> int:
    """Bytes one layer (the last) of the model needs on a server with :data:`RUNNER`, by one try."""
    from ggmlpy import _core
    from ggmlpy.gguf import GGUFReader
    from ggmlpy.runner.fit import _budgets, _Search, _tensor_bytes

    procs = start_servers([16])
    try:
        dev = _core.rpc_add_server(procs[0][1])[0]
        devs = [dev, _core.device("CPU")]
        n_layer = model_config().n_layer
        with GGUFReader(path) as r:
            tb, _ = _tensor_bytes(r, n_layer)
        rk = {k: v for k, v in RUNNER.items() if k != "n_ctx"} | {"flash_attn": True}
        s = _Search(path, devs, n_layer, tb, _budgets(devs, 0, None), _opener(path), rk)
        model, step, _ = s.attempt((1,), RUNNER["n_ctx"])
        model.close()
        return step.needs[dev.name]
    finally:
        stop_servers(procs)


def rss_mib() -> float:
    """This process's RSS after ``malloc_trim`` (tests/helpers.py)."""
    from helpers import rss_mib

    return rss_mib()


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_case(seed: int, i: int, one_layer: int = ONE_LAYER, stop: bool = False) -> dict:
    """Case ``i``: the servers' budgets (MiB), the scenario, the victim and its moment; pure."""
    rng = random.Random(f"{seed}:{i}")
    n = rng.choice([1, 2, 2, 3])
    one = one_layer / MIB
    mems = []
    for _ in range(n):
        m = rng.choice(MEMS)
        mems.append({"one-": one - 1 / MIB, "one": one, "one+": one + 1 / MIB}.get(m, m))
    scenario = rng.choice(SCENARIOS + [STOP] * stop)
    return {"i": i, "mems": mems, "scenario": scenario, "victim": rng.randrange(n),
            "delay": round(rng.uniform(0.0, 0.3), 3), "n_requests": rng.randint(1, 3),
            "max_tokens": rng.choice([8, 40, 100]), "n_ctx": rng.choice([RUNNER["n_ctx"], "auto"])}


def run_case(path: str, case: dict) -> dict:
    """Run one case in this process; returns ``case`` with ``outcome`` and ``problems`` (empty: passed)."""
    from ggmlpy import GGMLError, _core
    from ggmlpy.runner import Runner, RunnerError

    problems: list[str] = []
    res = dict(case)
    procs = start_servers(case["mems"])
    eps = [ep for _, ep in procs]
    victim_proc, victim = procs[case["victim"]]
    scenario = case["scenario"]
    harmed = threading.Event()

    def harm():
        if scenario.startswith("stop"):
            os.kill(victim_proc.pid, signal.SIGSTOP)
        else:
            victim_proc.kill()
        harmed.set()

    threads0 = threading.active_count()
    timer = None
    model = rt = None
    try:
        if scenario == "kill-fit":
            timer = threading.Timer(case["delay"], harm)
            timer.start()
        try:
            model = fit(path, eps, n_ctx=case.get("n_ctx", RUNNER["n_ctx"]), n_ctx_min=64)
        except GGMLError as e:
            if timer is not None:
                timer.join()
            if not harmed.is_set():
                problems.append(f"fit failed with no server harmed: {type(e).__name__}: {e}")
            elif victim not in str(e):
                problems.append(f"fit error does not name the dead server {victim}: {type(e).__name__}: {e}")
            res["fit"] = f"error {type(e).__name__}"
        else:
            res["fit"] = model.placement.summary()
            held = {d.name for d in [*model.placement.layers, model.placement.output]}
            res["victim_used"] = any(d.endpoint == victim for d in _core.devices() if d.name in held)
        if timer is not None:
            timer.join()
        if model is not None:
            try:
                rt = Runner(model)
                if scenario == "none":
                    rep = rt.memory_report()
                    for name, budget in model.fit.budgets.items():
                        if name != "CPU" and name in rep.devices and rep.devices[name].self_total > budget:
                            problems.append(f"{name} holds {rep.devices[name].self_total} bytes, over its budget "
                                            f"{budget}")
                handles = [rt.submit([1 + j, 2, 3, 4], max_tokens=case["max_tokens"], temperature=0)
                           for j in range(case["n_requests"])]
                if scenario.endswith("generate"):
                    timer = threading.Timer(case["delay"], harm)
                    timer.start()
                    timer.join()
                ends = []
                for h in handles:
                    try:
                        h.result(timeout=REQUEST_TIMEOUT)
                        ends.append("done")
                    except RunnerError as e:
                        ends.append("error")
                        if not harmed.is_set() or victim not in str(e):
                            problems.append(f"request error not naming the dead server {victim}: {e}")
                    except TimeoutError:
                        ends.append("hang")
                        problems.append(f"a request did not end within {REQUEST_TIMEOUT:g} s")
                res["requests"] = ends
                # every handle done, and the runner holds no request (slot, queue or batch in flight)
                if not all(h.done for h in handles):
                    problems.append("a handle is not done after its result")
                deadline = time.monotonic() + 10
                while (rt._active or rt._waiting or rt._inflight) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if rt._active or rt._waiting or rt._inflight:
                    problems.append(f"the runner still holds requests: {len(rt._active)} active, "
                                    f"{len(rt._waiting)} waiting, {rt._inflight} batches in flight")
                if harmed.is_set() and "error" in ends:
                    # the same runner: a later request fails the same way (bounded), never hangs
                    t0 = time.monotonic()
                    try:
                        rt.generate([1, 2], max_tokens=2, temperature=0)
                    except (RunnerError, GGMLError) as e:
                        if victim not in str(e):
                            problems.append(f"a later request's error does not name {victim}: {e}")
                    if time.monotonic() - t0 > REQUEST_TIMEOUT:
                        problems.append("a later request took longer than the bound")
            except GGMLError as e:
                # a runner that cannot start on the dead server: named too
                if not harmed.is_set() or victim not in str(e):
                    problems.append(f"runner error {type(e).__name__}: {e}")
                res["requests"] = [f"runner {type(e).__name__}"]
    except Exception as e:  # noqa: BLE001 -- the point: any other exception is a failure of the case
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        if timer is not None:
            timer.join()
        if rt is not None:
            rt.close()
        if model is not None:
            model.close()
        rt = model = None
        gc.collect()
    # nothing of this client stays on the servers still alive (a stopped one is woken up to ask)
    for k, (p, ep) in enumerate(procs):
        if k == case["victim"] and harmed.is_set():
            if scenario.startswith("kill"):
                continue
            os.kill(p.pid, signal.SIGCONT)
            # the client backs off a server that timed out: its calls fail at once, with no reconnect,
            # for one RPC timeout (at least 1 s) after the last timeout (vendor/ggml patch 0001)
            time.sleep(max(RPC_TIMEOUT, 1.0))
        try:
            dev = _core.rpc_add_server(ep)[0]
            free, total = dev.memory()
        except GGMLError as e:
            problems.append(f"the surviving server {ep} does not answer: {e}")
            continue
        if free != total:
            problems.append(f"{ep} still holds {total - free} bytes of this client's after close")
    deadline = time.monotonic() + 10
    while threading.active_count() > threads0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if threading.active_count() > threads0:
        problems.append(f"{threading.active_count() - threads0} thread(s) left after close")
    stop_servers(procs)
    if harmed.is_set():
        # the process goes on: a model on the CPU alone
        from ggmlpy.models import load_model

        try:
            with load_model(path, devices="cpu") as m, Runner(m, n_ctx=32) as r:
                r.decode([1, 2, 3])
        except Exception as e:  # noqa: BLE001
            problems.append(f"a CPU model after the case: {type(e).__name__}: {e}")
    res["harmed"] = harmed.is_set()
    res["problems"] = problems
    res["outcome"] = "ok" if not problems else "failed"
    return res


def run_child(work: str, seed: int, start: int, stop: int, with_stop: bool = False) -> None:
    """Run cases ``start .. stop - 1`` printing ``start i`` before and a JSON line after each."""
    import ggmlpy

    ggmlpy.rpc_set_timeout(RPC_TIMEOUT)
    path = make_model(work)
    one = int(open(os.path.join(work, "one_layer")).read())
    for i in range(start, stop):
        case = make_case(seed, i, one, with_stop)
        fuzz_pool.case_start(i)
        res = run_case(path, case)
        res["rss_mib"] = round(rss_mib(), 1)
        res["fds"] = n_fds()
        fuzz_pool.case_result(res)


def run(cases: int, seed: int = 0, case_timeout: float = 180.0, work: str | None = None, log=None,
        stop: bool = False) -> dict:
    """Run ``cases`` cases in child processes (``stop``: with the SIGSTOP scenario); returns the summary."""
    t0 = time.monotonic()
    with fuzz_pool.work_dir(work, "rpc-fit-fuzz-") as work:
        path = make_model(work)
        one = one_layer_need(path)
        with open(os.path.join(work, "one_layer"), "w") as f:
            f.write(str(one))
        summary: dict = {"cases": 0, "ok": 0, "failed": 0, "aborts": 0, "hangs": 0, "one_layer_bytes": one,
                         "by_scenario": {}, "fit_errors": 0, "request_errors": 0, "failures": []}
        rss: list[float] = []
        fds: list[int] = []
        # one child runs every case; after an abort or a hang, a new one runs the rest
        for r in fuzz_pool.results(__file__, fuzz_pool.ranges(0, cases), seed=seed, work=work,
                                   case_timeout=case_timeout, args=["--stop"] * stop):
            if isinstance(r, fuzz_pool.Lost):
                if r.case is None:          # exited non-zero, or stalled, between cases
                    summary["failures"].append(f"child exited {r.rc}: {r.stderr}"
                                               if r.outcome == "abort" else r.message)
                    continue
                summary[r.outcome + "s"] += 1
                summary["cases"] += 1
                what = "hang" if r.outcome == "hang" else f"abort rc={r.rc}"
                summary["failures"].append(f"case {r.case} {make_case(seed, r.case, one, stop)}: "
                                           f"{what} {r.stderr}")
                continue
            summary["cases"] += 1
            summary[r["outcome"]] += 1
            sc = summary["by_scenario"].setdefault(r["scenario"], {})
            key = ("fit-error" if str(r.get("fit", "")).startswith("error") else
                   "request-errors" if "error" in r.get("requests", []) else "served")
            sc[key] = sc.get(key, 0) + 1
            summary["fit_errors"] += key == "fit-error"
            summary["request_errors"] += r.get("requests", []).count("error")
            rss.append(r["rss_mib"])
            fds.append(r["fds"])
            if r["problems"]:
                summary["failures"].append(f"case {r['i']} {r['scenario']} {r['mems']}: "
                                           f"{r['problems']}")
            if log is not None:
                log.write(json.dumps(r) + "\n")
        # growth from the first few cases (one-time costs) to the end
        k = min(3, len(rss) - 1)
        summary["rss_mib_first_last"] = [rss[k], rss[-1]] if rss else None
        summary["fds_first_last"] = [fds[k], fds[-1]] if fds else None
        return fuzz_pool.finish(summary, t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fuzz_pool.add_options(ap, cases=20, case_timeout=180.0,
                          work_help="folder for the model (default: a temporary one)")
    ap.add_argument("--stop", action="store_true",
                    help="add the scenario of a server stopped mid-generation")
    a = ap.parse_args(argv)
    if a.child:
        run_child(a.work, a.seed, *fuzz_pool.child_range(a), a.stop)
        return 0

    def go(log):
        return run(a.cases, a.seed, a.case_timeout, a.work, log, a.stop)

    return fuzz_pool.run_main(a.log, go)


if __name__ == "__main__":
    sys.exit(main())
