"""``load_model(..., n_gpu_layers="auto")`` and the runner over loopback RPC servers that are tiny, have
odd or mismatched budgets, die during the fit, or die or stall while requests generate.

Each scenario is one bounded case of tests/rpc_fit_fuzz.py (its checks: the fit loads or names the dead
server; every request ends, finished or with a ``RunnerError`` naming the endpoint; nothing of the
client stays on a surviving server; no runner thread or request is left; a CPU model loads afterwards);
a random sample of it runs with the slow tests (``GGMLPY_RPC_FIT_FUZZ_CASES`` sets its size; the long
run is ``python tests/rpc_fit_fuzz.py --cases 200``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import rpc_fit_fuzz as fz
from helpers import rss_mib

import ggmlpy
from ggmlpy import _core
from ggmlpy.runner import Runner

pytestmark = [pytest.mark.rpc]

MIB = fz.MIB


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return fz.make_model(str(tmp_path_factory.mktemp("rpcfit")))


@pytest.fixture(scope="module")
def one_layer(model_path):
    """Bytes the model's last layer needs on a server (weights, cache, graph) with the fuzzer's runner."""
    return fz.one_layer_need(model_path)


@pytest.fixture
def short_timeout():
    before = ggmlpy.rpc_get_timeout()
    ggmlpy.rpc_set_timeout(fz.RPC_TIMEOUT)
    yield
    ggmlpy.rpc_set_timeout(before)


def _case(**kw) -> dict:
    return {"i": 0, "mems": [5, 3.5], "scenario": "none", "victim": 0, "delay": 0.0, "n_requests": 2,
            "max_tokens": 8, **kw}


def _check(model_path, case) -> dict:
    res = fz.run_case(model_path, case)
    assert not res["problems"], res
    return res


def _units(model, endpoint) -> int:
    names = {d.name for d in _core.devices() if d.endpoint == endpoint}
    return sum(d.name in names for d in model.placement.layers) + (model.placement.output.name in names)


@pytest.mark.parametrize("budget,units", [(0.001, 0), ("one-", 0), ("one", 1)])
def test_tiny_and_one_layer_budgets(model_path, one_layer, budget, units):
    """A budget of 1 KiB or one byte short of a layer holds nothing (the CPU takes it all, no error);
    exactly what one layer needs holds that layer; the device stays within it."""
    mib = {"one-": (one_layer - 1) / MIB, "one": one_layer / MIB, "one+": (one_layer + 1) / MIB}.get(budget, budget)
    procs = fz.start_servers([mib])
    try:
        with fz.fit(model_path, [procs[0][1]]) as model:
            assert _units(model, procs[0][1]) == units, model.fit
            name = next(d.name for d in _core.devices() if d.endpoint == procs[0][1])
            with Runner(model) as rt:
                used = rt.memory_report().devices.get(name)
                assert used is None or used.self_total <= model.fit.budgets[name] <= mib * MIB
                assert len(rt.generate([1, 2, 3], max_tokens=4, temperature=0).tokens) == 4
    finally:
        fz.stop_servers(procs)


@pytest.mark.parametrize("mems", [[0.001, 5], ["one+", 1, "one-"]])
def test_mismatched_budgets(model_path, one_layer, mems):
    """Servers of very different sizes, in either order: each holds what fits (the tiny ones nothing),
    every request is served, and each server's memory is free again after close."""
    one = one_layer / MIB
    mems = [{"one-": one - 1 / MIB, "one+": one + 1 / MIB}.get(m, m) for m in mems]
    _check(model_path, _case(mems=mems))


@pytest.mark.parametrize("victim,delay", [(0, 0.0), (1, 0.04), (0, 0.12)])
def test_server_killed_during_the_fit(model_path, short_timeout, victim, delay):
    """A server SIGKILLed at a moment of the fit (a try's allocation, the weights' load, or just after):
    load_model raises an error naming it (or loads, if the kill came after), the other server keeps
    nothing, and the process goes on (a CPU model loads)."""
    _check(model_path, _case(scenario="kill-fit", victim=victim, delay=delay, n_requests=2, max_tokens=8))


@pytest.mark.parametrize("victim,delay", [(0, 0.0), (1, 0.1)])
def test_server_killed_mid_generation_ends_every_request(model_path, short_timeout, victim, delay):
    """Two requests generating on layers split over two servers; one server is killed: every request
    ends with a RunnerError naming its endpoint, a later request too, no request or thread is left."""
    res = _check(model_path, _case(scenario="kill-generate", victim=victim, delay=delay, max_tokens=100))
    assert res["harmed"] and "error" in res["requests"], res


STOPPED = r"""
import json, sys
import ggmlpy
import rpc_fit_fuzz as fz
ggmlpy.rpc_set_timeout(fz.RPC_TIMEOUT)
case = {"i": 0, "mems": [16], "scenario": "stop-generate", "victim": 0, "delay": 0.02, "n_requests": 1,
        "max_tokens": 40}
print(json.dumps(fz.run_case(sys.argv[1], case)))
"""


def test_server_stopped_mid_generation_times_out(model_path):
    """A server that stops answering (SIGSTOP; a hung host) but whose kernel still accepts connections:
    the request ends about one RPC timeout after the stop with an error naming it, and a later request
    at once (the client backs off the server instead of reconnecting for each call, vendor/ggml patch
    0001). In a child, bounded: before that back-off it took many minutes."""
    try:
        out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", STOPPED, model_path], capture_output=True,
                             text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        pytest.fail("the request on the stopped server did not end within 60 s")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.splitlines()[-1])
    assert not res["problems"] and "error" in res["requests"], res


def test_repeated_deaths_leave_the_client_flat(model_path, short_timeout):
    """Fits and generations whose server dies, over and over: the client's RSS, open files and threads
    stay where they were, and a fit on new servers then works."""
    def one(k):
        _check(model_path, _case(scenario="kill-generate" if k % 2 else "kill-fit", victim=k % 2,
                                 delay=0.03 * (k % 4), max_tokens=40))
    one(0)
    one(1)                                  # warm: one-time costs of both paths
    rss0, fds0, threads0 = rss_mib(), len(os.listdir("/proc/self/fd")), threading.active_count()
    for k in range(2, 6):
        one(k)
    assert rss_mib() - rss0 < 8, (rss0, rss_mib())
    assert len(os.listdir("/proc/self/fd")) <= fds0 and threading.active_count() <= threads0
    _check(model_path, _case())


@pytest.mark.slow
@pytest.mark.fuzz
def test_random_sample(tmp_path):
    """A sample of tests/rpc_fit_fuzz.py: random budgets, scenarios, victims and moments, in a child."""
    n = int(os.environ.get("GGMLPY_RPC_FIT_FUZZ_CASES", "4"))
    s = fz.run(n, seed=5, case_timeout=120.0, work=str(tmp_path))
    assert s["cases"] == n and not s["failures"], s["failures"]
    assert s["aborts"] == s["hangs"] == 0, s
