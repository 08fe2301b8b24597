"""Fit a model to the devices' memory from real allocations (``load_model(..., n_gpu_layers="auto")``).

Ollama's engine places layers by trying them: it allocates a layout without loading anything, reads
what every device really needed, and moves layers until each device holds what it can. llama.cpp's
``--fit`` does the same. :func:`fit_model` does it with ggmlpy's own allocation path:

1. Each *try* is one allocation pass on a candidate :class:`~ggmlpy.backend.Placement`: the weights
   (allocated, no data read), the KV cache at the requested context (and a recurrent model's states, whose
   size does not follow the context) and the worst-case graphs a
   :class:`~ggmlpy.runner.Runner` reserves, on every device. What each device needed comes from the
   memory report; everything is freed again, except after the try that is kept, whose weights are
   then loaded (the data is read once).
2. The candidates fill the devices in order, fastest first (``devices``' order: local GPUs, then RPC
   servers; the CPU last), as llama.cpp's ``-ngl`` counts: the *last* layers go first, and the output
   layer only after every repeating layer (llama.cpp offloads it at ``-ngl n_layer + 1``). Each device
   takes as many of those units as its budget, ``free - margin``, holds with the sizes measured so far
   (weights from the file's tensor table before the first try, cache and graphs from the tries).
3. A try that overruns a device, or whose allocation fails there, caps that device at one unit fewer
   (for that starting unit) and the next candidate is computed from the new measurements; so the
   search ends, and usually after one or two tries.
4. With ``n_ctx="auto"`` the context starts at the model's training context and is halved, down to
   ``n_ctx_min``, while the model does not fit wholly on the accelerators (llama.cpp's order: context
   before layers); if the halving never gets it whole, the largest context that offloads as many units
   as the smallest one is kept. With a number, the context is never changed.

The steps are kept in :class:`FitResult` (``model.fit``; printed with the model's memory report).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ggmlpy import _core
from ggmlpy._core import Device, GGMLMemoryError, GGMLValueError
from ggmlpy.backend import Placement, choose_devices, n_cpu_moe_overrides
from ggmlpy.defaults import n_ctx_for
from ggmlpy.memory import MemoryReport

log = logging.getLogger("ggmlpy")

__all__ = ["FitResult", "FitStep", "default_margin", "fit_model"]

_MIB = 2**20
Unit = Union[int, str]


def default_margin(total: int) -> int:
    """The headroom left free on a device of ``total`` bytes: 10 % of it, at most 512 MiB (llama.cpp's
    ``--fit-target`` is 1024 MiB on GPUs; test servers of a few MiB need a proportional one)."""
    return min(512 * _MIB, total // 10)


@dataclass
class FitStep:
    """One try: the placement, what each device needed and could give, and the outcome."""

    n_ctx: int
    #: units per accelerator, in device order
    counts: tuple[int, ...]
    summary: str
    #: bytes each device needed (for a failed allocation: what it asked for)
    needs: dict[str, int]
    budgets: dict[str, int]
    ok: bool
    reason: str
    seconds: float

    def to_dict(self) -> dict:
        return {"n_ctx": self.n_ctx, "counts": list(self.counts), "summary": self.summary, "needs": dict(self.needs),
                "budgets": dict(self.budgets), "ok": self.ok, "reason": self.reason, "seconds": self.seconds}


@dataclass
class FitResult:
    """What :func:`fit_model` decided and how.

    Attributes
    ----------
    placement : Placement
        The chosen layout.
    n_ctx : int
        The context the decision was made for (the one chosen, with ``n_ctx="auto"``).
    runner_kwargs : dict
        The runner settings the tries reserved for (``n_ctx``, ``n_seq_max``, ``n_batch``, ``n_ubatch``,
        ``type_k``, ``type_v``, ``flash_attn``): a :class:`~ggmlpy.runner.Runner` made with them fits.
        ``Runner(model)`` takes them by default.
    budgets : dict
        Bytes each device could give (``free - margin``, read before the first try).
    steps : list of FitStep
        Every try, in order.
    seconds : float
        Time to the decision (all tries).
    """

    placement: Placement
    n_ctx: int
    runner_kwargs: dict
    budgets: dict[str, int]
    steps: list[FitStep] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"placement": self.placement.summary(), "n_ctx": self.n_ctx, "runner_kwargs": dict(self.runner_kwargs),
                "budgets": dict(self.budgets), "steps": [s.to_dict() for s in self.steps], "seconds": self.seconds}

    def __str__(self) -> str:
        names = list(self.budgets)
        rows = [["try", "n_ctx", *[f"{n} need/budget" for n in names], "result"]]
        for i, s in enumerate(self.steps, 1):
            cells = []
            for n in names:
                need = s.needs.get(n)
                cells.append("-" if need is None else f"{need / _MIB:.1f}/{self.budgets[n] / _MIB:.1f}")
            rows.append([str(i), str(s.n_ctx), *cells, ("ok" if s.ok else "no") + f": {s.reason}"])
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
        lines = [f"placement search [MiB] ({len(self.steps)} tries, {self.seconds * 1e3:.0f} ms): "
                 f"{self.placement.summary()}, n_ctx {self.n_ctx}"]
        for r in rows:
            lines.append("  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
        for i, s in enumerate(self.steps, 1):
            lines.append(f"  try {i}: {s.summary}")
        return "\n".join(lines)


class _Search:
    """The state of one search: devices, budgets, sizes measured so far, tries."""

    def __init__(self, path, devs: list[Device], n_layer: int, tensor_bytes: dict, budgets: dict[str, int],
                 open_model: Callable[[Placement], Any], runner_kw: dict, overrides: tuple = (),
                 overridden: Optional[dict] = None) -> None:
        self.path = path
        self.cpu = _core.device("CPU")
        self.accel = [d for d in devs if d != self.cpu]
        self.n_layer = n_layer
        #: offload order: the last layer first, the output after every layer
        self.units: list[Unit] = [*range(n_layer - 1, -1, -1), "output"]
        self.budgets = budgets
        #: opens the model on a placement, weights allocated, no data read (load_model's, passed down: it
        #: lives a floor above this module)
        self.open_model = open_model
        self.runner_kw = runner_kw
        # sizes: weights per unit (from the file's tensor table, then measured), cache per unit, graph
        # per (device, holds the output)
        self.weights: dict[Unit, int] = dict(tensor_bytes)
        #: tensor overrides: the placement's, and the bytes of each unit they send to each device
        #: ``{(unit, device name): bytes}`` (from the file's table): those never move with the unit
        self.overrides = overrides
        self.overridden = dict(overridden or {})
        self.cache: dict[Unit, int] = {}
        #: recurrent states per unit: measured like the cache, but their size does not follow the context
        self.state: dict[Unit, int] = {}
        self.graph: dict[tuple[str, bool], int] = {}
        self.caps: dict[tuple[int, int], int] = {}
        self.steps: list[FitStep] = []
        self.last_report: Optional[MemoryReport] = None

    # -------------------------------------------------------------- candidates

    def _size(self, u: Unit) -> int:
        return self.weights.get(u, 0) + self.cache.get(u, 0) + self.state.get(u, 0)

    def _graph(self, d: Device, output: bool) -> int:
        g = self.graph.get((d.name, output))
        if g is None:
            # not measured on this device yet: the largest measured anywhere for the same role
            g = max((v for (_, o), v in self.graph.items() if o == output), default=0)
        return g

    def candidate(self) -> tuple[int, ...]:
        """Units per accelerator: each, in order, takes what fits of the units left."""
        counts = []
        k = 0
        for i, d in enumerate(self.accel):
            cap = self.caps.get((i, k), len(self.units))
            # what overrides put on this device whatever its layers
            used, c = sum(v for (_, dn), v in self.overridden.items() if dn == d.name), 0
            while k + c < len(self.units) and c < cap:
                u = self.units[k + c]
                if used + self._size(u) + self._graph(d, u == "output") > self.budgets[d.name]:
                    break
                used += self._size(u)
                c += 1
            counts.append(c)
            k += c
        return tuple(counts)

    def placement(self, counts: Sequence[int]) -> Placement:
        layers: list[Device] = [self.cpu] * self.n_layer
        output = self.cpu
        k = 0
        for d, c in zip(self.accel, counts):
            for u in self.units[k:k + c]:
                if u == "output":
                    output = d
                else:
                    layers[u] = d
            k += c
        return Placement(layers=layers, output=output, input=self.cpu, overrides=self.overrides)

    # -------------------------------------------------------------- tries

    def attempt(self, counts: tuple[int, ...], n_ctx: int):
        """One allocation pass; returns (the model with its weights allocated, or None, the step)."""
        from ggmlpy.runner.runner import Runner

        placement = self.placement(counts)
        t0 = time.perf_counter()
        model = None
        report: Optional[MemoryReport] = None
        failed = ""
        try:
            model = self.open_model(placement)
            report = Runner.measure(model, **{**self.runner_kw, "n_ctx": n_ctx})
        except GGMLMemoryError as e:
            report = e.report if isinstance(e.report, MemoryReport) else (model.report if model else None)
            failed = str(e).splitlines()[0]
            if model is not None:
                model.close()
                model = None
        needs = {}
        if report is not None:
            needs = {name: m.self_total for name, m in report.devices.items()}
            self._learn(report, placement)
        over = [n for n in needs if n in self.budgets and needs[n] > self.budgets[n]]
        ok = not failed and not over
        if ok:
            reason = "fits"
        elif failed:
            reason = f"allocation failed: {failed}"
        else:
            reason = "over budget on " + ", ".join(over)
        step = FitStep(n_ctx, counts, placement.summary(), needs, dict(self.budgets), ok, reason,
                       time.perf_counter() - t0)
        self.steps.append(step)
        log.info("fit: try %d, n_ctx %d: %s: %s", len(self.steps), n_ctx, step.summary, reason)
        if not ok and model is not None:
            model.close()
            model = None
        failing = {n for n in needs if n in over} | self._failed_devices(report, failed)
        return model, step, failing

    @staticmethod
    def _failed_devices(report: Optional[MemoryReport], failed: str) -> set[str]:
        if not failed or report is None:
            return set()
        return {n for n, m in report.devices.items() if False in (m.weights_ok, m.cache_ok, m.graph_ok)}

    def _learn(self, report: MemoryReport, placement: Placement) -> None:
        """Take the sizes this try measured."""
        units: dict[Unit, int] = {}
        for m in report.devices.values():
            for g, v in m.weights.items():
                # the vision encoder goes with the output layer (Placement.device_of("vision"))
                u: Optional[Unit] = "output" if g == "vision" else None if g == "input" else g
                if u is None or m.name != placement.device_of(g).name:
                    continue            # a tensor override's bytes: they stay where it puts them
                units[u] = units.get(u, 0) + v - self.overridden.get((u, m.name), 0)
            for g, v in m.cache.items():
                if v:
                    self.cache[g] = v
            for g, v in m.state.items():
                if v:
                    self.state[g] = v
            if m.graph:         # what it needed, also when that allocation failed
                self.graph[(m.name, placement.output.name == m.name)] = m.graph
        self.weights.update({u: v for u, v in units.items() if v})
        self.last_report = report

    def rescale_cache(self, ratio: float) -> None:
        """A new context: the cache per layer scales with it (not the recurrent states); the graphs are measured
        again."""
        self.cache = {u: int(v * ratio) for u, v in self.cache.items()}
        self.graph.clear()

    def search(self, n_ctx: int):
        """Tries until no candidate is better than the best that fitted: (model, step), or (None, last step)
        when nothing fits (even the CPU cannot hold the rest).

        A candidate is computed from the sizes measured so far; one that fits is kept, and is replaced by
        a later one only if that holds more units on the faster devices (counts compared in device order);
        one that does not fit caps the failing accelerators below what they were given."""
        self.caps.clear()
        seen: set = set()
        best, best_step = None, None
        try:
            while True:
                counts = self.candidate()
                if counts in seen or (best_step is not None and counts <= best_step.counts):
                    break
                seen.add(counts)
                model, step, failing = self.attempt(counts, n_ctx)
                if model is not None:
                    if best is not None:
                        best.close()
                    best, best_step = model, step
                    continue
                accel_failing = [i for i, d in enumerate(self.accel) if d.name in failing and counts[i] > 0]
                if not accel_failing:
                    break               # only the CPU overran: nothing left to move off it
                k = 0
                for i, c in enumerate(counts):
                    if i in accel_failing:
                        self.caps[(i, k)] = min(self.caps.get((i, k), c), c - 1)
                    k += c
        except BaseException:
            if best is not None:
                best.close()
            raise
        return best, best_step if best_step is not None else self.steps[-1]


def _tensor_bytes(reader, n_layer: int, placement: Optional[Placement] = None) -> tuple[dict, dict]:
    """Weight bytes per unit from the file's tensor table (the first estimate, before any try), without
    the tensors ``placement``'s overrides send elsewhere; and those, ``{(unit, device name): bytes}``."""
    out: dict[Unit, int] = {}
    moved: dict[tuple[Unit, str], int] = {}
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            try:
                u: Unit = int(name.split(".")[1])
            except ValueError:
                continue
            if not 0 <= u < n_layer:
                continue
        elif name.startswith("output"):
            u = "output"
        else:
            continue
        dev = placement.override_of((name,)) if placement is not None and placement.overrides else None
        if dev is not None:
            moved[(u, dev.name)] = moved.get((u, dev.name), 0) + int(t.nbytes)
        else:
            out[u] = out.get(u, 0) + int(t.nbytes)
    return out, moved


def _budgets(devs: Sequence[Device], margin, memory) -> dict[str, int]:
    """Bytes each device may take: ``free - margin``, capped by ``memory[name]``."""
    out = {}
    margins = margin if isinstance(margin, dict) else {}
    caps = {str(k).upper(): int(v) for k, v in (memory or {}).items()}
    for d in devs:
        free, total = d.memory()
        m = margins.get(d.name, margins.get(d.name.upper())) if isinstance(margin, dict) else margin
        m = default_margin(total) if m is None else int(m)
        if m < 0:
            raise GGMLValueError(f"load_model: margin for {d.name} must be >= 0 (got {m})")
        b = max(0, int(free) - m)
        if d.name.upper() in caps:
            b = min(b, caps[d.name.upper()])
        out[d.name] = b
    return out


def fit_model(path, *, devices: Union[str, Sequence[str]] = "auto", rpc: Sequence[str] = (),
              n_ctx: Union[int, str, None] = None, n_ctx_min: int = 2048, n_seq_max: int = 1, n_batch: int = 512,
              n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16", flash_attn: Optional[bool] = None,
              margin: Union[None, int, dict] = None, memory: Optional[dict] = None,
              open_model: Optional[Callable[[Placement], Any]] = None,
              progress=None, check_tensors: bool = False, mmap: bool = False, overrides: tuple = (),
              n_cpu_moe: int = 0) -> Any:
    """Choose a placement by trying allocations (see the module), then load the model on it.

    Called by :func:`~ggmlpy.load.load_model` with ``n_gpu_layers="auto"``; the parameters are its
    (``overrides``: its tensor overrides, parsed, :func:`~ggmlpy.backend.parse_tensor_overrides`; every
    try keeps them and ``n_cpu_moe``'s, and the tensors they move are not counted with their layer).
    ``n_ctx=None`` is the runner's default for this model (:func:`ggmlpy.defaults.n_ctx_for`).

    Returns
    -------
    Model
        Loaded, with ``model.fit`` (:class:`FitResult`) and the search in its memory report.

    Raises
    ------
    GGMLMemoryError
        Even the CPU cannot hold what the accelerators cannot (at ``n_ctx_min`` with ``n_ctx="auto"``); the
        message has the last try's report and the steps, ``.report`` the report. Nothing stays allocated.
    """
    from ggmlpy.gguf import open_reader
    from ggmlpy.models import model_class
    from ggmlpy.runner.runner import Runner

    t0 = time.perf_counter()
    auto_ctx = isinstance(n_ctx, str)
    if auto_ctx and n_ctx != "auto":
        raise GGMLValueError(f"load_model: n_ctx must be a positive integer or 'auto' (got {n_ctx!r})")
    tk, tv, fa = Runner.check_cache_types(type_k, type_v, flash_attn)
    with open_reader(path) as reader:
        cfg = model_class(reader.metadata.get("general.architecture"), str(path)).read_config(reader, str(path))
        cpu = _core.device("CPU")
        overrides = tuple(overrides) + n_cpu_moe_overrides(n_cpu_moe, cfg.n_layer)
        tensor_bytes, overridden = _tensor_bytes(reader, cfg.n_layer,
                                                 Placement(layers=[], output=cpu, input=cpu, overrides=overrides))
    if auto_ctx:
        if int(n_ctx_min) < 1:
            raise GGMLValueError(f"load_model: n_ctx_min must be >= 1 (got {n_ctx_min})")
        ctx = max(int(cfg.n_ctx_train), int(n_ctx_min))
    else:
        ctx = n_ctx_for(cfg.n_ctx_train) if n_ctx is None else int(n_ctx)
        if ctx < 1:
            raise GGMLValueError(f"load_model: n_ctx must be >= 1 (got {n_ctx})")
    devs = choose_devices(devices, rpc=rpc)
    budgets = _budgets(devs, margin, memory)
    runner_kw = {"n_seq_max": int(n_seq_max), "n_batch": int(n_batch), "n_ubatch": int(n_ubatch),
                 "type_k": type_k, "type_v": type_v, "flash_attn": fa}
    if open_model is None:
        raise GGMLValueError("fit_model: open_model is required (load_model passes it)")
    s = _Search(path, devs, cfg.n_layer, tensor_bytes, budgets, open_model, runner_kw, overrides,
                overridden)
    # the first estimate of the cache: K and V rows of every cell (no window, no padding; no V apart for a
    # latent cache) of the attention layers (a recurrent layer's state is measured by the first try); tries
    # measure it
    rk, rv = cfg.cache_rows() if hasattr(cfg, "cache_rows") else (0, 0)
    recurrent = getattr(cfg, "recurrent_layers", ()) or (False,) * cfg.n_layer
    if rk:
        per_cell = _core.row_size(tk, rk) + (_core.row_size(tv, rv) if rv else 0)
        s.cache = {u: per_cell * ctx * int(n_seq_max) for u in range(cfg.n_layer) if not recurrent[u]}
    tried: list[tuple[int, int, tuple]] = []          # (units offloaded, n_ctx, counts) per context that fitted
    while True:
        model, step = s.search(ctx)
        whole = model is not None and sum(step.counts) == len(s.units)
        if not auto_ctx or whole or (not s.accel and model is not None) or ctx // 2 < n_ctx_min:
            break
        if model is not None:
            tried.append((sum(step.counts), ctx, step.counts))
            model.close()
        log.info("fit: n_ctx %d does not fit wholly on the accelerators: trying %d", ctx, ctx // 2)
        ctx //= 2
        s.rescale_cache(0.5)
    if model is not None and tried and not whole:
        # the smallest context gained no layer over a larger one: keep the largest context that offloads as many
        units, best_ctx, counts = max(tried + [(sum(step.counts), ctx, step.counts)])
        if best_ctx != ctx:
            model.close()
            model, step, _ = s.attempt(counts, best_ctx)
            ctx = best_ctx
    seconds = time.perf_counter() - t0
    result = FitResult(s.placement(step.counts), ctx, {**runner_kw, "n_ctx": ctx}, budgets, s.steps, seconds)
    if model is None:
        report = s.last_report
        raise GGMLMemoryError(f"load_model: {path}: no placement fits the devices' memory (margin included)\n"
                              f"{result}" + (f"\nlast try:\n{report}" if report is not None else ""), report)
    try:
        model.report.fit = result
        model.fit = result
        model.load(progress, check_tensors, mmap=mmap)
        if getattr(model, "vision", None) is not None:
            model.vision.load(progress, check_tensors=check_tensors)
    except BaseException:
        model.close()
        raise
    return model
