"""backend.py: device choice, layer split, weights placement and loading, worst-case reservation,
the memory report (every number equals the ggml buffer size it describes), and RPC splits."""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest
from test_core_backend import rpc_server  # noqa: F401  (the loopback server fixture)

import ggmlpy as gp
from ggmlpy import _core
from ggmlpy import backend as bk
from ggmlpy.memory import HUGE_PAGES_MIN, advise_huge_pages

N_EMBD, N_LAYERS = 32, 3


def _model(placement, rng, types=(gp.Type.F32, gp.Type.Q8_0)):
    """A tiny MLP stack: per layer an up and a down matrix, plus an output head."""
    w = bk.Weights(placement, max_tensors=16)
    for i in range(N_LAYERS):
        w.add(f"blk.{i}.up", types[i % len(types)], (N_EMBD, 2 * N_EMBD), i)
        w.add(f"blk.{i}.down", gp.Type.F32, (2 * N_EMBD, N_EMBD), i)
    w.add("output", gp.Type.F32, (N_EMBD, 8), "output")
    data = {name: (rng.standard_normal(tuple(reversed(t.ne[:2]))) / 6).astype(np.float32)
            for name, (t, _) in w.tensors.items()}
    return w, data


def _forward(weights, n_tokens):
    ctx = gp.Context.for_tensors(64, graph_size=256, no_alloc=True)
    x = ctx.new_tensor(gp.Type.F32, (N_EMBD, n_tokens), name="x").set_input()
    h = x
    for i in range(N_LAYERS):
        h = ctx.add(h, ctx.mul_mat(weights[f"blk.{i}.down"], ctx.relu(ctx.mul_mat(weights[f"blk.{i}.up"], h))))
    y = ctx.mul_mat(weights["output"], h).set_output()
    gf = ctx.new_graph(256)
    gf.build_forward_expand(y)
    return ctx, x, y, gf


def _reference(weights, data, X):
    h = X
    for i in range(N_LAYERS):
        up = weights[f"blk.{i}.up"].get()             # dequantized as stored
        h = h + np.maximum(h @ up.T, 0) @ data[f"blk.{i}.down"].T
    return h @ data["output"].T


def test_choose_devices_and_split():
    devs = bk.choose_devices("auto")
    assert devs[-1].type == "CPU"
    assert bk.choose_devices("cpu") == [_core.device("CPU")]
    with pytest.raises(gp.BackendUnavailable):
        bk.choose_devices(["NPU7"])
    p = bk.split_layers(4, devs)
    assert p.n_layers == 4 and p.input.type == "CPU"
    if len(devs) == 1:                                  # no accelerator here: everything on the CPU
        assert all(d.type == "CPU" for d in p.layers)
    else:                                               # (a device build: test_device.py's suite)
        assert all(d == devs[0] for d in p.layers)


def test_weights_report_matches_buffers_and_loads_with_progress():
    rng = np.random.default_rng(0)
    placement = bk.split_layers(N_LAYERS, bk.choose_devices("cpu"))
    w, data = _model(placement, rng)
    report = w.allocate()
    cpu = report.devices["CPU"]
    assert cpu.weights_ok is True
    # Every figure equals the buffer ggml allocated.
    assert cpu.weights_total == sum(b.size for b in w.buffers.values())
    assert set(cpu.weights) == {0, 1, 2, "output"}
    assert cpu.weights[0] >= w["blk.0.up"].nbytes + w["blk.0.down"].nbytes
    seen = []
    w.load(lambda name: data[name], progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == sum(t.nbytes for t, _ in w.tensors.values())
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    np.testing.assert_array_equal(w["output"].get(), data["output"])
    text = str(report)
    assert "memory breakdown" in text and "CPU" in text
    d = json.loads(report.to_json())
    assert d["devices"]["CPU"]["weights_total"] == cpu.weights_total
    assert d["devices"]["CPU"]["unaccounted"] == cpu.total - cpu.free - cpu.self_total
    assert "output" in report.layer_table()
    w.close()


def test_progress_bar():
    import io

    out = io.StringIO()
    bar = bk.ProgressBar("loading", width=10, stream=out)
    for done in range(0, 101, 5):
        bar(done * 2**20, 100 * 2**20)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11                          # every 10% on a non-terminal stream
    assert lines[-1].startswith("loading [##########] 100%") and lines[-1].endswith("100.0/100.0 MiB")
    assert lines[5].startswith("loading [#####.....]  50%")


def test_reserve_then_computes_never_allocate(caplog):
    rng = np.random.default_rng(1)
    placement = bk.split_layers(N_LAYERS, bk.choose_devices("cpu"))
    w, data = _model(placement, rng, types=(gp.Type.F32,))   # exact reference (q8_0 would quantize activations)
    report = w.allocate()
    w.load(lambda name: data[name])
    rt = bk.Runtime(placement.devices(), n_threads=2, graph_size=1024, report=report)
    with caplog.at_level(logging.INFO, logger="ggmlpy"):
        sizes = rt.reserve(lambda n: _forward(w, n)[3], n_prompt=64)
    assert "graph nodes/splits" in caplog.text
    assert sizes["CPU"] > 0 and report.devices["CPU"].graph == sizes["CPU"] == rt.sched.buffer_size(rt.backends[-1])
    for n in (1, 17, 64, 2, 33, 1, 64):
        ctx, x, y, gf = _forward(w, n)
        X = rng.standard_normal((n, N_EMBD)).astype(np.float32)
        rt.sched.alloc_graph(gf)
        x.set(X)
        rt.compute(gf)
        np.testing.assert_allclose(y.get().reshape(n, 8), _reference(w, data, X), rtol=2e-4, atol=2e-4)
    assert rt.reallocations == 0 and rt.buffer_sizes() == sizes
    rt.close()
    w.close()


def test_growth_past_the_reservation_is_counted_once_per_allocation(caplog):
    # a graph larger than the reservation grows the compute buffers when it is allocated (through run, or
    # compute on a graph not allocated): counted and logged; the same graph computed again is not
    rng = np.random.default_rng(2)
    placement = bk.split_layers(N_LAYERS, bk.choose_devices("cpu"))
    w, data = _model(placement, rng, types=(gp.Type.F32,))
    w.allocate()
    w.load(lambda name: data[name])
    rt = bk.Runtime(placement.devices(), n_threads=1, graph_size=1024)
    try:
        small = rt.reserve(lambda n: _forward(w, n)[3], n_prompt=2)
        ctx, x, y, gf = _forward(w, 256)
        X = rng.standard_normal((256, N_EMBD)).astype(np.float32)
        with caplog.at_level(logging.WARNING, logger="ggmlpy"):
            rt.run(gf, lambda: x.set(X))
        assert rt.reallocations == 1 and "grew past the reservation" in caplog.text
        assert rt.buffer_sizes()["CPU"] > small["CPU"] and rt.reserved == rt.buffer_sizes()
        rt.run(gf, lambda: x.set(X))       # in its allocation: inputs set again, nothing grows
        np.testing.assert_allclose(y.get().reshape(256, 8), _reference(w, data, X), rtol=2e-4, atol=2e-4)
        rt.compute(gf)
        assert rt.reallocations == 1
        gf2 = _forward(w, 512)[3]
        rt.compute(gf2)                    # not allocated: the scheduler allocates it, larger again
        assert rt.reallocations == 2
    finally:
        rt.close()
        w.close()


def test_too_much_memory_raises_with_report_and_the_process_goes_on():
    placement = bk.split_layers(1, bk.choose_devices("cpu"))
    w = bk.Weights(placement, max_tensors=4)
    w.add("huge", gp.Type.F32, (1 << 20, 1 << 20), 0)         # 4 TiB
    with pytest.raises(MemoryError) as ei:
        w.allocate()
    err = ei.value
    assert isinstance(err, gp.GGMLMemoryError) and err.report is not None
    cpu = err.report.devices["CPU"]
    assert cpu.weights_ok is False and cpu.weights_total >= 4 << 40     # what it needed
    assert "FAILED" in str(err)
    # The next request works.
    rng = np.random.default_rng(2)
    w2, data = _model(bk.split_layers(N_LAYERS, bk.choose_devices("cpu")), rng)
    w2.allocate()
    w2.load(lambda name: data[name])
    assert w2.report.devices["CPU"].weights_ok
    w2.close()


@pytest.mark.rpc
def test_rpc_and_cpu_split_matches_cpu_alone(rpc_server):  # noqa: F811
    rng = np.random.default_rng(3)
    # the server and the CPU (a device build lists its own device too: not this test's)
    devs = [d for d in bk.choose_devices("auto", rpc=[rpc_server]) if d.type == "CPU" or d.endpoint == rpc_server]
    assert devs[0].type == "GPU" and devs[0].endpoint == rpc_server
    placement = bk.split_layers(N_LAYERS, devs, n_gpu_layers=2)        # layers 1, 2 on the server
    assert [d.type for d in placement.layers] == ["CPU", "GPU", "GPU"]
    w, data = _model(placement, rng)
    report = w.allocate()
    assert report.devices[devs[0].name].weights_total == w.buffers[(devs[0].name, devs[0].buffer_type().name)].size
    w.load(lambda name: data[name])
    rt = bk.Runtime(placement.devices(), n_threads=1, graph_size=1024, report=report)
    rt.reserve(lambda n: _forward(w, n)[3], n_prompt=16)
    assert rt.stats["pp"][1] >= 2                      # split across the two backends
    # The same weights on the CPU alone.
    cpu_only = bk.split_layers(N_LAYERS, bk.choose_devices("cpu"))
    wc = bk.Weights(cpu_only, max_tensors=16)
    for name, (t, grp) in w.tensors.items():
        wc.add(name, t.type, t.ne[:2], grp)
    wc.allocate()
    wc.load(lambda name: data[name])
    rc = bk.Runtime(cpu_only.devices(), n_threads=1, graph_size=1024)
    for n in (16, 1, 5):
        X = rng.standard_normal((n, N_EMBD)).astype(np.float32)
        outs = []
        for weights, r in ((w, rt), (wc, rc)):
            ctx, x, y, gf = _forward(weights, n)
            r.sched.alloc_graph(gf)
            x.set(X)
            r.compute(gf)
            outs.append(y.get())
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert rt.reallocations == 0
    rt.close()
    rc.close()


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "none"


def _thp_eligible(addr: int) -> bool:
    """Whether the mapping holding ``addr`` may take transparent huge pages (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
@pytest.mark.parametrize("env, advised", [(None, True), ("0", False)])
def test_weights_of_32_mib_and_more_take_huge_pages(monkeypatch, env, advised):
    """A weight buffer of at least HUGE_PAGES_MIN is advised to take huge pages before it is filled (unless
    GGMLPY_HUGE_PAGES=0), a smaller one never; the values read back are the values loaded."""
    if env is None:
        monkeypatch.delenv("GGMLPY_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("GGMLPY_HUGE_PAGES", env)
    placement = bk.split_layers(1, bk.choose_devices("cpu"))
    rows = HUGE_PAGES_MIN // (4 * 1024) + 64
    big = bk.Weights(placement, max_tensors=2)
    big.add("blk.0.w", gp.Type.F32, (1024, rows), 0)
    small = bk.Weights(placement, max_tensors=2)
    small.add("blk.0.w", gp.Type.F32, (1024, 16), 0)
    data = np.random.default_rng(3).standard_normal((rows, 1024), dtype=np.float32)
    try:
        for w, n in ((big, rows), (small, 16)):
            w.allocate()
            w.load(lambda name, n=n: data[:n])
        t = big["blk.0.w"]
        assert [b.size >= HUGE_PAGES_MIN for b in big.buffers.values()] == [True]
        if _thp_mode() == "madvise":
            assert _thp_eligible(t.data_ptr + t.nbytes // 2) is advised
            assert _thp_eligible(small["blk.0.w"].data_ptr) is False
        np.testing.assert_array_equal(t.get(), data)
        np.testing.assert_array_equal(small["blk.0.w"].get(), data[:16])
    finally:
        big.close()
        small.close()


def test_huge_pages_are_advised_for_cpu_buffers_only(rpc_server):  # noqa: F811
    # a buffer on the CPU device takes the advice (where the system has it); one on an RPC server's device
    # is another process's memory and is refused (its address means nothing here); a freed one raises
    buf = _core.device("CPU").buffer_type().alloc_buffer(1 << 20)
    try:
        assert buf.advise_huge_pages() is (_thp_mode() != "none" and sys.platform.startswith("linux"))
    finally:
        buf.free()
    with pytest.raises(gp.ClosedError):
        buf.advise_huge_pages()
    remote = next(d for d in bk.choose_devices("auto", rpc=[rpc_server]) if d.endpoint == rpc_server)
    rbuf = remote.buffer_type().alloc_buffer(HUGE_PAGES_MIN)
    try:
        assert rbuf.advise_huge_pages() is False
        assert advise_huge_pages(rbuf) is False
    finally:
        rbuf.free()
