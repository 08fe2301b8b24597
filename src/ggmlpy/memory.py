"""Memory per device and per purpose: :class:`MemoryReport` and its rows, :class:`DeviceMemory`.

What every device holds (weights, KV cache, recurrent states, compute graph; per layer group and per buffer
type) and whether each allocation succeeded, after llama.cpp's memory breakdown. The weights
(:class:`ggmlpy.weights.Weights`), the caches (:mod:`ggmlpy.kvcache`) and the scheduler's reservation
(:meth:`ggmlpy.backend.Runtime.reserve`) record into one report; a failed allocation raises
:class:`~ggmlpy.GGMLMemoryError` carrying it. Re-exported by :mod:`ggmlpy.backend`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Union

from ggmlpy._core import Buffer, Device

#: A layer group: ``"input"`` (embeddings, always on the CPU), a layer index, or ``"output"``.
Group = Union[str, int]

__all__ = ["HUGE_PAGES_MIN", "DeviceMemory", "Group", "MemoryReport", "advise_huge_pages"]

#: The smallest buffer :func:`advise_huge_pages` advises: glibc gives an allocation this large a mapping of its
#: own (its mmap threshold is at most 32 MiB), so the advice reaches no other allocation's memory.
HUGE_PAGES_MIN = 32 << 20


def advise_huge_pages(buf: Buffer) -> bool:
    """Ask for huge pages behind a CPU buffer of weights, cache or states before it is first written
    (:meth:`ggmlpy.Buffer.advise_huge_pages`): each token reads these through, and with 4 KiB pages the TLB
    misses cost generation 4-6% (Zen 4, 110M to 7B files; prompts unchanged). Linux only, where transparent
    huge pages are in ``madvise`` mode (``always``: they are used anyway; ``never``: not at all). Buffers
    under :data:`HUGE_PAGES_MIN` are left alone; ``GGMLPY_HUGE_PAGES=0`` turns the advice off. True where
    given.

    The cost is at load, where a huge page is zeroed when first written: one fault instead of 512 (2 GiB of
    memory touched before took 0.20 s in huge pages, 0.83 s in small ones, on the machine above), but in a
    virtual machine whose host backs the guest's memory only once it is first touched (Firecracker) a huge
    page comes from memory the guest never touched, and there a 4 GB file loaded in 10-14 s instead of
    5 s. Set ``GGMLPY_HUGE_PAGES=0`` where loading matters more."""
    if buf.size < HUGE_PAGES_MIN or os.environ.get("GGMLPY_HUGE_PAGES", "1").strip() == "0":
        return False
    return buf.advise_huge_pages()


@dataclass
class DeviceMemory:
    """What one device holds: bytes per layer group for weights, cache and recurrent states, the compute graph,
    and outcomes (``cache_ok`` covers the states too)."""

    name: str
    description: str
    n_layers: int
    weights: dict[Group, int] = field(default_factory=dict)
    cache: dict[Group, int] = field(default_factory=dict)
    #: recurrent states (a recurrent layer's per-sequence state and its checkpoints): fixed, whatever the context
    state: dict[Group, int] = field(default_factory=dict)
    #: weight bytes per buffer type (``"CPU"``, ``"CPU_REPACK"``...)
    weight_buffers: dict[str, int] = field(default_factory=dict)
    graph: int = 0
    #: what each reserved graph needs here (``pp``, ``tg``, ``vision``...); the compute buffer holds the largest
    graphs: dict[str, int] = field(default_factory=dict)
    weights_ok: bool | None = None       # None: not attempted
    cache_ok: bool | None = None
    graph_ok: bool | None = None
    free: int = 0
    total: int = 0

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_total(self) -> int:
        return sum(self.cache.values())

    @property
    def state_total(self) -> int:
        return sum(self.state.values())

    @property
    def context_total(self) -> int:
        """The K/V cache and the recurrent states: llama.cpp's "context"."""
        return self.cache_total + self.state_total

    @property
    def self_total(self) -> int:
        """model + context + compute, in llama.cpp's words."""
        return self.weights_total + self.context_total + self.graph

    @property
    def unaccounted(self) -> int:
        """``total - free - self``, signed: memory in use on the device that this report does not explain.

        Positive: other processes, the driver, this process's other allocations.
        Negative: the report counts more than the device shows as used. That is
        normal on the CPU device, whose ``free`` is the system's available
        memory: ggml's host buffers are reserved but their pages are only
        taken when first written, so untouched parts of the cache and compute
        buffers still look free; it also happens when ``free`` was read before
        an allocation (the figures are read when each part is recorded).
        """
        return self.total - self.free - self.self_total

    def to_dict(self) -> dict:
        return {
            "name": self.name, "description": self.description,
            "weights": {str(k): v for k, v in self.weights.items()},
            "cache": {str(k): v for k, v in self.cache.items()},
            "state": {str(k): v for k, v in self.state.items()},
            "weight_buffers": dict(self.weight_buffers),
            "graph": self.graph, "graphs": dict(self.graphs),
            "weights_total": self.weights_total, "cache_total": self.cache_total, "state_total": self.state_total,
            "self": self.self_total, "free": self.free, "total": self.total, "unaccounted": self.unaccounted,
            "allocated": {"weights": self.weights_ok, "cache": self.cache_ok, "graph": self.graph_ok},
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _status(ok: bool | None) -> str:
    return {None: "", True: "", False: " FAILED"}[ok]


class MemoryReport:
    """Memory per device and per purpose (weights, KV cache, recurrent states, compute graph), per layer.

    ``str(report)`` is an aligned table in MiB with one row per device and a
    llama.cpp-style breakdown ``total = free + (self = model + context +
    compute) + unaccounted``; :meth:`to_dict` / :meth:`to_json` give the same
    numbers. A device whose allocation failed still shows what it needed.
    ``unaccounted`` may be negative (see :attr:`DeviceMemory.unaccounted`); the
    table then says why in a note.
    """

    def __init__(self, n_layers: int = 0):
        self.n_layers = n_layers
        self.devices: dict[str, DeviceMemory] = {}
        #: how the placement was chosen (``load_model(..., n_gpu_layers="auto")``: a FitResult), else None
        self.fit: Any = None

    def device(self, dev: Device) -> DeviceMemory:
        m = self.devices.get(dev.name)
        if m is None:
            m = self.devices[dev.name] = DeviceMemory(dev.name, dev.description, self.n_layers)
        m.free, m.total = dev.memory()
        return m

    def add_weights(self, dev: Device, group: Group, nbytes: int) -> None:
        m = self.device(dev)
        m.weights[group] = m.weights.get(group, 0) + int(nbytes)

    def add_cache(self, dev: Device, group: Group, nbytes: int) -> None:
        m = self.device(dev)
        m.cache[group] = m.cache.get(group, 0) + int(nbytes)

    def add_state(self, dev: Device, group: Group, nbytes: int) -> None:
        """Recurrent state bytes of ``group`` (a layer) on ``dev`` (:class:`~ggmlpy.kvcache.Recurrent`)."""
        m = self.device(dev)
        m.state[group] = m.state.get(group, 0) + int(nbytes)

    def set_graph(self, dev: Device, nbytes: int, ok: bool = True) -> None:
        m = self.device(dev)
        m.graph = int(nbytes)
        m.graph_ok = ok

    def note_graph(self, dev: Device, label: str, nbytes: int) -> None:
        """Record what the graph ``label`` needs on ``dev`` (the largest of its reservations)."""
        m = self.device(dev)
        m.graphs[label] = max(m.graphs.get(label, 0), int(nbytes))

    @property
    def total(self) -> int:
        return sum(m.self_total for m in self.devices.values())

    def to_dict(self) -> dict:
        out = {"n_layers": self.n_layers, "devices": {k: m.to_dict() for k, m in self.devices.items()},
               "total": self.total}
        if self.fit is not None:
            out["fit"] = self.fit.to_dict()
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @property
    def has_state(self) -> bool:
        """Whether any device holds recurrent states (the tables then show them in a column of their own)."""
        return any(m.state_total for m in self.devices.values())

    def layer_table(self) -> str:
        """Weights and cache (and recurrent states, where there are) per layer group and device, in MiB."""
        groups: list[Group] = ["input", *range(self.n_layers), "output"]
        names = list(self.devices)
        state = self.has_state
        rows = [["layer", *[f"{n} weights" for n in names], *[f"{n} cache" for n in names],
                 *([f"{n} state" for n in names] if state else [])]]
        for gname in groups:
            w = [self.devices[n].weights.get(gname, 0) for n in names]
            cch = [self.devices[n].cache.get(gname, 0) for n in names]
            st = [self.devices[n].state.get(gname, 0) for n in names] if state else []
            if any(w) or any(cch) or any(st):
                rows.append([str(gname), *map(_mib, w), *map(_mib, cch), *map(_mib, st)])
        return _table(rows)

    def __str__(self) -> str:
        # a "state" column only for models with recurrent layers: the table of every other model stays as it was
        state = self.has_state
        rows = [["device", "weights", "cache", *(["state"] if state else []), "graph", "self", "free", "total"]]
        for m in self.devices.values():
            rows.append([m.name, _mib(m.weights_total) + _status(m.weights_ok),
                         _mib(m.cache_total) + _status(m.cache_ok),
                         *([_mib(m.state_total) + _status(m.cache_ok)] if state else []),
                         _mib(m.graph) + _status(m.graph_ok), _mib(m.self_total), _mib(m.free), _mib(m.total)])
        rows.append(["total", _mib(sum(m.weights_total for m in self.devices.values())),
                     _mib(sum(m.cache_total for m in self.devices.values())),
                     *([_mib(sum(m.state_total for m in self.devices.values()))] if state else []),
                     _mib(sum(m.graph for m in self.devices.values())), _mib(self.total), "", ""])
        lines = ["memory [MiB]", _table(rows), "", "memory breakdown [MiB] | total = free + (self = model + context + "
                 "compute) + unaccounted" + (" (context: cache + state)" if state else "")]
        for m in self.devices.values():
            lines.append(f"  - {m.name} ({m.description}) | {_mib(m.total)} = {_mib(m.free)} + ({_mib(m.self_total)} = "
                         f"{_mib(m.weights_total)} + {_mib(m.context_total)} + {_mib(m.graph)}) + {_mib(m.unaccounted)}"
                         + (" *" if m.unaccounted < 0 else ""))
        if any(m.unaccounted < 0 for m in self.devices.values()):
            lines.append("  * unaccounted < 0: this report counts more than the device shows as used; host "
                         "buffers take\n    their pages only when first written (untouched cache and compute "
                         "memory still\n    looks free), or free memory was read before an allocation")
        vision = [m for m in self.devices.values() if "vision" in m.weights or "vision" in m.graphs]
        if vision:
            # in the figures above too: the encoder's weights are in "weights", its graph shares the compute buffer
            rows = [["device", "weights", "graph"]]
            rows += [[m.name, _mib(m.weights.get("vision", 0)), _mib(m.graphs.get("vision", 0))] for m in vision]
            lines += ["", "vision encoder [MiB] (included above; its graph shares the compute buffer)", _table(rows)]
        if self.fit is not None:
            lines += ["", str(self.fit)]
        return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
