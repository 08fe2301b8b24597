"""Devices, device choice, layer placement, scheduling with worst-case reservation.

The runtime layer over ``ggmlpy._core``'s backend handles, after Ollama's
``ml`` package and llama.cpp's ``llama-context``:

* :func:`choose_devices` picks devices (``"auto"``: GPUs first, then the CPU;
  explicit names; RPC servers by ``host:port``), and :func:`split_layers`
  assigns each layer to a device (``n_gpu_layers`` style, split by free
  memory); :func:`parse_tensor_overrides` sends weights by name elsewhere.
* :class:`Runtime` owns one backend per device and a scheduler, and
  :meth:`Runtime.reserve` reserves the worst-case graphs (prompt batch, one
  token, prompt batch again) so that later computes never allocate;
  :class:`GraphPool` keeps built graphs for reuse.

Also importable from here, as before they had their own modules:
:class:`MemoryReport` and :class:`DeviceMemory` (:mod:`ggmlpy.memory`),
:class:`Weights`, :func:`amx_usable`, :func:`weight_buffer_allowed` and
:data:`KNOWN_BAD_WEIGHT_BUFFERS` (:mod:`ggmlpy.weights`, a floor above this one,
so they are re-exported lazily), :class:`ProgressBar` (``ggmlpy._progress``).

Nothing here touches a C pointer: everything goes through ``_core``.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggmlpy import _core
from ggmlpy._core import (
    Backend,
    Device,
    GGMLMemoryError,
    GGMLValueError,
    Graph,
)
from ggmlpy._progress import ProgressBar
from ggmlpy.memory import DeviceMemory, Group, MemoryReport

log = logging.getLogger("ggmlpy")

__all__ = [
    "DeviceMemory", "MemoryReport", "Placement", "ProgressBar", "Runtime", "choose_devices",
    "devices", "main_accelerator", "n_cpu_moe_overrides", "parse_tensor_overrides", "split_layers",
    "Weights",  # noqa: F822  (re-exported lazily from ggmlpy.weights: see __getattr__)
]

#: Names that moved up to :mod:`ggmlpy.weights` (which imports this module), still importable from here.
_FROM_WEIGHTS = frozenset({"KNOWN_BAD_WEIGHT_BUFFERS", "Weights", "amx_usable", "weight_buffer_allowed"})


def __getattr__(name: str) -> Any:
    # A lazy re-export: ggmlpy.weights sits a floor above this module (it places weights with a
    # Placement), so importing it here at the top would run the import order backwards.
    if name in _FROM_WEIGHTS:
        from ggmlpy import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def devices() -> list[Device]:
    """Every device ggml knows (compiled-in ones and added RPC servers), CPU last."""
    return _core.devices()


def choose_devices(spec: str | Sequence[str] = "auto", rpc: Iterable[str] = ()) -> list[Device]:
    """Pick devices.

    Parameters
    ----------
    spec : ``"auto"``, ``"cpu"``, or a list (or comma-separated string) of device names
        ``"auto"`` takes every local GPU and the devices of the RPC servers given
        in ``rpc`` (ggml reports them as GPUs), then the CPU; names are case-insensitive (``"CUDA0"``,
        ``"RPC0"``, ``"CPU"``).
    rpc : endpoints ``"host:port"`` of ``ggmlpy rpc-server`` processes to add first

    Returns
    -------
    list of Device, the CPU always last (ggml's scheduler needs it as fallback).

    Raises
    ------
    BackendUnavailable
        A named device is not in this build; the message gives the rebuild option.
    ConnectionError
        An RPC endpoint does not answer.
    """
    rpc_devs = [d for ep in rpc for d in _core.rpc_add_server(ep)]
    if isinstance(spec, str) and spec.lower() == "auto":
        # local accelerators, plus the RPC servers named in this call (not every
        # server added earlier in the process, which may be gone by now)
        chosen = [d for d in devices() if d.type in ("GPU", "IGPU") and d.endpoint is None] + rpc_devs
    elif isinstance(spec, str) and spec.lower() == "cpu":
        chosen = list(rpc_devs)
    else:
        names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
        chosen = [_core.device(n) for n in names if n]
        chosen += [d for d in rpc_devs if d not in chosen]
    cpu = _core.device("CPU")
    out: list[Device] = []
    for d in chosen:
        if d not in out and d != cpu:
            out.append(d)
    return out + [cpu]


def main_accelerator(spec: str | Sequence[str] = "auto", index: int = 0, rpc: Iterable[str] = ()) -> list[str] | str:
    """The command lines' ``-sm none -mg INDEX`` (llama.cpp's split mode none): the ``index``-th
    accelerator of :func:`choose_devices` takes every offloaded layer. Returns the ``devices`` argument
    for :func:`ggmlpy.models.load_model`: that device's name in a list, or ``"cpu"`` when there is no
    accelerator (then ``index`` must be 0)."""
    accels = [d for d in choose_devices(spec, rpc=rpc) if d.type != "CPU"]
    if not 0 <= index < max(len(accels), 1):
        raise GGMLValueError(f"-mg {index}: there are {len(accels)} accelerators "
                             f"({', '.join(d.name for d in accels) or 'none'})")
    return [accels[index].name] if accels else "cpu"


def _override_device(name: str, option: str) -> Device:
    """The device a tensor override names: a device (``CPU``, ``Vulkan0``, ``RPC0``) or its buffer type's
    name (llama.cpp's ``-ot`` takes those: ``CUDA0``, ``RPC0[host:port]``), any case."""
    want = name.strip().lower()
    for d in devices():
        if want in (d.name.lower(), d.buffer_type().name.lower()):
            return d
    names = ", ".join(d.name for d in devices())
    raise GGMLValueError(f"{option}: unknown device or buffer type {name.strip()!r} (this process has: {names}; "
                         f"an RPC server's device exists once -rpc adds it)")


def parse_tensor_overrides(spec: str | Sequence[str | tuple[str, str | Device]] | None,
                           option: str = "tensor_overrides") -> tuple[tuple[str, Device], ...]:
    """Tensor overrides as llama.cpp's ``-ot``/``--override-tensor``: ``PATTERN=DEVICE``, comma-separated in
    a string (``"ffn_.*_exps=CPU,attn=Vulkan0"``), or a list of such strings or ``(pattern, device)`` pairs.

    A weight whose name (or, for a fused weight, a part's file name) matches ``PATTERN`` (a regular
    expression, searched as llama.cpp does) goes to ``DEVICE`` instead of its layer's device; the first
    match wins. The device is a device name or its buffer type's name, case-insensitive. Returns
    ``((pattern, Device), ...)``; every pattern is compiled and every device looked up first, so a bad one
    is refused before anything is allocated (:class:`~ggmlpy.GGMLValueError` naming it).
    """
    if spec is None:
        return ()
    items = [x for x in spec.split(",") if x.strip()] if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if isinstance(item, str):
            pattern, eq, dev = item.partition("=")
            if not eq or not pattern or not dev.strip():
                raise GGMLValueError(f"{option}: {item!r} is not PATTERN=DEVICE (e.g. 'ffn_.*_exps=CPU')")
        else:
            pattern, dev = item
        try:
            re.compile(pattern)
        except re.error as e:
            raise GGMLValueError(f"{option}: pattern {pattern!r} is not a regular expression: {e}") from None
        out.append((pattern, dev if isinstance(dev, Device) else _override_device(str(dev), option)))
    return tuple(out)


#: The override :func:`n_cpu_moe_overrides` makes for layer ``{}`` (llama.cpp's, for --n-cpu-moe).
N_CPU_MOE_PATTERN = r"blk\.{}\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def n_cpu_moe_overrides(n: int, n_layers: int) -> tuple[tuple[str, Device], ...]:
    """llama.cpp's ``--n-cpu-moe N``: the expert weights (``ffn_{up,down,gate,gate_up}_exps`` and their
    biases) of the first ``n`` of ``n_layers`` layers stay on the CPU, as overrides
    (:func:`parse_tensor_overrides`), one per layer. ``n >= n_layers``: every layer (``--cpu-moe``)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise GGMLValueError(f"n_cpu_moe must be an integer >= 0 (got {n!r})")
    cpu = _core.device("CPU")
    return tuple((N_CPU_MOE_PATTERN.format(i), cpu) for i in range(min(int(n), n_layers)))


@dataclass
class Placement:
    """Which device holds each layer group: input (CPU), layers ``0..n_layers-1``, output; and the tensor
    overrides (:func:`parse_tensor_overrides`): weights by name on another device than their group's."""

    layers: list[Device]
    output: Device
    input: Device
    #: ``((pattern, Device), ...)``: the first pattern found in a weight's name sends it to its device
    overrides: tuple = ()

    def override_of(self, names: Sequence[str]) -> Device | None:
        """The device the first override matching any of ``names`` names (None: no override)."""
        for pattern, dev in self.overrides:
            if any(re.search(pattern, n) for n in names):
                return dev
        return None

    def device_for(self, group: Group, names: Sequence[str] = ()) -> Device:
        """Where a weight of ``group`` named ``names`` goes: its override's device, else the group's."""
        dev = self.override_of(names) if self.overrides else None
        return dev if dev is not None else self.device_of(group)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def device_of(self, group: Group) -> Device:
        if group == "input":
            return self.input
        if group in ("output", "vision"):
            # a vision encoder (mmproj) runs where the output layer does, as in Ollama's engine
            return self.output
        if isinstance(group, int) and 0 <= group < len(self.layers):
            return self.layers[group]
        raise GGMLValueError(f"placement: no layer group {group!r} (layers 0..{len(self.layers) - 1}, input, output, "
                             f"vision)")

    def devices(self) -> list[Device]:
        """The distinct devices used, in scheduler order (CPU last)."""
        seen: list[Device] = []
        for d in [*self.layers, self.output, self.input, *(dev for _, dev in self.overrides)]:
            if d not in seen:
                seen.append(d)
        return sorted(seen, key=lambda d: d.type == "CPU")

    def summary(self) -> str:
        """llama.cpp-style one-liner: how many repeating layers each device got."""
        counts: dict[str, int] = {}
        for d in self.layers:
            counts[d.name] = counts.get(d.name, 0) + 1
        parts = [f"{n} on {name}" for name, n in counts.items()]
        ot = ""
        if self.overrides:          # (n_cpu_moe makes one per layer: counted, not listed, beyond a few)
            listed = ", ".join(f"{p}={d.name}" for p, d in self.overrides)
            ot = f"; tensor overrides {listed}" if len(self.overrides) <= 3 else \
                f"; {len(self.overrides)} tensor overrides"
        return f"{self.n_layers} layers: {', '.join(parts)}; output on {self.output.name}{ot}"


def split_layers(n_layers: int, devs: Sequence[Device], n_gpu_layers: int = -1,
                 split: str | Sequence[float] = "memory") -> Placement:
    """Assign ``n_layers`` repeating layers, the input and the output to ``devs``.

    As llama.cpp's ``-ngl``: the *last* ``n_gpu_layers`` layers go to the
    non-CPU devices (``-1``: all of them, and the output too when every layer
    is offloaded); the rest and the input embeddings stay on the CPU. Among
    several accelerators the layers are split by free memory (``"memory"``),
    evenly (``"count"``), or by explicit proportions (a list of floats).
    """
    if n_layers < 0:
        raise GGMLValueError(f"split_layers: n_layers must be >= 0 (got {n_layers})")
    cpu = _core.device("CPU")
    accel = [d for d in devs if d != cpu]
    n_off = n_layers if n_gpu_layers < 0 else min(n_gpu_layers, n_layers + 1)
    if not accel:
        if n_gpu_layers > 0:
            # llama.cpp ignores -ngl without a GPU too, but says so: the user expected offloading
            warnings.warn(f"split_layers: n_gpu_layers={n_gpu_layers} ignored: no accelerator among the devices "
                          f"({', '.join(d.name for d in devs)}); devices='auto' or ['CUDA0'] picks a GPU, and "
                          f"ggmlpy.system_info()['backends'] says which backends this build has", stacklevel=2)
        n_off = 0
    n_rep = min(n_off, n_layers)
    if isinstance(split, str):
        if split == "memory":
            weights = [max(d.memory()[0], 1) for d in accel]
        elif split == "count":
            weights = [1.0] * len(accel)
        else:
            raise GGMLValueError(f"split_layers: split must be 'memory', 'count' or a list (got {split!r})")
    elif not accel:
        weights = []                # nothing to divide (the n_gpu_layers warning above says why)
    else:
        weights = list(split)
        if len(weights) != len(accel) or any(w < 0 for w in weights) or not sum(weights) > 0:
            raise GGMLValueError(f"split_layers: need {len(accel)} non-negative proportions (got {weights!r})")
    layers = [cpu] * (n_layers - n_rep)
    if n_rep:
        total = float(sum(weights))
        bounds = np.cumsum([w / total for w in weights])
        for j in range(n_rep):
            k = int(np.searchsorted(bounds, (j + 0.5) / n_rep))
            layers.append(accel[min(k, len(accel) - 1)])
    output = layers[-1] if (n_off > n_layers or (n_gpu_layers < 0 and accel)) and layers else cpu
    if n_layers == 0 and accel and n_off:
        output = accel[0]
    return Placement(layers=layers, output=output, input=cpu)


class GraphPool:
    """Built graphs kept for reuse by shape, as llama.cpp reuses its graph when only the inputs change.

    A graph is keyed by what its topology depends on (batch size, output rows, the cache plan's
    :attr:`key`, the kind of output). :meth:`take` hands out a pooled graph of that key or builds one;
    :meth:`give` returns it after compute: ``keep`` per key (two: one computing while the next is
    built), the ``shapes`` most recent keys. Thread-safe: the loop thread takes while the compute
    thread gives.

    Items need ``free()``; the pool sets their ``key``.
    """

    def __init__(self, enabled: bool = True, keep: int = 2, shapes: int = 16) -> None:
        self.enabled = bool(enabled)
        self.keep, self.shapes = int(keep), int(shapes)
        self.built = 0                          # graphs built (not taken from the pool)
        self._pools: dict = {}
        self._lock = threading.Lock()

    def take(self, key: tuple, build: Callable[[], Any]):
        """A pooled graph of ``key``, or ``build()``'s."""
        with self._lock:
            pool = self._pools.get(key)
            item = pool.pop() if pool else None
        if item is None:
            item = build()
            item.key = key
            self.built += 1
        return item

    def give(self, item) -> None:
        """Keep a computed graph for reuse (or free it when the pool is full or disabled)."""
        with self._lock:
            pool = self._pools.setdefault(item.key, [])
            if len(pool) < self.keep and self.enabled:
                pool.append(item)
                item = None
            old = []
            if len(self._pools) > self.shapes:  # shapes seen long ago
                for key in list(self._pools)[:-self.shapes]:
                    old += self._pools.pop(key)
        for b in ([item] if item is not None else []) + old:
            b.free()

    def clear(self) -> None:
        """Free every pooled graph (each one tried; the first error raised after)."""
        with self._lock:
            pools, self._pools = self._pools, {}
        errors = []
        for pool in pools.values():
            for b in pool:
                try:
                    b.free()
                except Exception as e:
                    errors.append(e)
        if errors:
            raise errors[0]


class Runtime:
    """One backend per device plus a scheduler over them, with worst-case reservation.

    Every graph computes through :meth:`run` (allocation through the scheduler, inputs, compute),
    the forward graphs and the cache's maintenance (shift, defragmentation) alike, so both work for
    any device; :attr:`graphs` is the pool of forward graphs kept for reuse.

    Parameters
    ----------
    devs : the devices (CPU last), e.g. ``placement.devices()``
    n_threads : CPU threads (default: all cores)
    graph_size : scheduler capacity for nodes + leafs (twice the largest graph's)
    report : MemoryReport to record compute-graph bytes in
    threadpool : give the CPU backend a persistent threadpool (:meth:`ggmlpy.Backend.set_threadpool`), as
        llama.cpp's tools do, instead of ggml starting its threads for every graph
    poll : how eagerly the pool's idle threads poll for the next graph (0-100, llama-bench's ``--poll``)
    reuse_graphs : keep built forward graphs for reuse (:class:`GraphPool`)
    """

    def __init__(self, devs: Sequence[Device], n_threads: int = 0, graph_size: int = 8192,
                 report: MemoryReport | None = None, parallel: bool = False, op_offload: bool = True,
                 threadpool: bool = True, poll: int = 50, reuse_graphs: bool = True):
        self.graphs = GraphPool(enabled=reuse_graphs)
        self.graph_size = int(graph_size)
        self.devices = list(devs)
        if not self.devices or self.devices[-1].type != "CPU":
            self.devices = [d for d in self.devices if d.type != "CPU"] + [_core.device("CPU")]
        self.backends: list[Backend] = []
        self.sched = None
        try:
            for d in self.devices:
                self.backends.append(d.init())
            cpu = self.backends[-1]
            n = n_threads if n_threads > 0 else _core.default_n_threads()
            self.n_threads = n
            if threadpool:
                cpu.set_threadpool(n, poll=poll)        # also sets the backend's thread count
            else:
                cpu.set_n_threads(n)
            self.sched = _core.Scheduler(self.backends, graph_size=graph_size, parallel=parallel,
                                         op_offload=op_offload)
        except BaseException:
            self.close()              # the backends made so far: a failed start holds nothing
            raise
        self.report = report if report is not None else MemoryReport()
        self.reserved: dict[str, int] = {}
        self.stats: dict[str, tuple[int, int]] = {}
        self.reallocations = 0

    def buffer_sizes(self) -> dict[str, int]:
        """Bytes of each backend's compute buffer now."""
        return {d.name: self.sched.buffer_size(b) for d, b in zip(self.devices, self.backends)}

    def reserve(self, build: Callable[[int], Graph], n_prompt: int, n_decode: int = 1,
                extra: Sequence[tuple[str, Callable[[], Graph]]] = ()) -> dict[str, int]:
        """Reserve compute buffers for the worst case, as llama.cpp's context does.

        ``build(n_tokens)`` returns a graph at full context for a batch of
        ``n_tokens``; it is called for the prompt batch, a decode batch, and
        the prompt batch again (so the final allocation is the prompt-sized
        one). ``extra`` are other graphs the buffers must hold, ``(label,
        build())``, reserved before the last prompt batch: the largest image
        batch of a vision encoder. Logs node and split counts. Returns the bytes per device.

        Raises
        ------
        GGMLMemoryError
            A compute buffer could not be allocated; ``.report`` has the figures.
        """
        steps = [("pp", lambda: build(n_prompt)), ("tg", lambda: build(n_decode)), *extra,
                 ("pp", lambda: build(n_prompt))]
        for d in self.devices:
            self.report.device(d).graphs.clear()
        for label, make in steps:
            gf = make()
            # measured without allocating, for the report; keyed by backend name ("RPC0[host:port]")
            by_backend = self.sched.reserve_size(gf)
            need = {d.name: by_backend.get(b.name, 0) for d, b in zip(self.devices, self.backends)}
            for d in self.devices:
                self.report.note_graph(d, label, need[d.name])
            try:
                self.sched.reserve(gf)
            except MemoryError as e:
                for d in self.devices:
                    self.report.set_graph(d, need.get(d.name, 0), ok=False)
                raise GGMLMemoryError(f"reserve: {e}\n{self.report}", self.report) from None
            self.sched.alloc_graph(gf)
            self.stats[label] = (gf.n_nodes, self.sched.n_splits)
        self.sched.reset()
        log.info("graph nodes/splits = %d/%d (with bs=%d), %d/%d (with bs=%d)",
                 *self.stats["pp"], n_prompt, *self.stats["tg"], n_decode)
        self.reserved = self.buffer_sizes()
        for d in self.devices:
            self.report.set_graph(d, self.reserved[d.name], ok=True)
            log.info("%s compute buffer size = %.2f MiB", d.name, self.reserved[d.name] / 2**20)
        return dict(self.reserved)

    def pin(self, pins) -> None:
        """Keep each ``(node, device)`` of a graph on that device's backend (until the graph is freed):
        for a node ggml's scheduler would otherwise give its neighbours' device."""
        for node, dev in pins:
            i = next(i for i, d in enumerate(self.devices) if d.name == dev.name)
            self.sched.set_tensor_backend(node, self.backends[i])

    def run(self, graph: Graph, fill: Callable[[], None] | None = None) -> None:
        """Allocate ``graph`` through the scheduler (unless it keeps an allocation), ``fill()`` its
        inputs, compute it."""
        if not self.sched.is_allocated(graph):      # a reused graph keeps its allocation
            self.sched.alloc_graph(graph)
            self._note_growth()
        if fill is not None:
            fill()
        self.compute(graph)

    def compute(self, graph: Graph) -> None:
        """Allocate and compute ``graph``; counts any growth of the compute buffers past the reservation."""
        fresh = not self.sched.is_allocated(graph)
        self.sched.compute(graph)
        if fresh:
            self._note_growth()

    def _note_growth(self) -> None:
        # only an allocation can grow the buffers: a graph computed again in its allocation is not checked
        # (the sizes per backend cost ~20 us a token on caches the weight sweep has emptied)
        if self.reserved and self.buffer_sizes() != self.reserved:
            self.reallocations += 1
            self.reserved = self.buffer_sizes()
            log.warning("compute buffers grew past the reservation: %s", self.reserved)

    def close(self) -> None:
        """Free the pooled graphs, the scheduler (its compute buffers) and the backends; safe to call twice."""
        try:
            self.graphs.clear()
        finally:
            self._close_sched()

    def _close_sched(self) -> None:
        if self.sched is not None:
            self.sched.free()
            self.sched = None
        for b in self.backends:
            b.free()
        self.backends = []

