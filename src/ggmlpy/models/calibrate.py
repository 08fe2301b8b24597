"""Measuring ggmlpy's own CPU kernels against ggml's ops on this machine (:func:`kernel_choices`).

A :class:`~ggmlpy.Runner` calls :func:`kernel_choices` before it reserves memory. The sites (see
:mod:`ggmlpy.models.kernels`) are found by building the model's worst-case prompt and decode graphs
once under a recorder, so exactly the places a graph would ask about are measured, with the weights it
would multiply. Each site is timed both ways on the CPU backend with the runner's thread count:

* **matvec / matvec_id**: every weight of the site (every layer's ``attn_q``...; up to
  :data:`GROUP_BYTES` read per run, which streams from memory as a generated token does) times one
  vector, in one graph: :meth:`~ggmlpy.Context.mul_mat_vec` against ``mul_mat`` (and the experts'
  versions, with ``n_expert_used`` distinct experts, whose rows are all a run reads). Where what a run
  reads fits twice in the CPU's last-level cache, the cache is emptied before every timed run (by
  reading another buffer): generation reads each weight once a token, from memory, and a kernel
  that wins on cached weights can lose there (a Q8_0 768 x 3352 site, 23 MiB in a 32 MiB cache:
  1.24x ggml's from the cache, 0.95x in generation; a 64-expert model's Q4_K expert sites, 6 used,
  the same way: 0.98x in generation). Q8_0 and Q6_K weights on a CPU with AVX-512 VNNI have two own
  paths, ggmlpy's row kernel and ggml's ``vec_dot`` under ggmlpy's schedule: both are timed, and the
  faster is the own kernel's time and the path the graphs take;
* **attn_decode**: one query row over a float cache (in the cache's layout: a cell's heads side by
  side) at each depth class's depth (:data:`DECODE_DEPTHS`), as many layers' caches as make
  :data:`ATTN_BYTES`, against ``flash_attn_ext``; where its AVX-512 path can run (grouped heads, an
  AVX-512 CPU) the AVX2 path is timed too, and the faster of the two is the own kernel's time and
  the path the graphs take (:data:`ggmlpy.models.kernels.VARIANTS`);
* **attn_prefill**: :data:`PREFILL_ROWS` rows over as many cells, causal, against ``flash_attn_ext``;
* **geglu**: one row and :data:`PREFILL_ROWS` rows of the model's feed-forward width against ``geglu``;
* **experts_rq**: :data:`PREFILL_ROWS` tokens, each with ``n_expert_used`` distinct experts, through the
  site's first repacked expert stack: :meth:`~ggmlpy.Context.mul_mat_id_rq` against ``mul_mat_id``;
* **gemm_rq**: :data:`PREFILL_ROWS` tokens through the site's first repacked Q4_K matrix:
  :meth:`~ggmlpy.Context.mul_mat_rq4k` against ``mul_mat``.

The graphs of a site run in turn (one warm-up each, then :data:`TIMING` rounds), and each
keeps its median time: the rule (:func:`ggmlpy.models.kernels.decide`) compares median with median. The
110M model's 8 sites take 0.7 s on 2 cores, the Llama-3.2-1B shape's 11 take 1.5 s (Zen 4); the timings are
cached in ``kernels.json`` beside the benchmark's ``roofline.json``
(:func:`ggmlpy._cache.cache_dir`: ``ggmlpy cache path``), one entry per CPU model, thread count, ggml build,
ggmlpy version and build of its extension, so the next runner on this machine measures only sites
it has not seen. ``refresh=True`` (``ggmlpy bench --kernels-refresh``: :func:`forget`) measures again.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ggmlpy import _core
from ggmlpy._cache import cache_dir as _cache_dir
from ggmlpy._core import Context, GGMLError, Tensor, Type
from ggmlpy._files import read_machine_cache, write_machine_cache
from ggmlpy._system import cpu_model_name, cpu_variant, ggml_commit, ggml_version
from ggmlpy._version import __version__

from . import blocks, kernels
from .kernels import KernelChoices, Measurement, Site

__all__ = ["CACHE_FILE", "DECODE_DEPTHS", "GROUP_BYTES", "PREFILL_ROWS", "TIMING", "Recorder", "cached_summary",
           "forget", "kernel_choices", "machine_key", "measure_site", "read_cache"]

log = logging.getLogger("ggmlpy.kernels")

CACHE_FILE = "kernels.json"
#: Bumped when the measurement changes: entries of another format are measured again (2: attention
#: over the cache's layout, each cell's heads side by side, and attn_decode's paths each timed; 3:
#: matrix-vector sites timed from memory, the last-level cache emptied before each run, and every
#: site's median run compared, not its best; 4: the experts' sites too, by the bytes their chosen
#: experts read).
FORMAT = 4
#: The bytes of weights (or cache) one site's graph reads per run, at most: several times a core's
#: share of the last-level cache, so the runs stream from memory as generation does.
GROUP_BYTES = 256 << 20
#: The bytes read to empty the last-level cache before a timed run of a site whose weights fit in it: at
#: least this, and twice the cache (:func:`_llc_bytes`).
EVICT_BYTES = 64 << 20
#: The bytes of cache the decode attention's graph reads per run, at most (a few layers' worth).
ATTN_BYTES = 64 << 20
#: The cache depth each attention depth class is measured at (class 0: up to
#: :data:`ggmlpy.models.kernels.DEPTH_CLASS_BOUND` cells; class 1: deeper).
DECODE_DEPTHS = (512, 4096)
#: Query rows (and cache cells) of the prefill measurement, and the rows of GeGLU's class 1.
PREFILL_ROWS = 128
#: Timed rounds of each site (after a warm-up), and the seconds after which no more rounds start once
#: ``min_rounds`` are done.
TIMING: dict[str, Any] = {"rounds": 11, "min_rounds": 5, "max_s": 1.0}
_POLL = 50


class Recorder(KernelChoices):
    """Choices that take every own kernel and note each site asked about, with its weights."""

    def __init__(self) -> None:
        super().__init__("own")
        self.sites: dict[Site, dict[int, Tensor]] = {}

    def use(self, site: Site, weight: Optional[Tensor] = None) -> bool:
        seen = self.sites.setdefault(site, {})
        if weight is not None:
            seen.setdefault(id(weight), weight)
        return True


def machine_key(n_threads: int) -> str:
    """The cache entry's key: CPU model, thread count, ggml build, ggmlpy version and build (the
    extension's size and time: a rebuilt kernel is measured again, not judged by its old timings)."""
    v = cpu_variant()
    return (f"{cpu_model_name()} | {int(n_threads)} threads | ggml {ggml_version()} ({ggml_commit()}), cpu "
            f"{'native' if v is None else v[0]} | ggmlpy {__version__} ({_build_id()})")


def _build_id() -> str:
    try:
        st = os.stat(_core.__file__)
        return f"{st.st_size:x}-{int(st.st_mtime):x}"
    except (OSError, AttributeError, TypeError):
        return "unknown"


def _default_dir() -> Path:
    return _cache_dir()


def read_cache(path: Path) -> dict[str, Any]:
    """The cache file's content (an empty one where it is missing, unreadable or of another format)."""
    return read_machine_cache(path, FORMAT)


def _entries(data: dict[str, Any], key: str) -> dict[str, Measurement]:
    entry = data["machines"].get(key)
    sites = entry.get("sites") if isinstance(entry, dict) else None
    out = {}
    for site, v in (sites.items() if isinstance(sites, dict) else ()):
        try:
            out[site] = Measurement(float(v["own_s"]), float(v["ggml_s"]), str(v.get("variant", "")))
        except (KeyError, TypeError, ValueError):       # a hand-edited entry: measured again
            continue
    return out


def _write(path: Path, key: str, n_threads: int, new: dict[str, Measurement]) -> bool:
    data = read_cache(path)                 # (re-read: another process may have added sites)
    entry = data["machines"].get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("sites"), dict):
        entry = data["machines"][key] = {"n_threads": int(n_threads), "sites": {}}
    entry["measured_at"] = time.strftime("%Y-%m-%d %H:%M")
    for site, m in new.items():
        entry["sites"][site] = {"own_s": m.own_s, "ggml_s": m.ggml_s, "use_own": m.use_own}
        if m.variant:
            entry["sites"][site]["variant"] = m.variant
    return _save(path, data)


def _save(path: Path, data: dict[str, Any]) -> bool:
    try:
        write_machine_cache(path, data)
        return True
    except OSError as e:
        log.warning("kernels: could not write %s (%s); measured again next time", path, e)
        return False


def _machine(key: str) -> list[str]:
    """A cache key without its thread count: the CPU, the build, the version."""
    parts = key.split(" | ")
    return parts[:1] + parts[2:]


def forget(cache_dir: str | os.PathLike | None = None) -> int:
    """Drop this machine's timings (every thread count of this CPU, build and version) from the cache, so
    that the next runners measure again. Returns how many entries were dropped."""
    path = (Path(cache_dir) if cache_dir is not None else _default_dir()) / CACHE_FILE
    data = read_cache(path)
    mine = [k for k in data["machines"] if _machine(k) == _machine(machine_key(0))]
    for k in mine:
        del data["machines"][k]
    if mine:
        _save(path, data)
    return len(mine)


def cached_summary(cache_dir: str | os.PathLike | None = None) -> list[str]:
    """What ``ggmlpy info`` prints: the mode, and per thread count this machine's cached choices (the
    sites where the own kernel won, and where ggml's op did), or how to measure them."""
    path = (Path(cache_dir) if cache_dir is not None else _default_dir()) / CACHE_FILE
    m = kernels.mode()
    lines = [f"own kernels: mode {m} ($GGMLPY_KERNELS; measure: each against ggml's op, the faster taken)"]
    data = read_cache(path)
    found = False
    for key in sorted(data["machines"]):
        if _machine(key) != _machine(machine_key(0)):
            continue
        found = True
        entries = _entries(data, key)
        own = sorted(k for k, e in entries.items() if e.use_own)
        entry = data["machines"][key]
        when = entry.get("measured_at", "?") if isinstance(entry, dict) else "?"
        lines.append(f"  {key.split(' | ')[1]} ({when}): own at {len(own)} of {len(entries)} sites")
        for k, e in sorted(entries.items()):
            path = f" [{e.variant}]" if e.variant else ""
            lines.append(f"    {k}: {e.speedup:.2f}x ggml's -> {'own' + path if e.use_own else 'ggml'}")
    if not found:
        lines.append(f"  no timings for this machine yet in {path} (a runner measures its sites when it starts; "
                     "ggmlpy bench prints them)")
    return lines


def kernel_choices(record: Callable[[Recorder], None], n_threads: int, *, mode: Optional[str] = None,
                   n_ctx: int = 0, n_expert_used: int = 1, cache_dir: str | os.PathLike | None = None,
                   refresh: bool = False) -> KernelChoices:
    """The choices for a runner: its sites measured (or read from the cache) with ``n_threads`` threads.

    Parameters
    ----------
    record : callable
        Builds (and frees) the graphs the runner will build, under the :class:`Recorder` it is given
        (``with kernels.using(recorder): ...``).
    n_threads : int
        The runner's CPU threads.
    mode : str, optional
        :func:`ggmlpy.models.kernels.mode`'s (default ``$GGMLPY_KERNELS`` or ``"measure"``); only
        ``"measure"`` measures anything.
    n_ctx : int
        The runner's context: attention's deeper depth class is measured only where it can be reached.
    n_expert_used : int
        Experts per token (the experts' sites).
    cache_dir : path, optional
        Folder of ``kernels.json`` (default :func:`ggmlpy._cache.cache_dir`).
    refresh : bool
        Measure every site again.
    """
    m = kernels.mode(mode)
    if m != "measure":
        return KernelChoices(m, n_threads=int(n_threads))
    rec = Recorder()
    record(rec)
    sites = dict(rec.sites)
    for site in list(sites):
        if site.op == "attn_decode":                     # both depth classes where the context reaches the second
            sites.pop(site)
            for c in range(2 if n_ctx > kernels.DEPTH_CLASS_BOUND else 1):
                sites.setdefault(Site(site.op, site.type, site.shape[:4] + (c,)), {})
    path = (Path(cache_dir) if cache_dir is not None else _default_dir()) / CACHE_FILE
    key = machine_key(n_threads)
    known = {} if refresh else _entries(read_cache(path), key)
    todo = [s for s in sites if s.key not in known]
    new: dict[str, Measurement] = {}
    t0 = time.perf_counter()
    if todo:
        be = _core.backend_init("CPU")
        try:
            be.set_threadpool(int(n_threads), poll=_POLL)
            for site in todo:
                try:
                    new[site.key] = measure_site(be, site, list(sites[site].values()), n_expert_used=n_expert_used)
                except GGMLError as e:       # a site the measurement cannot build: ggml's op is kept there
                    log.warning("kernels: %s not measured (%s); ggml's op is used there", site.key, e)
                    new[site.key] = Measurement(math.inf, 1.0)
        finally:
            be.free()
    spent = time.perf_counter() - t0
    where = str(path)
    if new:
        log.info("kernels: measured %d site(s) in %.2f s with %d threads", len(new), spent, n_threads)
        if not _write(path, key, n_threads, new):
            where = ""
    entries = {s.key: new.get(s.key) or known[s.key] for s in sites}
    return KernelChoices("measure", entries=entries, n_threads=int(n_threads), path=where,
                         measured_s=spent if new else 0.0)


# --------------------------------------------------------------------------- one site


def measure_site(be: Any, site: Site, weights: Iterable[Tensor] = (), n_expert_used: int = 1) -> Measurement:
    """Time ``site``'s own kernel and ggml's op on the CPU backend ``be``: a :class:`Measurement`.

    ``weights`` are the tensors a matrix-vector site multiplies (the model's own); the other sites make
    their inputs.
    """
    builder = {"matvec": _matvec, "matvec_id": _matvec, "attn_decode": _attn, "attn_prefill": _attn,
               "geglu": _geglu, "experts_rq": _experts_rq, "gemm_rq": _gemm_rq}.get(site.op)
    if builder is None:
        raise GGMLError(f"kernels: no measurement for op {site.op!r}")
    with _Bench(be) as bench:
        builder(bench, site, list(weights), n_expert_used)
        return bench.run()


class _Bench:
    """The site's graphs on the CPU backend (the own kernel's, one per path, then ggml's), their inputs,
    and what to free."""

    def __init__(self, be: Any) -> None:
        self.be = be
        self.owned: list[Any] = []
        self.buffers: list[Any] = []         # freed after the contexts whose tensors they hold
        self.graphs: list[Any] = []
        self.labels: list[str] = []
        self.fills: list[Callable[[], None]] = []
        #: read before each timed run to empty the last-level cache (None: the graphs stream from memory)
        self.evict: Optional[np.ndarray] = None

    def __enter__(self) -> _Bench:
        return self

    def __exit__(self, *exc) -> None:
        for o in [*reversed(self.owned), *self.buffers]:
            o.free()

    def context(self, n_tensors: int) -> Context:
        ctx = Context.for_tensors(n_tensors, graph_size=8 * n_tensors + 32, no_alloc=True)
        self.owned.append(ctx)
        return ctx

    def constants(self, ctx: Context) -> None:
        """Allocate ``ctx``'s tensors (made with no data: caches, inputs shared by both graphs)."""
        self.buffers.append(_core.alloc_ctx_tensors(ctx, self.be))

    def graph(self, ctx: Context, outputs: list[Tensor], label: str = "") -> None:
        """One of the site's graphs: the own kernel's (``label`` its path where it has several), in the
        order they are added, then ggml's op's last."""
        gf = ctx.new_graph(8 * len(outputs) + 32)         # a few nodes per output (views, the merge)
        for o in outputs:
            gf.build_forward_expand(o.set_output())
        ga = _core.Gallocr(self.be.buffer_type)
        self.owned.append(ga)
        ga.alloc_graph(gf)
        self.graphs.append(gf)
        self.labels.append(label)

    def run(self) -> Measurement:
        for f in self.fills:
            f()
        n = len(self.graphs)
        times: list[list[float]] = [[] for _ in range(n)]
        for gf in self.graphs:
            self.be.graph_compute(gf)                  # warm-up: page faults, the pool's start
        end = time.perf_counter() + float(TIMING["max_s"])
        for i in range(int(TIMING["rounds"])):
            if i >= int(TIMING["min_rounds"]) and time.perf_counter() > end:
                break
            for j in [(i + t) % n for t in range(n)]:  # rotated each round: none always runs first
                if self.evict is not None:
                    self._empty_cache()
                t0 = time.perf_counter()
                self.be.graph_compute(self.graphs[j])
                times[j].append(time.perf_counter() - t0)
        return _measurement(times, self.labels)

    def _empty_cache(self) -> None:
        self.evict.max()


def _measurement(times: list[list[float]], labels: list[str]) -> Measurement:
    """The site's :class:`Measurement` from each graph's run times (the own kernel's paths, then ggml's op).

    The median run, not the best: an own kernel's runs from memory can spread widely (a Q8_0 2048 x 768
    site: 0.62-2.10 ms, ggml's 0.78-1.24 ms), and the best of a wide spread wins a comparison that
    generation, which sees the typical run, loses."""
    mid = [statistics.median(t) for t in times]
    own = min(range(len(times) - 1), key=lambda j: mid[j])
    return Measurement(mid[own], mid[-1], labels[own] if len(times) > 2 else "")


def _llc_bytes(base: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the CPU's largest cache (Linux's sysfs; 32 MiB where it cannot be read)."""
    best = 0
    try:
        for d in base.glob("index*"):
            text = (d / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text[:-1] if scale > 1 else text
            if digits.isdigit():
                best = max(best, int(digits) * scale)
    except OSError:
        pass
    return best or 32 << 20


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _matvec(bench: _Bench, site: Site, weights: list[Tensor], n_used: int) -> None:
    if not weights:
        raise GGMLError(f"kernels: no weight recorded for {site.key}")
    k = weights[0].ne[0]
    experts = site.op == "matvec_id"
    n_used = max(1, min(int(n_used), weights[0].ne[2])) if experts else 1
    group, read = [], 0
    for w in weights:                                   # up to GROUP_BYTES read per run
        # experts: a run reads only the chosen ones' rows (the same experts every run; a token's differ)
        w_read = w.nbytes * n_used // w.ne[2] if experts else w.nbytes
        if group and read + w_read > GROUP_BYTES:
            break
        group.append(w)
        read += w_read
    llc = _llc_bytes()
    if read < 2 * llc:
        bench.evict = np.ones(max(EVICT_BYTES, 2 * llc) // 8, np.uint64)
    inputs = bench.context(2)
    x = inputs.new_tensor(Type.F32, (k, 1, 1) if experts else (k, 1))
    ids = inputs.new_tensor(Type.I32, (n_used, 1)) if experts else None
    bench.constants(inputs)
    x.set(_rng().standard_normal((1, k), dtype=np.float32).reshape(x.shape))
    if ids is not None:
        ids.set(_rng().permutation(weights[0].ne[2])[:n_used].astype(np.int32).reshape(ids.shape))
    # Q8_0/Q6_K rows on an AVX-512 VNNI CPU have two own paths: ggmlpy's row kernel and ggml's vec_dot
    # under ggmlpy's schedule; which is faster depends on the CPU and the row length, so both are timed
    paths = kernels.VARIANTS["matvec"] if not experts and _core._mul_mat_vec_own_rows(group[0]) else ("",)
    for path in (*paths, None):                        # the own kernel's paths, then ggml's op
        ctx = bench.context(len(group) + 2)
        if experts:
            outs = [ctx.mul_mat_id_vec(w, x, ids) if path is not None else ctx.mul_mat_id(w, x, ids) for w in group]
        elif path is None:
            outs = [ctx.mul_mat(w, x) for w in group]
        else:
            outs = [ctx.mul_mat_vec(w, x, own_rows=path != "dot") for w in group]
        bench.graph(ctx, outs, path or "")


def _experts_rq(bench: _Bench, site: Site, weights: list[Tensor], n_used: int) -> None:
    if not weights:
        raise GGMLError(f"kernels: no weight recorded for {site.key}")
    w = weights[0]
    k, n_expert = w.ne[0], w.ne[2]
    n_used = max(1, min(int(n_used), n_expert))
    inputs = bench.context(2)
    x = inputs.new_tensor(Type.F32, (k, 1, PREFILL_ROWS))
    ids = inputs.new_tensor(Type.I32, (n_used, PREFILL_ROWS))
    bench.constants(inputs)
    rng = _rng()
    x.set(rng.standard_normal(x.shape, dtype=np.float32))
    ids.set(np.argsort(rng.random((PREFILL_ROWS, n_expert)), axis=1)[:, :n_used].astype(np.int32))
    for own in (True, False):
        ctx = bench.context(2)
        bench.graph(ctx, [ctx.mul_mat_id_rq(w, x, ids) if own else ctx.mul_mat_id(w, x, ids)])


def _gemm_rq(bench: _Bench, site: Site, weights: list[Tensor], _n_used: int) -> None:
    if not weights:
        raise GGMLError(f"kernels: no weight recorded for {site.key}")
    w = weights[0]
    inputs = bench.context(1)
    x = inputs.new_tensor(Type.F32, (w.ne[0], PREFILL_ROWS))
    bench.constants(inputs)
    x.set(_rng().standard_normal(x.shape, dtype=np.float32))
    for own in (True, False):
        ctx = bench.context(3)
        bench.graph(ctx, [ctx.mul_mat_rq4k(w, x) if own else ctx.mul_mat(w, x)])


def _attn(bench: _Bench, site: Site, _weights: list[Tensor], _n_used: int) -> None:
    hd_k, hd_v, n_head, n_head_kv = site.shape[:4]
    tk, tv = (Type[t] for t in site.type.split("/"))
    decode = site.op == "attn_decode"
    n_q = 1 if decode else PREFILL_ROWS
    depth = DECODE_DEPTHS[site.shape[4]] if decode else PREFILL_ROWS
    per_layer = depth * n_head_kv * (hd_k * _core.type_size(tk) + hd_v * _core.type_size(tv))
    copies = max(1, min(16, ATTN_BYTES // max(1, per_layer))) if decode else 1
    data = bench.context(2 * copies + 2)
    # the cache's layout: a cell's heads side by side (the kernels read it cell by cell)
    kc = [data.new_tensor(tk, (hd_k * n_head_kv, depth)) for _ in range(copies)]
    vc = [data.new_tensor(tv, (hd_v * n_head_kv, depth)) for _ in range(copies)]
    q = data.new_tensor(Type.F32, (hd_k, n_head, n_q))
    pad = -(-n_q // 64) * 64
    mask = data.new_tensor(Type.F16, (depth, pad))
    bench.constants(data)
    rng = _rng()
    for ts in (kc, vc):                                 # one layer's values, copied to every layer
        a = rng.standard_normal(ts[0].shape, dtype=np.float32).astype(np.float16 if ts[0].type == Type.F16
                                                                          else np.float32)
        for t in ts:
            t.set(a)
    q.set(rng.standard_normal(q.shape, dtype=np.float32))
    m = np.zeros((pad, depth), np.float16)
    if not decode:                                      # a causal prompt over its own cells
        m[np.triu_indices(pad, 1, depth)] = -np.inf
    mask.set(m)
    scale = 1.0 / math.sqrt(hd_k)
    # attn_decode's AVX-512 path runs only for grouped heads on an AVX-512 CPU: there both are timed
    paths = kernels.VARIANTS["attn_decode"] if decode and n_head > n_head_kv \
        and _core._attn_decode_avx512(hd_k, hd_v) else ("",)
    for path in (*paths, None):                        # the own kernel's paths, then ggml's op
        ctx = bench.context(6 * copies + 4)
        outs = []
        for kt, vt in zip(kc, vc):
            k = ctx.view(kt, (hd_k, depth, n_head_kv), (kt.nb[1], hd_k * kt.nb[0]), 0)
            v = ctx.view(vt, (hd_v, depth, n_head_kv), (vt.nb[1], hd_v * vt.nb[0]), 0)
            if path is None:
                outs.append(ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), k, v, mask, scale=scale))
            elif decode:
                outs.append(ctx.attn_decode(q, k, v, mask, scale=scale, n_chunks=blocks._decode_chunks(depth),
                                            avx512=path != "avx2"))
            else:
                outs.append(ctx.attn_prefill(q, k, v, mask, scale=scale))
        bench.graph(ctx, outs, path or "")


def _geglu(bench: _Bench, site: Site, _weights: list[Tensor], _n_used: int) -> None:
    n_ff, rows_class = site.shape
    rows = 1 if rows_class == 0 else PREFILL_ROWS
    copies = 16
    data = bench.context(2)
    g, u = (data.new_tensor(Type.F32, (n_ff, rows)) for _ in range(2))
    bench.constants(data)
    rng = _rng()
    for t in (g, u):
        t.set(rng.standard_normal(t.shape, dtype=np.float32))
    for own in (True, False):
        ctx = bench.context(copies + 2)
        outs = [ctx.geglu_tanh(g, u) if own else ctx.geglu_split(g, u) for _ in range(copies)]
        bench.graph(ctx, outs)
