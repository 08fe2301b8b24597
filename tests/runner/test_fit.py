"""Fitting a model to the devices' memory (``load_model(..., n_gpu_layers="auto")``, ggmlpy.runner.fit)
on loopback RPC servers that advertise, and hold to, small memory sizes (``ggmlpy rpc-server --mem``),
and the CPU: every layer placed within each device's budget, the placement equal to the best found by
trying every split, logits equal to the CPU's, and failures that leave nothing behind."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import free_port, rss_mib

from ggmlpy import _core
from ggmlpy._core import GGMLMemoryError, GGMLValueError
from ggmlpy.models import load_model
from ggmlpy.models import synthetic as syn
from ggmlpy.runner import Runner
from ggmlpy.runner.fit import _budgets, _Search, _tensor_bytes

pytestmark = [pytest.mark.rpc]

MIB = 2**20
#: 6 layers of ~1.3 MiB (F16) and a 2 MiB output layer
CFG = syn.SyntheticConfig("fit", 256, 6, 4, 4, 512, 4096, 512, "fit test model")
#: the runner the placement leaves room for (small graphs, so the layers decide)
RUNNER = {"n_ctx": 128, "n_batch": 32, "n_ubatch": 32, "type_k": "f32", "type_v": "f32"}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200]



def _start(mem_mib: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1", "--port",
                             str(port), "--threads", "1", "--mem", str(mem_mib)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("rpc-server --mem did not start")


@pytest.fixture(scope="module")
def servers():
    """Three servers: 5 MiB, 3.5 MiB and 1 MiB (that one holds no layer)."""
    procs = [_start(m) for m in (5, 3.5, 1)]
    yield [ep for _, ep in procs]
    for p, _ in procs:
        p.kill()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(syn.write_synthetic(tmp_path_factory.mktemp("fit") / "fit.gguf", CFG, "F16", seed=3))


def _opener(path):
    """What load_model gives the fit's search: the model opened on a placement, nothing read."""
    from ggmlpy.load import load_model

    return lambda placement: load_model(path, placement=placement, load=False)


def _fit(path, eps, **kw):
    return load_model(path, devices="auto", rpc=eps, n_gpu_layers="auto", margin=0, **{**RUNNER, **kw})


def _counts(model, names) -> tuple:
    return tuple(sum(d.name == n for d in model.placement.layers) + (model.placement.output.name == n)
                 for n in names)


def test_fits_every_layer_within_budgets_and_equals_cpu(model_path, servers):
    """A model that fits on no single server: every layer placed, each device within its budget (the
    memory report of a runner made with the same settings), the faster (first) server filled first, and
    the logits those of the CPU alone."""
    eps = servers[:2]
    with load_model(model_path, devices="cpu") as cpu_model, Runner(cpu_model, **RUNNER) as rt:
        ref = rt.decode(PROMPT, logits="all")
    with _fit(model_path, eps) as model:
        fit = model.fit
        devs = {d.endpoint: d for d in _core.devices() if d.endpoint in eps}
        a, b = devs[eps[0]], devs[eps[1]]
        counts = _counts(model, [a.name, b.name])
        assert counts[0] >= counts[1] >= 1          # both servers hold layers, the first one more
        assert sum(counts) < len(model.placement.layers) + 1      # and the CPU the rest (none fits all)
        # layers are contiguous, the CPU's first: CPU, then the second server, then the first
        order = [d.name for d in model.placement.layers]
        assert order == sorted(order, key=lambda n: {"CPU": 0, b.name: 1, a.name: 2}[n])
        with Runner(model) as rt:
            assert rt.n_ctx == RUNNER["n_ctx"]                     # the fitted context by default
            rep = rt.memory_report()
            for d in (a, b):
                assert 0 < rep.devices[d.name].self_total <= fit.budgets[d.name] <= 5 * MIB
            got = rt.decode(PROMPT, logits="all")
        assert any(s.ok and s.counts == counts for s in fit.steps)
        assert "placement search" in str(model.report) and "try 1" in str(model.report)
    # test_runner_rpc.py's bound: the CPU alone runs its own attention kernel, the split ggml's
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_equals_brute_force(model_path, servers):
    """The split chosen equals the best of every split, tried by allocation: the most units on the first
    server, then the most on the second (units: the last layer first, the output layer last)."""
    eps = servers[:2]
    with _fit(model_path, eps) as model:
        names = [d.name for d in (next(d for d in _core.devices() if d.endpoint == ep) for ep in eps)]
        chosen = _counts(model, names)
        n_tries = len(model.fit.steps)
    devs = [_core.device(n) for n in names] + [_core.device("CPU")]
    budgets = _budgets(devs, 0, None)
    from ggmlpy.gguf import GGUFReader

    with GGUFReader(model_path) as r:
        tb, _ = _tensor_bytes(r, CFG.n_layer)
    s = _Search(model_path, devs, CFG.n_layer, tb, budgets, _opener(model_path),
                {k: v for k, v in RUNNER.items() if k != "n_ctx"} | {"flash_attn": True})
    n_units = CFG.n_layer + 1
    feasible = []
    for c in itertools.product(range(n_units + 1), repeat=2):
        if sum(c) > n_units:
            continue
        m, step, _ = s.attempt(c, RUNNER["n_ctx"])
        if m is not None:
            m.close()
            feasible.append(c)
    assert max(feasible) == chosen
    assert n_tries <= 3                              # the search itself tried only a few


def test_nothing_fits_but_the_cpu(model_path, servers):
    """A server too small for any layer: everything on the CPU, no error."""
    with _fit(model_path, servers[2:]) as model:
        assert {d.name for d in model.placement.layers} == {"CPU"} and model.placement.output.name == "CPU"
        assert model.fit.steps[-1].ok


def test_nothing_fits_leaves_nothing_behind(model_path, servers):
    """A CPU cap that holds nothing either: GGMLMemoryError with the tries and the report; the servers' free
    memory and this process's RSS back where they were; the next model loads."""
    devs = [d for ep in servers[:2] for d in _core.rpc_add_server(ep)]
    before = [d.memory()[0] for d in devs]
    _fit(model_path, servers[:2]).close()          # warm: the first load's one-time costs
    rss0 = rss_mib()
    with pytest.raises(GGMLMemoryError) as ei:
        _fit(model_path, servers[:2], memory={"CPU": 1 * MIB})
    msg = str(ei.value)
    assert "no placement fits" in msg and "try 1" in msg and "CPU" in msg
    assert ei.value.report is not None and ei.value.report.devices["CPU"].self_total > 1 * MIB
    assert [d.memory()[0] for d in devs] == before
    assert rss_mib() - rss0 < 8
    with load_model(model_path, devices="cpu") as model, Runner(model, **RUNNER) as rt:
        assert rt.decode(PROMPT).shape == (1, CFG.n_vocab)


def test_auto_context(model_path, servers, tmp_path):
    """n_ctx="auto": from the training context (512) down, halved while the model does not fit wholly on
    the servers, not below the floor. Here no context gets the 11.5 MiB model onto 8.5 MiB of servers, and
    the smaller contexts gain no layer: the largest one is kept. A model that fits wholly at a smaller
    context gets the largest such context."""
    big = servers[:2]
    with _fit(model_path, big, n_ctx="auto", n_ctx_min=64) as model:
        ctxs = [s.n_ctx for s in model.fit.steps]
        assert ctxs[0] == CFG.n_ctx and set(ctxs) == {512, 256, 128, 64}
        by_ctx = {c: max(sum(s.counts) for s in model.fit.steps if s.ok and s.n_ctx == c) for c in set(ctxs)}
        assert model.fit.n_ctx == max(c for c, u in by_ctx.items() if u == max(by_ctx.values()))
        assert model.fit.steps[-1].ok and model.fit.steps[-1].n_ctx == model.fit.n_ctx
    with _fit(model_path, big, n_ctx="auto", n_ctx_min=512) as model:
        assert model.fit.n_ctx == 512 and {s.n_ctx for s in model.fit.steps} == {512}
    # 2 layers with a large cache per token: whole on the first server only at a small context
    small = syn.SyntheticConfig("fit2", 128, 2, 2, 2, 256, 512, 4096, "fit test model 2")
    path = str(syn.write_synthetic(tmp_path / "ctx.gguf", small, "F16", seed=4))
    with _fit(path, big[:1], n_ctx="auto", n_ctx_min=64, type_k="f32", type_v="f32") as model:
        fit = model.fit
        assert fit.steps[-1].counts == (3,)                     # both layers and the output on the server
        assert 64 <= fit.n_ctx < 4096
        assert not any(s.ok and s.counts == (3,) and s.n_ctx > fit.n_ctx for s in fit.steps)


def test_bad_arguments(model_path):
    with pytest.raises(GGMLValueError, match="n_gpu_layers"):
        load_model(model_path, n_gpu_layers="all", devices="cpu")
    with pytest.raises(GGMLValueError, match="n_ctx"):
        load_model(model_path, n_gpu_layers="auto", n_ctx="big", devices="cpu")
    with pytest.raises(GGMLValueError, match="load=False"):
        load_model(model_path, n_gpu_layers="auto", load=False, devices="cpu")
    with pytest.raises(GGMLValueError, match="margin"):
        load_model(model_path, n_gpu_layers="auto", margin=-1, devices="cpu")


def test_cpu_only_fit(model_path):
    """No accelerator: one try on the CPU, which fits; a cap below the model: a clear error."""
    with load_model(model_path, devices="cpu", n_gpu_layers="auto", **RUNNER) as model:
        assert len(model.fit.steps) == 1 and model.fit.steps[0].ok
        assert model.fit.steps[0].needs["CPU"] >= model.size
    with pytest.raises(GGMLMemoryError, match="no placement fits"):
        load_model(model_path, devices="cpu", n_gpu_layers="auto", memory={"CPU": 2 * MIB}, **RUNNER)


def test_bench_ngl_auto():
    """``ggmlpy bench -ngl auto`` (``-fit on``) loads through the placement search, shows ``auto`` in the
    ngl column and the search with ``-v``."""
    import json

    out = subprocess.run([sys.executable, "-m", "ggmlpy.cli", "bench", "--synthetic", "tiny", "-fit", "on", "-p", "16",
                          "-n", "0", "-r", "1", "-o", "json", "-v"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["n_gpu_layers"] for r in rows] == [-2]
    assert "placement search" in out.stderr and "ok: fits" in out.stderr
    md = subprocess.run([sys.executable, "-m", "ggmlpy.cli", "bench", "--synthetic", "tiny", "-ngl", "auto,0",
                         "-p", "16", "-n", "0", "-r", "1"], capture_output=True, text=True, timeout=300)
    assert md.returncode == 0, md.stderr
    cells = [[c.strip() for c in line.split("|")] for line in md.stdout.splitlines() if "pp16" in line]
    assert [row[5] for row in cells] == ["auto", "0"]


def test_tensor_split_and_split_mode_none(model_path, servers, capsys):
    """``load_model(tensor_split=)`` divides the offloaded layers among the accelerators in the given
    proportions (llama.cpp's ``-ts``); the bench's ``-ts``, ``-sm none`` and ``-mg`` place the same way
    and say so in their records."""
    import json

    from ggmlpy import cli
    from ggmlpy.backend import choose_devices

    eps = servers[:2]
    a, b = [d.name for d in choose_devices("auto", rpc=eps)][:2]
    with load_model(model_path, devices="auto", rpc=eps, n_gpu_layers=4, tensor_split=[3, 1]) as m:
        assert [d.name for d in m.placement.layers] == ["CPU", "CPU", a, a, a, b]
    with load_model(model_path, devices="auto", rpc=eps, n_gpu_layers=4, tensor_split=[1, 1]) as m:
        assert [d.name for d in m.placement.layers] == ["CPU", "CPU", a, a, b, b]
    with pytest.raises(GGMLValueError, match="need 2 non-negative proportions"):
        load_model(model_path, devices="auto", rpc=eps, n_gpu_layers=4, tensor_split=[1, 1, 1])
    with pytest.raises(GGMLValueError, match="tensor_split and n_gpu_layers='auto'"):
        load_model(model_path, devices="auto", rpc=eps, n_gpu_layers="auto", tensor_split=[1, 1])

    argv = ["bench", "-m", model_path, "-rpc", ",".join(eps), "-ngl", "2", "-p", "8", "-n", "0", "-r", "1",
            "-o", "json", "--no-warmup"]
    assert cli.main([*argv, "-ts", "1/3", "-sm", "layer"]) == 0
    assert cli.main([*argv, "-sm", "none", "-mg", "1"]) == 0
    assert cli.main([*argv, "-sm", "none", "-mg", "2"]) != 0            # two accelerators: 0 and 1
    out = capsys.readouterr()
    rows = [r for chunk in out.out.split("\n]") if chunk.strip() for r in json.loads(chunk + "\n]")]
    assert [(r["split_mode"], r["main_gpu"], r["tensor_split"], r["backends"]) for r in rows] == \
        [("layer", 0, "1.00/3.00", "RPC"), ("none", 1, "0.00", "RPC")]
    assert "-mg 2: there are 2 accelerators" in out.err


def test_fit_leaves_room_for_what_overrides_keep_elsewhere(model_path, servers):
    """With the feed-forward weights kept on the CPU (``tensor_overrides="ffn_=CPU"``, llama.cpp's -ot),
    a layer's weights on the server are 0.5 MiB instead of 1.25: the search counts only what moves with
    a layer (its first candidate already offers more layers than without the override), so the 5 MiB
    server ends with more layers (4 of 6 against 2), within its budget, and the overridden weights are
    in the CPU's report. The logits are the CPU's."""
    ep = servers[:1]
    with load_model(model_path, devices="cpu") as cpu_model, Runner(cpu_model, **RUNNER) as rt:
        ref = rt.decode(PROMPT, logits="all")
    with _fit(model_path, ep) as plain:
        name = next(d.name for d in plain.placement.devices() if d.type != "CPU")
        (before,) = _counts(plain, [name])
        first = plain.fit.steps[0].counts
    with _fit(model_path, ep, tensor_overrides="ffn_=CPU") as model:
        (after,) = _counts(model, [name])
        assert after > before, (before, after)
        assert model.fit.steps[0].counts > first, (model.fit.steps[0].counts, first)
        assert model.fit.steps[-1].ok and "ffn_=CPU" in model.fit.placement.summary()
        on_server = {i for i, d in enumerate(model.placement.layers) if d.name == name}
        ffn = {n: t.nbytes for n, (t, g) in model.weights.tensors.items() if "ffn_" in n}
        assert set(model.weights.overridden) == {n for n in ffn if int(n.split(".")[1]) in on_server}
        with Runner(model) as rt:
            rep = rt.memory_report()
            assert rep.devices[name].self_total <= model.fit.budgets[name]
            assert sum(rep.devices["CPU"].weights[i] for i in on_server) == \
                sum(v for n, v in ffn.items() if int(n.split(".")[1]) in on_server)
            got = rt.decode(PROMPT, logits="all")
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
