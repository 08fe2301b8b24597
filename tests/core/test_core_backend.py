"""The ggml-backend layer of _core: devices, backends, buffers, the graph allocator,
the scheduler (CPU and CPU + an RPC server on loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from helpers import free_port, sched_model

import ggmlpy as gp
from ggmlpy import _core as c


def _graph(ctx, out, size=64):
    gf = ctx.new_graph(size)
    gf.build_forward_expand(out)
    return gf


def test_devices_and_cpu_backend():
    devs = c.devices()
    assert devs[-1].type == "CPU" and c.device("cpu") == devs[-1]
    free_b, total_b = devs[-1].memory()
    assert 0 < free_b <= total_b
    be = c.backend_init("CPU")
    assert be.is_cpu and be.device.name == "CPU" and be.buffer_type.is_host
    be.set_n_threads(2)
    with pytest.raises(gp.GGMLValueError, match="n_threads"):
        be.set_n_threads(0)
    if not any(d.name == "CUDA0" for d in devs):
        # the message differs between a CPU-only and a CUDA build: tests/device/test_cuda.py checks both
        with pytest.raises(gp.BackendUnavailable, match="CUDA0: "):
            c.device("CUDA0")


def test_buffers_and_ctx_allocation():
    be = c.backend_init("CPU")
    buf = be.alloc_buffer(1024)
    assert buf.size == 1024 and buf.is_host and buf.usage == c.BufferUsage.ANY
    buf.usage = c.BufferUsage.WEIGHTS
    assert buf.usage == c.BufferUsage.WEIGHTS
    buf.clear(7)
    buf.free()
    with pytest.raises(gp.ClosedError):
        _ = buf.name
    with pytest.raises(MemoryError, match="could not allocate"):
        be.alloc_buffer(1 << 62)
    ctx = gp.Context.for_tensors(4, no_alloc=True)
    a = ctx.new_tensor(gp.Type.F32, (10, 3))
    b = ctx.new_tensor(gp.Type.F16, (7,))
    wbuf = c.alloc_ctx_tensors(ctx, be)
    assert wbuf.size >= a.nbytes + b.nbytes
    a.set(np.arange(30, dtype=np.float32).reshape(3, 10))
    b.set(np.ones(7, np.float16))
    assert a.get()[2, 9] == 29.0 and b.get().sum() == 7.0
    with pytest.raises(gp.GGMLValueError, match="still hold tensors"):
        wbuf.free()
    with pytest.raises(gp.GGMLValueError, match="no_alloc"):
        c.alloc_ctx_tensors(gp.Context(1 << 16), be)
    with pytest.raises(gp.GGMLValueError, match="nothing|no tensors"):
        c.alloc_ctx_tensors(ctx, be)          # everything already has memory


def test_huge_context_allocation_is_memoryerror_and_recoverable():
    be = c.backend_init("CPU")
    ctx = gp.Context.for_tensors(2, no_alloc=True)
    ctx.new_tensor(gp.Type.F32, (1 << 40,))
    with pytest.raises(MemoryError):
        c.alloc_ctx_tensors(ctx, be)
    ok = gp.Context.for_tensors(2, no_alloc=True)
    t = ok.new_tensor(gp.Type.F32, (4,))
    c.alloc_ctx_tensors(ok, be)
    t.set(np.ones(4, np.float32))
    assert t.get().sum() == 4.0


def test_gallocr_and_backend_compute():
    be = c.backend_init("CPU")
    wctx = gp.Context.for_tensors(2, no_alloc=True)
    w = wctx.new_tensor(gp.Type.F32, (4, 3))
    c.alloc_ctx_tensors(wctx, be)
    W = np.arange(12, dtype=np.float32).reshape(3, 4)
    w.set(W)
    ctx = gp.Context.for_tensors(8, graph_size=64, no_alloc=True)
    x = ctx.new_tensor(gp.Type.F32, (4, 2)).set_input()
    y = ctx.mul_mat(w, x).set_output()
    gf = _graph(ctx, y)
    with pytest.raises(gp.GGMLValueError, match="no backend memory"):
        be.graph_compute(gf)
    ga = c.Gallocr(be.buffer_type)
    ga.reserve(gf)
    ga.alloc_graph(gf)
    assert ga.buffer_size > 0
    X = np.ones((2, 4), np.float32)
    x.set(X)
    be.graph_compute(gf)
    np.testing.assert_allclose(y.get(), X @ W.T)


def _n_os_threads():
    import os

    return len(os.listdir("/proc/self/task"))


def _openmp() -> bool:
    # with OpenMP, ggml's pool starts no threads of its own (OpenMP's team does the work)
    with open("/proc/self/maps") as f:
        return "libgomp" in f.read()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="counts threads in /proc")
def test_cpu_threadpool_computes_the_same_and_gives_its_threads_back():
    rng = np.random.default_rng(5)
    be = c.backend_init("CPU")
    wctx = gp.Context.for_tensors(2, no_alloc=True)
    w = wctx.new_tensor(gp.Type.F32, (64, 48))
    c.alloc_ctx_tensors(wctx, be)
    W = rng.standard_normal((48, 64)).astype(np.float32)
    w.set(W)
    ctx = gp.Context.for_tensors(8, graph_size=64, no_alloc=True)
    x = ctx.new_tensor(gp.Type.F32, (64, 5)).set_input()
    y = ctx.mul_mat(w, x).set_output()
    gf = _graph(ctx, y)
    ga = c.Gallocr(be.buffer_type)
    ga.alloc_graph(gf)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    x.set(X)
    before = _n_os_threads()
    assert be.threadpool_threads == 0
    be.set_threadpool(3, poll=0)
    assert be.threadpool_threads == 3
    omp = _openmp()             # OpenMP's team computes instead of the pool's workers: no counts to check
    assert omp or _n_os_threads() == before + 2          # the pool's workers (the caller is the third)
    for _ in range(3):
        be.graph_compute(gf)
        np.testing.assert_allclose(y.get(), X @ W.T, rtol=1e-5, atol=1e-5)
    be.set_n_threads(2)                            # a pool has a fixed size: it is remade
    assert be.threadpool_threads == 2 and (omp or _n_os_threads() == before + 1)
    be.graph_compute(gf)
    np.testing.assert_allclose(y.get(), X @ W.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(gp.GGMLValueError, match="poll"):
        be.set_threadpool(2, poll=101)
    be.set_threadpool(0)
    assert be.threadpool_threads == 0 and (omp or _n_os_threads() == before)
    be.set_threadpool(2)
    be.free()                                      # the pool goes with the backend
    assert omp or _n_os_threads() == before


def test_scheduler_cpu_reserve_then_never_allocates():
    rng = np.random.default_rng(3)
    cpu = c.backend_init("CPU")
    keep, build, ref = sched_model([cpu, cpu], rng)
    s = c.Scheduler([cpu], graph_size=256)
    worst = build(64)
    s.reserve(worst[3])
    size = s.buffer_size(cpu)
    assert size > 0
    for n in (1, 7, 64, 3, 32, 1):
        ctx, x, y, gf = build(n)
        X = rng.standard_normal((n, 16)).astype(np.float32)
        s.alloc_graph(gf)
        x.set(X)
        s.compute(gf)
        np.testing.assert_allclose(y.get().reshape(n, 16), ref(X), rtol=1e-5, atol=1e-5)
        assert s.buffer_size(cpu) == size          # within the reservation: no reallocation
    # The reservation graph itself is still intact and computes correctly.
    ctx, x, y, gf = worst
    X = rng.standard_normal((64, 16)).astype(np.float32)
    s.alloc_graph(gf)
    x.set(X)
    s.compute(gf)
    np.testing.assert_allclose(y.get().reshape(64, 16), ref(X), rtol=1e-5, atol=1e-5)


def test_scheduler_rules():
    cpu = c.backend_init("CPU")
    with pytest.raises(gp.GGMLValueError, match="1 to 16"):
        c.Scheduler([])
    with pytest.raises(gp.GGMLValueError, match="distinct"):
        c.Scheduler([cpu, cpu])
    s = c.Scheduler([cpu], graph_size=16)
    ctx = gp.Context(1 << 20)                        # host tensors, not backend buffers
    y = ctx.scale(ctx.from_numpy(np.ones(4, np.float32)), 2.0)
    with pytest.raises(gp.GGMLValueError, match="backend buffers"):
        s.compute(_graph(ctx, y))
    nctx = gp.Context.for_tensors(64, graph_size=64, no_alloc=True)
    x = nctx.new_tensor(gp.Type.F32, (4,))
    for _ in range(10):
        x = nctx.scale(x, 1.0)
    with pytest.raises(MemoryError, match="graph_size"):
        s.reserve(_graph(nctx, x))



@pytest.fixture(scope="module")
def rpc_server():
    port = free_port()
    # its output goes to a file: a pipe nobody reads fills up (64 KiB of per-connection lines over the
    # architectures test_arch_rpc runs) and the server then blocks in a write, its next handshake timing out
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1",
                             "--port", str(port), "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("rpc-server did not start")
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=10)
    log.close()


@pytest.mark.rpc
def test_rpc_split_matches_cpu(rpc_server):
    devs = c.rpc_add_server(rpc_server)
    assert devs and devs[0].endpoint == rpc_server and devs[0] in c.devices()
    assert c.rpc_add_server(rpc_server.replace("127.0.0.1", "localhost")) == devs   # one connection per server
    rpc = devs[0].init()
    cpu = c.backend_init("CPU")
    rng = np.random.default_rng(5)
    keep, build, ref = sched_model([rpc, cpu], rng)     # first layer's weights on the server
    s = c.Scheduler([rpc, cpu], graph_size=256)
    s.reserve(build(8)[3])
    for n in (8, 1, 5):
        ctx, x, y, gf = build(n)
        X = rng.standard_normal((n, 16)).astype(np.float32)
        s.alloc_graph(gf)
        x.set(X)
        s.compute(gf)
        assert s.n_splits >= 1
        np.testing.assert_allclose(y.get().reshape(n, 16), ref(X), rtol=1e-5, atol=1e-5)
    # Reading and writing tensors in server memory goes through the backend API.
    w = keep[0][0]
    m = rng.standard_normal((16, 16)).astype(np.float32)
    w.set(m)
    np.testing.assert_array_equal(w.get(), m)
    with pytest.raises(gp.GGMLValueError):
        w.numpy()                                        # no zero-copy view of remote memory


def test_rpc_bad_endpoints():
    with pytest.raises(gp.GGMLValueError, match="host:port"):
        c.rpc_add_server("nonsense")
    with pytest.raises(ConnectionError):
        c.rpc_add_server(f"127.0.0.1:{free_port()}", timeout=1.0)


def test_rpc_server_refuses_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "in use" in out.stderr.lower()


DEAD_SERVER_SCRIPT = r"""
import gc, socket, subprocess, sys, time
import numpy as np
import ggmlpy as gp
from ggmlpy import _core as c
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--port", str(port), "-t", "1"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(300):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close(); break
    except OSError:
        time.sleep(0.1)
dev = c.rpc_add_server(f"127.0.0.1:{port}")[0]
be = dev.init(); cpu = c.backend_init("CPU")
wctx = gp.Context.for_tensors(2, no_alloc=True)
w = wctx.new_tensor(gp.Type.F32, (16, 16))
buf = c.alloc_ctx_tensors(wctx, be); buf.usage = c.BufferUsage.WEIGHTS
w.set(np.ones((16, 16), np.float32)); buf.clear(0)
ctx = gp.Context.for_tensors(16, graph_size=64, no_alloc=True)
x = ctx.new_tensor(gp.Type.F32, (16, 2)).set_input()
y = ctx.mul_mat(w, x).set_output()
gf = ctx.new_graph(64); gf.build_forward_expand(y)
s = c.Scheduler([be, cpu], graph_size=256); s.reserve(gf); s.alloc_graph(gf)
x.set(np.ones((2, 16), np.float32)); s.compute(gf)
proc.kill(); proc.wait(); time.sleep(0.2)
del s, gf, y, x, ctx, w, wctx, buf, be
gc.collect()
print("survived")
"""


@pytest.mark.rpc
def test_dropping_memory_of_a_dead_rpc_server_does_not_abort():
    # Without the liveness check ggml's RPC client aborts here while freeing
    # the scheduler's buffers (checked by disabling it).
    out = subprocess.run([sys.executable, "-c", DEAD_SERVER_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "survived" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.rpc
@pytest.mark.parametrize("type_", [gp.Type.Q8_0, gp.Type.BF16, gp.Type.F32])
def test_get_bytes_reads_what_set_bytes_wrote_host_and_remote(rpc_server, type_):
    """get_bytes is set_bytes' counterpart: the stored bytes of any type (no conversion), from any offset, on
    the host and on an RPC device; a range past the end is refused."""
    row = type_.row_size(64)
    raw = np.random.default_rng(5).integers(0, 256, 4 * row, dtype=np.uint8)     # any bytes: stored as given
    host = gp.Context(1 << 20).new_tensor(type_, (64, 4))
    dev = c.rpc_add_server(rpc_server)[0]
    ctx = gp.Context.for_tensors(1, no_alloc=True)
    remote = ctx.new_tensor(type_, (64, 4))
    buf = c.alloc_ctx_tensors(ctx, dev.buffer_type())
    for t in (host, remote):
        t.set_bytes(raw)
        assert t.get_bytes().tobytes() == raw.tobytes()
        assert t.get_bytes(row, 2 * row).tobytes() == raw[row:3 * row].tobytes()
        assert t.get_bytes(4 * row).size == 0
        with pytest.raises(gp.GGMLValueError, match="do not fit"):
            t.get_bytes(row, 4 * row)
        with pytest.raises(gp.GGMLValueError, match="past"):
            t.get_bytes(4 * row + 1)
    del buf
