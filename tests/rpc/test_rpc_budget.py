"""``ggmlpy rpc-server --mem``: RPC servers that advertise a memory size and hold to it (a budget device
around the CPU), as several loopback servers of different sizes for testing layer placement without a GPU.
Servers run as ``ggmlpy rpc-server`` processes on 127.0.0.1; the client is this process."""

from __future__ import annotations

import gc
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import free_port, sched_model

import ggmlpy as gp
from ggmlpy import _core as c

pytestmark = pytest.mark.rpc

MiB = 1 << 20



def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ggmlpy.cli", "rpc-server", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def start_server():
    """``start_server(*cli_args)`` -> ``(endpoint, startup line)`` of a new ``rpc-server`` process."""
    procs = []

    def start(*args):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1",
                                 "--port", str(port), "--threads", "1", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        first = proc.stdout.readline()          # ours, flushed before ggml starts serving
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return f"127.0.0.1:{port}", first
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"rpc-server {' '.join(args)} did not start: {first}{proc.stdout.read() if proc.poll() else ''}")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server64(start_server):
    """One 64 MiB server shared by the tests below; each leaves it as it found it (all 64 MiB free)."""
    return start_server("--mem", "64")


def _rpc_dev(endpoint):
    return c.rpc_add_server(endpoint)[0]


def test_client_sees_the_size_and_every_allocation_counts(server64):
    ep, first = server64
    assert re.search(r"serving CPU \(64 MiB\) at 127\.0\.0\.1:\d+", first), first
    dev = _rpc_dev(ep)
    assert dev.memory() == (64 * MiB, 64 * MiB)
    bt = dev.buffer_type()
    a = bt.alloc_buffer(10 * MiB)
    assert a.size == 10 * MiB and dev.memory() == (54 * MiB, 64 * MiB)
    b = bt.alloc_buffer(30 * MiB)
    assert dev.memory() == (24 * MiB, 64 * MiB)
    # More than is free: refused, named, and nothing counted.
    with pytest.raises(gp.GGMLMemoryError, match=rf"25\.00 MiB .*on device {re.escape(dev.name)} "
                                                 rf"\(it reports 24\.00 MiB free of 64\.00 MiB\)"):
        bt.alloc_buffer(25 * MiB)
    assert dev.memory() == (24 * MiB, 64 * MiB)
    full = bt.alloc_buffer(24 * MiB)                    # exactly what is free: fits
    assert dev.memory() == (0, 64 * MiB)
    with pytest.raises(MemoryError, match=re.escape(dev.name)):
        bt.alloc_buffer(1)
    full.free()
    b.free()
    assert dev.memory() == (54 * MiB, 64 * MiB)
    a.free()
    assert dev.memory() == (64 * MiB, 64 * MiB)
    # Weights through alloc_ctx_tensors count by the buffer's size, and come back when it goes.
    wctx = gp.Context.for_tensors(2, no_alloc=True)
    w = wctx.new_tensor(gp.Type.F32, (1024, 1000))
    wctx.new_tensor(gp.Type.F16, (1000,))
    wbuf = c.alloc_ctx_tensors(wctx, dev.buffer_type())
    assert 1024 * 1000 * 4 + 2000 <= wbuf.size and dev.memory() == (64 * MiB - wbuf.size, 64 * MiB)
    m = np.random.default_rng(1).standard_normal((1000, 1024)).astype(np.float32)
    w.set(m)
    np.testing.assert_array_equal(w.get(), m)
    del w, wctx, wbuf
    gc.collect()
    assert dev.memory() == (64 * MiB, 64 * MiB)
    # A weights context that does not fit fails the same way.
    big = gp.Context.for_tensors(1, no_alloc=True)
    big.new_tensor(gp.Type.F32, (1024, 17 * 1024))      # 68 MiB
    with pytest.raises(MemoryError, match=rf"68\.00 MiB .*on device {re.escape(dev.name)}"):
        c.alloc_ctx_tensors(big, dev.buffer_type())
    assert dev.memory() == (64 * MiB, 64 * MiB)


def test_refusals_leave_the_server_serving_and_computing_like_the_cpu(server64):
    dev = _rpc_dev(server64[0])
    assert dev.memory() == (64 * MiB, 64 * MiB)
    hold = dev.buffer_type().alloc_buffer(63 * MiB)     # 1 MiB left
    with pytest.raises(MemoryError):
        dev.buffer_type().alloc_buffer(2 * MiB)
    rpc = dev.init()
    cpu = c.backend_init("CPU")
    cpu.set_n_threads(1)                                # as the server computes
    keep, build, ref = sched_model([rpc, cpu], np.random.default_rng(7))    # first layer's weights in the 1 MiB
    keep_c, build_c, _ = sched_model([cpu, cpu], np.random.default_rng(7))  # the same weights, all on the CPU
    s = c.Scheduler([rpc, cpu], graph_size=256)
    # Compute buffers beyond the budget: refused, then a graph that fits reserves and computes.
    with pytest.raises(MemoryError):
        s.reserve(build(1 << 15)[3])                    # activations of 32768 tokens: 2 MiB each
    s = c.Scheduler([rpc, cpu], graph_size=256)
    s.reserve(build(8)[3])
    assert s.buffer_size(rpc) > 0
    in_use = hold.size + keep[0][2].size + s.buffer_size(rpc)
    assert dev.memory() == (64 * MiB - in_use, 64 * MiB)
    s_c = c.Scheduler([cpu], graph_size=256)
    rng = np.random.default_rng(8)
    for n in (8, 1, 5):
        X = rng.standard_normal((n, 16)).astype(np.float32)
        ctx, x, y, gf = build(n)
        s.alloc_graph(gf)
        x.set(X)
        s.compute(gf)
        ctx_c, x_c, y_c, gf_c = build_c(n)
        s_c.alloc_graph(gf_c)
        x_c.set(X)
        s_c.compute(gf_c)
        out = y.get().reshape(n, 16)
        np.testing.assert_allclose(out, ref(X), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, y_c.get().reshape(n, 16), rtol=1e-6, atol=1e-7)
    assert dev.memory()[0] <= 64 * MiB - in_use            # within the reservation, or more if it grew
    hold.free()
    del s, keep, build, ctx, x, y, gf
    gc.collect()
    assert dev.memory() == (64 * MiB, 64 * MiB)


CLIENT_LEAVES = r"""
import os, sys
from ggmlpy import _core as c
dev = c.rpc_add_server(sys.argv[1])[0]
bufs = [dev.buffer_type().alloc_buffer(n << 20) for n in (12, 8)]
print(dev.memory(), flush=True)
os._exit(0)                      # no free: the server frees what a closed connection held
"""


def test_a_client_that_leaves_gives_its_memory_back(start_server):
    ep, _ = start_server("-m", "32")
    out = subprocess.run([sys.executable, "-c", CLIENT_LEAVES, ep], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"({12 * MiB}, {32 * MiB})", out.stdout + out.stderr
    assert _rpc_dev(ep).memory() == (32 * MiB, 32 * MiB)


def test_servers_and_devices_report_their_own_sizes(start_server):
    small, big = start_server("--mem", "3.5"), start_server("--mem", "96")
    both, first = start_server("--device", "CPU", "--device", "CPU", "--mem", "16", "--mem", "0")
    assert "serving CPU (3.5 MiB) at" in small[1]
    assert _rpc_dev(small[0]).memory() == (7 * MiB // 2, 7 * MiB // 2)
    assert _rpc_dev(big[0]).memory() == (96 * MiB, 96 * MiB)
    cpu_total = c.device("CPU").memory()[1]
    assert re.search(rf"serving CPU \(16 MiB\), CPU \({cpu_total >> 20} MiB, its own\) at", first), first
    limited, own = c.rpc_add_server(both)
    assert limited.memory() == (16 * MiB, 16 * MiB)
    assert own.memory()[1] == cpu_total                 # not limited: the host's memory
    buf = limited.buffer_type().alloc_buffer(4 * MiB)
    assert limited.memory() == (12 * MiB, 16 * MiB) and own.memory()[1] == cpu_total
    del buf
    gc.collect()
    assert limited.memory() == (16 * MiB, 16 * MiB)


@pytest.mark.parametrize("args, message", [
    (["--mem", "-1"], "number of MiB from 1 byte up"),
    (["--mem", "abc"], "number of MiB from 1 byte up"),
    (["--mem", "nan"], "number of MiB from 1 byte up"),
    (["--mem", "inf"], "number of MiB from 1 byte up"),
    (["--mem", "1e-9"], "number of MiB from 1 byte up"),      # rounds to no byte
    (["--mem", str(1 << 44)], "number of MiB from 1 byte up"),
    (["--mem", "8", "--mem", "16"], "2 --mem sizes for 1 device"),
    (["-d", "CPU", "-d", "CPU", "-d", "CPU", "-m", "8", "-m", "16"], "2 --mem sizes for 3 device"),
])
def test_cli_refuses_bad_mem(args, message):
    out = _cli("--port", str(free_port()), *args, timeout=30)
    assert out.returncode == 2 and "--mem" in out.stderr and message in out.stderr, out.stderr
    assert "serving" not in out.stdout


BAD_MEM = r"""
import sys
import ggmlpy as gp
from ggmlpy import _core as c
ep = sys.argv[1]
for mem, devs in [(0, None), (-1, None), (1.5, None), ("64", None), (True, None), (1 << 64, None),
                  ([1, 2], None), ([None], [c.device("CPU")] * 2), ([5, 0], [c.device("CPU")] * 2)]:
    try:
        c.rpc_start_server(ep, devs, mem=mem)
    except gp.GGMLValueError as e:
        print(e)
    else:
        print("served", mem)
"""


def test_rpc_start_server_refuses_bad_mem():
    # In a child: a value taken by mistake would serve (block) instead of raising.
    out = subprocess.run([sys.executable, "-c", BAD_MEM, f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 9, out.stdout + out.stderr
    assert all(line.startswith("rpc_start_server: mem") for line in lines), lines
    for line, part in zip(lines, ["byte count in 1..", "byte count in 1..", "whole number of bytes",
                                  "whole number of bytes", "whole number of bytes", "byte count in 1..",
                                  "mem lists 2 sizes for 1 device", "mem lists 1 sizes for 2 device",
                                  "mem[1] must be a byte count in 1.."]):
        assert part in line, (part, line)
    assert "(got 0)" in lines[0] and "(got 1.5)" in lines[2] and "(got True)" in lines[4]
