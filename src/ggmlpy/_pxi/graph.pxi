# graph.pxi: Graph, ggml's computation graph, with capacity checked before
# every expand and CPU compute that releases the GIL and can be interrupted.

# C helpers over the graph's internals (ggmlpy_graph.h says why each exists).
cdef extern from "ggmlpy_graph.h":
    int ggmlpy_count_new(g.ggml_cgraph * gr, g.ggml_tensor * root, int * n_nodes, int * n_leafs, int * depth) nogil
    int ggmlpy_expand_one(g.ggml_cgraph * gr, g.ggml_tensor * root) noexcept nogil
    int ggmlpy_use_count(g.ggml_cgraph * gr, g.ggml_tensor * t) noexcept nogil
    uint64_t ggmlpy_unalloc_mask(g.ggml_cgraph * gr, char ** starts, size_t * sizes, int n, int written) noexcept nogil
    int64_t ggmlpy_bad_index(const g.ggml_tensor * t, int64_t bound, int64_t * value) nogil


cdef unsigned long long _graph_serial = 0


cdef unsigned long long _next_graph_serial() noexcept:
    global _graph_serial
    _graph_serial += 1
    return _graph_serial


# ggml visits new parts of a graph recursively; keep far below a thread's stack.
cdef int _MAX_EXPAND_DEPTH = 50000
MAX_EXPAND_DEPTH = _MAX_EXPAND_DEPTH

cdef g.ggml_backend_dev_t _cpu_dev = NULL


cdef g.ggml_backend_dev_t _cpu_device() except NULL:
    global _cpu_dev
    if _cpu_dev == NULL:
        _cpu_dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
        if _cpu_dev == NULL:
            raise BackendUnavailable("the CPU backend is not registered")
    return _cpu_dev


cdef struct _AbortState:
    volatile bint * cancel
    int64_t next_check_us
    PyObject * exc


cdef bint _abort_poll(void * data) noexcept nogil:
    # Called by ggml between nodes on the calling thread. Cancellation is a flag
    # read; signals (Ctrl-C) are looked at every 50 ms under the GIL.
    cdef _AbortState * st = <_AbortState *> data
    cdef int64_t now
    if st.cancel[0]:
        return True
    now = g.ggml_time_us()
    if now < st.next_check_us:
        return False
    st.next_check_us = now + 50000
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as e:
            Py_INCREF(e)
            st.exc = <PyObject *> e
            return True
    return False


cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1


@cython.final
@cython.no_gc_clear
cdef class Graph:
    """A ggml computation graph. Made by ``Context.new_graph()``.

    Nodes are added with ``build_forward_expand(t)``, which pulls in every
    ancestor of ``t`` not yet present; ``compute()`` runs them in order on the
    CPU. Capacity is checked before each expand, so a full graph raises
    ``GGMLMemoryError`` instead of aborting.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("Graphs are created by a Context: ctx.new_graph(size)")

    def __dealloc__(self):
        if self.tp != NULL:
            g.ggml_threadpool_free(self.tp)
            self.tp = NULL
        if self.work != NULL:
            free(self.work)
            self.work = NULL
        if self.ptr != NULL:
            self.ptr = NULL
            _debug_count_nogil(1)

    cdef int _ensure(self) except -1:
        return self._ensure_op("graph")

    cdef int _ensure_op(self, str op) except -1:
        if self.gen != self.ctx.gen:
            raise ClosedError(f"{op}: the graph's context has been freed or reset")
        return 0

    cdef int _note_ctx(self, _ContextBase c) except -1:
        # Remember every context whose tensors the graph holds (and what those
        # read from), so compute can refuse to run over freed memory.
        cdef _ContextBase d
        for entry in self.ctxs:
            if entry[0] is c and entry[2] == len(c.deps):
                return 0
        todo = [c]
        while todo:
            d = todo.pop()
            for i, entry in enumerate(self.ctxs):
                if entry[0] is d:
                    if entry[2] == len(d.deps):
                        break
                    self.ctxs[i] = (d, d.gen, len(d.deps))
                    todo.extend(d.deps)
                    break
            else:
                self.ctxs.append((d, d.gen, len(d.deps)))
                todo.extend(d.deps)
        return 0

    cdef int _check_ctxs(self) except -1:
        # Every context the graph reads is alive, unchanged since it was added, and any memory a
        # graph allocator gave its tensors still exists. (ggml never moves a tensor that has data:
        # allocating the graph again would keep pointers into a replaced buffer.)
        cdef _ContextBase c
        if len(self.ctxs) == 1 and not self.ctx.deps:
            if self.ctx.allocs:
                _allocs_live(self.ctx, "graph_compute")
            return 0          # only the graph's own context, checked by _ensure
        for entry in self.ctxs:
            c = entry[0]
            if c.freed or c.gen != entry[1]:
                raise ClosedError("graph_compute: the graph uses tensors of a context that was freed or reset "
                                  "since they were added")
            if c.deps:
                _deps_alive(c, "graph_compute")
            if c.allocs:
                _allocs_live(c, "graph_compute")
        return 0

    cdef _ContextBase _owner(self, g.ggml_tensor * p):
        # The context whose arena holds p, among all the graph holds (expanded tensors of other
        # contexts included): the Tensor handed out must go stale when that context is freed.
        cdef _ContextBase c
        for entry in self.ctxs:
            c = entry[0]
            if c.mem != NULL and <char *> c.mem <= <char *> p < <char *> c.mem + c.mem_size:
                return c
        return _owner_of(self.ctx, p)

    cdef bint _ctxs_valid(self) noexcept:
        # _check_ctxs without raising (for cleanup paths)
        cdef _ContextBase c
        if self.gen != self.ctx.gen:
            return False
        for entry in self.ctxs:
            c = entry[0]
            if c.freed or c.gen != entry[1]:
                return False
            for d, gen in c.deps.items():
                if (<_ContextBase> d).freed or (<_ContextBase> d).gen != gen:
                    return False
        return True

    cdef int _readable(self) except -1:
        # Inspection reads every node and leaf, which may live in other contexts: those must be
        # alive too (a context freed after its tensors were expanded into this graph would leave
        # dangling pointers here).
        self._ensure()
        self._check_ctxs()
        return 0

    cdef int _begin(self, str op) except -1:
        # Mark the graph and every context it reads as in use for the time the GIL is released
        # (compute, allocation): freeing, resetting or expanding them meanwhile raises instead of
        # pulling memory from under ggml. The contexts whose tensors it writes (its nodes, the
        # inputs an allocator places) are taken exclusively: ggml's allocators and scheduler
        # rewrite those tensors' fields, so a second graph over them must wait its turn.
        cdef _ContextBase c
        cdef uint64_t written
        cdef int i = 0
        if self.busy:
            raise GGMLValueError(f"{op}: this graph is already being computed or allocated (in another thread)")
        written = self._ctx_mask(True)
        taken = []
        for entry in self.ctxs:
            c = entry[0]
            if written & ((<uint64_t> 1) << (i if i < 63 else 63)):
                if c.writers:
                    for c in taken:
                        c.writers -= 1
                    raise GGMLValueError(f"{op}: another graph that computes tensors of the same context is running in "
                                         f"another thread; one graph at a time may write a context's tensors")
                c.writers += 1
                taken.append(c)
            i += 1
        self.busy = True
        self.busy_ctxs = [entry[0] for entry in self.ctxs]
        self.written_ctxs = taken
        for c in self.busy_ctxs:
            c.busy += 1
        return 0

    cdef void _end(self) noexcept:
        cdef _ContextBase c
        if self.busy_ctxs is not None:
            for c in self.busy_ctxs:
                c.busy -= 1
            for c in self.written_ctxs:
                c.writers -= 1
            self.busy_ctxs = None
            self.written_ctxs = None
        self.busy = False

    cdef uint64_t _unallocated_mask(self) noexcept:
        return self._ctx_mask(False)

    cdef uint64_t _ctx_mask(self, bint written) noexcept:
        # Which of self.ctxs own tensors without data / tensors a compute writes (see ggmlpy_unalloc_mask).
        cdef char * starts[64]
        cdef size_t sizes[64]
        cdef int n = 0
        cdef _ContextBase c
        for entry in self.ctxs:
            c = entry[0]
            starts[n] = <char *> c.mem
            sizes[n] = c.mem_size if c.mem != NULL else 0
            n += 1
            if n == 64:
                break
        return ggmlpy_unalloc_mask(self.ptr, starts, sizes, n, written)

    @property
    def context(self):
        return self.ctx

    @property
    def size(self):
        """Maximum number of nodes (and, separately, of leafs)."""
        self._ensure()
        return self.ptr.size

    @property
    def n_nodes(self):
        """Number of computed tensors in the graph."""
        self._ensure()
        return self.ptr.n_nodes

    @property
    def n_leafs(self):
        """Number of constant inputs (tensors with no op) in the graph."""
        self._ensure()
        return self.ptr.n_leafs

    def __len__(self):
        self._ensure()
        return self.ptr.n_nodes

    def node(self, int i):
        """The i-th node (negative i counts from the end)."""
        self._readable()
        cdef int n = self.ptr.n_nodes
        if i < -n or i >= n:
            raise IndexError(f"graph_node: index {i} out of range for a graph of {n} nodes")
        if i < 0:
            i += n
        return _wrap(self._owner(self.ptr.nodes[i]), self.ptr.nodes[i])

    @property
    def nodes(self):
        """All nodes, in execution order."""
        self._readable()
        return [_wrap(self._owner(self.ptr.nodes[i]), self.ptr.nodes[i]) for i in range(self.ptr.n_nodes)]

    @property
    def leafs(self):
        """All leafs (tensors without an op)."""
        self._readable()
        return [_wrap(self._owner(self.ptr.leafs[i]), self.ptr.leafs[i]) for i in range(self.ptr.n_leafs)]

    def _visit_state(self):
        """For tests: per node, then per leaf, (name, use count, marked for compute) as ggml's visit left them."""
        self._readable()
        cdef g.ggml_tensor * t
        out = []
        for i in range(self.ptr.n_nodes + self.ptr.n_leafs):
            t = self.ptr.nodes[i] if i < self.ptr.n_nodes else self.ptr.leafs[i - self.ptr.n_nodes]
            out.append((t.name.decode(errors="replace"), ggmlpy_use_count(self.ptr, t),
                        bool(t.flags & g.GGML_TENSOR_FLAG_COMPUTE)))
        return out

    def get_tensor(self, str name):
        """The node or leaf named ``name``, or None."""
        self._readable()
        cdef bytes b = name.encode()
        cdef g.ggml_tensor * p = g.ggml_graph_get_tensor(self.ptr, b)
        return None if p == NULL else _wrap(self._owner(p), p)

    @cython.always_allow_keywords(False)   # METH_O: the hot call of op-by-op graph building
    def build_forward_expand(self, Tensor tensor not None):
        """Add ``tensor`` and every ancestor not yet in the graph.

        Raises
        ------
        GGMLMemoryError
            The graph has no room for the new nodes or leafs.
        ClosedError
            The tensor's context was freed.
        """
        cdef int n_nodes, n_leafs, depth, rc
        self._ensure_op("build_forward_expand")
        if self.busy:
            raise GGMLValueError("build_forward_expand: the graph is being computed in another thread; "
                                 "expand it after the compute returns")
        _arg(tensor, "build_forward_expand", "tensor")
        if tensor.ctx is not self.ctx:
            self._note_ctx(tensor.ctx)
        elif len(self.ctx.deps) != self.own_ndeps:
            self._note_ctx(self.ctx)
            self.own_ndeps = len(self.ctx.deps)
        rc = ggmlpy_expand_one(self.ptr, tensor.ptr)
        if rc == 1:
            return      # one new node, filed by the fast path as ggml's expand would have
        if rc == 0:
            n_nodes = n_leafs = depth = 0
        elif ggmlpy_count_new(self.ptr, tensor.ptr, &n_nodes, &n_leafs, &depth) != 0:
            raise GGMLMemoryError("build_forward_expand: out of host memory while counting new nodes")
        if self.ptr.n_nodes + n_nodes > self.ptr.size or self.ptr.n_leafs + n_leafs > self.ptr.size:
            raise GGMLMemoryError(
                f"build_forward_expand: graph is full (has {self.ptr.n_nodes} nodes and {self.ptr.n_leafs} leafs "
                f"of size {self.ptr.size}; this expand adds {n_nodes} nodes and {n_leafs} leafs); "
                f"create it with ctx.new_graph(size=...) larger")
        if depth > _MAX_EXPAND_DEPTH:
            raise GGMLValueError(f"build_forward_expand: {depth} new nodes in one dependency chain; expand in "
                                 f"steps of at most {_MAX_EXPAND_DEPTH} (ggml visits them recursively)")
        g.ggml_build_forward_expand(self.ptr, tensor.ptr)

    def clear(self):
        """Remove every node and leaf."""
        self._ensure()
        if self.busy:
            raise GGMLValueError("graph_clear: the graph is being computed in another thread")
        g.ggml_graph_clear(self.ptr)
        self.checked_nodes = 0
        self.index_checks = []

    def cancel(self):
        """Stop the compute in progress (from another thread); it raises ``ComputeAborted``."""
        self.cancel_flag = True

    cdef int _check_compute(self, g.ggml_backend_dev_t dev) except -1:
        # Every node and leaf needs memory, and the CPU backend must implement
        # each node for its types; ggml would crash or abort otherwise.
        cdef int i
        cdef g.ggml_tensor * t
        for i in range(self.ptr.n_leafs):
            t = self.ptr.leafs[i]
            if _device_tensor(t):
                raise GGMLValueError(f"graph_compute: leaf '{t.name.decode()}' lives in device memory; compute "
                                     f"with its backend (Backend.graph_compute or a Scheduler)")
            if t.data == NULL and g.ggml_nelements(t) > 0:
                raise GGMLValueError(f"graph_compute: leaf '{t.name.decode()}' ({g.ggml_type_name(t.type).decode()} "
                                     f"ne={_ne_str(t)}) has no data; allocate it or use an allocating context")
        for i in range(self.checked_nodes, self.ptr.n_nodes):
            t = self.ptr.nodes[i]
            if _device_tensor(t):
                raise GGMLValueError(f"graph_compute: node '{t.name.decode()}' lives in device memory; compute "
                                     f"with its backend (Backend.graph_compute or a Scheduler)")
            if t.data == NULL and g.ggml_nelements(t) > 0:
                raise GGMLValueError(f"graph_compute: node '{t.name.decode()}' ({g.ggml_op_desc(t).decode()}) has no data; "
                                     f"its context is no_alloc: allocate the graph with a graph allocator")
            _check_cpu_node(t, dev)
            _plan_index_check(t, self.index_checks)
        self.checked_nodes = self.ptr.n_nodes
        return 0

    def compute(self, int n_threads=0):
        """Compute the graph on the CPU with ``n_threads`` threads (0: all cores).

        The GIL is released while ggml runs. Ctrl-C interrupts between nodes
        (KeyboardInterrupt); ``cancel()`` from another thread raises
        ``ComputeAborted``.

        Raises
        ------
        GGMLValueError
            A tensor has no data, or the CPU backend does not implement a node
            for its types.
        ClosedError
            A context of the graph's tensors was freed.
        """
        cdef g.ggml_cplan plan
        cdef g.ggml_status status
        cdef _AbortState st
        cdef void * w
        cdef g.ggml_threadpool_params tpp
        self._ensure_op("graph_compute")
        self._check_ctxs()
        if n_threads <= 0:
            n_threads = _default_threads()
        if n_threads > 512:
            raise GGMLValueError(f"graph_compute: n_threads={n_threads} exceeds ggml's maximum of 512")
        if self.checked_nodes != self.ptr.n_nodes:
            self._check_compute(_cpu_device())
        for entry in self.index_checks:
            _scan_indices(entry)
        if self.busy:
            raise GGMLValueError("graph_compute: this graph is already being computed (from another thread)")
        if self.tp == NULL or self.tp_n != n_threads:
            # A threadpool kept with the graph: ggml would otherwise build and
            # tear one down on every compute.
            if self.tp != NULL:
                g.ggml_threadpool_free(self.tp)
                self.tp = NULL
            tpp = g.ggml_threadpool_params_default(n_threads)
            self.tp = g.ggml_threadpool_new(&tpp)
            if self.tp == NULL:
                raise GGMLMemoryError(f"graph_compute: could not create a threadpool of {n_threads} threads")
            self.tp_n = n_threads
        plan = g.ggml_graph_plan(self.ptr, n_threads, self.tp)
        if plan.work_size > self.work_size:
            w = malloc(plan.work_size)
            _check_alloc(w, plan.work_size, "graph_compute work buffer")
            free(self.work)
            self.work = w
            self.work_size = plan.work_size
        plan.work_data = <uint8_t *> self.work
        st.cancel = &self.cancel_flag
        st.next_check_us = g.ggml_time_us() + 50000
        st.exc = NULL
        plan.abort_callback = _abort_poll
        plan.abort_callback_data = &st
        self._begin("graph_compute")
        try:
            with nogil:
                status = g.ggml_graph_compute(self.ptr, &plan)
        finally:
            self._end()
        self.cancel_flag = False
        if st.exc != NULL:
            exc = <object> st.exc
            Py_DECREF(exc)
            raise exc
        _check_status(status, "graph_compute")

    def print(self, file=None):
        """Print one line per node and leaf: index, op, type, ne, name."""
        print(self.summary(), file=file)

    def summary(self):
        """A readable listing of the graph's nodes and leafs."""
        self._readable()
        lines = [f"graph: {self.ptr.n_nodes} nodes, {self.ptr.n_leafs} leafs (size {self.ptr.size})"]
        for i in range(self.ptr.n_nodes):
            t = self.ptr.nodes[i]
            lines.append(f"  node {i:5d} {g.ggml_op_desc(t).decode():>16} {g.ggml_type_name(t.type).decode():>6} "
                         f"ne={_ne_str(t)} {t.name.decode()}")
        for i in range(self.ptr.n_leafs):
            t = self.ptr.leafs[i]
            lines.append(f"  leaf {i:5d} {g.ggml_type_name(t.type).decode():>6} ne={_ne_str(t)} {t.name.decode()}")
        return "\n".join(lines)

    def dump_dot(self, filename):
        """Write the graph in Graphviz dot format to ``filename``."""
        self._ensure()
        path = os.fsencode(filename)
        with open(path, "w"):
            pass  # ggml asserts if it cannot open the file: find out here
        self._readable()   # after the open, which let other threads run
        g.ggml_graph_dump_dot(self.ptr, NULL, path)

    def __repr__(self):
        if self.gen != self.ctx.gen:
            return "<ggmlpy.Graph (freed)>"
        return f"<ggmlpy.Graph {self.ptr.n_nodes} nodes, {self.ptr.n_leafs} leafs, size {self.ptr.size}>"


cdef int _default_threads_cache = 0

cdef int _default_threads():
    global _default_threads_cache
    if _default_threads_cache == 0:
        try:
            _default_threads_cache = len(os.sched_getaffinity(0))
        except AttributeError:
            _default_threads_cache = os.cpu_count() or 1
    return _default_threads_cache


cdef int _plan_index_check(g.ggml_tensor * t, list checks) except -1:
    # Index-driven kernels (get_rows, set_rows, mul_mat_id, add_id, ssm_scan) read or
    # write out of bounds -- or abort -- on a bad index, which depends on data.
    # Indices whose values exist before compute (leafs and views of leafs) are
    # scanned before every compute; computed indices are accepted only from ops
    # whose output range is known (argsort, top_k, argmax) and fits.
    cdef g.ggml_tensor * idx
    cdef g.ggml_tensor * p
    cdef int64_t bound
    if t.op == g.GGML_OP_GET_ROWS:
        idx, bound, name = t.src[1], t.src[0].ne[1], "get_rows"
    elif t.op == g.GGML_OP_SET_ROWS:
        idx, bound, name = t.src[1], t.ne[1], "set_rows"
    elif t.op == g.GGML_OP_MUL_MAT_ID:
        idx, bound, name = t.src[2], t.src[0].ne[2], "mul_mat_id"
    elif t.op == g.GGML_OP_ADD_ID:
        idx, bound, name = t.src[2], t.src[1].ne[1], "add_id"
    elif t.op == g.GGML_OP_SSM_SCAN:
        idx, bound, name = t.src[6], t.src[0].ne[3], "ssm_scan"
    else:
        return 0
    p = idx.view_src if idx.view_src != NULL else idx
    if p.op == g.GGML_OP_NONE:
        checks.append((<uintptr_t> idx, bound, name))
        return 0
    p = idx
    while p.op in (g.GGML_OP_VIEW, g.GGML_OP_RESHAPE, g.GGML_OP_PERMUTE, g.GGML_OP_TRANSPOSE,
                   g.GGML_OP_CONT, g.GGML_OP_DUP, g.GGML_OP_CPY):
        p = p.src[0]
    if p.op in (g.GGML_OP_ARGSORT, g.GGML_OP_TOP_K, g.GGML_OP_ARGMAX) and p.src[0].ne[0] <= bound:
        return 0
    raise GGMLValueError(f"{name}: indices computed by {g.ggml_op_desc(p).decode()} cannot be checked before compute "
                         f"(indices must come from a tensor with data, or from argsort/top_k/argmax over at most "
                         f"{bound} entries)")


cdef int _scan_indices(tuple entry) except -1:
    cdef g.ggml_tensor * idx = <g.ggml_tensor *> <uintptr_t> entry[0]
    cdef int64_t bound = entry[1], value = 0, where
    with nogil:
        where = ggmlpy_bad_index(idx, bound, &value)
    if where >= 0:
        raise GGMLValueError(f"{entry[2]}: index {value} at position {where} is out of range [0, {bound}) "
                             f"(got indices: {g.ggml_type_name(idx.type).decode()} ne={_ne_str(idx)})")
    return 0


def default_n_threads():
    """Threads ggmlpy computes with when none are given: the cores this process may use."""
    return _default_threads()


cdef int _check_cpu_node(g.ggml_tensor * t, g.ggml_backend_dev_t dev) except -1:
    if t.op == g.GGML_OP_NONE:
        return 0
    if not g.ggml_backend_dev_supports_op(dev, t):
        srcs = ", ".join(f"{g.ggml_type_name(t.src[i].type).decode()} ne={_ne_str(t.src[i])}"
                         for i in range(g.GGML_MAX_SRC) if t.src[i] != NULL)
        raise GGMLValueError(f"{g.ggml_op_desc(t).decode().lower()}: the CPU backend does not implement this op for "
                             f"these inputs (got {srcs} -> {g.ggml_type_name(t.type).decode()})")
    return 0
