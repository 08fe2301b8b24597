"""Reference implementations for the ggmlpy binding-overhead benchmarks.

bench/bench_overhead.py times two small workloads through ggmlpy's Python API
and compares them with the two baselines defined here:

* **C baseline** (``_baseline_c.c``, built by :func:`build_c_baseline`, run by
  :func:`run_c_baseline`).  The same workloads written directly against
  ggml's C API.  This is the *floor*: no binding can be faster than ggml
  itself, so ``ggmlpy_time - c_time`` is the cost the binding adds.

* **ctypes baseline** (:class:`CtypesGGML`, :func:`ctypes_graph_build`,
  :class:`CtypesRoundTrip`).  The same workloads through a hand-written
  ctypes binding of the same shared libraries that ggmlpy ships.  This is
  how the existing Python bindings of ggml (ggml-python, llama-cpp-python)
  work: plain ``ctypes.Structure``/``POINTER`` declarations, structs passed
  and returned by value, and ``ctypes.memmove`` between numpy buffers
  (``ndarray.ctypes.data``) and tensor data.  It is the bar a Cython binding
  is expected to clear.

The workloads:

``graph_build``
    A ``no_alloc`` context sized for ``n_ops + 2`` tensors plus a graph of
    16384 nodes; two F32 tensors ``x``, ``y`` of 64 elements; then ``n_ops``
    times ``x = ggml_add(ctx, x, y); ggml_build_forward_expand(gf, x)``.
    Measures the per-op cost of building a graph (two foreign calls per op).

``round_trip``
    One allocating context set up once with ``a``, ``b`` (F32[64]),
    ``c = a + b``, a graph and a ``ggml_cplan`` whose work buffer is allocated
    once.  One round trip = copy two host arrays into ``a`` and ``b``,
    ``ggml_graph_compute``, copy ``c`` out into a fresh host array.  Measures
    the fixed cost of one small computation driven from the host.

Public API: :func:`package_lib_dir`, :func:`include_dir`,
:func:`build_c_baseline`, :func:`run_c_baseline`, :class:`CtypesGGML`,
:func:`load_ctypes_ggml`, :func:`ctypes_graph_build`, :class:`CtypesRoundTrip`.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

__all__ = [
    "package_lib_dir",
    "include_dir",
    "build_c_baseline",
    "run_c_baseline",
    "CtypesGGML",
    "load_ctypes_ggml",
    "ctypes_graph_build",
    "CtypesRoundTrip",
]

_BENCH_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _BENCH_DIR.parent
_C_SOURCE = _BENCH_DIR / "_baseline_c.c"

GRAPH_SIZE = 16384            # graph capacity used by the graph_build workload
GGML_DEFAULT_GRAPH_SIZE = 2048  # ggml.h
GGML_TYPE_F32 = 0             # enum ggml_type
GGML_STATUS_SUCCESS = 0       # enum ggml_status

_LIB_NAMES = ("libggml-base.so", "libggml-cpu.so", "libggml.so")


# --------------------------------------------------------------------------
# Locating the shared libraries and headers
# --------------------------------------------------------------------------

def package_lib_dir() -> Path:
    """Folder of the installed ggmlpy package holding libggml*.so.

    With an editable install ``ggmlpy.__file__`` may point into ``src/`` while
    the compiled extension and the libraries live in site-packages, so the
    extension module's location is tried first.
    """
    candidates: list[Path] = []
    try:
        from ggmlpy import _core  # noqa: PLC0415
        candidates.append(Path(_core.__file__).resolve().parent)
    except ImportError:
        pass
    try:
        import ggmlpy  # noqa: PLC0415
        candidates.extend(Path(p).resolve() for p in getattr(ggmlpy, "__path__", []))
    except ImportError:
        pass
    for folder in candidates:
        if all((folder / name).exists() for name in _LIB_NAMES):
            return folder
    raise FileNotFoundError(
        "could not find libggml-base.so, libggml-cpu.so and libggml.so in the "
        f"ggmlpy package folder (looked in: {[str(c) for c in candidates] or 'nothing, ggmlpy not importable'})"
    )


def include_dir() -> Path:
    """ggml's public header folder: vendor/ggml/src/include under the repo root."""
    inc = _REPO_ROOT / "vendor" / "ggml" / "src" / "include"
    missing = [h for h in ("ggml.h", "ggml-cpu.h") if not (inc / h).is_file()]
    if missing:
        raise FileNotFoundError(
            f"ggml headers {missing} not found in {inc}; fetch the vendored ggml "
            "sources first (vendor/ggml/fetch.py)"
        )
    return inc


# --------------------------------------------------------------------------
# C baseline
# --------------------------------------------------------------------------

def build_c_baseline(out_dir: str | os.PathLike) -> Path:
    """Compile bench/_baseline_c.c against ggmlpy's libraries; return the executable's path."""
    cc = shutil.which("cc")
    if cc is None:
        raise FileNotFoundError("no C compiler: `cc` is not on PATH")
    inc = include_dir()
    libdir = package_lib_dir()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "baseline_c"
    cmd = [
        cc, "-O2", "-std=c11", "-D_POSIX_C_SOURCE=199309L",
        f"-I{inc}",
        str(_C_SOURCE),
        "-o", str(exe),
        f"-L{libdir}", "-lggml", "-lggml-base", "-lggml-cpu",
        f"-Wl,-rpath,{libdir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"compiling the C baseline failed ({proc.returncode}):\n"
            f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )
    return exe


def run_c_baseline(path: str | os.PathLike, reps: int = 20, iters: int = 10000) -> dict:
    """Run the C baseline; return its results keyed by workload name.

    ``reps`` repetitions of each workload (``iters`` round trips per
    repetition).  Returns e.g.::

        {"graph_build": {"ns_per_op": ..., "ns_per_op_median": ...,
                         "ns_total": ..., "ns_total_median": ..., "n_nodes": 10000, ...},
         "round_trip":  {"ns_per_iter": ..., "ns_per_iter_median": ..., ...}}

    The un-suffixed values are minima over repetitions.
    """
    proc = subprocess.run(
        [str(path), str(int(reps)), str(int(iters))],
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"C baseline failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    results: dict = {}
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            results[rec["workload"]] = rec
    for needed in ("graph_build", "round_trip"):
        if needed not in results:
            raise RuntimeError(f"C baseline printed no {needed!r} result:\n{proc.stdout}")
    return results


# --------------------------------------------------------------------------
# ctypes binding
# --------------------------------------------------------------------------

class ggml_init_params(ctypes.Structure):
    """struct ggml_init_params (ggml.h)."""
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class ggml_tensor(ctypes.Structure):
    """struct ggml_tensor, used opaquely (data is reached via ggml_get_data)."""


class ggml_cgraph(ctypes.Structure):
    """struct ggml_cgraph (opaque in ggml.h)."""


ggml_context_p = ctypes.c_void_p
ggml_tensor_p = ctypes.POINTER(ggml_tensor)
ggml_cgraph_p = ctypes.POINTER(ggml_cgraph)

# typedef bool (*ggml_abort_callback)(void * data);
ggml_abort_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


class ggml_cplan(ctypes.Structure):
    """struct ggml_cplan (ggml-cpu.h), field for field."""
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.POINTER(ctypes.c_uint8)),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ggml_abort_callback),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class CtypesGGML:
    """ctypes binding of the ggml functions the two workloads need.

    Loads libggml-base.so, libggml-cpu.so and libggml.so from ``lib_dir``
    (default: ggmlpy's package folder) with RTLD_GLOBAL, and exposes each
    declared function as an attribute of the same name.
    """

    def __init__(self, lib_dir: str | os.PathLike | None = None):
        lib_dir = Path(lib_dir) if lib_dir is not None else package_lib_dir()
        self.lib_dir = lib_dir
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)
        self.ggml = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=mode)

        base, cpu = self.base, self.cpu
        c_size_t, c_int, c_int64, c_bool = ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, ctypes.c_bool

        # ggml.h (libggml-base)
        self.ggml_init = self._decl(base, "ggml_init", [ggml_init_params], ggml_context_p)
        self.ggml_free = self._decl(base, "ggml_free", [ggml_context_p], None)
        self.ggml_new_tensor_1d = self._decl(
            base, "ggml_new_tensor_1d", [ggml_context_p, c_int, c_int64], ggml_tensor_p)
        self.ggml_add = self._decl(
            base, "ggml_add", [ggml_context_p, ggml_tensor_p, ggml_tensor_p], ggml_tensor_p)
        self.ggml_new_graph_custom = self._decl(
            base, "ggml_new_graph_custom", [ggml_context_p, c_size_t, c_bool], ggml_cgraph_p)
        self.ggml_build_forward_expand = self._decl(
            base, "ggml_build_forward_expand", [ggml_cgraph_p, ggml_tensor_p], None)
        self.ggml_graph_n_nodes = self._decl(base, "ggml_graph_n_nodes", [ggml_cgraph_p], c_int)
        self.ggml_get_data = self._decl(base, "ggml_get_data", [ggml_tensor_p], ctypes.c_void_p)
        self.ggml_nbytes = self._decl(base, "ggml_nbytes", [ggml_tensor_p], c_size_t)
        self.ggml_tensor_overhead = self._decl(base, "ggml_tensor_overhead", [], c_size_t)
        self.ggml_graph_overhead_custom = self._decl(
            base, "ggml_graph_overhead_custom", [c_size_t, c_bool], c_size_t)

        # ggml-cpu.h (libggml-cpu)
        self.ggml_graph_plan = self._decl(
            cpu, "ggml_graph_plan", [ggml_cgraph_p, c_int, ctypes.c_void_p], ggml_cplan)
        self.ggml_graph_compute = self._decl(
            cpu, "ggml_graph_compute", [ggml_cgraph_p, ctypes.POINTER(ggml_cplan)], c_int)

    @staticmethod
    def _decl(lib: ctypes.CDLL, name: str, argtypes: list, restype):
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
        return fn


@functools.cache
def load_ctypes_ggml(lib_dir: str | None = None) -> CtypesGGML:
    """Shared :class:`CtypesGGML` instance (loading is done once per process)."""
    return CtypesGGML(lib_dir)


def ctypes_graph_build(n_ops: int = 10000, lib: CtypesGGML | None = None) -> float:
    """Workload 1 through ctypes; return the seconds spent in the add/expand loop.

    Context creation and freeing are not timed.  Raises RuntimeError if the
    graph does not end up with exactly ``n_ops`` nodes.
    """
    g = lib if lib is not None else load_ctypes_ggml()
    graph_size = max(GRAPH_SIZE, n_ops)
    params = ggml_init_params(
        mem_size=g.ggml_tensor_overhead() * (n_ops + 2)
        + g.ggml_graph_overhead_custom(graph_size, False),
        mem_buffer=None,
        no_alloc=True,
    )
    ctx = g.ggml_init(params)
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        x = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64)
        y = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64)
        gf = g.ggml_new_graph_custom(ctx, graph_size, False)

        add, expand = g.ggml_add, g.ggml_build_forward_expand
        t0 = time.perf_counter()
        for _ in range(n_ops):
            x = add(ctx, x, y)
            expand(gf, x)
        elapsed = time.perf_counter() - t0

        n_nodes = g.ggml_graph_n_nodes(gf)
        if n_nodes != n_ops:
            raise RuntimeError(f"graph has {n_nodes} nodes, expected {n_ops}")
    finally:
        g.ggml_free(ctx)
    return elapsed


class CtypesRoundTrip:
    """Workload 2 through ctypes: ``rt(a, b)`` returns ``a + b`` computed by ggml.

    :meth:`setup` (called by the constructor) creates the context, tensors,
    graph and cplan once; each call then does one round trip: memmove the two
    float32 arrays into ``a`` and ``b``, ``ggml_graph_compute``, copy ``c``
    into a new numpy array.  Tensor data pointers are looked up once in setup,
    as a reasonable ctypes user would.  Call :meth:`close` (or use it as a
    context manager) to free the context.
    """

    def __init__(self, n: int = 64, lib: CtypesGGML | None = None):
        self.n = int(n)
        self.lib = lib if lib is not None else load_ctypes_ggml()
        self.ctx = None
        self.setup()

    def setup(self) -> None:
        self.close()
        g = self.lib
        n = self.n
        nbytes = n * 4
        params = ggml_init_params(
            mem_size=3 * (g.ggml_tensor_overhead() + nbytes)
            + g.ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE, False)
            + 1024,
            mem_buffer=None,
            no_alloc=False,
        )
        ctx = g.ggml_init(params)
        if not ctx:
            raise MemoryError("ggml_init failed")
        self.ctx = ctx
        a = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n)
        b = g.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n)
        c = g.ggml_add(ctx, a, b)
        gf = g.ggml_new_graph_custom(ctx, GGML_DEFAULT_GRAPH_SIZE, False)
        g.ggml_build_forward_expand(gf, c)

        cplan = g.ggml_graph_plan(gf, 1, None)
        self._work = None
        if cplan.work_size > 0:
            self._work = (ctypes.c_uint8 * cplan.work_size)()
            cplan.work_data = ctypes.cast(self._work, ctypes.POINTER(ctypes.c_uint8))

        self.gf = gf
        self.cplan = cplan
        self._cplan_ref = ctypes.byref(cplan)
        self.nbytes = g.ggml_nbytes(c)
        assert self.nbytes == nbytes
        self.a_data = g.ggml_get_data(a)
        self.b_data = g.ggml_get_data(b)
        self.c_data = g.ggml_get_data(c)
        self._tensors = (a, b, c)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        n = self.n
        for arr in (a, b):
            if arr.dtype != np.float32 or arr.size != n or not arr.flags.c_contiguous:
                raise ValueError(f"expected a C-contiguous float32 array of {n} elements")
        nbytes = self.nbytes
        ctypes.memmove(self.a_data, a.ctypes.data, nbytes)
        ctypes.memmove(self.b_data, b.ctypes.data, nbytes)
        status = self.lib.ggml_graph_compute(self.gf, self._cplan_ref)
        if status != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")
        out = np.empty(n, dtype=np.float32)
        ctypes.memmove(out.ctypes.data, self.c_data, nbytes)
        return out

    def close(self) -> None:
        if self.ctx:
            self.lib.ggml_free(self.ctx)
        self.ctx = None

    def __enter__(self) -> CtypesRoundTrip:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
