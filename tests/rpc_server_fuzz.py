"""Hostile clients against ``ggmlpy rpc-server`` (ggml's RPC server with our patch
``vendor/ggml/patches/0002-rpc-server-hardening.patch``), speaking the wire protocol by hand.

The protocol (ggml 0.25.3, RPC protocol 7): a client sends HELLO (command byte 14, an 8-byte size,
24 bytes of transport capabilities) and reads the reply (an 8-byte size, 28 bytes); then each
request is a command byte, an 8-byte little-endian size and that many bytes, and some commands
answer with an 8-byte size and that many bytes. Tensors travel as ``rpc_tensor`` (296 bytes,
:func:`pack_tensor`).

Case ``i`` of a run is a pure function of ``(seed, i)`` (:func:`make_case`): one connection that
sends one of

* random bytes, before or after HELLO;
* a command (any byte) with a declared size from the edges (0, the command's size +- 1, 2**31,
  2**32, 2**63, 2**64 - 1, random) and up to 4 KiB of what it declares;
* a tensor command (set/get/memset/copy/init/alloc-size/set-hash, clear, free, get-base) on a
  buffer the case allocated, with tensor fields, offsets and sizes from the edges (types out of
  range, rows that are not whole blocks, more than INT64_MAX elements, extents past 2**64, data
  before, across or past the buffer, regions past the tensor);
* a graph (GRAPH_COMPUTE, sometimes GRAPH_RECOMPUTE) with structural faults: node and tensor
  counts that lie, null nodes, a node listed twice, sources missing or cycling, ops, unary ops and
  GLU ops out of range, tensors outside their buffer, more nodes than tensors.

Graph nodes are ``GGML_OP_NONE`` or out of range: a well-formed graph of real ops whose shapes do
not fit together reaches ggml's own shape checks, which abort (graph contents are trusted: the
README's RPC paragraph). Expected of every case: the server stays up; after the run a new client
is served, the server's memory is all free again (``--mem``) and its peak RSS stayed bounded.

    python tests/rpc_server_fuzz.py --cases 5000 [--seed 0] [--mem 64]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time

CMD = {
    "ALLOC_BUFFER": 0, "GET_ALIGNMENT": 1, "GET_MAX_SIZE": 2, "BUFFER_GET_BASE": 3, "FREE_BUFFER": 4,
    "BUFFER_CLEAR": 5, "SET_TENSOR": 6, "SET_TENSOR_HASH": 7, "GET_TENSOR": 8, "COPY_TENSOR": 9,
    "GRAPH_COMPUTE": 10, "GET_DEVICE_MEMORY": 11, "INIT_TENSOR": 12, "GET_ALLOC_SIZE": 13, "HELLO": 14,
    "DEVICE_COUNT": 15, "GRAPH_RECOMPUTE": 16, "MEMSET_TENSOR": 17,
}
RPC_TENSOR = 296                        # sizeof(rpc_tensor), packed
MAX_SRC = 10
# request sizes of the fixed-size commands
FIXED = {
    "ALLOC_BUFFER": 12, "GET_ALIGNMENT": 4, "GET_MAX_SIZE": 4, "BUFFER_GET_BASE": 8, "FREE_BUFFER": 8,
    "BUFFER_CLEAR": 9, "SET_TENSOR_HASH": RPC_TENSOR + 16, "GET_TENSOR": RPC_TENSOR + 16,
    "COPY_TENSOR": 2 * RPC_TENSOR, "GET_DEVICE_MEMORY": 4, "INIT_TENSOR": RPC_TENSOR,
    "GET_ALLOC_SIZE": 4 + (1 + MAX_SRC) * RPC_TENSOR, "DEVICE_COUNT": 0, "GRAPH_RECOMPUTE": 4,
    "MEMSET_TENSOR": RPC_TENSOR + 17,
}
SET_TENSOR_HEADER = RPC_TENSOR + 9
GGML_OP_COUNT, GGML_OP_UNARY, GGML_OP_GLU = 101, 91, 100
GGML_TYPE_COUNT, GGML_TYPE_Q4_0 = 43, 2
U64 = (1 << 64) - 1


def pack_tensor(id=1, type=0, buffer=0, ne=(1, 1, 1, 1), nb=None, op=0, op_params=(), flags=0, src=(),
                view_src=0, view_offs=0, data=0, name=b"", use_count=0) -> bytes:
    """One ``rpc_tensor``: F32 with contiguous strides unless told otherwise."""
    if nb is None:
        nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
    params = list(op_params) + [0] * (16 - len(op_params))
    srcs = list(src) + [0] * (MAX_SRC - len(src))
    out = struct.pack("<QIQ4I4II16ii10QQQQ64si", id & U64, type & 0xFFFFFFFF, buffer & U64,
                      *(x & 0xFFFFFFFF for x in ne), *(x & 0xFFFFFFFF for x in nb), op & 0xFFFFFFFF,
                      *params, flags, *(s & U64 for s in srcs), view_src & U64, view_offs & U64, data & U64,
                      name[:64], use_count)
    assert len(out) == RPC_TENSOR
    return out


def frame(cmd: int, payload: bytes = b"", declared: int | None = None) -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload) if declared is None else declared & U64) + payload


def graph_payload(nodes, tensors, device=0, n_nodes=None, n_tensors=None) -> bytes:
    """GRAPH_COMPUTE's message: device, node ids, rpc_tensors (counts may be made to lie)."""
    return (struct.pack("<II", device, len(nodes) if n_nodes is None else n_nodes)
            + b"".join(struct.pack("<Q", n & U64) for n in nodes)
            + struct.pack("<I", len(tensors) if n_tensors is None else n_tensors) + b"".join(tensors))


class Conn:
    """One client connection, HELLO done unless ``hello=False``."""

    def __init__(self, port: int, hello: bool = True, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hello:
            self.sock.sendall(frame(CMD["HELLO"], bytes(24)))
            size, = struct.unpack("<Q", self.recv(8))
            assert size == 28, size
            self.recv(28)

    def recv(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(min(n - len(data), 1 << 20))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, cmd: str, payload: bytes = b"", reply: int | None = None) -> bytes:
        """Send a request; read a reply of ``reply`` bytes (None: any size), checking its size."""
        self.sock.sendall(frame(CMD[cmd], payload))
        size, = struct.unpack("<Q", self.recv(8))
        if reply is not None and size != reply:
            raise ConnectionError(f"{cmd}: a reply of {size} bytes, expected {reply}")
        return self.recv(size)

    def alloc(self, size: int, device: int = 0) -> tuple[int, int]:
        return struct.unpack("<QQ", self.call("ALLOC_BUFFER", struct.pack("<IQ", device, size), 16))

    def base(self, ptr: int) -> int:
        return struct.unpack("<Q", self.call("BUFFER_GET_BASE", struct.pack("<Q", ptr), 8))[0]

    def memory(self, device: int = 0) -> tuple[int, int]:
        return struct.unpack("<QQ", self.call("GET_DEVICE_MEMORY", struct.pack("<I", device), 16))

    def device_count(self) -> int:
        return struct.unpack("<I", self.call("DEVICE_COUNT", b"", 4))[0]

    def closed_by_server(self, within: float) -> bool:
        """Whether the server closes this connection within ``within`` seconds (reading and dropping
        anything it still sends)."""
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except TimeoutError:
                return False
            except OSError:                 # reset
                return True

    def close(self) -> None:
        self.sock.close()


class Server:
    """A ``ggmlpy rpc-server`` process on a free loopback port; its output goes to a file."""

    def __init__(self, *args: str, env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="rpc-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--threads", "1", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        out = self.output()
        self.stop()
        raise RuntimeError(f"rpc-server {' '.join(args)} did not start: {out[-2000:]}")

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def status(self, field: str) -> float:
        """``VmRSS`` / ``VmHWM`` of the server, MiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise KeyError(field)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def served(self, within: float = 10.0, n: int = 4096) -> bool:
        """A new client's HELLO, DEVICE_COUNT and a write/read round trip of ``n`` bytes through a
        buffer are answered within ``within`` seconds."""
        try:
            c = Conn(self.port, timeout=within)
            try:
                return c.device_count() >= 1 and roundtrip(c, n)
            finally:
                c.close()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()
        os.unlink(self.log.name)


def roundtrip(c: Conn, n: int = 4096) -> bool:
    """Allocate a buffer, write ``n`` bytes, read them back, free it."""
    ptr, size = c.alloc(n)
    if ptr == 0:
        return False
    base = c.base(ptr)
    data = random.Random(n).randbytes(n)
    t = pack_tensor(buffer=ptr, ne=(n // 4, 1, 1, 1), data=base)
    c.send(frame(CMD["SET_TENSOR"], t + b"\0" + struct.pack("<Q", 0) + data))
    back = c.call("GET_TENSOR", t + struct.pack("<QQ", 0, n), n)
    c.send(frame(CMD["FREE_BUFFER"], struct.pack("<Q", ptr)))
    return back == data


# ------------------------------------------------------------------------------------------------ cases

BUF = 1 << 16                           # the buffer a tensor or graph case allocates


def _edge32(r: random.Random) -> int:
    return r.choice([0, 1, 2, 3, 4, 31, 32, 255, 4096, 1 << 16, 1 << 31, (1 << 32) - 1, r.getrandbits(32)])


def _edge64(r: random.Random, base: int) -> int:
    return r.choice([0, 1, 4, 64, BUF - 1, BUF, BUF + 1, 1 << 31, 1 << 32, 1 << 63, U64, U64 - base,
                     r.getrandbits(64), r.randrange(BUF)])


def _tensor(r: random.Random, ptr: int, base: int, tid: int = 1, **kw) -> bytes:
    """A tensor in the case's buffer, each field kept sane or pushed to an edge."""
    ne = [r.choice([1, 2, 4, 16]) for _ in range(4)]
    if r.random() < 0.3:
        ne[r.randrange(4)] = _edge32(r)
    f = dict(id=tid, type=0, buffer=ptr, ne=tuple(ne), data=base + r.choice([0, 0, 64, BUF - 64]))
    if r.random() < 0.2:
        f["type"] = r.choice([GGML_TYPE_Q4_0, r.randrange(GGML_TYPE_COUNT), GGML_TYPE_COUNT, r.getrandbits(32)])
    if r.random() < 0.3:
        f["nb"] = tuple(_edge32(r) for _ in range(4))
    if r.random() < 0.2:
        f["data"] = r.choice([0, base - 1, base + BUF, base + BUF - 1, U64, base + r.getrandbits(20)])
    if r.random() < 0.1:
        f["buffer"] = r.choice([0, ptr + 8, r.getrandbits(64)])
    f.update(kw)
    return pack_tensor(**f)


def make_case(seed: int, i: int) -> tuple[str, object]:
    """Case ``i`` of run ``seed``: (kind, builder). A builder takes (conn, ptr, base) and returns the
    bytes to send (``ptr``/``base``: the buffer allocated for it, 0 where the kind needs none)."""
    r = random.Random(seed * 1_000_003 + i)
    kind = r.choice(["noise-prehello", "noise", "size", "size", "tensor", "tensor", "tensor", "graph", "graph"])
    if kind == "noise-prehello":
        return kind, lambda c, p, b: r.randbytes(r.randrange(300))
    if kind == "noise":
        return kind, lambda c, p, b: r.randbytes(r.randrange(1, 600))
    if kind == "size":
        def build(c, p, b):
            cmd = r.choice([*CMD.values(), *CMD.values(), 18, 19, r.randrange(256)])
            name = next((k for k, v in CMD.items() if v == cmd), None)
            want = FIXED.get(name, SET_TENSOR_HEADER)
            declared = r.choice([0, want, want - 1, want + 1, 1 << 31, 1 << 32, 1 << 63, U64, r.getrandbits(64),
                                 3 << 29])
            return frame(cmd, r.randbytes(min(declared & U64, r.randrange(4096))), declared)
        return kind, build
    if kind == "tensor":
        def build(c, p, b):
            cmd = r.choice(["SET_TENSOR", "GET_TENSOR", "MEMSET_TENSOR", "COPY_TENSOR", "INIT_TENSOR",
                            "GET_ALLOC_SIZE", "SET_TENSOR_HASH", "BUFFER_CLEAR", "FREE_BUFFER", "BUFFER_GET_BASE"])
            t = _tensor(r, p, b)
            off, size = _edge64(r, b), _edge64(r, b)
            if r.random() < 0.5:
                off, size = r.randrange(256), r.randrange(1, 1024)
            if cmd == "SET_TENSOR":
                n = min(size, 1 << 14)
                return frame(CMD[cmd], t + bytes([r.randrange(2)]) + struct.pack("<Q", off) + r.randbytes(n),
                             SET_TENSOR_HEADER + size)
            if cmd == "GET_TENSOR":
                return frame(CMD[cmd], t + struct.pack("<QQ", off, size))
            if cmd == "MEMSET_TENSOR":
                return frame(CMD[cmd], t + struct.pack("<QQB", off, size, 7))
            if cmd == "COPY_TENSOR":
                return frame(CMD[cmd], t + _tensor(r, p, b, tid=2))
            if cmd == "INIT_TENSOR":
                return frame(CMD[cmd], t)
            if cmd == "GET_ALLOC_SIZE":
                srcs = [_tensor(r, p, b, tid=3 + k) if r.random() < 0.3 else bytes(RPC_TENSOR) for k in range(MAX_SRC)]
                return frame(CMD[cmd], struct.pack("<I", r.choice([0, 0, 1, U64 & 0xFFFFFFFF])) + t + b"".join(srcs))
            if cmd == "SET_TENSOR_HASH":
                return frame(CMD[cmd], t + struct.pack("<QQ", off, r.getrandbits(64)))
            ptr = r.choice([p, p, p + 1, 0, r.getrandbits(64)])
            if cmd == "BUFFER_CLEAR":
                return frame(CMD[cmd], struct.pack("<QB", ptr, 1))
            return frame(CMD[cmd], struct.pack("<Q", ptr))
        return kind, build

    def build_graph(c, p, b):
        n = r.randrange(1, 12)
        ids = [r.choice([k + 1, k + 1, r.getrandbits(64)]) for k in range(n)]
        tensors = []
        for k in range(n):
            src = [r.choice([0, 0, *ids, r.getrandbits(64)]) for _ in range(r.randrange(3))]
            op, params = 0, ()
            roll = r.random()
            if roll < 0.1:
                op = r.choice([GGML_OP_COUNT, r.randrange(GGML_OP_COUNT, 1 << 32)])
            elif roll < 0.2:
                op, params = r.choice([(GGML_OP_UNARY, (r.choice([22, -1, 1 << 30]),)),
                                       (GGML_OP_GLU, (r.choice([7, -1, 1 << 30]),))])
            view = r.choice([0, 0, 0, *ids])
            tensors.append(_tensor(r, p, b, tid=ids[k], src=src, view_src=view, op=op, op_params=params))
        nodes = [r.choice(ids) for _ in range(r.randrange(0, n + 1))]
        if r.random() < 0.2:
            nodes.append(r.choice([0, nodes[0] if nodes else 0, r.getrandbits(64)]))
        lie = {}
        if r.random() < 0.15:
            lie["n_nodes"] = r.choice([len(nodes) + 1, 1 << 31, U64 & 0xFFFFFFFF])
        if r.random() < 0.15:
            lie["n_tensors"] = r.choice([len(tensors) + 1, 0, 1 << 31, U64 & 0xFFFFFFFF])
        device = r.choice([0, 0, 0, 1, U64 & 0xFFFFFFFF])
        out = frame(CMD["GRAPH_COMPUTE"], graph_payload(nodes, tensors, device, **lie))
        if r.random() < 0.3:
            out += frame(CMD["GRAPH_RECOMPUTE"], struct.pack("<I", r.choice([0, 1, U64 & 0xFFFFFFFF])))
        return out
    return kind, build_graph


def connect(port: int, hello: bool) -> Conn:
    """A :class:`Conn`, tried again a moment later while the server refuses it: connections that
    just closed (a case before, a start-up probe) may still count against its --max-clients."""
    for _ in range(100):
        try:
            return Conn(port, hello=hello, timeout=10)
        except ConnectionError:
            time.sleep(0.02)
    raise ConnectionError(f"127.0.0.1:{port} refused 100 connections in a row")


def run_case(port: int, seed: int, i: int) -> str:
    """Run case ``i`` on a new connection; returns its kind."""
    kind, build = make_case(seed, i)
    c = connect(port, hello=kind != "noise-prehello")
    try:
        ptr = base = 0
        if kind in ("tensor", "graph"):
            ptr, _ = c.alloc(BUF)
            base = c.base(ptr)
        try:
            c.send(build(c, ptr, base))
        except OSError:
            pass                        # the server closed the connection half-way: that is fine
    finally:
        c.close()
    return kind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem", type=float, default=64.0, help="the server's --mem, MiB")
    ap.add_argument("--hwm-mib", type=float, default=200.0, help="the bound on the server's peak RSS, MiB")
    args = ap.parse_args(argv)
    server = Server("--mem", f"{args.mem:g}", "--timeout", "2")
    kinds: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        for i in range(args.cases):
            kind = make_case(args.seed, i)[0]
            try:
                run_case(server.port, args.seed, i)
            except OSError:
                if server.alive():
                    raise
            kinds[kind] = kinds.get(kind, 0) + 1
            if not server.alive():
                print(f"FAIL: the server died on case {i} ({kind}, seed {args.seed}): "
                      f"{server.output()[-3000:]}", file=sys.stderr)
                return 1
            if (i + 1) % 500 == 0:
                print(f"{i + 1} cases, {time.monotonic() - t0:.0f} s, server RSS {server.status('VmRSS'):.0f} MiB "
                      f"(peak {server.status('VmHWM'):.0f})", flush=True)
        ok = server.served()
        time.sleep(0.5)                 # the last connections' buffers are freed as their threads end
        c = Conn(server.port)
        free, total = c.memory()
        c.close()
        hwm = server.status("VmHWM")
        print(f"{args.cases} cases (seed {args.seed}) in {time.monotonic() - t0:.0f} s: "
              f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; server alive, "
              f"{'serves' if ok else 'DOES NOT SERVE'} a new client, {free >> 20} of {total >> 20} MiB free, "
              f"peak RSS {hwm:.0f} MiB")
        return 0 if ok and free == total and hwm < args.hwm_mib else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
