# backend.pxi: ggml-backend devices, backends, buffer types, buffers, the
# graph allocator, the scheduler and RPC.
#
# Ownership: Device and BufferType are ggml's static registry objects (never
# freed); Backend, Buffer, Gallocr and Scheduler own their handle and free it
# once. A Buffer keeps the Backend or BufferType it came from alive, a
# Scheduler its Backends, and a Context the Buffers its tensors live in.
# Allocator and scheduler failures leave ggml's object half-updated (a later
# call would dereference a buffer that was never made), so after a failure the
# Python object refuses further use: create a new one.

import threading

cdef dict _DEV_TYPE_NAMES = {g.GGML_BACKEND_DEVICE_TYPE_CPU: "CPU", g.GGML_BACKEND_DEVICE_TYPE_GPU: "GPU",
                             g.GGML_BACKEND_DEVICE_TYPE_IGPU: "IGPU", g.GGML_BACKEND_DEVICE_TYPE_ACCEL: "ACCEL",
                             g.GGML_BACKEND_DEVICE_TYPE_META: "META"}

# Backends ggmlpy knows how to build, with the option that turns them on.
_BUILD_FLAG = {"CUDA": "GGML_CUDA", "METAL": "GGML_METAL", "MTL": "GGML_METAL", "VULKAN": "GGML_VULKAN",
               "BLAS": "GGML_BLAS", "RPC": "GGML_RPC", "SYCL": "GGML_SYCL", "HIP": "GGML_HIP"}


class BufferUsage(enum.IntEnum):
    """What a buffer holds (``ggml_backend_buffer_usage``); schedulers treat WEIGHTS specially."""
    ANY = g.GGML_BACKEND_BUFFER_USAGE_ANY
    WEIGHTS = g.GGML_BACKEND_BUFFER_USAGE_WEIGHTS
    COMPUTE = g.GGML_BACKEND_BUFFER_USAGE_COMPUTE


def _unavailable(str what):
    # Two different fixes, so two messages: a backend missing from the build
    # needs a rebuild; a compiled-in backend without devices needs a driver/GPU.
    key = what.upper().rstrip("0123456789")
    flag = _BUILD_FLAG.get(key)
    have = ", ".join(d.name for d in devices())
    regs = [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]
    reg = next((r for r in regs if r.upper() == key or _BUILD_FLAG.get(r.upper(), 0) == flag), None)
    if flag is not None and reg is not None:
        hint = {"CUDA": " (is its driver installed and the GPU visible: nvidia-smi, CUDA_VISIBLE_DEVICES?)",
                "VULKAN": " (is a Vulkan driver installed: vulkaninfo? ggml hides software devices such as "
                          "Mesa's lavapipe unless GGML_VK_VISIBLE_DEVICES names them)",
                "RPC": " (rpc_add_server('host:port') adds a server's devices)"}.get(key, "")
        return BackendUnavailable(f"{what}: no such device: the {reg} backend is compiled in but found "
                                  f"{_n_devices(reg)} device(s){hint}; devices: {have}")
    if flag is not None:
        doc = " (docs/install.md, \"CUDA\", for the toolkit)" if key == "CUDA" else ""
        return BackendUnavailable(
            f"{what}: this build of ggmlpy has no {key} backend (compiled in: {', '.join(regs)}; devices: {have}); "
            f"rebuild with it: CMAKE_ARGS=\"-D{flag}=on\" pip install --force-reinstall --no-binary ggmlpy ggmlpy{doc}")
    return BackendUnavailable(f"{what}: no such device (devices: {have})")


cdef size_t _n_devices(str reg_name):
    cdef g.ggml_backend_reg * reg
    for i in range(g.ggml_backend_reg_count()):
        reg = g.ggml_backend_reg_get(i)
        if g.ggml_backend_reg_name(reg).decode() == reg_name:
            return g.ggml_backend_reg_dev_count(reg)
    return 0


@cython.final
cdef class Device:
    """A ggml device (``ggml_backend_dev_t``): the CPU, a GPU, an RPC server's device.

    Get them from ``devices()`` or ``device(name)``; they live as long as the process.
    """
    cdef g.ggml_backend_dev_t ptr
    cdef object rpc_endpoint

    def __init__(self, *args, **kwargs):
        raise TypeError("Devices come from ggmlpy.devices() or ggmlpy.device(name)")

    @staticmethod
    cdef Device _make(g.ggml_backend_dev_t p, object endpoint=None):
        cdef Device d = Device.__new__(Device)
        d.ptr = p
        d.rpc_endpoint = endpoint
        return d

    @property
    def name(self):
        return g.ggml_backend_dev_name(self.ptr).decode()

    @property
    def description(self):
        return g.ggml_backend_dev_description(self.ptr).decode()

    @property
    def type(self):
        """``'CPU'``, ``'GPU'``, ``'IGPU'``, ``'ACCEL'`` or ``'META'``."""
        return _DEV_TYPE_NAMES.get(g.ggml_backend_dev_type_of(self.ptr), "?")

    @property
    def endpoint(self):
        """``host:port`` of an RPC device, else None."""
        return self.rpc_endpoint

    def memory(self):
        """``(free, total)`` bytes of device memory, as the backend reports it now."""
        cdef size_t free_b = 0, total_b = 0
        if self.rpc_endpoint is None:
            # a local device asks no server: a failure recorded earlier is not this call's
            with nogil:
                g.ggml_backend_dev_memory(self.ptr, &free_b, &total_b)
            return free_b, total_b
        _rpc_discard()
        with nogil:
            g.ggml_backend_dev_memory(self.ptr, &free_b, &total_b)
        _rpc_check("dev_memory", self.rpc_endpoint)
        return free_b, total_b

    @property
    def caps(self):
        """Capabilities: async, host_buffer, buffer_from_host_ptr, events, mmap_support."""
        cdef g.ggml_backend_dev_props props
        g.ggml_backend_dev_get_props(self.ptr, &props)
        _rpc_discard()      # an RPC device's props also ask for its memory; not what was asked here
        return {"async": props.caps.async_, "host_buffer": props.caps.host_buffer,
                "buffer_from_host_ptr": props.caps.buffer_from_host_ptr, "events": props.caps.events,
                "mmap_support": props.caps.mmap_support}

    @property
    def device_id(self):
        """PCI bus id (GPUs) or None."""
        cdef g.ggml_backend_dev_props props
        g.ggml_backend_dev_get_props(self.ptr, &props)
        _rpc_discard()
        return None if props.device_id == NULL else props.device_id.decode()

    def buffer_type(self):
        """The device's memory (``ggml_backend_dev_buffer_type``)."""
        return BufferType._make(g.ggml_backend_dev_buffer_type(self.ptr), self.name, self.rpc_endpoint)

    def host_buffer_type(self):
        """Pinned host memory for fast transfers to this device, or None."""
        cdef g.ggml_backend_buffer_type_t b = g.ggml_backend_dev_host_buffer_type(self.ptr)
        return None if b == NULL else BufferType._make(b, self.name)

    def supports_op(self, Tensor op not None):
        """Whether the device can compute ``op`` with its current types and shapes."""
        _arg(op, "supports_op", "op")
        return bool(g.ggml_backend_dev_supports_op(self.ptr, op.ptr))

    def supports_buft(self, BufferType buft not None):
        """Whether the device can use tensors in ``buft``."""
        return bool(g.ggml_backend_dev_supports_buft(self.ptr, buft.ptr))

    def extra_buffer_types(self):
        """Buffer types the device offers for weights besides its own memory, in ggml's order of preference.

        On the CPU these hold weights rearranged for its fastest matrix kernels
        (``AMX`` on Intel CPUs with AMX, ``CPU_REPACK`` for Q4_0/Q4_K/IQ4_NL/...
        on AVX2 and ARM, ``KLEIDIAI`` on ARM); other devices usually offer none.
        A tensor in one of them takes part only in the ops
        :meth:`supports_weight` accepts, is written whole and cannot be read
        back. Model loaders use them when asked to repack (llama.cpp's ``--repack``).
        """
        cdef g.ggml_backend_reg_t reg = g.ggml_backend_dev_backend_reg(self.ptr)
        cdef g.ggml_backend_dev_get_extra_bufts_t fn
        cdef g.ggml_backend_buffer_type_t * p
        if reg == NULL:
            return []
        fn = <g.ggml_backend_dev_get_extra_bufts_t> g.ggml_backend_reg_get_proc_address(
            reg, b"ggml_backend_dev_get_extra_bufts")
        if fn == NULL:
            return []
        p = fn(self.ptr)
        out = []
        while p != NULL and p[0] != NULL:
            out.append(BufferType._make(p[0], self.name, self.rpc_endpoint))
            p += 1
        return out

    def supports_weight(self, BufferType buft not None, Tensor op not None):
        """Whether the device computes ``op`` when its first source, a weight, lives in ``buft``.

        How a loader decides where a weight may go (as llama.cpp's loader
        does): build the op the model will run on it in a ``no_alloc`` context,
        over a weight tensor of the real type and shape that has no memory yet.
        For the question the weight is placed in an empty buffer of ``buft``.

        Raises
        ------
        GGMLValueError
            ``op`` has no first source, or that source already has memory.
        """
        cdef g.ggml_tensor * w
        cdef g.ggml_backend_buffer_t dummy
        cdef bint ok
        _arg(op, "supports_weight", "op")
        w = op.ptr.src[0]
        if w == NULL:
            _fail("supports_weight", f"op {g.ggml_op_desc(op.ptr).decode()} has no first source to place")
        if w.buffer != NULL or w.data != NULL or w.view_src != NULL:
            _fail("supports_weight", f"the weight {w.name.decode(errors='replace')!r} must be a tensor without memory "
                                     f"(build the op in a no_alloc context)")
        # size 0: ggml hands out a placeholder without asking the device (or an RPC server) for memory
        dummy = g.ggml_backend_buft_alloc_buffer(buft.ptr, 0)
        if dummy == NULL:
            raise GGMLMemoryError(f"supports_weight: no placeholder buffer of {buft.name}")
        w.buffer = dummy
        try:
            ok = g.ggml_backend_dev_supports_op(self.ptr, op.ptr)
        finally:
            w.buffer = NULL
            g.ggml_backend_buffer_free(dummy)
        return bool(ok)

    def offload_op(self, Tensor op not None):
        """Whether the device wants ``op`` even when its weights are in host memory."""
        _arg(op, "offload_op", "op")
        return bool(g.ggml_backend_dev_offload_op(self.ptr, op.ptr))

    def init(self, params=None):
        """A new Backend (stream) on this device."""
        cdef bytes p = params.encode() if params is not None else None
        cdef g.ggml_backend_t b
        with _rpc_lock_for(self.rpc_endpoint):
            b = g.ggml_backend_dev_init(self.ptr, <const char *> p if p is not None else NULL)
        if b == NULL:
            raise BackendUnavailable(f"backend_init: could not start a backend on device {self.name}")
        return Backend._make(b, self)

    def __eq__(self, other):
        return isinstance(other, Device) and (<Device> other).ptr == self.ptr

    def __hash__(self):
        return hash(<uintptr_t> self.ptr)

    def __repr__(self):
        try:
            free_b, total_b = self.memory()
        except RPCError:
            return f"<ggmlpy.Device {self.name} ({self.type}) {self.description!r} unreachable>"
        return (f"<ggmlpy.Device {self.name} ({self.type}) {self.description!r} "
                f"{_fmt_bytes(free_b)} free of {_fmt_bytes(total_b)}>")


def devices():
    """Every device ggml found (compiled-in backends plus added RPC servers), CPU last.

    Examples
    --------
    >>> any(d.type == "CPU" for d in devices())
    True
    """
    out = [Device._make(g.ggml_backend_dev_get(i)) for i in range(g.ggml_backend_dev_count())]
    for ep, devs in _rpc_devices.items():
        out.extend(devs)
    out.sort(key=lambda d: d.type == "CPU")
    return out


def device(name):
    """The device called ``name`` (``'CPU'``, ``'CUDA0'``, ``'RPC0'``...), case-insensitive.

    Raises
    ------
    BackendUnavailable
        No such device in this build; the message names the rebuild option.
    """
    for d in devices():
        if d.name.lower() == str(name).lower():
            return d
    raise _unavailable(str(name))


@cython.final
cdef class BufferType:
    """A kind of memory a backend allocates from (``ggml_backend_buffer_type_t``)."""
    cdef g.ggml_backend_buffer_type_t ptr
    cdef str dev_name
    cdef object endpoint     # RPC server of the device, or None

    def __init__(self, *args, **kwargs):
        raise TypeError("BufferTypes come from Device.buffer_type() or Backend.buffer_type")

    @staticmethod
    cdef BufferType _make(g.ggml_backend_buffer_type_t p, str dev_name, object endpoint=None):
        cdef BufferType b = BufferType.__new__(BufferType)
        b.ptr = p
        b.dev_name = dev_name
        b.endpoint = endpoint
        return b

    @property
    def name(self):
        return g.ggml_backend_buft_name(self.ptr).decode()

    @property
    def alignment(self):
        return g.ggml_backend_buft_get_alignment(self.ptr)

    @property
    def max_size(self):
        """Largest single buffer this type allocates."""
        return g.ggml_backend_buft_get_max_size(self.ptr)

    @property
    def is_host(self):
        """True if its memory is host memory (tensors can be read without a copy)."""
        return bool(g.ggml_backend_buft_is_host(self.ptr))

    @property
    def device_name(self):
        return self.dev_name

    def alloc_size(self, Tensor t not None):
        """Bytes ``t`` takes in this buffer type (may exceed ``t.nbytes`` for padded layouts)."""
        cdef size_t n
        _arg(t, "alloc_size", "t")
        if self.endpoint is None:
            return g.ggml_backend_buft_get_alloc_size(self.ptr, t.ptr)
        _rpc_discard()                   # an RPC buffer type may ask its server
        n = g.ggml_backend_buft_get_alloc_size(self.ptr, t.ptr)
        _rpc_check("alloc_size", self.endpoint)
        return n

    def alloc_buffer(self, size_t size):
        """A new Buffer of ``size`` bytes.

        Raises
        ------
        GGMLMemoryError
            The device could not provide it (the message names size and device).
        """
        cdef g.ggml_backend_buffer_t b
        if not (size > 0):
            _fail("alloc_buffer", "size must be > 0")
        with nogil:
            b = g.ggml_backend_buft_alloc_buffer(self.ptr, size)
        if b == NULL:
            _rpc_check("alloc_buffer", self.endpoint)
            raise GGMLMemoryError(f"alloc_buffer: could not allocate {_fmt_bytes(size)} of {self.name} "
                                  f"on device {self.dev_name}{_free_note(self)}")
        return Buffer._make(b, self)

    def __eq__(self, other):
        return isinstance(other, BufferType) and (<BufferType> other).ptr == self.ptr

    def __hash__(self):
        return hash(<uintptr_t> self.ptr)

    def __repr__(self):
        return f"<ggmlpy.BufferType {self.name} (device {self.dev_name}{', host' if self.is_host else ''})>"


cdef extern from "ggmlpy_mem.h" nogil:
    int ggmlpy_advise_huge_pages(void * p, size_t n)


@cython.no_gc_clear
cdef class Buffer:
    """A block of backend memory (``ggml_backend_buffer_t``) holding tensors.

    Made by ``BufferType.alloc_buffer``, ``Backend.alloc_buffer`` or
    ``alloc_ctx_tensors``. Contexts whose tensors live in it keep it alive.
    """
    cdef g.ggml_backend_buffer_t ptr
    cdef object owner        # BufferType or Backend it came from
    cdef list ctxs           # Contexts with tensors placed in this buffer
    cdef int busy            # clears running with the GIL released
    cdef readonly size_t size

    def __init__(self, *args, **kwargs):
        raise TypeError("Buffers come from BufferType.alloc_buffer() or alloc_ctx_tensors()")

    @staticmethod
    cdef Buffer _make(g.ggml_backend_buffer_t p, object owner):
        cdef Buffer b = Buffer.__new__(Buffer)
        b.ptr = p
        b.owner = owner
        b.ctxs = []
        b.size = g.ggml_backend_buffer_get_size(p)
        _debug_count("Buffer", 1)
        return b

    def __dealloc__(self):
        if self.ptr != NULL:
            if _rpc_gone(self.owner):
                # an unpatched ggml RPC client aborts the process when freeing memory
                # on a server that died; the memory died with it, so let it go
                # (never taken with vendor/ggml/patches/0001: see _rpc_gone)
                self.ptr = NULL
                _debug_count_nogil(2)
                return
            g.ggml_backend_buffer_free(self.ptr)
            self.ptr = NULL
            _debug_count_nogil(2)

    cdef int _ensure(self) except -1:
        if self.ptr == NULL:
            raise ClosedError("Buffer has been freed")
        return 0

    def free(self):
        """Free the memory now.

        Raises
        ------
        GGMLValueError
            A live context still has tensors in this buffer (free the context first).
        """
        cdef _ContextBase c
        if self.ptr == NULL:
            return
        if self.busy:
            raise GGMLValueError("buffer_free: the buffer is being cleared in another thread")
        live = [c for c in self.ctxs if not c.freed]
        if live:
            raise GGMLValueError(f"buffer_free: {len(live)} context(s) still hold tensors in this buffer; free them first")
        if not _rpc_gone(self.owner):
            g.ggml_backend_buffer_free(self.ptr)
        self.ptr = NULL
        _debug_count_nogil(2)

    @property
    def name(self):
        self._ensure()
        return g.ggml_backend_buffer_name(self.ptr).decode()

    @property
    def buffer_type(self):
        self._ensure()
        bt = self.owner if isinstance(self.owner, BufferType) else None
        return bt if bt is not None else BufferType._make(g.ggml_backend_buffer_get_type(self.ptr), "?")

    @property
    def is_host(self):
        self._ensure()
        return bool(g.ggml_backend_buffer_is_host(self.ptr))

    def advise_huge_pages(self):
        """Ask the OS to back this buffer with huge pages (Linux's transparent huge pages): fewer TLB
        misses where the whole buffer is read often, as the weights are each token. Call it before the
        buffer is first written (pages already touched stay as they are). Only buffers in this process's
        memory on the CPU device take it (not a GPU's, not an RPC server's). Returns True where the
        advice was given; False where it does not apply or the system has none (nothing changes then).
        """
        cdef g.ggml_backend_dev_t dev
        cdef void * base
        self._ensure()
        dev = g.ggml_backend_buft_get_device(g.ggml_backend_buffer_get_type(self.ptr))
        # ggml's plain CPU buffer type names no device; the CPU's extra types (CPU_REPACK...) name the CPU
        if (dev == NULL and not g.ggml_backend_buffer_is_host(self.ptr)) or (
                dev != NULL and g.ggml_backend_dev_type_of(dev) != g.GGML_BACKEND_DEVICE_TYPE_CPU):
            return False
        base = g.ggml_backend_buffer_get_base(self.ptr)
        return ggmlpy_advise_huge_pages(base, self.size) == 0

    @property
    def usage(self):
        """``BufferUsage`` of the buffer (settable)."""
        self._ensure()
        return BufferUsage(g.ggml_backend_buffer_get_usage(self.ptr))

    @usage.setter
    def usage(self, value):
        cdef int u = _index(value, "buffer_set_usage", "usage", _K_INT)
        self._ensure()
        if not (u in (0, 1, 2)):
            _fail("buffer_set_usage", f"usage must be a BufferUsage (got {value!r})")
        g.ggml_backend_buffer_set_usage(self.ptr, <g.ggml_backend_buffer_usage> u)

    def clear(self, int value=0):
        """Fill the whole buffer with the byte ``value``."""
        cdef g.ggml_backend_buffer_t p
        self._ensure()
        if not (0 <= value <= 255):
            _fail("buffer_clear", f"value must be a byte (got {value})")
        p = self.ptr
        self.busy += 1               # free() in another thread refuses meanwhile
        try:
            with nogil:
                g.ggml_backend_buffer_clear(p, <uint8_t> value)
        finally:
            self.busy -= 1
        _rpc_check("buffer_clear", _owner_endpoint(self.owner))

    def __repr__(self):
        if self.ptr == NULL:
            return "<ggmlpy.Buffer (freed)>"
        return f"<ggmlpy.Buffer {self.name} {_fmt_bytes(self.size)}>"


cdef str _free_note(BufferType bt):
    # After a failed allocation: " (it reports N free of M)" from the buffer type's device, or "" where
    # the device reports no memory or asking could abort (an RPC server with ggml's unpatched client).
    cdef size_t free_b = 0, total_b = 0
    cdef g.ggml_backend_dev_t dev = g.ggml_backend_buft_get_device(bt.ptr)
    if dev == NULL or (bt.endpoint is not None and not g.GGMLPY_RPC_ERRORS):
        return ""
    with nogil:
        g.ggml_backend_dev_memory(dev, &free_b, &total_b)
    if bt.endpoint is not None:
        _rpc_discard()       # a server lost meanwhile: the note is left out, the allocation error stands
    if total_b == 0:
        return ""
    return f" (it reports {_fmt_bytes(free_b)} free of {_fmt_bytes(total_b)})"


cdef object _owner_endpoint(object owner):
    # RPC endpoint ("host:port") of the device a BufferType or Backend belongs to, else None.
    if isinstance(owner, BufferType):
        return (<BufferType> owner).endpoint
    if isinstance(owner, Backend):
        return (<Backend> owner).dev.rpc_endpoint
    return None


cdef bint _rpc_gone(object owner):
    # True only when freeing memory of owner (a BufferType or Backend) must be
    # skipped. Local memory is never "gone": a programming error here must
    # surface, not turn into a skipped free (that once leaked every backend
    # buffer). With our patch to ggml's RPC client (GGMLPY_RPC_ERRORS) freeing
    # on a lost server returns quietly, so nothing is ever skipped; an
    # unpatched client aborts there, so probe whether the server still listens.
    ep = _owner_endpoint(owner)
    if ep is None or g.GGMLPY_RPC_ERRORS:
        return False
    host, _, port = ep.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return False
    except OSError:
        return True


cdef int _check_views_placeable(_ContextBase ctx) except -1:
    # ggml gives every view without a buffer the buffer of its source: a view of a tensor that has no
    # backend buffer (host memory of an allocating context, or a no_alloc context not allocated yet)
    # would abort in ggml_backend_view_init, unless the source is allocated in this same call.
    cdef g.ggml_tensor * p = g.ggml_get_first_tensor(ctx.ptr)
    cdef g.ggml_tensor * src
    cdef bint here
    while p != NULL:
        if p.view_src != NULL and p.buffer == NULL:
            src = p.view_src
            here = <char *> ctx.mem <= <char *> src < <char *> ctx.mem + ctx.mem_size
            if src.buffer == NULL and not (here and src.data == NULL):
                raise GGMLValueError(f"alloc_ctx_tensors: '{p.name.decode(errors='replace')}' is a view of a tensor "
                                     f"without backend memory (in another context not allocated yet, or in host "
                                     f"memory of an allocating context); allocate that context first")
        p = g.ggml_get_next_tensor(ctx.ptr, p)
    return 0


def alloc_ctx_tensors(Context ctx not None, target):
    """Allocate every tensor of a no_alloc context in one buffer of ``target``.

    ``target`` is a Backend or a BufferType. Returns the Buffer (the context
    keeps it alive). Data is not initialised; use ``Tensor.set``.

    Raises
    ------
    GGMLValueError
        The context is not no_alloc, or has nothing to allocate.
    GGMLMemoryError
        The device has no room; the context's tensors are unusable afterwards.
    """
    cdef BufferType bt
    cdef g.ggml_backend_buffer * b
    cdef size_t need
    ctx._ensure()
    bt = target.buffer_type if isinstance(target, Backend) else target
    if not isinstance(bt, BufferType):
        raise GGMLTypeError(f"alloc_ctx_tensors: target must be a Backend or BufferType (got {target!r})")
    if not ctx.no_alloc_:
        raise GGMLValueError("alloc_ctx_tensors: the context must be no_alloc (its tensors already have host memory)")
    if ctx.stale_below:
        # ggml would walk every tensor of the arena, those that read freed memory included
        raise GGMLValueError("alloc_ctx_tensors: some of the context's tensors read a context that was freed or "
                             "reset since; reset this context (or make a new one) first")
    if ctx.deps:
        _deps_alive(ctx, "alloc_ctx_tensors")
    _data_alive(ctx, "alloc_ctx_tensors")
    _check_views_placeable(ctx)
    need = g.ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.ptr, bt.ptr)
    if need == 0:
        raise GGMLValueError("alloc_ctx_tensors: the context has no tensors that need memory")
    if ctx.writers:
        raise GGMLValueError("alloc_ctx_tensors: the context's tensors are being allocated or computed in another "
                             "thread")
    held = _hold(ctx)            # the context and those its views read stay put while ggml runs
    ctx.writers += 1
    ctx.allocating = True        # and nobody adds objects to the list ggml walks
    try:
        with nogil:
            b = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, bt.ptr)
    finally:
        ctx.allocating = False
        ctx.writers -= 1
        _unhold(held)
    if b == NULL:
        # ggml may have placed earlier tensors in buffers it then freed: the
        # context's tensors must not be touched again.
        ctx.gen += 1
        ctx.stale_below = g.ggml_used_mem(ctx.ptr)
        _rpc_check("alloc_ctx_tensors", bt.endpoint)
        raise GGMLMemoryError(f"alloc_ctx_tensors: could not allocate {_fmt_bytes(need)} of {bt.name} on device "
                              f"{bt.dev_name}{_free_note(bt)}; the context's tensors are invalid now")
    buf = Buffer._make(b, bt)
    (<Buffer> buf).ctxs.append(ctx)
    ctx.keep.append(buf)
    return buf


@cython.no_gc_clear
cdef class Backend:
    """An execution stream on a device (``ggml_backend_t``). Made by ``Device.init()`` or ``backend_init``."""
    cdef g.ggml_backend_t ptr
    cdef Device dev
    cdef int busy             # computes running on it with the GIL released
    cdef object users         # WeakSet of the Schedulers built over it
    cdef g.ggml_threadpool * tp   # a CPU backend's own threadpool (set_threadpool), or NULL
    cdef int tp_threads

    def __init__(self, *args, **kwargs):
        raise TypeError("Backends come from Device.init() or ggmlpy.backend_init(name)")

    @staticmethod
    cdef Backend _make(g.ggml_backend_t p, Device dev):
        cdef Backend b = Backend.__new__(Backend)
        b.ptr = p
        b.dev = dev
        b.users = weakref.WeakSet()
        _debug_count("Backend", 1)
        return b

    def __dealloc__(self):
        if self.ptr != NULL:
            g.ggml_backend_free(self.ptr)
            self.ptr = NULL
            _debug_count_nogil(3)
        self._free_tp()

    cdef void _free_tp(self) noexcept:
        # after the backend itself is gone, or detached from it first
        if self.tp != NULL:
            g.ggml_threadpool_free(self.tp)
            self.tp = NULL
            self.tp_threads = 0

    cdef int _ensure(self) except -1:
        if self.ptr == NULL:
            raise ClosedError("Backend has been freed")
        return 0

    @property
    def name(self):
        self._ensure()
        return g.ggml_backend_name(self.ptr).decode()

    @property
    def device(self):
        return self.dev

    @property
    def is_cpu(self):
        self._ensure()
        return bool(g.ggml_backend_is_cpu(self.ptr))

    @property
    def buffer_type(self):
        """The backend's default BufferType."""
        self._ensure()
        return BufferType._make(g.ggml_backend_get_default_buffer_type(self.ptr), self.dev.name, self.dev.rpc_endpoint)

    @property
    def alignment(self):
        self._ensure()
        return g.ggml_backend_get_alignment(self.ptr)

    @property
    def max_size(self):
        self._ensure()
        return g.ggml_backend_get_max_size(self.ptr)

    def alloc_buffer(self, size_t size):
        """A new Buffer of ``size`` bytes in the backend's default buffer type."""
        buf = self.buffer_type.alloc_buffer(size)
        (<Buffer> buf).owner = self
        return buf

    def set_n_threads(self, int n_threads):
        """Threads the CPU backend computes with (1..512)."""
        self._ensure()
        if not g.ggml_backend_is_cpu(self.ptr):
            raise GGMLValueError(f"set_n_threads: {self.name} is not a CPU backend")
        if not (1 <= n_threads <= 512):
            _fail("set_n_threads", f"n_threads must be in [1, 512] (got {n_threads})")
        if self.tp != NULL and n_threads != self.tp_threads:
            self.set_threadpool(n_threads)          # a pool has a fixed size: make one of the new size
        g.ggml_backend_cpu_set_n_threads(self.ptr, n_threads)

    def set_threadpool(self, n_threads=None, *, int poll=50, bint strict_cpu=False):
        """Give this CPU backend a threadpool of its own that lives as long as the backend.

        Without one, ggml starts and joins its compute threads for every graph;
        a persistent pool (as llama.cpp's tools attach) saves that per graph,
        which shows in token generation, where a graph takes milliseconds.
        ``poll`` (0-100) is how long idle threads spin before sleeping, as
        llama-bench's ``--poll``. ``n_threads=None`` keeps the current count
        (``default_n_threads()`` for a new backend); ``n_threads=0`` drops the pool.

        Raises
        ------
        GGMLValueError
            Not a CPU backend, a compute runs on it, or a parameter out of range.
        """
        cdef g.ggml_threadpool_params params
        cdef g.ggml_threadpool * tp
        cdef int n
        self._ensure()
        if not g.ggml_backend_is_cpu(self.ptr):
            raise GGMLValueError(f"set_threadpool: {self.name} is not a CPU backend")
        if self.busy > 0:
            raise GGMLValueError(f"set_threadpool: {self.name} is computing in another thread")
        if not 0 <= poll <= 100:
            _fail("set_threadpool", f"poll must be in [0, 100] (got {poll})")
        n = (self.tp_threads or _default_threads()) if n_threads is None else int(n_threads)
        if not 0 <= n <= 512:
            _fail("set_threadpool", f"n_threads must be in [0, 512] (got {n})")
        g.ggml_backend_cpu_set_threadpool(self.ptr, NULL)
        self._free_tp()
        if n == 0:
            return
        params = g.ggml_threadpool_params_default(n)
        params.poll = poll
        params.strict_cpu = strict_cpu
        tp = g.ggml_threadpool_new(&params)
        if tp == NULL:
            raise GGMLMemoryError(f"set_threadpool: ggml could not start {n} threads")
        self.tp = tp
        self.tp_threads = n
        g.ggml_backend_cpu_set_threadpool(self.ptr, tp)
        g.ggml_backend_cpu_set_n_threads(self.ptr, n)

    @property
    def threadpool_threads(self):
        """Threads of the backend's own threadpool (``set_threadpool``), 0 without one."""
        return self.tp_threads

    def supports_op(self, Tensor op not None):
        self._ensure()
        _arg(op, "supports_op", "op")
        return bool(g.ggml_backend_supports_op(self.ptr, op.ptr))

    def supports_buft(self, BufferType buft not None):
        self._ensure()
        return bool(g.ggml_backend_supports_buft(self.ptr, buft.ptr))

    def synchronize(self):
        """Wait for the backend's queued work."""
        self._ensure()
        with nogil:
            g.ggml_backend_synchronize(self.ptr)

    def graph_compute(self, Graph graph not None):
        """Compute ``graph`` on this backend (GIL released).

        Every node and leaf must already have memory this backend can use
        (allocate with ``alloc_ctx_tensors`` or a ``Gallocr``) and every node
        must be supported by the backend.
        """
        cdef g.ggml_status st
        cdef g.ggml_cgraph * cg
        self._ensure()
        graph._ensure()
        graph._check_ctxs()
        _check_graph_on(graph.ptr, self.ptr, self.name)
        for entry in graph.index_checks:
            _scan_indices(entry)
        cg = graph.ptr
        graph._begin("backend_graph_compute")
        self.busy += 1
        try:
            with _rpc_lock_for(self.dev.rpc_endpoint):
                with nogil:
                    st = g.ggml_backend_graph_compute(self.ptr, cg)
        finally:
            self.busy -= 1
            graph._end()
        _rpc_check("backend_graph_compute", self.dev.rpc_endpoint)
        _check_status(st, "backend_graph_compute")

    def free(self):
        """Release the backend now.

        Raises
        ------
        GGMLValueError
            A compute runs on it in another thread, or a live Scheduler uses it
            (free the scheduler first).
        """
        if self.ptr != NULL:
            if self.busy > 0:
                raise GGMLValueError(f"backend_free: {self.name} is computing in another thread")
            live = [s for s in self.users if not (<Scheduler> s).dead]
            if live:
                raise GGMLValueError(f"backend_free: {len(live)} live Scheduler(s) use {self.name}; free them first")
            g.ggml_backend_free(self.ptr)
            self.ptr = NULL
            _debug_count_nogil(3)
            self._free_tp()

    def __repr__(self):
        return "<ggmlpy.Backend (freed)>" if self.ptr == NULL else f"<ggmlpy.Backend {self.name} on {self.dev.name}>"


cdef int _check_graph_on(g.ggml_cgraph * cg, g.ggml_backend_t be, str bname) except -1:
    # ggml_backend_graph_compute checks nothing: every tensor needs memory the
    # backend can use, and every node an implementation.
    cdef int i, k
    cdef g.ggml_tensor * t
    cdef g.ggml_backend_buffer * buf
    if cg.n_nodes == 0:
        raise GGMLValueError("backend_graph_compute: the graph has no nodes")
    for k in range(2):
        for i in range(cg.n_leafs if k == 0 else cg.n_nodes):
            t = cg.leafs[i] if k == 0 else cg.nodes[i]
            buf = t.buffer if t.view_src == NULL or t.buffer != NULL else t.view_src.buffer
            if g.ggml_nelements(t) == 0:
                continue
            if t.data == NULL or buf == NULL:
                raise GGMLValueError(f"backend_graph_compute: tensor '{t.name.decode()}' has no backend memory; "
                                     f"allocate its context with alloc_ctx_tensors or the graph with a Gallocr")
            if not g.ggml_backend_supports_buft(be, g.ggml_backend_buffer_get_type(buf)):
                raise GGMLValueError(f"backend_graph_compute: tensor '{t.name.decode()}' is in "
                                     f"{g.ggml_backend_buffer_name(buf).decode()} memory, which {bname} cannot use")
            if k == 1 and t.op != g.GGML_OP_NONE and not g.ggml_backend_supports_op(be, t):
                raise GGMLValueError(f"{g.ggml_op_desc(t).decode().lower()}: backend {bname} does not implement "
                                     f"this op for its types")
    return 0


def backend_init(name=None, params=None):
    """A Backend on the device called ``name`` (default: the best device, GPUs first)."""
    if name is None:
        return devices()[0].init(params)
    return device(name).init(params)


cdef class _Allocator:
    """Base of ``Gallocr`` and ``Scheduler``: allocators that point graph tensors into buffers they own.

    Lifetime rule: a tensor must not outlive the memory it points into. Each
    context whose tensors an allocator placed keeps the allocator alive (so
    dropping it does not free the memory) and remembers the allocator's
    ``epoch``; freeing the allocator explicitly, or growing its buffers for a
    bigger graph (ggml frees the old buffer and never moves tensors that
    already have data), makes those tensors raise ``ClosedError`` on any data
    access or compute instead of reading freed memory.
    """

    def __cinit__(self, *args, **kwargs):
        self.stamped = weakref.WeakSet()

    cdef int _stamp(self, Graph graph, uint64_t mask) except -1:
        # The contexts of graph whose tensors this allocator just gave memory (bits of mask, in
        # the order of graph.ctxs) depend on it from now on.
        cdef _ContextBase c
        cdef int i = 0
        for entry in graph.ctxs:
            if mask & ((<uint64_t> 1) << (i if i < 63 else 63)):
                c = entry[0]
                c.allocs[self] = self.epoch
                if not any(k is self for k in c.keep):
                    c.keep.append(self)
                self.stamped.add(c)
            i += 1
        return 0

    cdef int _start_moving(self, Graph graph, str op) except -1:
        # About to let ggml (re)place tensors and maybe replace the buffers: from now on computes
        # over tensors it placed refuse to start (_allocs_live), and none may be running except
        # the caller's own graph (counted once per context by its _begin).
        cdef _ContextBase c
        self.moving = True
        mine = graph.busy_ctxs or ()
        for c in list(self.stamped):
            if c.busy > (1 if any(x is c for x in mine) else 0):
                self.moving = False
                raise GGMLValueError(f"{op}: tensors this allocator placed are being computed or copied in another "
                                     f"thread; it cannot allocate (and maybe move its buffers) now")
        return 0

    cdef int _refuse_busy(self, str op) except -1:
        cdef _ContextBase c
        for c in list(self.stamped):
            if c.busy > 0:
                raise GGMLValueError(f"{op}: tensors in this allocator's buffers are being computed or copied in "
                                     f"another thread; wait for that to finish first")
        return 0


@cython.no_gc_clear
cdef class Gallocr(_Allocator):
    """A graph allocator for one buffer type (``ggml_gallocr``): places a graph's tensors in one reusable buffer.

    Contexts whose tensors it placed keep it alive; after ``free()`` (or after
    its buffer grew for a bigger graph) those tensors raise ``ClosedError``.
    """
    cdef g.ggml_gallocr_t ptr
    cdef BufferType bt
    cdef bint poisoned
    cdef object lock          # ggml's allocator is not thread-safe: one call at a time
    cdef object shape         # (graph serial, n_nodes, n_leafs) it was last sized for

    def __cinit__(self, BufferType buft not None):
        self.lock = threading.RLock()
        self.bt = buft
        self.ptr = g.ggml_gallocr_new(buft.ptr)
        if self.ptr == NULL:
            raise GGMLMemoryError("gallocr_new: out of host memory")

    def __dealloc__(self):
        if self.ptr != NULL:
            g.ggml_gallocr_free(self.ptr)
            self.ptr = NULL

    def free(self):
        """Free the buffer now (after a call running in another thread); tensors it placed raise
        ``ClosedError`` afterwards."""
        with self.lock:
            if self.ptr != NULL:
                self._refuse_busy("gallocr_free")
                self.dead = True
                g.ggml_gallocr_free(self.ptr)
                self.ptr = NULL

    close = free

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
        return False

    cdef int _ready(self, str op, Graph graph) except -1:
        if self.ptr == NULL:
            raise ClosedError(f"{op}: the allocator has been freed")
        if self.poisoned:
            raise GGMLValueError(f"{op}: this allocator failed earlier; create a new Gallocr")
        graph._ensure()
        graph._check_ctxs()
        return 0

    cdef size_t _size(self) noexcept:
        return g.ggml_gallocr_get_buffer_size(self.ptr, 0) if self.ptr != NULL else 0

    def reserve(self, Graph graph not None):
        """Size the buffer for ``graph`` (the largest graph it will allocate).

        Raises
        ------
        GGMLMemoryError
            The buffer could not be allocated; this Gallocr is unusable afterwards.
        """
        with self.lock:
            self._reserve(graph)

    cdef int _reserve(self, Graph graph) except -1:
        cdef bint ok
        cdef size_t before
        self._ready("gallocr_reserve", graph)
        before = self._size()
        graph._begin("gallocr_reserve")
        try:
            self._start_moving(graph, "gallocr_reserve")
            with nogil:
                ok = g.ggml_gallocr_reserve(self.ptr, graph.ptr)
        finally:
            self.moving = False
            graph._end()
        if not ok or self._size() != before:
            self.epoch += 1           # the old buffer is gone
        self.shape = (graph.serial, graph.ptr.n_nodes, graph.ptr.n_leafs) if ok else None
        if not ok:
            self.poisoned = True
            _rpc_check("gallocr_reserve", self.bt.endpoint)
            raise GGMLMemoryError(f"gallocr_reserve: could not allocate the compute buffer of {self.bt.name}")
        return 0

    def alloc_graph(self, Graph graph not None):
        """Assign memory to every unallocated tensor of ``graph``; call again for each new graph.

        Raises
        ------
        GGMLMemoryError
            The buffer could not be (re)allocated; this Gallocr is unusable afterwards.
        ClosedError
            The allocator was freed, or ``graph`` reads tensors whose memory is gone.
        """
        with self.lock:
            self._alloc(graph)

    cdef int _alloc(self, Graph graph) except -1:
        cdef bint ok
        cdef size_t before
        cdef uint64_t mask
        self._ready("gallocr_alloc_graph", graph)
        if self.shape is None or self.shape[0] != graph.serial or self.shape[1] != graph.ptr.n_nodes \
                or self.shape[2] != graph.ptr.n_leafs:
            # ggml re-sizes by itself only when the node count changes and would then place leafs
            # with the previous graph's offsets (a crash): size for this graph first
            self._reserve(graph)
        mask = graph._unallocated_mask()
        before = self._size()
        graph._begin("gallocr_alloc_graph")
        try:
            self._start_moving(graph, "gallocr_alloc_graph")
            with nogil:
                ok = g.ggml_gallocr_alloc_graph(self.ptr, graph.ptr)
        finally:
            self.moving = False
            graph._end()
        if not ok or self._size() != before:
            self.epoch += 1
        if not ok:
            self.poisoned = True
            _rpc_check("gallocr_alloc_graph", self.bt.endpoint)
            raise GGMLMemoryError(f"gallocr_alloc_graph: could not allocate the graph in {self.bt.name}")
        self._stamp(graph, mask)
        return 0

    @property
    def buffer_size(self):
        """Bytes of the compute buffer (0 before reserve)."""
        return self._size()
