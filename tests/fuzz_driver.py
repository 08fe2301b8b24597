"""Random op programs against ggmlpy, run in a child process by test_fuzz.py.

The driver writes every call as one line of Python, appends it to a log file
(flushed) *before* running it, then runs it. If ggml aborts or the process
crashes, the last line of the log is the call that killed it, and the log as
a whole is a replayable program (``--replay``), so a crash can be reduced by
deleting lines.

Each call is checked: it either succeeds (a Tensor result joins the pool of
arguments for later calls) or raises. A raised exception must be a
``ggmlpy.GGMLError`` whose message names the op (or one of the names the op
documents it delegates to), or a plain ``TypeError`` / ``OverflowError`` from
Cython's argument conversion. Anything else is recorded as a failure. Every few
calls a graph of random pool tensors is built and computed.

Usage::

    python tests/fuzz_driver.py --seed 1 --calls 300 --log /tmp/fuzz.log
    python tests/fuzz_driver.py --replay /tmp/fuzz.log      # re-run a log

The last line on stdout is a JSON summary: counts and the list of failures.
Options:

``--avoid FEATURES``  comma-separated features to leave out, to see past a
    known bug: ``lifetime`` (no Context.free/reset), ``type:NAME`` (no tensors of
    that type), ``index-compute`` (results of get_rows, set_rows, mul_mat_id and
    add_id, and everything computed from them, never go into a computed graph),
    ``col-views`` (views with ne[0] == 1 and a stride nb[0] other than the element
    size are not used), ``empty`` (tensors with a zero dimension are not used),
    ``huge`` (no parameters of 2**20 or more from the edge-value table),
    ``op:NAME`` (never call that op), ``cross-ctx`` (one context only),
    ``messages`` (do not report exceptions of the wrong type or without the op's
    name: crashes only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

import numpy as np

import ggmlpy as G
from ggmlpy import GGMLError, Type

NAN = float("nan")
INF = float("inf")

# Ops that document delegating to another op: a message naming the target is
# accepted (and counted as an alias note in the summary).
ALIASES = {
    "reglu": ("glu",), "geglu": ("glu",), "swiglu": ("glu",), "geglu_erf": ("glu",),
    "geglu_quick": ("glu",), "reglu_split": ("glu_split",), "geglu_split": ("glu_split",),
    "swiglu_split": ("glu_split",), "soft_max": ("soft_max_ext",), "pad": ("pad_ext",),
    "upscale": ("interpolate",), "view_1d": ("view",), "view_2d": ("view",), "view_3d": ("view",),
    "view_4d": ("view",), "reshape_1d": ("reshape",), "reshape_2d": ("reshape",),
    "reshape_3d": ("reshape",), "reshape_4d": ("reshape",), "cont_1d": ("cont",), "cont_2d": ("cont",),
    "cont_3d": ("cont",), "cont_4d": ("cont",), "new_tensor_1d": ("new_tensor",),
    "new_tensor_2d": ("new_tensor",), "new_tensor_3d": ("new_tensor",), "new_tensor_4d": ("new_tensor",),
    "dup_tensor": ("new_tensor",), "from_numpy": ("new_tensor", "set"),
}

INDEX_OPS = ("get_rows", "set_rows", "mul_mat_id", "add_id")

ALL_TYPES = list(Type)
FLOAT_T = [Type.F32, Type.F16, Type.BF16]
QUANT_T = [t for t in Type if t.is_quantized]
PLAIN_T = [t for t in Type if not t.is_quantized]

INT_EDGES = [0, 1, -1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 255, 256, -7, 2**16, 2**20, 2**30,
             2**31 - 1, -(2**31), 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63)]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-6, -1e-6, 1e30, -1e30, 1e300, NAN, INF, -INF, 3.5]
DIMS = [0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 7, 8, 8, 16, 32, 33, 64]
UNARY = ["abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf", "gelu_quick",
         "silu", "hardswish", "hardsigmoid", "exp", "expm1", "softplus", "floor", "ceil", "round", "trunc",
         "sqr", "sqrt", "log", "sin", "cos", "sum", "sum_rows", "mean", "argmax", "cumsum", "dup", "cont",
         "transpose", "diag", "soft_max", "reglu", "geglu", "swiglu", "geglu_erf", "geglu_quick", "l2_norm"]

MAX_ELEMS = 1 << 16   # tensors the driver creates on purpose stay small


# -- helpers visible to the logged program ------------------------------------------------

def arr(shape, kind, seed):
    """Deterministic random data for set()/from_numpy() (numpy order)."""
    r = np.random.default_rng(seed)
    shape = tuple(shape)
    if kind == "f":
        return (r.standard_normal(shape) * 2).astype(np.float32)
    if kind == "h":
        return r.standard_normal(shape).astype(np.float16)
    if kind == "d":
        return r.standard_normal(shape)
    if kind == "i":
        return r.integers(-2, 9, shape, dtype=np.int32)
    if kind == "l":
        return r.integers(-2, 9, shape, dtype=np.int64)
    if kind == "b":
        return r.integers(-5, 5, shape, dtype=np.int8)
    if kind == "s":
        return r.integers(-5, 5, shape, dtype=np.int16)
    if kind == "u":
        return r.integers(0, 9, shape, dtype=np.uint32)
    if kind == "c":
        return (r.standard_normal(shape) + 1j).astype(np.complex64)
    if kind == "o":
        return np.full(shape, None, dtype=object)
    if kind == "B":
        return r.integers(0, 2, shape).astype(bool)
    if kind == "x":   # special floats
        return np.resize(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e-30], np.float32),
                         shape).astype(np.float32)
    raise ValueError(kind)


NAMESPACE = {"G": G, "np": np, "Type": Type, "NAN": NAN, "INF": INF, "arr": arr}


def lit(v):
    """Python source for a literal argument."""
    if isinstance(v, float):
        if v != v:
            return "NAN"
        if v in (INF, -INF):
            return "INF" if v > 0 else "-INF"
        return repr(v)
    if isinstance(v, Type):
        return f"Type.{v.name}"
    return repr(v)


class Entry:
    __slots__ = ("name", "ctx", "epoch", "tainted", "type", "ne", "nb", "view", "data")

    def __init__(self, name, ctx, epoch, tainted, t):
        self.name, self.ctx, self.epoch, self.tainted = name, ctx, epoch, tainted
        self.type, self.ne, self.nb = t.type, t.ne, t.nb
        self.view, self.data = t.is_view, t.has_data


class Fuzzer:
    def __init__(self, seed, log, avoid=()):
        self.rng = random.Random(seed)
        self.avoid = set(avoid)
        self.seed = seed
        self.log = log
        self.unchecked = set(INDEX_OPS) if "index-compute" in self.avoid else set()
        self.int_edges = [v for v in INT_EDGES if abs(v) < 2**20] if "huge" in self.avoid else INT_EDGES
        self.ns = dict(NAMESPACE)
        self.pool: list[Entry] = []
        self.by_name: dict[str, Entry] = {}
        self.n = 0
        self.ngraph = 0
        self.graphs = []
        self.epoch = {}
        self.calls = self.raised = self.ok = 0
        self.computes = self.compute_ok = 0
        self.failures = []
        self.alias_notes = {}
        self.exc_counts = {}
        self.setup()

    # -- running one logged statement -------------------------------------------------------

    def run(self, stmt, op, args=()):
        """Log and run one statement; return True if it succeeded."""
        self.calls += 1
        self.log.write(stmt + "\n")
        self.log.flush()
        try:
            exec(stmt, self.ns)
        except GGMLError as e:
            self.raised += 1
            self.check_message(stmt, op, e)
            return False
        except (TypeError, OverflowError) as e:
            # Cython's argument conversion (wrong Python type, int out of C range).
            self.raised += 1
            key = f"{type(e).__name__}"
            self.exc_counts[key] = self.exc_counts.get(key, 0) + 1
            return False
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            self.raised += 1
            self.fail(stmt, op, f"{type(e).__name__} is not a GGMLError: {e}")
            return False
        self.ok += 1
        return True

    def check_message(self, stmt, op, e):
        msg = str(e)
        key = type(e).__name__
        self.exc_counts[key] = self.exc_counts.get(key, 0) + 1
        if op == "graph_compute":
            # compute names the node's op ("mul_mat: the CPU backend does not ...") or itself
            head = msg.split(":", 1)[0]
            if ":" in msg and head.replace("_", "").isalnum():
                return
            self.fail(stmt, op, f"{type(e).__name__} without an op name: {msg}")
            return
        if op in msg:
            return
        for alias in ALIASES.get(op, ()):
            if alias in msg:
                k = f"{op} -> {alias}"
                self.alias_notes[k] = self.alias_notes.get(k, 0) + 1
                return
        self.fail(stmt, op, f"{type(e).__name__} message does not name '{op}': {msg}")

    def fail(self, stmt, op, what):
        if "messages" in self.avoid:     # crashes only
            return
        if len(self.failures) < 50:
            self.failures.append({"call": self.calls, "op": op, "stmt": stmt, "error": what})

    # -- pool ---------------------------------------------------------------------------

    def live(self, e: Entry):
        return self.epoch[e.ctx] == e.epoch

    def add_result(self, name, ctx, tainted):
        t = self.ns.get(name)
        if not isinstance(t, G.Tensor):
            return None
        try:
            e = Entry(name, ctx, self.epoch[ctx], tainted, t)
        except GGMLError:
            return None
        if "col-views" in self.avoid and e.ne[0] == 1 and e.nb[0] != e.type.type_size:
            return None
        if "empty" in self.avoid and 0 in e.ne:
            return None
        self.pool.append(e)
        self.by_name[name] = e
        if len(self.pool) > 400:   # forget the oldest (the namespace keeps no reference either)
            old = self.pool.pop(0)
            self.by_name.pop(old.name, None)
            self.ns.pop(old.name, None)
        return e

    def fresh(self):
        self.n += 1
        return f"t{self.n}"

    def ctx_name(self, allow_noalloc=True):
        if "cross-ctx" in self.avoid:
            return "ctx0"
        r = self.rng.random()
        if r < 0.75:
            return "ctx0"
        if r < 0.9 or not allow_noalloc:
            return "ctx1"
        return "ctx2"

    def setup(self):
        for name, size, noalloc in (("ctx0", 32 << 20, False), ("ctx1", 1 << 20, False),
                                    ("ctx2", 1 << 20, True)):
            self.epoch[name] = 0
            stmt = f"{name} = G.Context({size}{', no_alloc=True' if noalloc else ''})"
            self.log.write(stmt + "\n")
            exec(stmt, self.ns)

    # -- random values -------------------------------------------------------------------

    def chance(self, p):
        return self.rng.random() < p

    def I(self, lo, hi, p_edge=0.1):  # noqa: E743
        if self.chance(p_edge):
            return self.rng.choice(self.int_edges)
        return self.rng.randint(lo, hi)

    def F(self, lo=-3.0, hi=3.0, p_edge=0.1):
        if self.chance(p_edge):
            return self.rng.choice(FLOAT_EDGES)
        return round(self.rng.uniform(lo, hi), 4)

    def rne(self, nd=None, ne0_mult=1, small=False):
        nd = nd or self.rng.randint(1, 4)
        dims = DIMS[:12] if small else DIMS
        ne = [self.rng.choice(dims) for _ in range(nd)]
        if ne0_mult > 1:
            ne[0] = ne0_mult * self.rng.choice([0, 1, 1, 1, 2])
        while len(ne) < 4:
            ne.append(1)
        while math.prod(ne) > MAX_ELEMS:
            i = max(range(4), key=lambda k: ne[k])
            ne[i] //= 2
        return tuple(ne)

    def rtype(self, kinds="float"):
        if kinds == "float":
            return self.rng.choice([Type.F32] * 5 + [Type.F16, Type.F16, Type.BF16])
        if kinds == "any":
            r = self.rng.random()
            if r < 0.5:
                return Type.F32
            if r < 0.7:
                return self.rng.choice(FLOAT_T + [Type.I32])
            return self.rng.choice(ALL_TYPES)
        if kinds == "vecdot":
            r = self.rng.random()
            if r < 0.5:
                return self.rng.choice(FLOAT_T)
            return self.rng.choice([Type.Q8_0, Type.Q4_0, Type.Q4_K, Type.Q6_K, Type.IQ4_NL, Type.MXFP4,
                                    Type.Q5_1, Type.TQ2_0] + QUANT_T)
        raise ValueError(kinds)

    # -- tensors -----------------------------------------------------------------------------

    def new(self, typ, ne, ctx=None, data=True):
        """Create a tensor (two logged calls: new_tensor, set). Returns its name or None."""
        if f"type:{typ.name}" in self.avoid:
            typ = Type.F32
        ctx = ctx or self.ctx_name()
        name = self.fresh()
        ne = tuple(ne)
        if typ.block_size > 1 and ne[0] % typ.block_size and self.chance(0.9):
            ne = (typ.block_size * max(1, ne[0] // typ.block_size),) + ne[1:]
        nd = len(ne)
        while nd > 1 and ne[nd - 1] == 1 and self.chance(0.7):
            nd -= 1
        if not self.run(f"{name} = {ctx}.new_tensor({lit(typ)}, {tuple(ne[:nd])!r})", "new_tensor"):
            return None
        e = self.add_result(name, ctx, False)
        if e is None:
            return None
        if data and e.data and math.prod(e.ne) > 0:
            kind = {Type.F16: "h", Type.F64: "d", Type.I32: "i", Type.I64: "l", Type.I8: "b",
                    Type.I16: "s"}.get(typ, "f")
            if self.chance(0.05):
                kind = self.rng.choice("fhdilbsucoBx")
            shape = tuple(reversed(e.ne[:max(1, nd)]))
            if self.chance(0.05):
                shape = tuple(reversed(self.rne()))
            self.run(f"{name}.set(arr({shape!r}, {kind!r}, {self.rng.randint(0, 10**6)}))", "set")
        return name

    def pick(self, pred=None, live=True):
        cands = [e for e in self.pool if (not live or self.live(e)) and (pred is None or pred(e))]
        if not cands:
            return None
        return self.rng.choice(cands[-120:]).name

    def T(self, typ, ne, ctx=None, view_p=0.15):
        """A tensor of type/ne: an existing matching one, a new one, or rarely anything."""
        ne = tuple(ne) + (1,) * (4 - len(ne))
        if self.chance(0.03):
            name = self.pick(live=self.chance(0.8))
            if name:
                return name
        if self.chance(0.3):
            name = self.pick(lambda e: e.type == typ and e.ne == ne)
            if name:
                return name
        name = self.new(typ, ne, ctx)
        if name is None:
            return self.pick() or "None"
        if self.chance(view_p):
            return self.viewish(name)
        return name

    def taint_of(self, args):
        return any(self.by_name[a].tainted for a in args if a in self.by_name)

    def call(self, ctx, op, args, kwargs=None, tensor_args=None):
        """Emit ``tN = ctx.op(args, **kwargs)``; add the result to the pool."""
        kwargs = kwargs or {}
        parts = list(args) + [f"{k}={v}" for k, v in kwargs.items()]
        name = self.fresh()
        if self.run(f"{name} = {ctx}.{op}({', '.join(parts)})", op):
            tens = tensor_args if tensor_args is not None else [
                a for a in list(args) + list(kwargs.values()) if a in self.by_name]
            tainted = op in self.unchecked or self.taint_of(tens)
            if self.add_result(name, ctx, tainted) is not None:
                return name
        return None

    def viewish(self, name):
        """A transpose / permute / view / reshape of name (when it succeeds)."""
        e = self.by_name.get(name)
        if e is None:
            return name
        ctx = e.ctx if self.chance(0.9) else self.ctx_name()
        r = self.rng.random()
        if r < 0.3:
            out = self.call(ctx, "transpose", [name])
        elif r < 0.55:
            perm = list(range(4))
            self.rng.shuffle(perm)
            if self.chance(0.05):
                perm[self.rng.randrange(4)] = self.rng.choice([-1, 4, 0, 2**31])
            out = self.call(ctx, "permute", [name] + [str(p) for p in perm])
        elif r < 0.85:
            out = self.random_view(ctx, e)
        else:
            n = math.prod(e.ne)
            ne = self.factor(n, e.type.block_size)
            out = self.call(ctx, "reshape", [name, repr(ne)])
        return out or name

    def factor(self, n, bs=1):
        if n == 0 or self.chance(0.05):
            return self.rne(small=True)
        divs = [d for d in range(1, min(n, 512) + 1) if n % d == 0 and d % bs == 0] or [n]
        ne0 = self.rng.choice(divs)
        rest = n // ne0
        divs = [d for d in range(1, min(rest, 512) + 1) if rest % d == 0] or [rest]
        ne1 = self.rng.choice(divs)
        return (ne0, ne1, rest // ne1)

    def random_view(self, ctx, e):
        bs = e.type.block_size
        ne = [max(0, min(d, self.rng.choice([d, d, d - 1, 1, 0, 2 * d]))) for d in e.ne]
        if bs > 1:
            ne[0] = (ne[0] // bs) * bs
        nd = self.rng.randint(1, 4)
        rs = e.type.row_size(ne[0]) if ne[0] % bs == 0 else 0
        nbs = []
        prev = rs
        for i in range(1, nd):
            r = self.rng.random()
            if r < 0.5:
                nb = prev
            elif r < 0.7 and i < 4:
                nb = e.nb[i]
            elif r < 0.9:
                nb = self.rng.choice([0, e.type.type_size, prev * 2, rs + e.type.type_size])
            else:
                nb = self.rng.choice(self.int_edges)
            nbs.append(nb)
            prev = max(nb, 1) * max(ne[i], 1)
        offset = self.rng.choice([0, 0, 0, e.type.type_size, e.nb[1], 1, 3, 2**40, -1])
        return self.call(ctx, "view", [e.name, repr(tuple(ne[:nd])), repr(tuple(nbs)) if nbs else "None",
                                       repr(offset)])

    # -- op generators ------------------------------------------------------------------------

    def g_binary(self, op):
        ta = self.rtype()
        ne = self.rne()
        a = self.T(ta, ne)
        bne = [self.rng.choice([d, 1, 1]) if d else self.rng.choice([0, 1]) for d in ne]
        if self.chance(0.1):
            bne = list(self.rne())
        b = self.T(self.rng.choice([ta, ta, Type.F32, self.rtype("any")]), bne)
        return [a, b], {}

    def g_unary(self, op):
        ne = self.rne()
        if op in ("reglu", "geglu", "swiglu", "geglu_erf", "geglu_quick") and ne[0] % 2:
            ne = (ne[0] + 1,) + ne[1:]
        if op == "diag":
            ne = (ne[0], 1) + ne[2:]
        typ = self.rtype() if self.chance(0.9) else self.rtype("any")
        return [self.T(typ, ne)], {}

    def gen_args(self, op):
        """Plausible arguments for op (a list of source strings and a kwargs dict)."""
        R, I, F, T = self.rng, self.I, self.F, self.T  # noqa: E741
        if op in ("add", "sub", "mul", "div", "add_inplace"):
            return self.g_binary(op)
        if op in UNARY:
            return self.g_unary(op)
        if op in ("leaky_relu", "scale", "fill"):
            a = T(self.rtype(), self.rne())
            return [a, lit(F())], {}
        if op in ("scale_bias", "clamp"):
            a = T(self.rtype(), self.rne())
            return [a, lit(F()), lit(F())], {}
        if op in ("norm", "rms_norm", "l2_norm"):
            return [T(self.rtype(), self.rne()), lit(F(0, 1e-3))], {}
        if op == "group_norm":
            ne = self.rne()
            return [T(Type.F32, ne), str(I(-1, 5)), lit(F(0, 1e-3))], {}
        if op in ("argsort", "top_k"):
            ne = self.rne()
            p = I(0, 1) if op == "argsort" else I(0, ne[0] + 1)
            return [T(Type.F32, ne), str(p)], {}
        if op == "count_equal":
            ne = self.rne(nd=2)
            return [T(Type.I32, ne), T(Type.I32, ne if self.chance(0.8) else self.rne())], {}
        if op == "repeat":
            ne = self.rne()
            mult = [d * R.choice([1, 1, 2, 3, 0]) for d in ne]
            return [T(self.rtype(), ne), T(self.rtype("any"), mult)], {}
        if op == "repeat_4d":
            ne = self.rne()
            return [T(self.rtype(), ne)] + [str(d * I(0, 3)) for d in ne], {}
        if op == "concat":
            ne = self.rne()
            dim = I(0, 3)
            ne2 = list(ne)
            if 0 <= dim < 4:
                ne2[dim] = R.choice(DIMS)
            typ = self.rtype("any") if self.chance(0.2) else self.rtype()
            return [T(typ, ne), T(typ if self.chance(0.9) else self.rtype(), ne2), str(dim)], {}
        if op in ("glu", "glu_split", "swiglu_oai"):
            ne = self.rne()
            if op == "glu":
                return [T(self.rtype(), ne), str(I(0, 5)), str(R.choice([True, False]))], {}
            typ = Type.F32 if op == "swiglu_oai" else self.rtype()
            extra = [lit(F()), lit(F())] if op == "swiglu_oai" else [str(I(0, 5))]
            return [T(typ, ne), T(typ, ne if self.chance(0.9) else self.rne())] + extra, {}
        if op in ("reglu_split", "geglu_split", "swiglu_split"):
            ne = self.rne()
            typ = self.rtype()
            return [T(typ, ne), T(typ, ne)], {}
        if op == "mul_mat":
            K, M, N = R.choice(DIMS[1:]), R.choice(DIMS), R.choice(DIMS)
            ta = self.rtype("vecdot")
            if ta.block_size > 1:
                K = ta.block_size * R.choice([1, 1, 2])
            B2, B3 = R.choice([1, 1, 2, 3]), R.choice([1, 1, 2])
            r2, r3 = R.choice([1, 1, 2]), R.choice([1, 1, 2])
            a = T(ta, (K, M, B2, B3))
            b = T(R.choice([Type.F32, Type.F32, ta]), (K if self.chance(0.95) else K + 1, N, B2 * r2, B3 * r3))
            kw = {"prec": str(R.choice([0, 10, 1, -1]))} if self.chance(0.2) else {}
            return [a, b], kw
        if op == "out_prod":
            K, M, N = R.choice(DIMS[1:]), R.choice(DIMS), R.choice(DIMS)
            ta = R.choice([Type.F32, Type.F32, Type.F16, Type.Q8_0, Type.Q4_K])
            if ta.block_size > 1:
                M = ta.block_size
            return [T(ta, (M, K, 1, 1)), T(Type.F32, (N, K, R.choice([1, 2]), 1))], {}
        if op == "mul_mat_id":
            K, Nf, E, nu, Tk = R.choice([4, 8, 32]), R.choice([1, 2, 5]), R.choice([1, 2, 4]), \
                R.choice([1, 2]), R.choice([1, 3])
            ta = self.rtype("vecdot")
            if ta.block_size > 1:
                K = ta.block_size
            return [T(ta, (K, Nf, E)), T(Type.F32, (K, R.choice([1, nu]), Tk)), T(Type.I32, (nu, Tk))], {}
        if op == "add_id":
            n, m, k, E = R.choice([1, 4]), R.choice([1, 3]), R.choice([1, 2]), R.choice([1, 3])
            return [T(Type.F32, (n, m, k)), T(Type.F32, (n, E)), T(Type.I32, (m, k))], {}
        if op == "cpy":
            ne = self.rne()
            ta, tb = self.rtype("any"), self.rtype("any")
            return [T(ta, ne), T(tb, ne if self.chance(0.7) else self.factor(math.prod(ne)))], {}
        if op == "cast":
            typ = R.choice(ALL_TYPES)
            tl = lit(typ) if self.chance(0.9) else repr(R.choice([4, 5, 99, -1, "q8_0", "bogus", 1.5, None]))
            ne = self.rne(ne0_mult=typ.block_size if self.chance(0.7) else 1)
            return [T(self.rtype("any"), ne), tl], {}
        if op == "cont_ne":
            ne = self.rne()
            return [T(self.rtype("any"), ne), repr(self.factor(math.prod(ne)))], {}
        if op in ("reshape", "view", "permute"):
            a = T(self.rtype("any"), self.rne())
            e = self.by_name.get(a)
            if op == "reshape":
                return [a, repr(self.factor(math.prod(e.ne)) if e else self.rne())], {}
            if op == "permute":
                perm = list(range(4))
                R.shuffle(perm)
                if self.chance(0.15):
                    perm[R.randrange(4)] = R.choice([-1, 4, 0, 3, 2**31])
                return [a] + [str(p) for p in perm], {}
            return None   # view: handled by viewish
        if op == "get_rows":
            ne0, nr, B, C = R.choice(DIMS[1:]), R.choice(DIMS), R.choice([1, 2]), R.choice([1, 2])
            ta = R.choice([Type.F32, Type.F16, Type.I32, Type.Q8_0, Type.Q4_K, self.rtype("any")])
            if ta.block_size > 1:
                ne0 = ta.block_size
            return [T(ta, (ne0, nr, B, C)), T(Type.I32, (R.choice(DIMS), B, C))], {}
        if op == "set_rows":
            ne0, nr, n, B, C = R.choice(DIMS[1:]), R.choice(DIMS), R.choice(DIMS), R.choice([1, 2]), R.choice([1, 2])
            ta = R.choice([Type.F32, Type.F16, Type.BF16, Type.Q8_0, Type.Q4_0, self.rtype("any")])
            if ta.block_size > 1:
                ne0 = ta.block_size
            return [T(ta, (ne0, nr, B, C)), T(R.choice([Type.F32, Type.F16]), (ne0, n, B, C)),
                    T(R.choice([Type.I64, Type.I32]), (n, R.choice([1, B, 0]), R.choice([1, C])))], {}
        if op in ("diag_mask_inf", "diag_mask_zero"):
            return [T(Type.F32, self.rne()), str(I(-2, 8))], {}
        if op == "soft_max_ext":
            ne = self.rne()
            a = T(Type.F32, ne)
            kw = {}
            if self.chance(0.6):
                mne = (ne[0], ne[1] + R.choice([0, 0, 1, -1]), R.choice([1, ne[2], 0]), R.choice([1, ne[3]]))
                kw["mask"] = T(R.choice([Type.F32, Type.F16]), mne)
            kw["scale"] = lit(F())
            kw["max_bias"] = lit(F(0, 8) if self.chance(0.8) else F())
            if self.chance(0.2):
                kw["sinks"] = T(Type.F32, (ne[2] if self.chance(0.8) else ne[2] + 1,))
            return [a], kw
        if op in ("rope_ext", "rope_multi"):
            hd = 2 * R.choice([1, 2, 4, 8])
            nh, nt = R.choice([1, 2, 3]), R.choice([0, 1, 2, 5])
            a = T(R.choice([Type.F32, Type.F16, Type.BF16]), (hd, nh, nt))
            kw = {"n_dims": str(R.choice([hd, hd, hd // 2, hd - 1, 0, -2, hd + 2])),
                  "freq_base": lit(F(1, 1e4)), "freq_scale": lit(F(0.1, 2)), "ext_factor": lit(F(0, 1)),
                  "attn_factor": lit(F(0, 2)), "beta_fast": lit(F(0, 64)), "beta_slow": lit(F(0, 2)),
                  "n_ctx_orig": str(I(0, 4096))}
            if op == "rope_ext":
                kw["mode"] = str(R.choice([0, 0, 2, 2, 8, 24, 40, 1, 4, -1]))
                pos = T(Type.I32, (nt if self.chance(0.9) else nt + 1,))
            else:
                kw["mode"] = str(R.choice([8, 24, 40, 0, 2]))
                s = [R.choice([0, 1, 2, hd // 4]) for _ in range(4)]
                kw["sections"] = repr(tuple(s) if self.chance(0.9) else tuple(s[:3]))
                pos = T(Type.I32, (4 * nt if self.chance(0.9) else nt,))
            ff = [T(Type.F32, (hd // 2,))] if self.chance(0.2) else []
            return [a, pos] + ff, kw
        if op == "flash_attn_ext":
            D, Dv, nq, nkv, H, Hk, S = (R.choice([4, 8, 32]), R.choice([4, 8, 32]), R.choice([1, 2, 3]),
                                         R.choice([1, 2, 4, 0]), R.choice([1, 2, 4]), 0, R.choice([1, 1, 2]))
            Hk = R.choice([d for d in (1, 2, 4) if H % d == 0])
            tk = R.choice([Type.F16, Type.F16, Type.F32, Type.Q8_0, Type.BF16, Type.Q4_0])
            if tk.block_size > 1:
                D = Dv = 32
            kw = {"scale": lit(F()), "max_bias": lit(F(0, 8) if self.chance(0.8) else F()),
                  "logit_softcap": lit(F(0, 30))}
            if self.chance(0.6):
                kw["mask"] = T(Type.F16, (nkv + R.choice([0, 0, 3]), nq + R.choice([0, 1]), R.choice([1, H]), 1))
            if self.chance(0.2):
                kw["prec"] = str(R.choice([0, 10, 5]))
            if self.chance(0.15):
                kw["sinks"] = T(Type.F32, (H,))
            return [T(Type.F32, (D, nq, H, S)), T(tk, (D, nkv, Hk, S)), T(tk, (Dv, nkv, Hk, S))], kw
        if op == "im2col":
            KW, KH, IC, OC = R.choice([1, 2, 3]), R.choice([1, 2, 3]), R.choice([1, 2]), R.choice([1, 2])
            W, H, N = R.choice([1, 3, 5, 8]), R.choice([1, 3, 5]), R.choice([1, 2])
            is2d = self.chance(0.7)
            a = T(R.choice([Type.F32, Type.F16]), (KW, KH, IC, OC) if is2d else (KW, IC, OC))
            b = T(R.choice([Type.F32, Type.F16]), (W, H, IC, N) if is2d else (W, IC, N))
            p = [I(1, 2), I(1, 2), I(0, 1), I(0, 1), I(1, 2), I(1, 2)]
            return [a, b] + [str(v) for v in p] + [str(is2d), lit(R.choice([Type.F16, Type.F32, Type.Q8_0]))], {}
        if op == "conv_1d":
            K, IC, OC, L, N = (R.choice([1, 2, 3]), R.choice([1, 2]), R.choice([1, 2]), R.choice([1, 4, 7]),
                               R.choice([1, 2]))
            return [T(R.choice([Type.F32, Type.F16]), (K, IC, OC)), T(R.choice([Type.F32, Type.F16]), (L, IC, N)),
                    str(I(1, 2)), str(I(0, 1)), str(I(1, 2))], {}
        if op == "conv_2d":
            KW, KH, IC, OC = R.choice([1, 2, 3]), R.choice([1, 2, 3]), R.choice([1, 2]), R.choice([1, 2])
            W, H, N = R.choice([1, 3, 5, 8]), R.choice([1, 3, 5]), R.choice([1, 2])
            return [T(R.choice([Type.F32, Type.F16]), (KW, KH, IC, OC)),
                    T(R.choice([Type.F32, Type.F16]), (W, H, IC, N))] + [str(v) for v in (
                        I(1, 2), I(1, 2), I(0, 1), I(0, 1), I(1, 2), I(1, 2))], {}
        if op == "conv_transpose_1d":
            K, OC, IC, L = R.choice([1, 2, 3]), R.choice([1, 2]), R.choice([1, 2]), R.choice([1, 4, 7])
            return [T(R.choice([Type.F32, Type.F16]), (K, OC, IC)), T(Type.F32, (L, IC)),
                    str(I(1, 3)), str(I(0, 0)), str(I(1, 1))], {}
        if op == "pool_1d":
            ne = self.rne()
            return [T(R.choice([Type.F32, Type.F16]), ne), str(I(0, 1)), str(I(1, 3)), str(I(1, 3)), str(I(0, 1))], {}
        if op == "pool_2d":
            ne = self.rne()
            return [T(R.choice([Type.F32, Type.F16]), ne), str(I(0, 1))] + [str(v) for v in (
                I(1, 3), I(1, 3), I(1, 3), I(1, 3), I(0, 1), I(0, 1))], {}
        if op == "upscale":
            return [T(Type.F32, self.rne(small=True)), str(I(1, 3)), str(R.choice([0, 1, 2, 256, 257, 3, 512]))], {}
        if op == "interpolate":
            ne = self.rne(small=True)
            return [T(Type.F32, ne)] + [str(I(1, 6)) for _ in range(4)] + [str(R.choice([0, 1, 2, 256, 3, 1024]))], {}
        if op in ("pad", "pad_ext"):
            n = 4 if op == "pad" else 8
            return [T(Type.F32, self.rne(small=True))] + [str(I(0, 3)) for _ in range(n)], {}
        if op == "pad_reflect_1d":
            ne = self.rne()
            return [T(Type.F32, ne), str(I(0, ne[0])), str(I(0, ne[0]))], {}
        if op == "roll":
            ne = self.rne()
            return [T(Type.F32, ne)] + [str(I(-d, d)) for d in ne], {}
        if op == "tri":
            n = R.choice(DIMS)
            return [T(Type.F32, (n, n if self.chance(0.9) else n + 1, R.choice([1, 2]))), str(I(0, 3))], {}
        if op == "arange":
            return [lit(F(-10, 10)), lit(F(-10, 100)), lit(F(0.01, 3))], {}
        if op == "timestep_embedding":
            return [T(Type.F32, (R.choice(DIMS),)), str(I(1, 33)), str(I(1, 10000))], {}
        raise KeyError(op)

    OPS = (["add", "sub", "mul", "div", "add_inplace", "leaky_relu", "scale", "fill", "scale_bias", "clamp",
            "norm", "rms_norm", "l2_norm", "group_norm", "argsort", "top_k", "count_equal", "repeat",
            "repeat_4d", "concat", "glu", "glu_split", "swiglu_oai", "reglu_split", "geglu_split",
            "swiglu_split", "mul_mat", "mul_mat", "out_prod", "mul_mat_id", "add_id", "cpy", "cast",
            "cont_ne", "reshape", "view", "permute", "get_rows", "set_rows", "diag_mask_inf",
            "diag_mask_zero", "soft_max_ext", "rope_ext", "rope_multi", "flash_attn_ext", "im2col",
            "conv_1d", "conv_2d", "conv_transpose_1d", "pool_1d", "pool_2d", "upscale", "interpolate",
            "pad", "pad_ext", "pad_reflect_1d", "roll", "tri", "arange", "timestep_embedding"]
           + UNARY)

    # -- mutation: swap a tensor argument for any pool tensor, or a number for an edge value --

    def mutate(self, args, kwargs):
        if not self.chance(0.25):
            return args, kwargs
        args = list(args)
        slots = list(range(len(args))) + list(kwargs)
        if not slots:
            return args, kwargs
        s = self.rng.choice(slots)
        cur = args[s] if isinstance(s, int) else kwargs[s]
        if cur in self.by_name or cur == "None":
            new = self.pick(live=self.chance(0.85)) or cur
            if self.chance(0.1):
                new = "None"
        else:
            new = self.rng.choice([repr(self.rng.choice(self.int_edges)), lit(self.rng.choice(FLOAT_EDGES)),
                                   "None", "'x'", "(1, 2)"])
        if isinstance(s, int):
            args[s] = new
        else:
            kwargs = dict(kwargs)
            kwargs[s] = new
        return args, kwargs

    def step_op(self):
        op = self.rng.choice(self.OPS)
        if f"op:{op}" in self.avoid:
            return
        if op == "view":
            name = self.pick(live=self.chance(0.9))
            if name is None:
                return
            e = self.by_name[name]
            self.random_view(e.ctx if self.chance(0.9) else self.ctx_name(), e)
            return
        args = self.gen_args(op)
        if args is None:
            return
        args, kwargs = args
        args, kwargs = self.mutate(args, kwargs)
        method = "cont" if op == "cont_ne" else op
        ctx = self.ctx_name()
        if op == "arange":
            self.call(ctx, op, args, kwargs, tensor_args=[])
            return
        self.call(ctx, method, args, kwargs)

    # -- other steps ---------------------------------------------------------------------------

    def step_compute(self):
        cands = [e for e in self.pool if self.live(e) and not e.tainted]
        if not cands:
            return
        roots = [self.rng.choice(cands[-80:]).name for _ in range(self.rng.randint(1, 3))]
        gctx = self.ctx_name() if self.chance(0.2) else self.by_name[roots[0]].ctx
        self.ngraph += 1
        gname = f"g{self.ngraph}"
        size = self.rng.choice([1, 2, 3, 8, 64, 2048, 2048, 2048])
        if not self.run(f"{gname} = {gctx}.new_graph({size})", "new_graph"):
            return
        self.graphs.append(gname)
        for r in roots:
            self.run(f"{gname}.build_forward_expand({r})", "build_forward_expand")
        self.computes += 1
        if self.run(f"{gname}.compute({self.rng.choice([1, 1, 1, 2])})", "graph_compute"):
            self.compute_ok += 1
            for r in roots:
                if self.chance(0.5):
                    self.run(f"_ = {r}.get()", "get")
                if self.chance(0.2):
                    self.run(f"_ = {r}.numpy()", "numpy")

    def step_misc(self):
        r = self.rng.random()
        if r < 0.25 and self.graphs:
            # recompute an old graph (maybe its context was freed or reset since)
            self.computes += 1
            g = self.rng.choice(self.graphs[-10:])
            if self.run(f"{g}.compute(1)", "graph_compute"):
                self.compute_ok += 1
        elif r < 0.45:
            name = self.pick(live=self.chance(0.7))
            if name:
                self.run(f"_ = {name}.get()", "get")
        elif r < 0.6:
            name = self.pick(live=self.chance(0.7))
            if name:
                e = self.by_name[name]
                shape = tuple(reversed(e.ne)) if self.chance(0.8) else tuple(reversed(self.rne()))
                kind = self.rng.choice("ffffhdilxc")
                self.run(f"{name}.set(arr({shape!r}, {kind!r}, {self.rng.randint(0, 10**6)}))", "set")
        elif r < 0.75:
            # wild new_tensor
            big = [2**31, 2**40, 2**62] if "huge" not in self.avoid else []
            ne = [self.rng.choice(DIMS + [-1] + big) for _ in range(self.rng.randint(0, 5))]
            typ = self.rng.choice([lit(self.rng.choice(ALL_TYPES)), "4", "99", "'f32'", "'nope'", "np.float32",
                                   "np.complex64", "None"])
            name = self.fresh()
            ctx = self.ctx_name()
            if self.run(f"{name} = {ctx}.new_tensor({typ}, {tuple(ne)!r})", "new_tensor"):
                self.add_result(name, ctx, False)
        elif r < 0.85:
            shape = tuple(self.rng.choice([0, 1, 2, 3, 5]) for _ in range(self.rng.randint(0, 5)))
            kind = self.rng.choice("ffhdilbsucoBx")
            name = self.fresh()
            ctx = self.ctx_name()
            typ = "" if self.chance(0.7) else f", type={lit(self.rng.choice(ALL_TYPES))}"
            if self.run(f"{name} = {ctx}.from_numpy(arr({shape!r}, {kind!r}, {self.rng.randint(0, 10**6)}){typ})",
                        "from_numpy"):
                self.add_result(name, ctx, False)
        elif r < 0.93:
            name = self.pick(live=self.chance(0.8))
            if name:
                self.viewish(name)
        elif "lifetime" not in self.avoid:
            # lifetime events: free or reset a context, then replace it
            ctx = self.rng.choice(["ctx1", "ctx1", "ctx2", "ctx0"])
            what = self.rng.choice(["free", "reset"])
            self.run(f"{ctx}.{what}()", what)
            self.epoch[ctx] += 1
            if what == "free":
                size = {"ctx0": 32 << 20}.get(ctx, self.rng.choice([1 << 12, 1 << 16, 1 << 20]))
                na = ", no_alloc=True" if ctx == "ctx2" else ""
                self.run(f"{ctx} = G.Context({size}{na})", "Context")

    def go(self, n_calls):
        while self.calls < n_calls:
            r = self.rng.random()
            if r < 0.7:
                self.step_op()
            elif r < 0.82:
                self.step_compute()
            else:
                self.step_misc()

    def summary(self):
        return {"seed": self.seed, "calls": self.calls, "ok": self.ok, "raised": self.raised,
                "computes": self.computes, "compute_ok": self.compute_ok, "failures": self.failures,
                "alias_notes": self.alias_notes, "exceptions": self.exc_counts}


def replay(path):
    ns = dict(NAMESPACE)
    with open(path) as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip() and not ln.startswith("#")]
    for i, ln in enumerate(lines):
        print(f"[{i}] {ln}", flush=True)
        try:
            exec(ln, ns)
        except Exception as e:  # noqa: BLE001
            print(f"    -> {type(e).__name__}: {e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--log", default="fuzz.log")
    ap.add_argument("--avoid", default="", help="comma-separated features to leave out, to see past a known bug: "
                    "lifetime, type:NAME, index-compute, col-views, empty, huge (see the module doc)")
    ap.add_argument("--replay", default=None, help="run the statements of a log file")
    a = ap.parse_args(argv)
    if a.replay:
        replay(a.replay)
        return 0
    with open(a.log, "w", buffering=1) as log:
        log.write(f"# ggmlpy fuzz program: seed={a.seed} calls={a.calls} avoid={a.avoid}\n")
        fz = Fuzzer(a.seed, log, [s for s in a.avoid.split(",") if s])
        fz.go(a.calls)
        log.write("# done\n")
    print(json.dumps(fz.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
