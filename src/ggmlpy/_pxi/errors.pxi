# errors.pxi: the exception hierarchy, the one place fallible C returns are
# checked, and the hooks ggmlpy installs into ggml at import.
#
# Lifetime and the GIL, once for the whole module
# ------------------------------------------------
# ggml hands out raw pointers that are valid only while their owner lives: a
# tensor while its context (or backend buffer) lives, a context until
# ggml_free. Every Python object that wraps such a pointer holds a strong
# reference to the wrapper of its owner (Tensor -> Context, Graph -> Context and
# every Context whose tensors it holds), so garbage collection can never free an
# owner first. Explicit early release (Context.free(), `with` blocks) is also
# allowed: it bumps the owner's generation counter, and every method of a
# dependent object starts with `_ensure()`, which compares generations and
# raises instead of touching freed memory. Freeing is done once, in
# __dealloc__ or free(), which NULL the pointer.
#
# The GIL is released around work that takes time and touches only C memory:
# graph compute, large copies, quantization. Before `with nogil` every pointer
# and size is copied into C locals, and the Python owners stay referenced by
# locals of the calling frame, so nothing can be freed underneath the C call.
# Callbacks from C into Python (log, abort poll) take the GIL themselves and
# never let an exception escape into C: they store it, and the caller re-raises
# it once ggml has returned.

import faulthandler


class GGMLError(Exception):
    """Base class of every error raised by ggmlpy."""


class GGMLValueError(ValueError, GGMLError):
    """An argument has the right type but a wrong value, shape or layout."""


class GGMLTypeError(TypeError, GGMLError):
    """An argument has the wrong Python type or the wrong ggml tensor type."""


class GGMLMemoryError(MemoryError, GGMLError):
    """An allocation failed or would not fit.

    ``report`` carries a memory report (a dict or ``MemoryReport``) where the
    failing layer has one, else None.
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class ComputeAborted(RuntimeError, GGMLError):
    """Graph compute was stopped before it finished (``Graph.cancel()``)."""


class ComputeFailed(RuntimeError, GGMLError):
    """A backend reported that graph compute failed."""


class BackendUnavailable(RuntimeError, GGMLError):
    """A backend was asked for that this build of ggmlpy does not include."""


class ClosedError(GGMLValueError):
    """The object, or the context that owns it, has been freed."""


cdef int _check_status(g.ggml_status status, str what) except -1 nogil:
    """Raise for a non-success ggml_status; takes the GIL only on failure."""
    if status == g.GGML_STATUS_SUCCESS:
        return 0
    with gil:
        name = g.ggml_status_to_string(status).decode()
        if status == g.GGML_STATUS_ALLOC_FAILED:
            raise GGMLMemoryError(f"{what}: allocation failed ({name})")
        if status == g.GGML_STATUS_ABORTED:
            raise ComputeAborted(f"{what}: aborted ({name})")
        raise ComputeFailed(f"{what}: failed ({name})")


cdef void * _check_alloc(void * ptr, size_t nbytes, str what) except? NULL:
    """Turn a NULL from an allocator into MemoryError naming the size."""
    if ptr == NULL and nbytes != 0:
        raise GGMLMemoryError(f"{what}: could not allocate {_fmt_bytes(nbytes)} on the host")
    return ptr


def _fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0


# --- hooks into ggml -----------------------------------------------------------

_log = logging.getLogger("ggmlpy")
cdef int _log_min_level = g.GGML_LOG_LEVEL_WARN
cdef int _log_last_level = g.GGML_LOG_LEVEL_INFO

cdef extern from "Python.h":
    void * PyGILState_GetThisThreadState() nogil

# Messages from threads Python never saw (ggml's own: the RPC client's dispatcher thread,
# which logs while the Python thread that waits for it holds the GIL). Taking the GIL there
# would deadlock, so they wait here, in order, and are logged by the next Python thread that
# logs or checks an RPC call (_log_drain). Entries: level byte, text, NUL.
cdef enum:
    _LOG_PEND_SIZE = 16384
cdef char _log_pend[_LOG_PEND_SIZE]
cdef size_t _log_pend_len = 0
cdef size_t _log_pend_dropped = 0
cdef PyThread_type_lock _log_pend_lock = PyThread_allocate_lock()


cdef void _log_pend_add(int lvl, const char * text) noexcept nogil:
    global _log_pend_len, _log_pend_dropped
    cdef size_t n = strlen(text)
    PyThread_acquire_lock(_log_pend_lock, WAIT_LOCK)
    if _log_pend_len + n + 2 <= _LOG_PEND_SIZE:
        _log_pend[_log_pend_len] = <char> lvl
        memcpy(&_log_pend[_log_pend_len + 1], text, n)
        _log_pend[_log_pend_len + 1 + n] = 0
        _log_pend_len += n + 2
    else:
        _log_pend_dropped += 1
    PyThread_release_lock(_log_pend_lock)


cdef int _log_drain() except -1:
    global _log_pend_len, _log_pend_dropped
    if _log_pend_len == 0:
        return 0
    PyThread_acquire_lock(_log_pend_lock, WAIT_LOCK)
    data = PyBytes_FromStringAndSize(_log_pend, _log_pend_len)
    dropped = _log_pend_dropped
    _log_pend_len = 0
    _log_pend_dropped = 0
    PyThread_release_lock(_log_pend_lock)
    for entry in data.split(b"\0")[:-1]:
        _log_emit(entry[0], entry[1:])
    if dropped:
        _log.warning("%d ggml log messages from ggml's own threads were dropped", dropped)
    return 0


cdef void _log_emit(int lvl, bytes text):
    msg = text.decode("utf-8", "replace").rstrip("\n")
    if msg:
        _log.log({1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING}.get(lvl, logging.ERROR), msg)


cdef void _log_cb(g.ggml_log_level level, const char * text, void * user) noexcept nogil:
    global _log_last_level
    cdef int lvl = level
    if lvl == g.GGML_LOG_LEVEL_CONT:
        lvl = _log_last_level
    else:
        _log_last_level = lvl
    if lvl < _log_min_level or text == NULL:
        return
    if PyGILState_GetThisThreadState() == NULL:
        _log_pend_add(lvl, text)
        return
    with gil:
        # An exception here (a broken handler on the logger) cannot reach ggml: Cython reports it
        # through sys.unraisablehook, never silently.
        _log_drain()
        _log_emit(lvl, text)


cdef void _abort_cb(const char * message) noexcept nogil:
    # Reaching here means a precondition slipped past our validators: the
    # process is about to abort. Leave the Python stack to find the call.
    with gil:
        sys.stderr.write("ggmlpy: ggml aborted: " + message.decode("utf-8", "replace") +
                         "\nggmlpy: this is a bug in ggmlpy's validation; the Python stack follows.\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)


def set_log_level(level):
    """Forward ggml's log messages at ``level`` and above to the ``ggmlpy`` logger.

    ``level`` is a ``logging`` level (``logging.DEBUG`` ... ``logging.ERROR``).
    The default forwards warnings and errors; ``GGMLPY_DEBUG=1`` in the
    environment forwards everything.
    """
    global _log_min_level
    level = int(level)
    _log_min_level = (g.GGML_LOG_LEVEL_DEBUG if level <= logging.DEBUG else
                      g.GGML_LOG_LEVEL_INFO if level <= logging.INFO else
                      g.GGML_LOG_LEVEL_WARN if level <= logging.WARNING else
                      g.GGML_LOG_LEVEL_ERROR)


def _load_backends():
    """Load the backend modules of a portable build from the package folder (at import).

    A native build links its backends and does nothing here. A portable one lets
    ggml's registry load every backend library beside _core (scoring the CPU
    variants and keeping the best one), then looks up the CPU and RPC entry
    points _core calls directly; anything missing raises ImportError, so no call
    can go through an empty pointer.
    """
    cdef char err[1024]
    if not g.GGMLPY_BACKEND_DL:
        return
    d = os.fsencode(os.path.dirname(os.path.abspath(__file__)))
    if g.ggmlpy_cpu_load(d, err, sizeof(err)) != 0 or g.ggmlpy_rpc_load(d, err, sizeof(err)) != 0:
        raise ImportError("ggmlpy: " + err.decode("utf-8", "replace"))


def _install_hooks():
    # Runs first at import: module-level code of the later .pxi files already calls ggml
    # (the RPC timeout), which in a portable build needs the backend modules loaded, and
    # loading logs, which needs the log hook.
    if os.environ.get("GGMLPY_DEBUG", "0") not in ("", "0"):
        set_log_level(logging.DEBUG)
    g.ggml_log_set(_log_cb, NULL)
    g.ggml_set_abort_callback(_abort_cb)
    g.ggml_time_init()
    _load_backends()
