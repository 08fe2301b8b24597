"""Shared helpers for the op tests: contexts, graph compute, numpy <-> ggml order, comparisons.

Conventions used throughout the op tests:

* ggml lists dimensions fastest-first (``ne[0]`` is a row); numpy lists them
  slowest-first. A 4-d numpy array ``x4`` of shape ``reversed(t.ne)`` holds a
  tensor ``t`` exactly, so ggml dimension ``i`` is numpy axis ``3 - i``.
* ``result4(t)`` reads any tensor (any type, any layout) as such a 4-d array;
  references are built as 4-d arrays too (``to4``), so a comparison also
  checks the result's ``ne``.
"""

from __future__ import annotations

import socket

import numpy as np

import ggmlpy

#: Arena size of the contexts the op tests use: data of every tensor plus one graph.
DEFAULT_MEM = 32 << 20

#: Test dtype names -> (ggml type, numpy dtype of the stored values).
DTYPES = {
    "f32": (ggmlpy.Type.F32, np.float32),
    "f16": (ggmlpy.Type.F16, np.float16),
}


def new_ctx(mem_size: int = DEFAULT_MEM) -> ggmlpy.Context:
    """An allocating Context large enough for the small op tests."""
    return ggmlpy.Context(mem_size)


def compute(ctx, *tensors, n_threads: int = 1, graph_size: int = 1024):
    """Build one graph computing every tensor in ``tensors`` and run it on the CPU.

    Returns the Graph (so a test can look at its nodes).
    """
    gf = ctx.new_graph(graph_size)
    for t in tensors:
        gf.build_forward_expand(t)
    gf.compute(n_threads)
    return gf


def ggml_axis(dim: int) -> int:
    """The numpy axis of ggml dimension ``dim`` in a 4-d array."""
    return 3 - dim


def to4(arr) -> np.ndarray:
    """``arr`` with leading size-1 axes added up to 4 dimensions (numpy order)."""
    arr = np.asarray(arr)
    if arr.ndim > 4:
        raise ValueError(f"to4: {arr.ndim} dimensions")
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape)


def ne_of(arr) -> tuple:
    """The ggml ``ne`` (4 entries) of a numpy array."""
    return tuple(reversed(to4(arr).shape))


def result4(t) -> np.ndarray:
    """A copy of tensor ``t``'s values as a 4-d numpy array of shape ``reversed(t.ne)``.

    Quantized and BF16 tensors are converted to float32 (``Tensor.get``); strided
    views are gathered.
    """
    return np.asarray(t.get()).reshape(tuple(reversed(t.ne)))


def store(x, dtype: str) -> np.ndarray:
    """``x`` rounded to the test dtype ('f32'/'f16'), in that numpy dtype (what a tensor of it holds)."""
    return np.asarray(x, dtype=DTYPES[dtype][1])


def leaf(ctx, x, dtype: str = "f32"):
    """A new tensor holding ``x`` stored as ``dtype``; returns ``(tensor, values as float64)``.

    The float64 values are exactly what the tensor holds (after f16 rounding),
    which is what a numpy reference should start from.
    """
    xs = store(x, dtype)
    return ctx.from_numpy(xs), xs.astype(np.float64)


def np_permute(x4: np.ndarray, axes) -> np.ndarray:
    """numpy equivalent of ``ggml_permute(a, *axes)`` on a 4-d array: source dim i becomes dim axes[i]."""
    perm = [0] * 4
    for i, ax in enumerate(axes):
        perm[3 - ax] = 3 - i
    return np.transpose(x4, perm)


def np_view(base: np.ndarray, ne, nb, offset: int) -> np.ndarray:
    """numpy equivalent of a ggml view (element ne, byte strides nb[0..3], byte offset) of the
    contiguous array ``base``; returns a 4-d copy."""
    flat = np.ascontiguousarray(base).reshape(-1)
    isz = flat.itemsize
    assert offset % isz == 0 and all(s % isz == 0 for s in nb)
    start = offset // isz
    out = np.empty(tuple(reversed(ne)), dtype=flat.dtype)
    idx = np.zeros(out.shape, dtype=np.int64) + start
    for dim in range(4):
        shape = [1, 1, 1, 1]
        shape[3 - dim] = ne[dim]
        idx = idx + (np.arange(ne[dim]) * (nb[dim] // isz)).reshape(shape)
    out[...] = flat[idx]
    return out


def _fmt_index(idx) -> str:
    return "(" + ", ".join(str(int(i)) for i in idx) + ")"


def assert_close(actual, expected, atol: float = 0.0, rtol: float = 0.0, what: str = "") -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise.

    Shapes must be equal. Infinities must match exactly (same sign, same
    places) and NaNs must appear in the same places. The message names the
    worst element (numpy index of the 4-d array), its values, and how many
    elements failed.
    """
    a = np.asarray(actual)
    e = np.asarray(expected)
    label = f"{what}: " if what else ""
    assert a.shape == e.shape, f"{label}shape {a.shape} != expected {e.shape}"
    a = a.astype(np.float64)
    e = e.astype(np.float64)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        idx = np.argwhere(nan_a != nan_e)[0]
        raise AssertionError(f"{label}NaN mismatch at {_fmt_index(idx)}: got {a[tuple(idx)]}, "
                             f"expected {e[tuple(idx)]} ({int((nan_a != nan_e).sum())} elements)")
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    if not np.array_equal(inf_a, inf_e) or not np.array_equal(a[inf_a], e[inf_e]):
        bad = (inf_a != inf_e) | (inf_a & inf_e & (a != e))
        idx = np.argwhere(bad)[0]
        raise AssertionError(f"{label}inf mismatch at {_fmt_index(idx)}: got {a[tuple(idx)]}, "
                             f"expected {e[tuple(idx)]} ({int(bad.sum())} elements)")
    fin = ~(nan_e | inf_e)
    a, e = np.where(fin, a, 0.0), np.where(fin, e, 0.0)
    err = np.abs(a - e)
    tol = atol + rtol * np.abs(e)
    bad = err > tol
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err - tol, -np.inf)), a.shape)
        raise AssertionError(
            f"{label}{int(bad.sum())} of {a.size} elements differ beyond atol={atol:g}, rtol={rtol:g}; "
            f"worst at {_fmt_index(idx)}: got {a[idx]!r}, expected {e[idx]!r} "
            f"(abs err {err[idx]:.3g}, max abs err {err.max():.3g})")


def rel_err(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius norms, float64)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


# --- memory the process really holds -------------------------------------------------------------
# Leak tests measure RSS, never ggmlpy's own object counters alone: a leak of every backend buffer
# once hid behind counters that said 0.

def rss_mib(field: str = "VmRSS") -> float:
    """Resident set size of this process now, in MiB (``/proc/self/status`` VmRSS).

    ``field="VmSize"`` gives the virtual size instead: memory allocated but never written (ggml's CPU
    buffers are not touched until a compute writes them) counts there, not in RSS.
    """
    import ctypes
    import gc

    gc.collect()
    try:  # give freed heap pages back to the OS first, so RSS shows what is really held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_growth(fn, loops: int = 5, warmup: int = 1, field: str = "VmRSS") -> float:
    """MiB of RSS gained over ``loops`` calls of ``fn()``, after ``warmup`` calls (caches, lazy init).

    A loop that gives back what it takes stays within a few MiB whatever ``loops`` is; a leak of
    ``n`` MiB per call grows by ``loops * n``. ``field="VmSize"``: see :func:`rss_mib`.
    """
    for _ in range(warmup):
        fn()
    before = rss_mib(field)
    for _ in range(loops):
        fn()
    return rss_mib(field) - before


def run_child(code: str, *args, timeout: float = 120):
    """Run ``code`` in a fresh interpreter (with faulthandler) and return the CompletedProcess.

    Crash tests go through here: an abort or segfault kills the child, not the test run, and shows
    as a negative return code with the C stack faulthandler printed.
    """
    import subprocess
    import sys
    import textwrap

    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def sched_model(backends_for_weights, rng, dim: int = 16, scale: float = 4.0):
    """Two ``dim x dim`` weight matrices, each in a weights buffer of the given backend, for scheduler tests.

    Returns ``(ws, build, ref)``: ``ws`` the ``(tensor, context, buffer, numpy values)`` of each weight
    (keep it alive),
    ``build(n_tokens)`` -> ``(ctx, x, y, graph)`` of ``y = w1 @ relu(w0 @ x)`` with ``x`` an input, and
    ``ref(X)`` the numpy result for ``X`` of shape ``(n_tokens, dim)``.
    """
    from ggmlpy import _core as c

    ws, mats = [], []
    for be in backends_for_weights:
        wctx = ggmlpy.Context.for_tensors(2, no_alloc=True)
        w = wctx.new_tensor(ggmlpy.Type.F32, (dim, dim))
        buf = c.alloc_ctx_tensors(wctx, be)
        buf.usage = c.BufferUsage.WEIGHTS
        m = rng.standard_normal((dim, dim)).astype(np.float32) / scale
        w.set(m)
        ws.append((w, wctx, buf, m))
        mats.append(m)

    def build(n_tokens):
        ctx = ggmlpy.Context.for_tensors(32, graph_size=128, no_alloc=True)
        x = ctx.new_tensor(ggmlpy.Type.F32, (dim, n_tokens)).set_input()
        h = ctx.relu(ctx.mul_mat(ws[0][0], x))
        y = ctx.mul_mat(ws[1][0], h).set_output()
        gf = ctx.new_graph(128)
        gf.build_forward_expand(y)
        return ctx, x, y, gf

    def ref(X):
        return np.maximum(X @ mats[0].T, 0) @ mats[1].T

    return ws, build, ref


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before: ggml's RPC
    client keeps one registry entry per endpoint for the life of the process, so a new server on a
    port an earlier test's server had would be answered with the old server's devices."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def exact_geglu(ctx, gate, up):
    """``gelu_tanh(gate) * up`` from exact F32 ops (ggml's GELU reads an F16 table)."""
    inner = ctx.scale(ctx.mul(gate, ctx.scale_bias(ctx.sqr(gate), 0.044715, 1.0)), 0.7978845608028654)
    return ctx.mul(ctx.mul(ctx.scale(gate, 0.5), ctx.scale_bias(ctx.tanh(inner), 1.0, 1.0)), up)


def exact_geglu_fused(ctx, a):
    n, rows = a.ne[0] // 2, a.ne[1]
    gate = ctx.cont(ctx.view(a, (n, rows), (a.nb[1],), 0))
    up = ctx.cont(ctx.view(a, (n, rows), (a.nb[1],), n * a.nb[0]))
    return exact_geglu(ctx, gate, up)
