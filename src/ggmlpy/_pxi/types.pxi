# types.pxi: ggml's enums as IntEnums (built from ggml's own name tables, so a
# newer pin needs no edit here) and the traits of each tensor type.


class _TypeBase(enum.IntEnum):
    """A ggml tensor type (``ggml_type``)."""

    @property
    def block_size(self):
        """Elements per block (1 for plain types, 32 for Q8_0, 256 for K-quants)."""
        return <int64_t> g.ggml_blck_size(<g.ggml_type> <int> self)

    @property
    def type_size(self):
        """Bytes per block."""
        return g.ggml_type_size(<g.ggml_type> <int> self)

    @property
    def is_quantized(self):
        """True for block-quantized types."""
        return bool(g.ggml_is_quantized(<g.ggml_type> <int> self))

    @property
    def numpy_dtype(self):
        """The numpy dtype of one element, or None (quantized types, BF16)."""
        return _NP_DTYPES.get(int(self))

    def row_size(self, ne0):
        """Bytes of one row of ``ne0`` elements; ``ne0`` must be a multiple of the block size."""
        ne0 = int(ne0)
        if ne0 < 0 or ne0 % self.block_size:
            raise GGMLValueError(f"row_size: ne0={ne0} is not a multiple of {self.name}'s block size {self.block_size}")
        return g.ggml_row_size(<g.ggml_type> <int> self, ne0)


def _enum_members(int count, name_of):
    out = {}
    for i in range(count):
        n = name_of(i)
        if n is None:
            continue
        key = n.upper().replace("-", "_").replace(" ", "_")
        if key and key not in out:
            out[key] = i
    return out


def _type_name(int i):
    cdef const g.ggml_type_traits * tr = g.ggml_get_type_traits(<g.ggml_type> i)
    # Removed types keep a slot with block size 0 (and a placeholder name).
    if tr == NULL or tr.blck_size == 0 or tr.type_name == NULL:
        return None
    return tr.type_name.decode()


def _op_name(int i):
    cdef const char * s = g.ggml_op_name(<g.ggml_op> i)
    return None if s == NULL else s.decode()


def _unary_name(int i):
    cdef const char * s = g.ggml_unary_op_name(<g.ggml_unary_op> i)
    return None if s == NULL else s.decode()


def _glu_name(int i):
    cdef const char * s = g.ggml_glu_op_name(<g.ggml_glu_op> i)
    return None if s == NULL else s.decode()


Type = _TypeBase("Type", _enum_members(g.GGML_TYPE_COUNT, _type_name), module="ggmlpy")
Op = enum.IntEnum("Op", _enum_members(g.GGML_OP_COUNT, _op_name), module="ggmlpy")
UnaryOp = enum.IntEnum("UnaryOp", _enum_members(g.GGML_UNARY_OP_COUNT, _unary_name), module="ggmlpy")
GluOp = enum.IntEnum("GluOp", _enum_members(g.GGML_GLU_OP_COUNT, _glu_name), module="ggmlpy")
Op.__doc__ = "A ggml graph operation (``ggml_op``)."
UnaryOp.__doc__ = "The function of a ``UNARY`` node (``ggml_unary_op``)."
GluOp.__doc__ = "The gate function of a ``GLU`` node (``ggml_glu_op``)."


class Status(enum.IntEnum):
    """Result of a compute call (``ggml_status``)."""
    ALLOC_FAILED = g.GGML_STATUS_ALLOC_FAILED
    FAILED = g.GGML_STATUS_FAILED
    SUCCESS = g.GGML_STATUS_SUCCESS
    ABORTED = g.GGML_STATUS_ABORTED


class Prec(enum.IntEnum):
    """Accumulation precision of mul_mat / flash_attn_ext (``ggml_prec``)."""
    DEFAULT = g.GGML_PREC_DEFAULT
    F32 = g.GGML_PREC_F32


class RopeType(enum.IntEnum):
    """RoPE layouts (``GGML_ROPE_TYPE_*``): NORMAL rotates adjacent pairs, NEOX the two halves."""
    NORMAL = g.GGML_ROPE_TYPE_NORMAL
    NEOX = g.GGML_ROPE_TYPE_NEOX
    MROPE = g.GGML_ROPE_TYPE_MROPE
    VISION = g.GGML_ROPE_TYPE_VISION
    IMROPE = g.GGML_ROPE_TYPE_IMROPE


class SortOrder(enum.IntEnum):
    """Order of ``argsort``."""
    ASC = g.GGML_SORT_ORDER_ASC
    DESC = g.GGML_SORT_ORDER_DESC


class PoolOp(enum.IntEnum):
    """Reduction of ``pool_1d`` / ``pool_2d``."""
    MAX = g.GGML_OP_POOL_MAX
    AVG = g.GGML_OP_POOL_AVG


class ScaleMode(enum.IntEnum):
    """Interpolation of ``upscale`` / ``interpolate`` (flags may be OR-ed in)."""
    NEAREST = g.GGML_SCALE_MODE_NEAREST
    BILINEAR = g.GGML_SCALE_MODE_BILINEAR
    BICUBIC = g.GGML_SCALE_MODE_BICUBIC
    ALIGN_CORNERS = 1 << 8


class TriType(enum.IntEnum):
    """Which triangle ``tri`` keeps."""
    UPPER_DIAG = g.GGML_TRI_TYPE_UPPER_DIAG
    UPPER = g.GGML_TRI_TYPE_UPPER
    LOWER_DIAG = g.GGML_TRI_TYPE_LOWER_DIAG
    LOWER = g.GGML_TRI_TYPE_LOWER


_NP_DTYPES = {
    g.GGML_TYPE_F32: np.dtype(np.float32),
    g.GGML_TYPE_F16: np.dtype(np.float16),
    g.GGML_TYPE_F64: np.dtype(np.float64),
    g.GGML_TYPE_I8: np.dtype(np.int8),
    g.GGML_TYPE_I16: np.dtype(np.int16),
    g.GGML_TYPE_I32: np.dtype(np.int32),
    g.GGML_TYPE_I64: np.dtype(np.int64),
}
_FROM_NP = {v: k for k, v in _NP_DTYPES.items()}

# Buffer-protocol format per type; raw storage (quantized blocks) is bytes and
# BF16 is exposed as its 16-bit pattern.
cdef const char * _buffer_format(int t) noexcept:
    if t == g.GGML_TYPE_F32: return b"f"
    if t == g.GGML_TYPE_F16: return b"e"
    if t == g.GGML_TYPE_F64: return b"d"
    if t == g.GGML_TYPE_I8: return b"b"
    if t == g.GGML_TYPE_I16: return b"h"
    if t == g.GGML_TYPE_I32: return b"i"
    if t == g.GGML_TYPE_I64: return b"q"
    if t == g.GGML_TYPE_BF16: return b"H"
    return b"B"


cdef inline bint _valid_type(int t) noexcept:
    if t < 0 or t >= g.GGML_TYPE_COUNT:
        return False
    return g.ggml_get_type_traits(<g.ggml_type> t).blck_size != 0


cdef int _as_type(object t, str op) except -1:
    """Accept a Type, its int value, its name ('q8_0') or a numpy dtype."""
    cdef int v
    if isinstance(t, int):
        v = t
    elif isinstance(t, str):
        try:
            v = Type[t.upper()]
        except KeyError:
            raise GGMLValueError(f"{op}: unknown ggml type {t!r} (expected one of {', '.join(Type.__members__)})") from None
    else:
        try:
            v = _FROM_NP[np.dtype(t)]
        except (KeyError, TypeError):
            raise GGMLTypeError(f"{op}: expected a ggml Type, got {t!r}") from None
    if not _valid_type(v):
        raise GGMLValueError(f"{op}: {v} is not a valid ggml type")
    return v


def type_name(t):
    """ggml's name of a type (``'q8_0'``)."""
    return g.ggml_type_name(<g.ggml_type> _as_type(t, "type_name")).decode()


def blck_size(t):
    """Elements per block of type ``t``."""
    return <int64_t> g.ggml_blck_size(<g.ggml_type> _as_type(t, "blck_size"))


def type_size(t):
    """Bytes per block of type ``t``."""
    return g.ggml_type_size(<g.ggml_type> _as_type(t, "type_size"))


def row_size(t, int64_t ne0):
    """Bytes of a row of ``ne0`` elements of type ``t`` (a multiple of the block size)."""
    return Type(_as_type(t, "row_size")).row_size(ne0)


def is_quantized(t):
    """True if ``t`` is a block-quantized type."""
    return bool(g.ggml_is_quantized(<g.ggml_type> _as_type(t, "is_quantized")))


def tensor_overhead():
    """Context bytes one tensor's metadata takes (``ggml_tensor_overhead``)."""
    return g.ggml_tensor_overhead()


def graph_overhead(size_t size=g.GGML_DEFAULT_GRAPH_SIZE, bint grads=False):
    """Context bytes a graph of ``size`` nodes takes (``ggml_graph_overhead_custom``)."""
    return g.ggml_graph_overhead_custom(size, grads)
