"""Which of ggmlpy's own CPU kernels a graph uses: each is chosen by measurement against ggml's op.

ggmlpy has its own CPU kernels for the generation step's matrix-vector products
(:meth:`~ggmlpy.Context.mul_mat_vec`, :meth:`~ggmlpy.Context.mul_mat_id_vec`), for a prompt's experts on
weights ggml repacked (:meth:`~ggmlpy.Context.mul_mat_id_rq`), for a prompt's products with Q4_K weights
ggml repacked (:meth:`~ggmlpy.Context.mul_mat_rq4k`), for attention over the
cache (:meth:`~ggmlpy.Context.attn_decode`, :meth:`~ggmlpy.Context.attn_prefill`) and for GeGLU
(:meth:`~ggmlpy.Context.geglu_tanh`). A kernel shaped for one microarchitecture (512-bit registers, a
prefetch distance) can lose to ggml's on the next one: on a Zen 4 the own F16 matrix-vector kernel gave
132 tokens/s where ggml's gave 150. So a :class:`~ggmlpy.Runner` measures each own kernel against
ggml's op on the model's own shapes and weights before it builds a graph
(:func:`ggmlpy.models.calibrate.kernel_choices`), caches the timings per machine, and the graph takes
the own kernel only where it measured faster.

This module holds the decisions (:class:`KernelChoices`) and the rule; the model's building blocks
(:mod:`ggmlpy.models.blocks`) ask :func:`use` at graph-building time, under the choices the runner set
with :func:`using`. A place is named by a :class:`Site`: the op, the weight or cache type, and the shape
class (a weight's ``(ne0, ne1)``, a cache's head sizes and depth class...).

Modes (``$GGMLPY_KERNELS``, or :func:`mode`):

* ``"measure"`` (the default): an own kernel only where it measured at least :data:`MARGIN` faster
  than ggml's op; a tie goes to ggml's.
* ``"own"``: every own kernel wherever it can run (ggmlpy before kernel selection; the test suite's
  setting, so that graphs do not depend on timings).
* ``"ggml"``: none of them.

The module switches of :mod:`~ggmlpy.models.blocks` (``blocks.matvec_kernel = False``...) still turn
a kernel off in every mode.

Examples
--------
>>> from ggmlpy.models.kernels import KernelChoices, Measurement, Site, decide
>>> decide(own_s=0.9e-3, ggml_s=1.0e-3), decide(own_s=0.99e-3, ggml_s=1.0e-3)
(True, False)
>>> site = Site("matvec", "F16", (2048, 8192))
>>> kc = KernelChoices("measure", entries={site.key: Measurement(1.2e-3, 1.0e-3)})
>>> kc.use(site), kc.use(Site("matvec", "F16", (2048, 2048)))     # measured slower; not measured
(False, True)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

from ggmlpy._core import GGMLValueError, Tensor

__all__ = ["MARGIN", "MODES", "VARIANTS", "KernelChoices", "Measurement", "Site", "attn_site", "current", "decide",
           "experts_site", "geglu_site", "gemm_site", "matvec_site", "mode", "use", "using", "variant", "weight_type"]

#: The modes of :func:`mode`.
MODES = ("measure", "own", "ggml")

#: How much faster an own kernel must measure to be chosen: 3%. Below that the two are a tie within a
#: shared machine's noise, and the tie goes to ggml's op (the reference).
MARGIN = 0.03

#: Ops with an own kernel, and the ggml op each competes with.
OPS = {
    "matvec": "mul_mat",                # Context.mul_mat_vec: a weight times 1-4 vectors
    "matvec_id": "mul_mat_id",          # Context.mul_mat_id_vec: a token's chosen experts
    "experts_rq": "mul_mat_id",         # Context.mul_mat_id_rq: a prompt's experts on a repacked stack
    "gemm_rq": "mul_mat",               # Context.mul_mat_rq4k: a prompt through a repacked Q4_K matrix
    "attn_decode": "flash_attn_ext",    # Context.attn_decode: a few query rows over the cache
    "attn_prefill": "flash_attn_ext",   # Context.attn_prefill: a prompt's rows
    "geglu": "geglu",                   # Context.geglu_tanh
}

#: The own kernel's paths a site may measure, per op (the first is the default, taken where none was
#: measured): ``attn_decode``'s AVX-512 path converts each K and V row once for all its query heads,
#: its AVX2 path once per head but with half-width registers, which some CPUs (256-bit datapaths)
#: may run as fast. ``matvec``'s (Q8_0 and Q6_K weights on a CPU with AVX-512 VNNI): ggmlpy's own
#: row kernel, or ggml's ``vec_dot`` under ggmlpy's schedule (on a Zen 4 the row kernel lost to
#: ggml's op on 768-value Q8_0 rows, where the schedule alone may still win).
VARIANTS = {"attn_decode": ("avx512", "avx2"), "matvec": ("vnni", "dot")}

#: Attention's depth classes: a decode over at most this many cache cells is in class 0, else class 1
#: (measured at the depths of :data:`ggmlpy.models.calibrate.DECODE_DEPTHS`).
DEPTH_CLASS_BOUND = 1024
#: GeGLU's row classes: fewer rows than this (generation) class 0, else class 1 (prompts).
ROWS_CLASS_BOUND = 64

_ENV = "GGMLPY_KERNELS"


def mode(value: Optional[str] = None) -> str:
    """The kernel-selection mode: ``value`` checked, else ``$GGMLPY_KERNELS``, else ``"measure"``.

    Raises
    ------
    GGMLValueError
        Not one of :data:`MODES` (names the variable where it came from there).
    """
    src = value if value is not None else os.environ.get(_ENV, "measure")
    m = str(src).strip().lower()
    if m not in MODES:
        where = "kernels" if value is not None else f"${_ENV}"
        raise GGMLValueError(f"{where}: {src!r} is not a kernel mode; expected one of {', '.join(MODES)}")
    return m


def decide(own_s: float, ggml_s: float, margin: float = MARGIN) -> bool:
    """Whether the own kernel is chosen: it took at least ``margin`` less time than ggml's op.

    A time that is not a positive finite number (a failed measurement) never chooses the own kernel.
    """
    ok = 0.0 < own_s < float("inf") and 0.0 < ggml_s < float("inf")
    return bool(ok and own_s <= ggml_s * (1.0 - margin))


@dataclass(frozen=True)
class Site:
    """A place a graph may use an own kernel: the op (a key of :data:`OPS`), the type (a weight's, or the
    cache's ``"F16/F16"``) and the shape class (a weight's or expert stack's ``ne``; attention's
    ``(head_dim_k, head_dim_v, n_head, n_head_kv[, depth class])``; GeGLU's ``(n_ff, rows class)``)."""

    op: str
    type: str
    shape: tuple

    @property
    def key(self) -> str:
        """``"matvec F16 2048x8192"``: the site's key in the cache file."""
        return f"{self.op} {self.type} {'x'.join(str(int(s)) for s in self.shape)}"

    @classmethod
    def from_key(cls, key: str) -> Site:
        op, type, shape = key.split(" ")
        return cls(op, type, tuple(int(s) for s in shape.split("x")))


@dataclass(frozen=True)
class Measurement:
    """The two timings of a site (seconds, the median of the runs) and the choice they make.

    Where the own kernel has several paths for one site (``attn_decode`` over a cache of grouped
    heads on a CPU with AVX-512, ``matvec`` on Q8_0/Q6_K weights with AVX-512 VNNI: :data:`VARIANTS`),
    each is timed, ``own_s`` is the fastest's and
    ``variant`` names it; ``""`` where there is one path.
    """

    own_s: float
    ggml_s: float
    variant: str = ""

    @property
    def use_own(self) -> bool:
        return decide(self.own_s, self.ggml_s)

    @property
    def speedup(self) -> float:
        """ggml's time over the own kernel's (above 1: the own kernel is faster)."""
        return self.ggml_s / self.own_s if self.own_s > 0 else 0.0


@dataclass
class KernelChoices:
    """The decisions a graph is built under: a mode and, for ``"measure"``, the measured sites.

    A site not measured keeps the own kernel (the calibration measures every site a model's graphs
    have; one it cannot, as a cache on another device, never reaches an own kernel anyway).
    """

    mode: str = "own"
    entries: dict = field(default_factory=dict)         # Site.key -> Measurement
    n_threads: int = 0
    path: str = ""                                       # the cache file the timings came from (or went to)
    measured_s: float = 0.0                              # seconds spent measuring for this runner (0: cached)

    def use(self, site: Site, weight: Optional[Tensor] = None) -> bool:
        """Whether the graph takes the own kernel at ``site`` (``weight``: the weight it multiplies, for
        the calibration's record of the sites a graph has)."""
        if self.mode != "measure":
            return self.mode == "own"
        m = self.entries.get(site.key)
        return True if m is None else m.use_own

    def variant(self, site: Site) -> str:
        """The own kernel's path the graph takes at ``site`` (one of :data:`VARIANTS`' for its op): the
        one that measured fastest, else the op's first; ``""`` for an op with one path."""
        paths = VARIANTS.get(site.op, ("",))
        m = self.entries.get(site.key) if self.mode == "measure" else None
        return m.variant if m is not None and m.variant in paths else paths[0]

    def summary(self) -> list[str]:
        """One line per measured site: the site, the two times, the ratio, the choice."""
        if self.mode != "measure":
            return [f"own kernels: {'all where they run' if self.mode == 'own' else 'none'} "
                    f"(mode {self.mode!r}, not measured)"]
        lines = []
        for key, m in sorted(self.entries.items()):
            path = f" [{m.variant}]" if m.variant else ""
            lines.append(f"{key}: own{path} {m.own_s * 1e3:.3f} ms, ggml {m.ggml_s * 1e3:.3f} ms ({m.speedup:.2f}x) "
                         f"-> {'own' if m.use_own else 'ggml'}")
        return lines

    def describe(self) -> str:
        """One sentence: which sites took the own kernel, for a table's footnote."""
        if self.mode != "measure":
            return self.summary()[0]
        own = [k for k, m in sorted(self.entries.items()) if m.use_own]
        other = [k for k, m in sorted(self.entries.items()) if not m.use_own]
        where = f"{self.n_threads} thread{'s' if self.n_threads != 1 else ''}"
        src = f", timings in {self.path}" if self.path else ""
        return (f"own kernels chosen by measurement ({where}{src}): own at {len(own)} of {len(self.entries)} sites"
                + (f" ({'; '.join(own)})" if own else "") + (f"; ggml's at {'; '.join(other)}" if other else ""))


_current: contextvars.ContextVar[Optional[KernelChoices]] = contextvars.ContextVar("ggmlpy_kernel_choices",
                                                                                   default=None)
_OWN = KernelChoices("own")


def current() -> KernelChoices:
    """The choices graphs are being built under (:func:`using`); outside a runner every own kernel runs."""
    return _current.get() or _OWN


@contextlib.contextmanager
def using(choices: Optional[KernelChoices]) -> Iterator[KernelChoices]:
    """Build graphs under ``choices`` inside the block (per thread and task: a context variable)."""
    token = _current.set(choices)
    try:
        yield current()
    finally:
        _current.reset(token)


def use(site: Site, weight: Optional[Tensor] = None) -> bool:
    """Whether a graph built now takes the own kernel at ``site`` (:func:`current`'s choice); ``weight``
    is the weight a matrix-vector site multiplies."""
    return current().use(site, weight)


def variant(site: Site) -> str:
    """The own kernel's path a graph built now takes at ``site`` (:meth:`KernelChoices.variant`)."""
    return current().variant(site)


def weight_type(w: Tensor) -> str:
    """A weight's type in a site: ``"Q4_0"``, or ``"Q4_0/repacked"`` in one of the CPU's extra buffer
    types (another layout, another kernel)."""
    return w.type.name + ("/repacked" if w.is_repacked else "")


def matvec_site(w: Tensor) -> Site:
    """The site of ``w`` times a few vectors: :meth:`~ggmlpy.Context.mul_mat_vec` (a matrix) or
    :meth:`~ggmlpy.Context.mul_mat_id_vec` (an expert stack, 3 dimensions)."""
    if w.ne[2] > 1:
        return Site("matvec_id", weight_type(w), (w.ne[0], w.ne[1], w.ne[2]))
    return Site("matvec", weight_type(w), (w.ne[0], w.ne[1]))


def experts_site(w: Tensor) -> Site:
    """The site of a prompt's tokens through the repacked expert stack ``w``
    (:meth:`~ggmlpy.Context.mul_mat_id_rq`)."""
    return Site("experts_rq", weight_type(w), (w.ne[0], w.ne[1], w.ne[2]))


def gemm_site(w: Tensor) -> Site:
    """The site of a prompt's tokens through the repacked Q4_K matrix ``w``
    (:meth:`~ggmlpy.Context.mul_mat_rq4k`)."""
    return Site("gemm_rq", weight_type(w), (w.ne[0], w.ne[1]))


def attn_site(op: str, k: Tensor, v: Tensor, n_head: int) -> Site:
    """The site of attention over the cache's ``k`` (``ne = (head_dim, n_kv, n_head_kv)``) and ``v`` for
    ``n_head`` query heads: ``op`` ``"attn_decode"`` (its depth class from ``n_kv``) or ``"attn_prefill"``."""
    shape = (k.ne[0], v.ne[0], n_head, k.ne[2])
    if op == "attn_decode":
        shape += (0 if k.ne[1] <= DEPTH_CLASS_BOUND else 1,)
    return Site(op, f"{k.type.name}/{v.type.name}", shape)


def geglu_site(n_ff: int, n_rows: int) -> Site:
    """The site of GeGLU over ``n_rows`` rows of ``n_ff`` (its rows class)."""
    return Site("geglu", "F32", (int(n_ff), 0 if n_rows < ROWS_CLASS_BOUND else 1))
