# sched.pxi: the multi-backend scheduler and RPC endpoints.

import socket

# C helpers around ggml's scheduler (ggmlpy_sched.h says why each exists).
cdef extern from "ggmlpy_sched.h":
    int ggmlpy_is_read(g.ggml_cgraph * gr, g.ggml_tensor * t) noexcept nogil
    ctypedef struct ggmlpy_saved_srcs
    ggmlpy_saved_srcs * ggmlpy_srcs_save(g.ggml_cgraph * gr) nogil
    void ggmlpy_srcs_restore(ggmlpy_saved_srcs * s, int restore) nogil
    size_t ggmlpy_unplaced(g.ggml_cgraph * gr, g.ggml_tensor ** out, size_t cap) noexcept nogil
    void ggmlpy_unplace(void ** rec, size_t n) noexcept nogil

GGML_SCHED_MAX_BACKENDS = 16


@cython.no_gc_clear
cdef class Scheduler(_Allocator):
    """``ggml_backend_sched``: splits graphs over several backends and owns their compute buffers.

    Parameters
    ----------
    backends : sequence of Backend
        In priority order; the last must be a CPU backend (ggml's rule: it is
        the fallback for ops no other backend implements).
    bufts : sequence of BufferType, optional
        The compute buffer type per backend (default: each backend's own).
    graph_size : int
        Capacity for nodes + leafs of the graphs it schedules; graphs may use
        at most half of it (the scheduler adds copies of split inputs).
    parallel : bool
        Keep several copies of inputs to overlap consecutive computes.
    op_offload : bool
        Let GPU backends pull ops whose weights are in host memory.

    Notes
    -----
    ggml's scheduler reuses the previous graph's allocation when asked to
    compute again and silently keeps stale state after a failed reservation.
    This class keeps the order ggml needs (reset, assign, reserve, reset,
    assign, allocate), re-applies ``set_tensor_backend`` assignments after each
    reset, and refuses further use after an allocation failure.

    Tensors it allocates point into its compute buffers: their contexts keep
    the scheduler alive, and after ``free()`` (or after a bigger graph grew the
    buffers) they raise ``ClosedError`` instead of reading freed memory.
    ``free()`` waits for a compute running in another thread.
    """
    cdef g.ggml_backend_sched_t ptr
    cdef list backends
    cdef size_t graph_size
    cdef dict assigned         # tensor address -> (Tensor, Backend)
    cdef object allocated      # (Graph, n_nodes, n_leafs) currently allocated, or None
    cdef bint poisoned
    cdef bint need_reserve
    cdef object lock
    cdef ggmlpy_saved_srcs * saved   # inputs of the allocated graph's nodes before ggml rewired them
    cdef object shape          # (graph serial, n_nodes, n_leafs) the allocator was last planned for

    def __cinit__(self, backends, bufts=None, size_t graph_size=g.GGML_DEFAULT_GRAPH_SIZE,
                  bint parallel=False, bint op_offload=True):
        cdef g.ggml_backend_t c_backends[16]
        cdef g.ggml_backend_buffer_type_t c_bufts[16]
        cdef Backend b
        cdef int i, n
        self.backends = list(backends)
        self.assigned = {}
        self.lock = threading.RLock()
        n = len(self.backends)
        if not (1 <= n <= GGML_SCHED_MAX_BACKENDS):
            _fail("sched_new", f"needs 1 to {GGML_SCHED_MAX_BACKENDS} backends (got {n})")
        if not (graph_size >= 16):
            _fail("sched_new", f"graph_size must be >= 16 (got {graph_size})")
        for i, b in enumerate(self.backends):
            if b is None:
                raise GGMLTypeError("sched_new: backends must be Backend objects")
            b._ensure()
            c_backends[i] = b.ptr
        if not (len({id(x) for x in self.backends}) == n):
            _fail("sched_new", "backends must be distinct")
        if not ((<Backend> self.backends[n - 1]).dev.type == "CPU"):
            _fail("sched_new", f"the last backend must be a CPU backend (got {[x.name for x in self.backends]})")
        if bufts is not None:
            bl = list(bufts)
            if not (len(bl) == n):
                _fail("sched_new", f"bufts needs one BufferType per backend (got {len(bl)} for {n})")
            for i in range(n):
                if not isinstance(bl[i], BufferType) or not g.ggml_backend_supports_buft(c_backends[i], (<BufferType> bl[i]).ptr):
                    raise GGMLValueError(f"sched_new: backend {self.backends[i].name} cannot use buffer type {bl[i]!r}")
                c_bufts[i] = (<BufferType> bl[i]).ptr
        # Registered as a user of each backend, then the pointers read again with no Python code in
        # between: from here on Backend.free() in another thread refuses (ggml_backend_sched_new
        # below runs without the GIL).
        for b in self.backends:
            b.users.add(self)
        for i, b in enumerate(self.backends):
            if b.ptr == NULL:
                self.dead = True
                raise ClosedError("sched_new: a backend was freed while the scheduler was being made")
            c_backends[i] = b.ptr
        self.graph_size = graph_size
        with nogil:
            self.ptr = g.ggml_backend_sched_new(c_backends, c_bufts if bufts is not None else NULL, n, graph_size,
                                                parallel, op_offload)
        if self.ptr == NULL:
            self.dead = True
            raise GGMLMemoryError("sched_new: out of host memory")
        _debug_count("Scheduler", 1)

    def __dealloc__(self):
        if self.saved != NULL:
            ggmlpy_srcs_restore(self.saved, 0)   # the graph may be gone already; just free
            self.saved = NULL
        if self.ptr != NULL:
            if not self._servers_gone():
                g.ggml_backend_sched_free(self.ptr)
            self.ptr = NULL
            _debug_count_nogil(4)

    cdef bint _servers_gone(self) except -1:
        # Freeing compute buffers on a dead RPC server aborts an unpatched ggml client: leak them
        # instead (with our patch, vendor/ggml/patches/0001, nothing is ever skipped: see _rpc_gone).
        for b in self.backends:
            if _rpc_gone(b):
                return True
        return False

    def free(self):
        """Free the scheduler and its compute buffers now (after a compute running in another thread).

        Tensors it allocated raise ``ClosedError`` afterwards.
        """
        with self.lock:
            if self.ptr != NULL:
                self._refuse_busy("sched_free")
                self.dead = True
                self._restore()
                if not self._servers_gone():
                    g.ggml_backend_sched_free(self.ptr)
                self.ptr = NULL
                _debug_count_nogil(4)

    cdef tuple _sizes(self):
        # Compute buffer bytes per backend: ggml replaces a buffer only to grow it (or frees it in
        # reserve_size), so a change means tensors placed before point into freed memory.
        return tuple(g.ggml_backend_sched_get_buffer_size(self.ptr, (<Backend> b).ptr) for b in self.backends)

    cdef int _ready(self, str op) except -1:
        if self.ptr == NULL:
            raise ClosedError(f"{op}: the scheduler has been freed")
        if self.poisoned:
            raise GGMLValueError(f"{op}: this scheduler failed to allocate earlier; create a new Scheduler")
        return 0

    cdef int _check_graph(self, Graph graph, str op) except -1:
        cdef int i, k
        cdef g.ggml_tensor * t
        cdef g.ggml_backend_buffer * buf
        cdef Backend b
        graph._ensure()
        graph._check_ctxs()
        if 2 * (graph.ptr.n_nodes + graph.ptr.n_leafs) > <int> self.graph_size:
            raise GGMLMemoryError(f"{op}: the graph has {graph.ptr.n_nodes} nodes and {graph.ptr.n_leafs} leafs; a "
                                  f"scheduler of graph_size {self.graph_size} takes at most "
                                  f"{self.graph_size // 2} together (create it with a larger graph_size)")
        if graph.ptr.n_nodes == 0:
            raise GGMLValueError(f"{op}: the graph has no nodes to schedule")
        for k in range(2):
            for i in range(graph.ptr.n_leafs if k == 0 else graph.ptr.n_nodes):
                t = graph.ptr.leafs[i] if k == 0 else graph.ptr.nodes[i]
                buf = t.buffer if t.view_src == NULL or t.buffer != NULL else t.view_src.buffer
                if (k == 0 and buf == NULL and t.data == NULL and not (t.flags & g.GGML_TENSOR_FLAG_INPUT)
                        and not ggmlpy_is_read(graph.ptr, t)):
                    # ggml places a data-less leaf by the op that reads it, or on the CPU when it
                    # is an input; otherwise it has no backend and ggml's allocator aborts
                    raise GGMLValueError(f"{op}: leaf '{t.name.decode()}' has no memory, is not marked as an input "
                                         f"(set_input()) and no op reads it directly (views do not count): the scheduler cannot place it")
                if t.data != NULL and buf == NULL and t.view_src == NULL:
                    raise GGMLValueError(f"{op}: tensor '{t.name.decode()}' has host memory from its context; tensors "
                                         f"a scheduler runs must live in backend buffers (use a no_alloc context and "
                                         f"alloc_ctx_tensors) or be left for the scheduler to allocate")
                if buf != NULL:
                    for b in self.backends:
                        if g.ggml_backend_supports_buft(b.ptr, g.ggml_backend_buffer_get_type(buf)):
                            break
                    else:
                        raise GGMLValueError(f"{op}: tensor '{t.name.decode()}' is in "
                                             f"{g.ggml_backend_buffer_name(buf).decode()} memory, which none of the "
                                             f"scheduler's backends can use")
                if k == 1 and t.op != g.GGML_OP_NONE:
                    for b in self.backends:
                        if g.ggml_backend_supports_op(b.ptr, t):
                            break
                    else:
                        raise GGMLValueError(f"{g.ggml_op_desc(t).decode().lower()}: none of the scheduler's backends "
                                             f"implements this op for its types")
        return 0

    cdef void _restore(self) noexcept:
        cdef Graph prev
        if self.saved != NULL:
            prev = self.allocated[0] if self.allocated is not None else None
            # the saved nodes may live in any context the graph read: write back only while every one
            # of them is alive and unchanged (else the writes would land in freed or reused memory)
            ggmlpy_srcs_restore(self.saved, prev is not None and prev._ctxs_valid())
            self.saved = NULL

    cdef void _reset(self) noexcept:
        cdef Tensor t
        cdef Backend b
        self._restore()
        g.ggml_backend_sched_reset(self.ptr)
        self.allocated = None
        stale = []
        for key, (t, b) in self.assigned.items():
            if t.gen == t.ctx.gen:
                g.ggml_backend_sched_set_tensor_backend(self.ptr, t.ptr, b.ptr)
            else:
                stale.append(key)     # its graph was freed: forget it (a runner pins nodes of every graph)
        for key in stale:
            del self.assigned[key]

    def reserve(self, Graph graph not None):
        """Allocate compute buffers big enough for ``graph`` (a worst case); later graphs within it never allocate.

        The graph is only measured and stays usable afterwards.

        Raises
        ------
        GGMLMemoryError
            A buffer could not be allocated; this scheduler is unusable afterwards.
        """
        with self.lock:
            self._reserve(graph, True)

    cdef int _reserve(self, Graph graph, bint mark_busy) except -1:
        cdef bint ok
        cdef ggmlpy_saved_srcs * saved
        self._ready("sched_reserve")
        self._check_graph(graph, "sched_reserve")
        self._reset()
        self._unplace(graph)
        saved = ggmlpy_srcs_save(graph.ptr)
        if saved == NULL:
            raise GGMLMemoryError("sched_reserve: out of host memory")
        before = self._sizes()
        begun = False
        try:
            if mark_busy:
                graph._begin("sched_reserve")
                begun = True
            self._start_moving(graph, "sched_reserve")
            with nogil:
                ok = g.ggml_backend_sched_reserve(self.ptr, graph.ptr)
                ggmlpy_srcs_restore(saved, 1)
            saved = NULL
        finally:
            self.moving = False
            if saved != NULL:
                ggmlpy_srcs_restore(saved, 1)
            if begun:
                graph._end()
        if not ok or self._sizes() != before:
            self.epoch += 1
        if not ok:
            self.poisoned = True
            _rpc_check("sched_reserve")
            raise GGMLMemoryError("sched_reserve: could not allocate the compute buffers")
        self.need_reserve = False
        self.shape = (graph.serial, graph.ptr.n_nodes, graph.ptr.n_leafs)
        self._reset()
        return 0

    def reserve_size(self, Graph graph not None):
        """Bytes each backend's compute buffer would need for ``graph``, without keeping them (a dict by name)."""
        cdef size_t sizes[16]
        cdef int i, n
        cdef ggmlpy_saved_srcs * saved
        with self.lock:
            self._ready("sched_reserve_size")
            self._check_graph(graph, "sched_reserve_size")
            n = len(self.backends)
            self._reset()
            self._unplace(graph)
            saved = ggmlpy_srcs_save(graph.ptr)
            if saved == NULL:
                raise GGMLMemoryError("sched_reserve_size: out of host memory")
            before = self._sizes()
            begun = False
            try:
                graph._begin("sched_reserve_size")
                begun = True
                self._start_moving(graph, "sched_reserve_size")
                with nogil:
                    g.ggml_backend_sched_reserve_size(self.ptr, graph.ptr, sizes)
                    ggmlpy_srcs_restore(saved, 1)
                saved = NULL
            finally:
                self.moving = False
                if saved != NULL:
                    ggmlpy_srcs_restore(saved, 1)
                if begun:
                    graph._end()
            if self._sizes() != before:
                self.epoch += 1
            # reserve_size frees buffers that would have to grow: reserve again before the next allocation.
            self.need_reserve = True
            self._reset()
            _rpc_check("sched_reserve_size")
            return {self.backends[i].name: sizes[i] for i in range(n)}

    def alloc_graph(self, Graph graph not None):
        """Assign backends and memory to ``graph`` (reserving first if needed).

        ggml rewires the inputs that cross backends to the scheduler's copies
        while the graph is allocated; they are put back when the scheduler
        resets or allocates another graph, so the graph stays reusable.
        """
        with self.lock:
            self._alloc(graph, True)

    cdef int _alloc(self, Graph graph, bint mark_busy) except -1:
        cdef bint ok
        cdef uint64_t mask
        cdef size_t n, i
        cdef void ** rec
        self._ready("sched_alloc_graph")
        self._check_graph(graph, "sched_alloc_graph")
        if self.allocated is None or self.allocated[0] is not graph:
            # allocated before, then another graph: plan all of it again (ggmlpy_sched.h)
            self._unplace(graph)
        if self.need_reserve or self.shape != (graph.serial, graph.ptr.n_nodes, graph.ptr.n_leafs):
            # ggml re-plans by itself only when the node count changes and would otherwise place
            # leafs with another graph's plan (an abort or a crash): plan for this graph first
            self._reserve(graph, mark_busy)
        self._reset()
        mask = graph._unallocated_mask()
        # the tensors this allocation places, then (once placed) their buffers: see _unplace
        n = ggmlpy_unplaced(graph.ptr, NULL, 0)
        placed = PyBytes_FromStringAndSize(NULL, 2 * n * sizeof(void *))
        rec = <void **> PyBytes_AS_STRING(placed)
        ggmlpy_unplaced(graph.ptr, <g.ggml_tensor **> rec, n)
        before = self._sizes()
        self.saved = ggmlpy_srcs_save(graph.ptr)
        if self.saved == NULL:
            raise GGMLMemoryError("sched_alloc_graph: out of host memory")
        self.allocated = (graph, graph.ptr.n_nodes, graph.ptr.n_leafs)
        begun = False
        try:
            if mark_busy:
                graph._begin("sched_alloc_graph")
                begun = True
            self._start_moving(graph, "sched_alloc_graph")
            with nogil:
                ok = g.ggml_backend_sched_alloc_graph(self.ptr, graph.ptr)
        except BaseException:
            self.allocated = None
            raise
        finally:
            self.moving = False
            if begun:
                graph._end()
        if not ok or self._sizes() != before:
            self.epoch += 1
        if not ok:
            self.poisoned = True
            # ggml split the graph before its allocation failed: its nodes read the scheduler's copies
            # now; put the graph's own sources back while the graph is still known
            self._restore()
            self.allocated = None
            _rpc_check("sched_alloc_graph")
            raise GGMLMemoryError("sched_alloc_graph: could not allocate the graph's compute buffers")
        for i in range(n):
            rec[n + i] = <void *> (<g.ggml_tensor *> rec[i]).buffer
        graph.placed = placed
        self._stamp(graph, mask)
        return 0

    cdef int _unplace(self, Graph graph) except -1:
        # The tensors this graph's last allocation placed lose their memory (ggmlpy_sched.h).
        cdef bytes rec = graph.placed
        if rec is not None:
            graph.placed = None
            ggmlpy_unplace(<void **> PyBytes_AS_STRING(rec), len(rec) // (2 * sizeof(void *)))
        return 0

    def is_allocated(self, Graph graph not None):
        """Whether ``graph`` (unchanged since) is the graph the scheduler holds memory for now.

        A reused graph can then have its inputs set and be computed again
        without another allocation.
        """
        alloc = self.allocated
        return (alloc is not None and alloc[0] is graph and alloc[1] == graph.ptr.n_nodes
                and alloc[2] == graph.ptr.n_leafs)

    def compute(self, Graph graph not None):
        """Allocate (if ``graph`` is not the one allocated) and compute it (GIL released)."""
        self._compute(graph, False)

    def compute_async(self, Graph graph not None):
        """Start computing ``graph`` on backends that queue work; ``synchronize()`` waits for it.

        On the CPU this is the same as ``compute``.
        """
        self._compute(graph, True)

    cdef int _compute(self, Graph graph, bint is_async) except -1:
        cdef g.ggml_status st
        cdef g.ggml_cgraph * cg
        with self.lock:
            self._ready("sched_graph_compute")
            graph._ensure()
            graph._check_ctxs()
            graph._begin("sched_graph_compute")
            try:
                alloc = self.allocated
                if (alloc is None or alloc[0] is not graph or alloc[1] != graph.ptr.n_nodes
                        or alloc[2] != graph.ptr.n_leafs):
                    self._alloc(graph, False)
                for entry in graph.index_checks:
                    _scan_indices(entry)
                cg = graph.ptr
                # the backends are busy too: set_threadpool (or free) on one must wait, not pull the
                # thread pool from under this compute
                for b in self.backends:
                    (<Backend> b).busy += 1
                try:
                    with nogil:
                        if is_async:
                            st = g.ggml_backend_sched_graph_compute_async(self.ptr, cg)
                        else:
                            st = g.ggml_backend_sched_graph_compute(self.ptr, cg)
                finally:
                    for b in self.backends:
                        (<Backend> b).busy -= 1
            finally:
                graph._end()
            _rpc_check("sched_graph_compute")
            _check_status(st, "sched_graph_compute")
        return 0

    def synchronize(self):
        with self.lock:
            self._ready("sched_synchronize")
            with nogil:
                g.ggml_backend_sched_synchronize(self.ptr)

    def reset(self):
        """Forget the current allocation (tensor backend assignments are kept)."""
        with self.lock:
            self._ready("sched_reset")
            self._reset()

    cdef int _index(self, Backend backend, str op) except -1:
        for i, b in enumerate(self.backends):
            if b is backend:
                return i
        raise GGMLValueError(f"{op}: backend {backend.name} is not one of the scheduler's")

    def set_tensor_backend(self, Tensor node not None, Backend backend not None):
        """Pin ``node`` to ``backend`` (kept across resets until the tensor's context is freed)."""
        with self.lock:
            self._ready("sched_set_tensor_backend")
            _arg(node, "sched_set_tensor_backend", "node")
            self._index(backend, "sched_set_tensor_backend")
            self.assigned[<uintptr_t> node.ptr] = (node, backend)
            g.ggml_backend_sched_set_tensor_backend(self.ptr, node.ptr, backend.ptr)
            self.allocated = None

    def tensor_backend(self, Tensor node not None):
        """The backend ``node`` was assigned to in the current allocation (or pinned to), or None."""
        cdef g.ggml_backend_t p
        with self.lock:
            self._ready("sched_get_tensor_backend")
            _arg(node, "sched_get_tensor_backend", "node")
            if self.allocated is None and <uintptr_t> node.ptr in self.assigned:
                return self.assigned[<uintptr_t> node.ptr][1]
            p = g.ggml_backend_sched_get_tensor_backend(self.ptr, node.ptr)
            for b in self.backends:
                if (<Backend> b).ptr == p:
                    return b
            return None

    def buffer_size(self, Backend backend not None):
        """Bytes of ``backend``'s compute buffer."""
        with self.lock:
            self._ready("sched_get_buffer_size")
            self._index(backend, "sched_get_buffer_size")
            return g.ggml_backend_sched_get_buffer_size(self.ptr, backend.ptr)

    @property
    def backends(self):
        return list(self.backends)

    @property
    def n_splits(self):
        """Number of per-backend pieces of the last allocated graph."""
        self._ready("sched_get_n_splits")
        return g.ggml_backend_sched_get_n_splits(self.ptr)

    @property
    def n_copies(self):
        """Copies of split inputs kept (1, or 4 with ``parallel``)."""
        self._ready("sched_get_n_copies")
        return g.ggml_backend_sched_get_n_copies(self.ptr)

    def __repr__(self):
        if self.ptr == NULL:
            return "<ggmlpy.Scheduler (freed)>"
        return f"<ggmlpy.Scheduler [{', '.join(b.name for b in self.backends)}] graph_size={self.graph_size}>"


# -- RPC -----------------------------------------------------------------------------
# ggml's RPC client keeps one socket per endpoint, shared by every buffer and
# backend on that server. Upstream it aborts the process when a socket call
# fails or a reply has the wrong size; our patch
# (vendor/ggml/patches/0001-rpc-client-errors-instead-of-abort.patch) records
# the failure for the calling thread instead, shuts that socket down so that no
# later call reads a reply out of step, and bounds every socket call by a
# timeout. Each call that may talk to a server is followed by _rpc_check, which
# turns the recorded failure into RPCError / RPCTimeoutError naming the server.
# Freeing on a lost server records nothing (its memory is gone with it), so
# Buffer and Scheduler free as usual; _rpc_discard drops a failure met by a
# call whose result does not matter (device props).

from libc cimport stdio as cstdio

import ipaddress
import struct

cdef dict _rpc_devices = {}     # endpoint -> [Device]
cdef dict _rpc_locks = {}       # endpoint -> lock serializing calls (ggml shares one socket per endpoint)


class RPCError(ConnectionError, GGMLError):
    """An RPC server refused or lost the connection, or does not speak ggml's RPC protocol.

    ``endpoint`` is the server's ``host:port`` (None where unknown). Objects in
    that server's memory are lost; once it runs again, ``rpc_add_server`` and
    new buffers work again.
    """

    endpoint = None


class RPCTimeoutError(TimeoutError, RPCError):
    """An RPC server did not answer within the timeout (see ``rpc_set_timeout``)."""


def _rpc_error(cls, str message, endpoint):
    # OSError subclasses read a second constructor argument as strerror: set the endpoint afterwards.
    e = cls(message)
    e.endpoint = endpoint
    return e


#: Default bound, in seconds, on each send/receive of an RPC connection: long
#: enough for one graph compute on a slow server, finite so that a stalled
#: server cannot hang the client. ``GGMLPY_RPC_TIMEOUT`` (seconds, 0 = none)
#: overrides it at import.
RPC_DEFAULT_TIMEOUT = 300.0
cdef double _rpc_timeout = RPC_DEFAULT_TIMEOUT


def rpc_set_timeout(seconds):
    """Bound each call to an RPC server by ``seconds`` (0 or None: wait forever).

    Applies to connections ggml opens from now on: set it before
    ``rpc_add_server``. The limit is per socket send or receive, and a graph
    compute's result is received in one: it must exceed the longest graph
    compute of a server. Default ``RPC_DEFAULT_TIMEOUT`` (300 s), or the
    ``GGMLPY_RPC_TIMEOUT`` environment variable (seconds) at import.

    Raises
    ------
    GGMLValueError
        ``seconds`` is negative, not finite or above 49 days.
    """
    global _rpc_timeout
    s = 0.0 if seconds is None else float(seconds)
    if not (0.0 <= s <= 4.2e6):
        raise GGMLValueError(f"rpc_set_timeout: seconds must be in [0, 4.2e6] or None (got {seconds!r})")
    _rpc_timeout = s
    # a positive limit never rounds to 0 ms, which would mean no limit
    g.ggml_backend_rpc_set_timeout_ms(max(1, <uint32_t> (s * 1000.0 + 0.5)) if s > 0 else 0)


def rpc_get_timeout():
    """The bound ``rpc_set_timeout`` set, in seconds (0.0: none)."""
    return _rpc_timeout


def _rpc_timeout_from_env():
    text = os.environ.get("GGMLPY_RPC_TIMEOUT")
    if text:
        try:
            rpc_set_timeout(float(text))
            return
        except (ValueError, GGMLValueError):
            _log.warning("GGMLPY_RPC_TIMEOUT=%r is not a number of seconds in [0, 4.2e6]; using %g s",
                         text, RPC_DEFAULT_TIMEOUT)
    rpc_set_timeout(RPC_DEFAULT_TIMEOUT)


_rpc_timeout_from_env()


cdef int _rpc_check(str op, object endpoint=None) except -1:
    # Raise for an RPC failure this thread met since the last check.
    cdef char ep[96]
    cdef int kind = g.ggml_backend_rpc_take_error(ep, sizeof(ep))
    _log_drain()   # what the RPC client's own thread logged about it
    if kind == 0:
        return 0
    where = ep.decode("utf-8", "replace") or endpoint
    server = f"RPC server {where}" if where else "an RPC server"
    if kind == 2:
        raise _rpc_error(RPCTimeoutError, f"{op}: {server} did not answer within {_rpc_timeout:g} s "
                              f"(rpc_set_timeout changes the limit)", where)
    if kind == 3:
        raise _rpc_error(RPCError, f"{op}: {server} sent a malformed reply (not a compatible ggml RPC server?); "
                       f"the connection is closed", where)
    raise _rpc_error(RPCError, f"{op}: {server} refused or lost the connection (did it stop?)", where)


cdef void _rpc_discard() noexcept nogil:
    # Forget a recorded failure: after freeing (memory on a lost server is gone with it), or before a
    # call whose own failure must not be confused with an earlier one.
    cdef char ep[8]
    g.ggml_backend_rpc_take_error(ep, sizeof(ep))


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


cdef object _rpc_lock_for(object endpoint):
    if endpoint is None:
        return _NO_LOCK
    return _rpc_locks.setdefault(endpoint, threading.Lock())


def _parse_endpoint(str endpoint, bint server=False):
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or ":" in host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise GGMLValueError(f"rpc: endpoint must be 'host:port' with an IPv4 host and a port in 1..65535 "
                             f"(got {endpoint!r})")
    try:
        addr = socket.gethostbyname(host)
    except OSError as e:
        raise GGMLValueError(f"rpc: cannot resolve host {host!r}: {e}") from None
    if server:
        try:
            socket.inet_aton(host)
        except OSError:
            raise GGMLValueError(f"rpc-server: the host must be an IPv4 address such as 127.0.0.1 (got {host!r})") from None
    return addr, int(port)


# HELLO as the pinned ggml's client sends it (unchanged from ggml 0.20 to 0.25; the
# protocol version, 7 in ggml 0.25.3, comes from ggml-rpc.h): command byte 14, an 8-byte size,
# rpc_msg_hello_req (24 bytes of transport capabilities, zero: plain TCP). The
# reply is an 8-byte size then rpc_msg_hello_rsp (major, minor, patch, pad, 24
# bytes of capabilities). Mirrors ggml-rpc.cpp; test_rpc_robust checks it
# against a real server, so a pin with another layout fails there.
_RPC_CMD_HELLO = 14
_RPC_HELLO_REQ = 24
_RPC_HELLO_RSP = 28


def _rpc_recv_exact(sock, size_t n, str key):
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise _rpc_error(RPCError, f"rpc_add_server: {key} closed the connection after {len(data)} of {n} bytes of its "
                           f"HELLO reply: not a ggml RPC server, or one serving another client", key)
        data += chunk
    return bytes(data)


def _rpc_hello(str key, addr, int port, double timeout):
    # ggml's client connects and reads the HELLO reply with no limit of its
    # own: check within `timeout` that a ggml RPC server of our protocol
    # answers before ggml's client opens its connection.
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except TimeoutError:
        raise _rpc_error(RPCTimeoutError, f"rpc_add_server: no TCP connection to {key} within {timeout:g} s", key) from None
    except OSError as e:
        raise _rpc_error(RPCError, f"rpc_add_server: nothing answers at {key}: {e}", key) from None
    try:
        sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_HELLO_REQ) + bytes(_RPC_HELLO_REQ))
        size, = struct.unpack("<Q", _rpc_recv_exact(sock, 8, key))
        if size != _RPC_HELLO_RSP:
            raise _rpc_error(RPCError, f"rpc_add_server: {key} is not a compatible ggml RPC server (its HELLO reply announces "
                           f"{size} bytes, expected {_RPC_HELLO_RSP})", key)
        major, minor, patch = _rpc_recv_exact(sock, _RPC_HELLO_RSP, key)[:3]
    except TimeoutError:
        raise _rpc_error(RPCTimeoutError, f"rpc_add_server: {key} accepted the connection but gave no HELLO reply within "
                              f"{timeout:g} s (not a ggml RPC server, or busy with another client)", key) from None
    except RPCError:
        raise
    except OSError as e:
        raise _rpc_error(RPCError, f"rpc_add_server: {key} broke the HELLO exchange: {e}", key) from None
    finally:
        sock.close()
    if major != g.RPC_PROTO_MAJOR_VERSION or minor > g.RPC_PROTO_MINOR_VERSION:
        raise _rpc_error(RPCError, f"rpc_add_server: {key} speaks RPC protocol {major}.{minor}.{patch}; this build of ggml "
                       f"needs {g.RPC_PROTO_MAJOR_VERSION}.x with x <= {g.RPC_PROTO_MINOR_VERSION}", key)


def rpc_add_server(str endpoint, float timeout=5.0):
    """Connect to a ggml RPC server at ``host:port`` and return its devices.

    The endpoint is normalised to its IPv4 address (ggml keeps one connection
    per spelling; a server without our patch 0002 also serves one client at a
    time). The server must answer ggml's HELLO within ``timeout`` seconds;
    later calls to it are bounded by ``rpc_get_timeout()``.

    Raises
    ------
    BackendUnavailable
        This build has no RPC backend.
    GGMLValueError
        A malformed endpoint.
    RPCTimeoutError
        (a TimeoutError and an RPCError) No answer within ``timeout``.
    RPCError
        (a ConnectionError) Nothing answers at the endpoint, or it is not a
        ggml RPC server of this protocol version.
    """
    cdef bytes ep
    cdef g.ggml_backend_reg * reg
    cdef g.ggml_backend_dev_t dev
    cdef g.ggml_backend_buffer_type_t bt
    if not g.GGMLPY_HAVE_RPC:
        raise _unavailable("RPC")
    if not (timeout > 0):
        raise GGMLValueError(f"rpc_add_server: timeout must be > 0 seconds (got {timeout})")
    addr, port = _parse_endpoint(endpoint)
    key = f"{addr}:{port}"
    if key in _rpc_devices:
        return list(_rpc_devices[key])
    _rpc_hello(key, addr, port, timeout)
    ep = key.encode()
    cdef const char * c_ep = ep
    with _rpc_lock_for(key):
        _rpc_discard()
        with nogil:
            reg = g.ggml_backend_rpc_add_server(c_ep)
        _rpc_check("rpc_add_server", key)
        if reg == NULL:
            raise _rpc_error(RPCError, f"rpc_add_server: {key} is not a compatible ggml RPC server (see the ggmlpy log)", key)
        devs = []
        for i in range(g.ggml_backend_reg_dev_count(reg)):
            dev = g.ggml_backend_reg_dev_get(reg, i)
            # ggml makes each device's buffer type once and keeps it: make it
            # now, while the server is known to answer, so that it never fails later.
            with nogil:
                bt = g.ggml_backend_dev_buffer_type(dev)
            _rpc_check("rpc_add_server", key)
            if bt == NULL:
                raise _rpc_error(RPCError, f"rpc_add_server: {key} did not describe its device {i}", key)
            devs.append(Device._make(dev, key))
    _rpc_devices[key] = devs
    return list(devs)


cdef object _rpc_server_budget(object v, str where):
    # One entry of rpc_start_server's mem: None (no limit) or a byte count.
    cdef size_t c_max = <size_t> -1
    if v is None:
        return None
    try:
        n = operator.index(v) if not isinstance(v, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise GGMLValueError(f"rpc_start_server: {where} must be None, a whole number of bytes, or a list of one "
                             f"per device (got {v!r})")
    if not 0 < n <= c_max:
        raise GGMLValueError(f"rpc_start_server: {where} must be a byte count in 1..{c_max} or None (got {n})")
    return n


def _rpc_server_budgets(mem, size_t n):
    # rpc_start_server's mem as one entry per device.
    if not isinstance(mem, (list, tuple)):
        return [_rpc_server_budget(mem, "mem")] * n
    if len(mem) != n:
        raise GGMLValueError(f"rpc_start_server: mem lists {len(mem)} sizes for {n} device(s)")
    return [_rpc_server_budget(v, f"mem[{i}]") for i, v in enumerate(mem)]


#: ``rpc_start_server``'s defaults: a client whose HELLO, or any message once begun, makes no
#: progress for this many seconds is disconnected; at most this many clients are served at once.
RPC_SERVER_TIMEOUT = 30.0
RPC_SERVER_MAX_CLIENTS = 4


cdef void _rpc_server_log_cb(g.ggml_log_level level, const char * text, void * user) noexcept nogil:
    # ggml's server logs from a thread per client that Python never runs on (the usual hook would
    # queue those lines until a Python thread logs, which never happens in a server): straight to
    # stderr, at the level set_log_level chose.
    global _log_last_level
    cdef int lvl = level
    if lvl == g.GGML_LOG_LEVEL_CONT:
        lvl = _log_last_level
    else:
        _log_last_level = lvl
    if lvl < _log_min_level or text == NULL:
        return
    cstdio.fputs(text, cstdio.stderr)
    cstdio.fflush(cstdio.stderr)


def _rpc_server_warning(str addr):
    """The warning ``rpc_start_server`` prints before it listens on ``addr`` (an IPv4 address), or
    None for a loopback address: the protocol has no authentication and no encryption."""
    if ipaddress.ip_address(addr).is_loopback:
        return None
    lines = [f"WARNING: the RPC server will listen on {addr}, reachable from other machines.",
             "ggml's RPC protocol has no authentication and no encryption: anyone who can reach",
             "this port can use this machine's devices and memory, and read and write what",
             "clients store there. Serve trusted networks only; 127.0.0.1 keeps it local."]
    width = max(len(line) for line in lines)
    bar = "!" * (width + 4)
    return "\n".join([bar, *(f"! {line.ljust(width)} !" for line in lines), bar])


def rpc_start_server(str endpoint, devices=None, cache_dir=None, size_t n_threads=0, mem=None,
                     timeout=RPC_SERVER_TIMEOUT, max_clients=RPC_SERVER_MAX_CLIENTS):
    """Serve ``devices`` (default: the CPU) over ggml's RPC protocol at ``endpoint``; blocks.

    Run it in its own process (``ggmlpy rpc-server``): ggml's server has no
    stop call. The protocol has no authentication and no encryption: a host
    other than a loopback address prints a warning to stderr first.

    With our patch (``vendor/ggml/patches/0002-rpc-server-hardening.patch``)
    each client is served on a thread of its own, its calls into the devices
    taking turns; a client that sends something malformed or too large is
    disconnected and the server goes on. ``timeout`` (seconds, default 30; 0:
    none) disconnects a client whose HELLO, or any message once begun, makes no
    progress for that long (a client may stay idle between messages as long as
    it likes); ``max_clients`` (default 4; 0: no limit) connections are served
    at once, one more is closed within half a second (unless one ends
    meanwhile) with a line on stdout. What a client
    declares cannot make the server allocate beyond what it needs: a fixed-size
    request must be exactly its size, tensor data must fit the tensor and a
    buffer that client allocated (so ``mem`` bounds it) and is copied as it
    arrives, a graph is at most 64 MiB. Without the patch (a ggml tree given
    with GGMLPY_GGML_DIR) ``timeout`` and ``max_clients`` do nothing, one
    client is served at a time and a malformed request can abort the process.

    ``mem`` limits the memory a device offers its clients: None (each device
    offers what it has), one byte count for every device, or a list with one
    entry per device (None: that one is not limited). A limited device
    reports the limit as its total and the limit less its live buffers as
    free, and refuses an allocation that does not fit, which the client sees
    as a failed allocation (GGMLMemoryError naming the device). The limit may
    exceed the device's real memory; allocations then also fail where the
    device runs out.

    Raises
    ------
    OSError
        The port is in use.
    GGMLValueError
        A malformed endpoint, or a bad ``mem``, ``timeout`` or ``max_clients``.
    GGMLMemoryError
        A limited device could not be set up (it cannot allocate at all).
    """
    cdef g.ggml_backend_dev_t devs[16]
    cdef size_t n = 0
    cdef bytes ep, cd
    cdef const char * c_cd = NULL
    cdef Device d
    if not g.GGMLPY_HAVE_RPC:
        raise _unavailable("RPC")
    addr, port = _parse_endpoint(endpoint, server=True)
    dl = list(devices) if devices is not None else [device("CPU")]
    if not (1 <= len(dl) <= 16):
        _fail("rpc_start_server", "serve 1 to 16 devices")
    budgets = _rpc_server_budgets(mem, len(dl))
    t = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else -1.0
    if not 0 <= t <= 86400:             # also refuses nan
        raise GGMLValueError(f"rpc_start_server: timeout must be 0 (none) or a number of seconds up to 86400 "
                             f"(got {timeout!r})")
    if isinstance(max_clients, bool) or not isinstance(max_clients, int) or not 0 <= max_clients <= 1024:
        raise GGMLValueError(f"rpc_start_server: max_clients must be 0 (no limit) or a whole number up to 1024 "
                             f"(got {max_clients!r})")
    warning = _rpc_server_warning(addr)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))      # raises OSError (address in use) before ggml would just return
    for d, budget in zip(dl, budgets):
        if budget is None:
            devs[n] = d.ptr
        else:
            # lives for the process, as ggml's server does not return while it serves
            devs[n] = g.ggmlpy_budget_device_new(d.ptr, <size_t> budget)
            if devs[n] == NULL:
                raise GGMLMemoryError(f"rpc_start_server: could not give {d.name} a memory limit: it cannot "
                                      f"allocate a buffer (or the host is out of memory)")
        n += 1
    if n_threads == 0:
        n_threads = _default_threads()
    ep = f"{addr}:{port}".encode()
    if cache_dir is not None:
        cd = os.fsencode(cache_dir)
        c_cd = cd
    cdef const char * c_ep = ep
    g.ggml_backend_rpc_server_set_limits(max(1, <uint32_t> (t * 1000.0 + 0.5)) if t > 0 else 0,
                                         <uint32_t> max_clients)
    sys.stderr.flush()
    g.ggml_log_set(_rpc_server_log_cb, NULL)     # for the life of the process: the server never returns
    with nogil:
        g.ggml_backend_rpc_start_server(c_ep, c_cd, n_threads, n, devs)
    raise RuntimeError(f"rpc_start_server: the server at {addr}:{port} stopped (see the messages above)")
