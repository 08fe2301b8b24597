# Class fields and cdef signatures of _core. The C declarations live in _ggml.pxd.
cimport cython
cimport ggmlpy._ggml as g
from libc.stdint cimport int64_t, uint64_t


cdef class Tensor                       # tensor.pxi (below; the ops' cdef helpers name it)


# Context is one class made of a chain of cdef classes, one file each (context.pxi
# says why); the fields and the C-level methods are those of the first.
cdef class _ContextBase:                # context.pxi
    cdef g.ggml_context * ptr
    cdef void * mem           # the arena we allocated; ggml does not own it
    cdef readonly size_t mem_size
    cdef unsigned int gen     # bumped by reset()/free(): outstanding Tensors go stale
    cdef bint freed           # free() was called (the arena may live on until exports end)
    cdef bint no_alloc_       # mirrors ggml_get_no_alloc (read on every op)
    cdef Py_ssize_t n_exports # live buffer/DLPack exports of tensor memory
    cdef dict deps            # Context -> its generation when this context's tensors started reading it
    cdef list keep            # other owners (buffers, foreign memory) kept alive
    cdef object dependents    # WeakSet of Contexts whose tensors read this one's
    cdef size_t stale_below   # arena offset below which tensors read a freed/reset context
    cdef dict allocs          # _Allocator -> its epoch when it last gave this context's tensors memory
    cdef int busy             # running computes / device copies that read this context (GIL-protected)
    cdef int writers          # running graph operations that write its tensors (0 or 1)
    cdef bint allocating      # alloc_ctx_tensors is walking its tensors (no new objects meanwhile)
    cdef object __weakref__
    cdef int _invalidate_dependents(self) except -1
    cdef bint _fresh(self, g.ggml_tensor * p) noexcept
    cdef int _ensure(self) except -1
    cdef int _ensure_op(self, str op) except -1
    cdef int _refuse_busy(self, str op) except -1
    cdef void _release(self) noexcept
    cdef int _room(self, str op, int64_t data_bytes, int n_tensors) except -1


cdef class _ContextOps(_ContextBase):   # ops.pxi
    pass


cdef class _ContextNN(_ContextOps):     # ops_nn.pxi
    pass


cdef class _ContextKernels(_ContextNN):     # kernels.pxi
    cdef int _attn_check(self, str op, Tensor q, Tensor k, Tensor v, Tensor mask, int max_d) except -1


cdef class Context(_ContextKernels):    # context.pxi: the public class
    pass


@cython.final
cdef class Tensor:
    cdef g.ggml_tensor * ptr
    cdef _ContextBase ctx
    cdef unsigned int gen
    cdef object base          # owner of foreign memory behind ptr.data, if any
    cdef bint readonly
    cdef Py_ssize_t _shape[4]
    cdef Py_ssize_t _strides[4]
    cdef int _ensure(self) except -1
    cdef int _ensure_op(self, str op) except -1
    cdef int _data(self, str op) except -1
    cdef int _host(self, str op) except -1
    cdef object _get_converted(self)
    cdef object _device_get(self)
    cdef int _device_set(self, array) except -1
    cdef int _set_slow(self, array) except -1


@cython.final
cdef class Graph:
    cdef g.ggml_cgraph * ptr
    cdef _ContextBase ctx
    cdef unsigned int gen
    cdef list ctxs            # [(Context, gen, n deps)] every context whose tensors the graph holds
    cdef Py_ssize_t own_ndeps # len(ctx.deps) when ctxs was last brought up to date for ctx
    cdef void * work
    cdef size_t work_size
    cdef int checked_nodes    # nodes [0, checked_nodes) were validated for compute
    cdef list index_checks    # [(index tensor address, bound, op)] scanned before every compute
    cdef volatile bint cancel_flag
    cdef bint busy            # a compute or allocation is running (from some thread)
    cdef list busy_ctxs       # contexts whose busy count this graph raised while busy
    cdef list written_ctxs    # the ones among them it holds as writer
    cdef unsigned long long serial   # unique per graph made: allocators recognise a graph by it
    cdef object placed        # bytes: the tensors a Scheduler placed at its last allocation, their buffers
    cdef g.ggml_threadpool * tp   # kept between computes; rebuilt when n_threads changes
    cdef int tp_n
    cdef int _ensure(self) except -1
    cdef int _ensure_op(self, str op) except -1
    cdef int _note_ctx(self, _ContextBase c) except -1
    cdef int _check_ctxs(self) except -1
    cdef int _readable(self) except -1
    cdef bint _ctxs_valid(self) noexcept
    cdef _ContextBase _owner(self, g.ggml_tensor * p)
    cdef int _begin(self, str op) except -1
    cdef void _end(self) noexcept
    cdef uint64_t _unallocated_mask(self) noexcept
    cdef uint64_t _ctx_mask(self, bint written) noexcept
    cdef int _check_compute(self, g.ggml_backend_dev_t dev) except -1


cdef class _Allocator:
    # Base of Gallocr and Scheduler: tensors they place point into buffers they own. ``epoch`` moves
    # whenever those buffers are replaced (grown) and ``dead`` once they are freed, so a context
    # stamped with an older epoch knows its tensors' data is gone.
    cdef unsigned int epoch
    cdef bint dead
    cdef bint moving          # ggml is placing tensors / maybe replacing its buffers right now
    cdef object stamped       # WeakSet of the contexts it gave memory to
    cdef object __weakref__
    cdef int _stamp(self, Graph graph, uint64_t mask) except -1
    cdef int _refuse_busy(self, str op) except -1
    cdef int _start_moving(self, Graph graph, str op) except -1
